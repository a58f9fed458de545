//! From YAML text to [`RawConfig`], reporting every value that does not deserialize.
//!
//! serde stops at the first error, and one bad value must not hide the rest of the file
//! (`--check` prints every error, SPEC §2). So after a failure the text is read once more as a
//! `yaml_serde::Value`; the node that failed is set aside (removed, so that its default
//! applies) and the typed pass runs again, a bounded number of times. The later passes read
//! the pruned tree written back as YAML rather than the tree itself: a typed pass over text
//! treats scalars as the first pass did (a plain `2024` is a string where a string is wanted;
//! over a `Value` it would be a number, and a spurious error).
//!
//! Setting a node aside must not invent errors of its own: a required field left missing ends
//! the passes without a word, a validation error at a set-aside node is dropped, and list
//! elements set aside would shift the indices after them, so every path is mapped back to the
//! index written in the file. A syntax error stops at once: the text has no tree to go on with.
//! Only the first error has a line and column; the later passes read text of their own.

use serde_path_to_error::Segment;
use yaml_serde::Value;

use super::{ConfigError, RawConfig};

/// Nodes set aside at most before giving up: a file with more bad values than this is not
/// worth reading further, and every pass costs a parse.
const MAX_SET_ASIDE: usize = 100;

/// What reading the text gave: the typed configuration if one was reached, and every error.
pub(super) struct Parsed {
    pub(super) raw: Option<RawConfig>,
    pub(super) errors: Vec<ConfigError>,
    set_aside: SetAside,
}

impl Parsed {
    fn stop(errors: Vec<ConfigError>, set_aside: SetAside) -> Parsed {
        Parsed {
            raw: None,
            errors,
            set_aside,
        }
    }

    /// Adds the errors validation found in the pruned configuration, at the paths the file
    /// has them, leaving out those about a node that was set aside (its default is not what
    /// the file says, and the file's value already has its error).
    pub(super) fn add_validation(&mut self, errors: Vec<ConfigError>) {
        for mut e in errors {
            e.path = self.set_aside.in_file(&e.path);
            if !self.set_aside.covers(&e.path) {
                self.errors.push(e);
            }
        }
    }
}

/// Parses YAML text into [`RawConfig`], collecting every deserialization error.
pub(super) fn parse(text: &str) -> Parsed {
    if text.trim().is_empty() {
        let e = error("", "the configuration is empty; `listen` is required");
        return Parsed::stop(vec![e], SetAside::default());
    }
    let first = match typed(text) {
        // A key written twice in a map of names (`upstreams`) passes the typed reading, the
        // last one winning: the tree, which refuses it, says where.
        Ok(raw) => {
            let errors = match yaml_serde::from_str::<Value>(text) {
                Err(e) if e.to_string().contains("duplicate entry") => {
                    vec![duplicate_entry(text, &e)]
                }
                // Anything else the tree refuses, the typed reading took: as it always did.
                _ => Vec::new(),
            };
            return Parsed {
                raw: errors.is_empty().then_some(raw),
                errors,
                set_aside: SetAside::default(),
            };
        }
        Err(e) => e,
    };
    let mut set_aside = SetAside::default();
    let mut segments: Vec<Segment> = first.path().iter().cloned().collect();
    let mut failed = describe(first, Some(text));
    let mut errors = Vec::new();
    // A text that is not even a YAML tree (a syntax error, a duplicate key) has nothing
    // further to read: its one error, with line and column, is the whole answer.
    let Ok(mut doc) = yaml_serde::from_str::<Value>(text) else {
        return Parsed::stop(vec![failed], set_aside);
    };
    for _ in 0..MAX_SET_ASIDE {
        if let Some(field) = missing_field(&failed.message) {
            if !set_aside.left_missing(&failed.path, field) {
                failed.path = set_aside.in_file(&failed.path);
                errors.push(failed);
            }
            return Parsed::stop(errors, set_aside);
        }
        let here = failed.path.clone();
        failed.path = set_aside.in_file(&failed.path);
        errors.push(failed);
        if !set_aside.remove(&mut doc, &segments, &here) {
            return Parsed::stop(errors, set_aside);
        }
        let Ok(pruned) = yaml_serde::to_string(&doc) else {
            return Parsed::stop(errors, set_aside);
        };
        match typed(&pruned) {
            Ok(raw) => {
                return Parsed {
                    raw: Some(raw),
                    errors,
                    set_aside,
                };
            }
            Err(e) => {
                segments = e.path().iter().cloned().collect();
                failed = describe(e, None);
            }
        }
    }
    errors.push(error(
        "",
        format!("more than {MAX_SET_ASIDE} values could not be read; fix these and check again"),
    ));
    Parsed::stop(errors, set_aside)
}

