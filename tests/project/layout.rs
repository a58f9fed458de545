//! The layout keeps itself: no file in `src/` passes 600 lines (split it along the steps it
//! holds, STYLE 11), and `src/lib.rs`'s `# Layout` list has a line for every module the
//! library declares. Walks `src/` as it is when the test runs.

use std::fs;
use std::path::{Path, PathBuf};

/// The most lines a source file may have.
const MAX_LINES: usize = 600;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, depth first; bounded by the tree itself (no links followed).
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
    for entry in entries {
        let entry = entry.unwrap_or_else(|e| panic!("an entry of {}: {e}", dir.display()));
        let kind = entry
            .file_type()
            .unwrap_or_else(|e| panic!("the type of {}: {e}", entry.path().display()));
        let path = entry.path();
        if kind.is_dir() {
            rust_files(&path, out);
        } else if kind.is_file() && path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_source_file_passes_600_lines() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    assert!(
        files.len() > 20,
        "src/ holds the crate's files: found {}",
        files.len()
    );
    let mut over: Vec<String> = files
        .iter()
        .filter_map(|path| {
            let text =
                fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
            let lines = text.lines().count();
            (lines > MAX_LINES).then(|| format!("{} ({lines} lines)", path.display()))
        })
        .collect();
    over.sort();
    assert!(
        over.is_empty(),
        "files over {MAX_LINES} lines, to split along the steps they hold:\n{}",
        over.join("\n")
    );
}

/// The modules `lib.rs` declares (`mod x;`, `pub mod x;`).
fn declared_modules(lib: &str) -> Vec<String> {
    lib.lines()
        .filter_map(|line| {
            let line = line.trim();
            let rest = line
                .strip_prefix("pub mod ")
                .or_else(|| line.strip_prefix("mod "))?;
            Some(rest.strip_suffix(';')?.trim().to_owned())
        })
        .collect()
}

/// The modules the `# Layout` section of `lib.rs`'s docs lists, one `//! - [`name`]` line each.
fn listed_modules(lib: &str) -> Vec<String> {
    lib.lines()
        .skip_while(|line| line.trim() != "//! # Layout")
        .skip(1)
        .take_while(|line| line.starts_with("//!") && !line.starts_with("//! #"))
        .filter_map(|line| {
            let item = line.strip_prefix("//! - [`")?;
            Some(item.split_once('`')?.0.to_owned())
        })
        .collect()
}

#[test]
fn the_layout_list_in_lib_rs_names_every_module() {
    let path = src().join("lib.rs");
    let lib = fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let declared = declared_modules(&lib);
    assert!(
        declared.len() > 10,
        "lib.rs declares the crate's modules: {declared:?}"
    );
    let listed = listed_modules(&lib);
    let missing: Vec<&String> = declared.iter().filter(|m| !listed.contains(m)).collect();
    assert!(
        missing.is_empty(),
        "lib.rs's # Layout list has no line for {missing:?} (listed: {listed:?})"
    );
    let stale: Vec<&String> = listed.iter().filter(|m| !declared.contains(m)).collect();
    assert!(
        stale.is_empty(),
        "lib.rs's # Layout list names modules that no longer exist: {stale:?}"
    );
    // Every module directory or file at the top of src/ is a declared module (or a binary's).
    let entries = fs::read_dir(src()).unwrap_or_else(|e| panic!("read src/: {e}"));
    for entry in entries {
        let entry = entry.unwrap_or_else(|e| panic!("an entry of src/: {e}"));
        let name = entry.file_name().to_string_lossy().into_owned();
        let module = name.strip_suffix(".rs").unwrap_or(&name);
        if ["lib", "main", "bin", "demo"].contains(&module) {
            continue;
        }
        assert!(
            declared.iter().any(|m| m == module),
            "src/{name} is not a module lib.rs declares"
        );
    }
}
