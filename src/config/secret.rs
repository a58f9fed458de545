//! Secrets (the admin token, the Redis password): read from a file or an environment variable,
//! never written inline in the YAML, never printed.
//!
//! The proxy and the `idemproxy keys` command read the same token file, so both go through
//! [`Secret::read_file`]: a token the two sides trimmed differently could never match.

use std::fmt;
use std::path::Path;

/// A secret, never printed (`Debug` shows `<redacted>`).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

/// The longest secret file read: a token or a password is a few dozen bytes, and a wrong path
/// such as `/dev/zero` must be refused, not read until memory runs out.
const MAX_SECRET_BYTES: u64 = 64 * 1024;

impl Secret {
    /// Wraps a secret as it is, untrimmed.
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The secret itself.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// A secret as written by hand or by a tool: whitespace at either end (the newline of
    /// `echo`, an editor's trailing space, CRLF) is not part of it. Nothing but whitespace is
    /// an error: an empty token would match an empty `Bearer`.
    pub fn from_text(text: &str) -> Result<Secret, String> {
        match text.trim() {
            "" => Err("the secret is empty".to_owned()),
            t => Ok(Secret(t.to_owned())),
        }
    }

    /// Reads a secret file (UTF-8, at most 64 KiB), trimmed as [`Secret::from_text`] trims.
    /// Errors name the file.
    pub fn read_file(path: &Path) -> Result<Secret, String> {
        let text = read_text(path)?;
        Secret::from_text(&text).map_err(|e| format!("{e} ({})", path.display()))
    }
}

/// A secret file's text as it is (UTF-8, at most 64 KiB): errors name the file, never show its
/// content. Webhook secrets, one a line, are read through it.
pub(crate) fn read_text(path: &Path) -> Result<String, String> {
    use std::io::Read;
    let shown = path.display();
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read {shown}: {e}"))?;
    let mut bytes = Vec::new();
    file.take(MAX_SECRET_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read {shown}: {e}"))?;
    if bytes.len() as u64 > MAX_SECRET_BYTES {
        return Err(format!(
            "{shown} is longer than {MAX_SECRET_BYTES} bytes: not a secret file"
        ));
    }
    String::from_utf8(bytes).map_err(|_| format!("{shown} is not UTF-8 text"))
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl std::ops::Deref for Secret {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

/// Reads `NAME_file` or `NAME_env` (at most one). An unreadable file, an unset variable or an
/// empty secret is an error naming the field.
pub(super) fn secret(
    name: &str,
    file: Option<&str>,
    env: Option<&str>,
    err: &mut impl FnMut(String, String),
) -> Option<Secret> {
    let (field, value) = match (file, env) {
        (None, None) => return None,
        (Some(_), Some(_)) => {
            err(
                format!("{name}_file"),
                format!("set {name}_file or {name}_env, not both"),
            );
            return None;
        }
        (Some(path), None) => (format!("{name}_file"), Secret::read_file(Path::new(path))),
        (None, Some(var)) => (
            format!("{name}_env"),
            std::env::var(var)
                .map_err(|_| format!("the environment variable {var} is not set"))
                .and_then(|v| Secret::from_text(&v)),
        ),
    };
    value.map_err(|message| err(field, message)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn surrounding_whitespace_is_not_part_of_a_secret() {
        let t = |s: &str| Secret::from_text(s).map(|s| s.expose().to_owned());
        assert_eq!(t("tok\n"), Ok("tok".to_owned()));
        assert_eq!(t("  tok \t \r\n"), Ok("tok".to_owned()));
        assert_eq!(t("a b"), Ok("a b".to_owned()), "inner spaces are kept");
        assert!(t(" \n").is_err());
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("token");
        std::fs::write(&file, "  s3cret  \n").expect("write");
        assert_eq!(
            Secret::read_file(&file).map(|s| s.0),
            Ok("s3cret".to_owned())
        );
        std::fs::write(&file, "\n\n").expect("write");
        let e = Secret::read_file(&file).expect_err("empty");
        assert!(e.contains("empty") && e.contains("token"), "{e}");
    }
}