type TypedError = serde_path_to_error::Error<yaml_serde::Error>;

fn typed(text: &str) -> Result<RawConfig, TypedError> {
    serde_path_to_error::deserialize(yaml_serde::Deserializer::from_str(text))
}

fn error(path: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        path: path.into(),
        message: message.into(),
    }
}

/// One deserialization error as a [`ConfigError`]: the precise path once, and, for an error in
/// the file's own `text` (not in a pruned copy), the line and column where YAML knows them.
fn describe(e: TypedError, text: Option<&str>) -> ConfigError {
    let path = e.path().to_string();
    let inner = e.into_inner();
    let mut message = inner.to_string();
    // yaml_serde prefixes its own, coarser path (often the parent mapping); the path from
    // serde_path_to_error is the precise one, so name the field once.
    let own_prefix = message
        .split_once(": ")
        .filter(|(head, _)| !head.is_empty() && !head.contains(' '))
        .filter(|(head, _)| path.starts_with(head))
        .map(|(_, rest)| rest.to_owned());
    if let Some(rest) = own_prefix {
        message = rest;
    }
    // serde_path_to_error writes `?` for a position it could not name (a syntax error before
    // the next key); the known part of the path is what helps.
    let mut path = match path.as_str() {
        "?" | "." => String::new(),
        p => p.strip_suffix(".?").unwrap_or(p).to_owned(),
    };
    // serde names a missing or repeated field in its message, at the path of the mapping
    // around it: the field's own path is the one an operator looks for.
    let repeated = named_field(&message, "duplicate field `").map(str::to_owned);
    if let Some(field) = missing_field(&message).or(repeated.as_deref()) {
        path = join(&path, field);
    }
    if let Some(text) = text {
        if let Some(loc) = inner.location() {
            // A repeated field is reported where its mapping starts; the repeat is what to fix.
            let repeat = repeated
                .as_deref()
                .and_then(|field| second_key(text, loc.line(), loc.column(), field));
            // yaml_serde already appends the position to some messages (syntax errors): say
            // it once, the repeat's own when there is one.
            match (repeat, message.split_once(" at line ")) {
                (Some((line, column)), Some((head, _))) => {
                    message = format!("{head} at line {line} column {column}");
                }
                (None, Some(_)) => {}
                (Some((line, column)), None) => {
                    message = format!("{message} at line {line} column {column}");
                }
                (None, None) => {
                    message = format!("{message} at line {} column {}", loc.line(), loc.column());
                }
            }
        }
    } else if let Some((head, _)) = message.split_once(" at line ") {
        // A position in the pruned text would point at a line the operator never wrote.
        message = head.to_owned();
    }
    error(path, message)
}

/// A key written twice in a map that the typed reading takes whole (`upstreams`), as the
/// YAML tree refuses it: at the repeated key's path, line and column.
fn duplicate_entry(text: &str, e: &yaml_serde::Error) -> ConfigError {
    let shown = e.to_string();
    let message = shown
        .split_once(" at line ")
        .map_or(shown.as_str(), |(m, _)| m);
    // yaml_serde starts the message with the map's path, when it has one.
    let (map, message) = match message.split_once(": ") {
        Some((path, rest)) if !path.contains(' ') => (path, rest),
        _ => ("", message),
    };
    let key = message
        .strip_prefix("duplicate entry with key \"")
        .and_then(|rest| rest.strip_suffix('"'));
    let (Some(key), Some(loc)) = (key, e.location()) else {
        return error(map, shown.clone());
    };
    let (line, column) =
        second_key(text, loc.line(), loc.column(), key).unwrap_or((loc.line(), loc.column()));
    error(
        join(map, key),
        format!("{message} at line {line} column {column}"),
    )
}

