//! Phases.
