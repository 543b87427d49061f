//! Every public type name of the workspace is declared once (issue 20): two
//! `Completion`s or two `Role`s in one tree make a reader, a grep and a
//! `use` line guess which one is meant. The scan covers the engine, roles,
//! transports and checks (`src/`), the phases (`systems/src`) and the plain
//! data (`components/src`), `src/model/` included; `kernels/` keeps its own names.
//!
//! "Public" is any `pub`, restricted ones (`pub(crate)`, `pub(super)`)
//! included: those still meet in the same crate and the same greps.
//! A `stub.rs` is left out: it is the feature-off twin of a feature-gated
//! type (`transport/ucx/stub.rs` without `ucx`, `transport/rdma/stub.rs`
//! without `rdma`), and a build compiles it or the real one, never both.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The folders scanned, relative to the workspace root (all of each).
const ROOTS: &[&str] = &["src", "systems/src", "components/src"];

/// The type name a line declares publicly (`pub struct X`, `pub(crate) enum Y<'a>`,
/// `pub type Z = ...`, `pub trait W`), if it does.
fn declared(line: &str) -> Option<&str> {
    let rest = line.trim_start().strip_prefix("pub")?;
    // A restricted visibility, `pub(crate)`, `pub(super)`, `pub(in path)`.
    let rest = match rest.strip_prefix('(') {
        Some(r) => &r[r.find(')')? + 1..],
        None => rest,
    };
    // `pub` must be its own word (not `public_fn`).
    if !rest.starts_with(char::is_whitespace) {
        return None;
    }
    let mut words = rest.split_whitespace();
    let kind = words.next()?;
    if !matches!(kind, "struct" | "enum" | "type" | "trait" | "union") {
        return None;
    }
    let name = words.next()?;
    let end = name.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(name.len());
    (end > 0).then(|| &name[..end])
}

/// Every public type name in `files` (path, text), with where each is declared.
fn declarations(files: &[(PathBuf, String)]) -> BTreeMap<&str, Vec<String>> {
    let mut out: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for (path, text) in files {
        for (i, line) in text.lines().enumerate() {
            if let Some(name) = declared(line) {
                out.entry(name).or_default().push(format!("{}:{}", path.display(), i + 1));
            }
        }
    }
    out
}

/// The names declared more than once, one line each, naming every place.
fn duplicates(files: &[(PathBuf, String)]) -> Vec<String> {
    declarations(files).into_iter().filter(|(_, at)| at.len() > 1).map(|(name, at)| format!("{name}: {}", at.join(", "))).collect()
}

fn rust_files(dir: &Path, root: &Path, out: &mut Vec<(PathBuf, String)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display())).map(|e| e.expect("dir entry").path()).collect();
    entries.sort();
    for path in entries {
        let rel = path.strip_prefix(root).expect("under the root").to_path_buf();
        if path.is_dir() {
            rust_files(&path, root, out);
        } else if path.extension().is_some_and(|e| e == "rs") && path.file_name().is_none_or(|n| n != "stub.rs") {
            let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
            out.push((rel, text));
        }
    }
}

#[test]
fn every_public_type_name_is_declared_once() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for r in ROOTS {
        rust_files(&root.join(r), root, &mut files);
    }
    // The scan must have seen the tree (a moved folder would pass it vacuously).
    let names = declarations(&files);
    for known in ["Engine", "Failure", "Topology", "PlanCompletion"] {
        assert!(names.contains_key(known), "the scan missed `{known}`: are {ROOTS:?} still the source folders?");
    }
    let dups = duplicates(&files);
    assert!(dups.is_empty(), "public type names declared more than once (rename one so each says what it is):\n{}", dups.join("\n"));
}

/// The scanner itself: what it counts as a declaration, and that a duplicate fails.
#[test]
fn the_scan_finds_a_duplicate() {
    assert_eq!(declared("pub struct PrefillJob<'a> {"), Some("PrefillJob"));
    assert_eq!(declared("    pub(super) struct Route {"), Some("Route"));
    assert_eq!(declared("pub(in crate::roles) enum Role {"), Some("Role"));
    assert_eq!(declared("pub type Source = Arc<dyn Error>;"), Some("Source"));
    assert_eq!(declared("pub trait Mover: Send {"), Some("Mover"));
    assert_eq!(declared("struct Private {"), None);
    assert_eq!(declared("pub fn structure() {}"), None);
    assert_eq!(declared("pub structural: u32,"), None);
    assert_eq!(declared("// pub struct Commented;"), None);
    let files = vec![
        (PathBuf::from("a.rs"), "pub struct Completion {}\npub enum Unique {}\n".to_string()),
        (PathBuf::from("b.rs"), "/// doc\npub(crate) struct Completion;\n".to_string()),
    ];
    assert_eq!(duplicates(&files), vec!["Completion: a.rs:1, b.rs:2".to_string()]);
}
