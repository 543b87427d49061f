//! ECS components (filled in with the engine).