/// The field a "missing field `NAME`" error names.
fn missing_field(message: &str) -> Option<&str> {
    named_field(message, "missing field `")
}

/// The field an error that starts with `prefix` (up to the opening backquote) names.
fn named_field<'a>(message: &'a str, prefix: &str) -> Option<&'a str> {
    message
        .strip_prefix(prefix)
        .and_then(|rest| rest.split_once('`'))
        .map(|(name, _)| name)
}

/// Where `field` is written the second time in the block mapping whose first key is at `line`
/// and `column` (1-based, as YAML reports them): the key of the block's lines at that column,
/// until a line less indented ends the block. `None` for what this reading can't follow (a
/// flow mapping, `{a: 1, a: 2}`): the mapping's own position is reported then.
fn second_key(text: &str, line: usize, column: usize, field: &str) -> Option<(usize, usize)> {
    let at = column.checked_sub(1)?;
    let mut seen = 0;
    for (i, l) in text.lines().enumerate().skip(line.checked_sub(1)?) {
        let indent = l.len() - l.trim_start_matches(' ').len();
        let rest = &l[indent..];
        if rest.is_empty() || rest.starts_with('#') {
            continue;
        }
        // The first line of a list item holds its mapping's first key after the dash.
        let key_at = match rest.strip_prefix("- ") {
            Some(item) if i + 1 == line => indent + 2 + (item.len() - item.trim_start().len()),
            _ => indent,
        };
        if key_at < at || (i + 1 > line && key_at == at && rest.starts_with("- ")) {
            return None;
        }
        if key_at != at {
            continue;
        }
        let key = l[key_at..].split(':').next().unwrap_or("").trim_end();
        let key = key.trim_matches(|c| c == '"' || c == '\'');
        if key == field {
            seen += 1;
            if seen == 2 {
                return Some((i + 1, key_at + 1));
            }
        }
    }
    None
}

/// One node taken out of the tree.
struct Removed {
    /// The path of its mapping or list, as it was when the node was removed.
    parent: String,
    /// Its key in a mapping, or its index in a list.
    key: Key,
    /// Its own path in the file.
    in_file: String,
}

#[derive(PartialEq)]
enum Key {
    Field(String),
    Index(usize),
}

/// The nodes set aside so far, in order.
#[derive(Default)]
struct SetAside(Vec<Removed>);

impl SetAside {
    /// Removes the node at `segments` (whose path reads `path`) from `doc`. False when there is
    /// no such node to remove (the document itself, a key that is not a string).
    fn remove(&mut self, doc: &mut Value, segments: &[Segment], path: &str) -> bool {
        let Some((last, parents)) = segments.split_last() else {
            return false;
        };
        let mut node = doc;
        for segment in parents {
            let child = match (segment, node) {
                (Segment::Seq { index }, Value::Sequence(seq)) => seq.get_mut(*index),
                (Segment::Map { key }, Value::Mapping(map)) => map.get_mut(key.as_str()),
                _ => None,
            };
            let Some(child) = child else {
                return false;
            };
            node = child;
        }
        let key = match (last, node) {
            (Segment::Seq { index }, Value::Sequence(seq)) if *index < seq.len() => {
                seq.remove(*index);
                Key::Index(*index)
            }
            (Segment::Map { key }, Value::Mapping(map)) => match map.shift_remove(key.as_str()) {
                Some(_) => Key::Field(key.clone()),
                None => return false,
            },
            _ => return false,
        };
        let parent = parent_of(path, &key);
        let in_file = self.in_file(path);
        self.0.push(Removed {
            parent,
            key,
            in_file,
        });
        true
    }

    /// `path`, read in the pruned tree, as the file writes it: every list index after a
    /// removed element moves back up by one, latest removal first.
    fn in_file(&self, path: &str) -> String {
        let mut path = path.to_owned();
        for removed in self.0.iter().rev() {
            if let Key::Index(at) = removed.key {
                path = shift_index(&path, &removed.parent, at);
            }
        }
        path
    }

    /// Whether `in_file` (a path as the file writes it) is a node set aside, or inside one.
    fn covers(&self, in_file: &str) -> bool {
        self.0.iter().any(|r| {
            in_file == r.in_file
                || in_file
                    .strip_prefix(r.in_file.as_str())
                    .is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
        })
    }

    /// Whether `field`, at `path` (in the pruned tree), is missing because it was set aside.
    fn left_missing(&self, path: &str, field: &str) -> bool {
        let in_file = self.in_file(path);
        self.0
            .iter()
            .any(|r| r.key == Key::Field(field.to_owned()) && r.in_file == in_file)
    }
}

/// The path of the mapping or list that holds the node at `path` under `key`.
fn parent_of(path: &str, key: &Key) -> String {
    let own = match key {
        Key::Field(name) => name.clone(),
        Key::Index(i) => format!("[{i}]"),
    };
    let parent = path.strip_suffix(own.as_str()).unwrap_or(path);
    parent.strip_suffix('.').unwrap_or(parent).to_owned()
}

fn join(parent: &str, field: &str) -> String {
    if parent.is_empty() {
        field.to_owned()
    } else {
        format!("{parent}.{field}")
    }
}

/// `path` with the index it has right after `list` raised by one when it is `at` or later.
fn shift_index(path: &str, list: &str, at: usize) -> String {
    let Some(rest) = path.strip_prefix(list).and_then(|r| r.strip_prefix('[')) else {
        return path.to_owned();
    };
    let Some((digits, tail)) = rest.split_once(']') else {
        return path.to_owned();
    };
    match digits.parse::<usize>() {
        Ok(i) if i >= at => format!("{list}[{}]{tail}", i + 1),
        _ => path.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_after_a_removed_element_are_mapped_back() {
        assert_eq!(shift_index("routes[2].path", "routes", 1), "routes[3].path");
        assert_eq!(shift_index("routes[0].path", "routes", 1), "routes[0].path");
        assert_eq!(shift_index("routes_old[2]", "routes", 0), "routes_old[2]");
        assert_eq!(shift_index("store.timeout", "routes", 0), "store.timeout");
        // Two elements of one list removed, the second after the first was gone.
        let mut s = SetAside::default();
        let mut doc: Value = yaml_serde::from_str("a: [x, y, z, w]").expect("yaml");
        let seg = |i| vec![Segment::Map { key: "a".into() }, Segment::Seq { index: i }];
        assert!(s.remove(&mut doc, &seg(0), "a[0]"));
        assert!(s.remove(&mut doc, &seg(1), "a[1]"));
        // Left: y (file index 1) and w (file index 3).
        assert_eq!(s.in_file("a[0]"), "a[1]");
        assert_eq!(s.in_file("a[1]"), "a[3]");
        assert!(s.covers("a[0]") && s.covers("a[2].b") && !s.covers("a[1]"));
    }

    #[test]
    fn a_missing_field_is_named() {
        assert_eq!(missing_field("missing field `path`"), Some("path"));
        assert_eq!(missing_field("invalid type: map"), None);
    }

    #[test]
    fn the_second_key_of_a_repeated_field_is_found_in_its_block() {
        let text = "listen: a\nroutes:\n  - name: x\n    # a comment\n    ttl: 1h\n\n    ttl: 2h\n  - name: y\n    ttl: 3h\nttl: 4h\n";
        // The list item's mapping starts on line 3, column 5.
        assert_eq!(second_key(text, 3, 5, "ttl"), Some((7, 5)));
        // The next item, and the outer mapping's keys, are not this block's.
        assert_eq!(second_key(text, 8, 5, "ttl"), None);
        assert_eq!(second_key(text, 1, 1, "listen"), None);
        assert_eq!(
            second_key("a: 1\nb: 2\n\"a\": 3\n", 1, 1, "a"),
            Some((3, 1))
        );
        assert_eq!(second_key("{a: 1, a: 2}", 1, 2, "a"), None);
    }
}
