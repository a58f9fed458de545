//! The `X-Mock-*` request headers that steer an answer (see the [crate] docs).

use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

const X_MOCK_DELAY: &str = "x-mock-delay";
const X_MOCK_STATUS: &str = "x-mock-status";
const X_MOCK_RESET: &str = "x-mock-reset";
const X_MOCK_BODY_SIZE: &str = "x-mock-body-size";
const X_MOCK_SET_COOKIE: &str = "x-mock-set-cookie";
const X_MOCK_HEADER: &str = "x-mock-header";
const X_MOCK_PARTIAL: &str = "x-mock-partial";
const X_MOCK_LOSE_RESPONSE: &str = "x-mock-lose-response";
const X_MOCK_HANG: &str = "x-mock-hang";
const X_MOCK_COMMIT_AFTER: &str = "x-mock-commit-after";

/// When `X-Mock-Lose-Response` drops the connection: before or after the route's side effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lose {
    /// The route does not run (no booking is made).
    Before,
    /// The route runs (the booking is made and stored), then the response is lost.
    After,
}

/// The parsed `X-Mock-*` request headers.
#[derive(Debug, Default)]
pub(crate) struct Directives {
    pub(crate) delay: Option<Duration>,
    pub(crate) status: Option<StatusCode>,
    pub(crate) reset: bool,
    pub(crate) body_size: Option<u64>,
    pub(crate) set_cookies: Vec<HeaderValue>,
    pub(crate) headers: Vec<(HeaderName, HeaderValue)>,
    pub(crate) partial: bool,
    pub(crate) lose: Option<Lose>,
    pub(crate) hang: Option<Duration>,
    pub(crate) commit_after: Option<Duration>,
}

impl Directives {
    pub(crate) fn parse(headers: &HeaderMap) -> Result<Self, String> {
        let text = |name: &str| -> Result<Option<&str>, String> {
            headers
                .get(name)
                .map(|v| v.to_str().map(str::trim))
                .transpose()
                .map_err(|_| format!("{name}: not visible ASCII"))
        };
        let flag = |name: &str| -> Result<bool, String> {
            match text(name)?.map(str::to_ascii_lowercase).as_deref() {
                None | Some("false" | "0" | "no") => Ok(false),
                Some("true" | "1" | "yes") => Ok(true),
                Some(other) => Err(format!("{name}: expected true or false, got {other:?}")),
            }
        };

        let mut directives = Directives {
            reset: flag(X_MOCK_RESET)?,
            partial: flag(X_MOCK_PARTIAL)?,
            ..Directives::default()
        };
        let duration = |name: &str| -> Result<Option<Duration>, String> {
            text(name)?
                .map(|value| {
                    humantime::parse_duration(value)
                        .map_err(|e| format!("{name}: {e} (expected e.g. 300ms or 2s)"))
                })
                .transpose()
        };
        directives.delay = duration(X_MOCK_DELAY)?;
        directives.hang = duration(X_MOCK_HANG)?;
        directives.commit_after = duration(X_MOCK_COMMIT_AFTER)?;
        directives.lose = match text(X_MOCK_LOSE_RESPONSE)?
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            None => None,
            Some("before") => Some(Lose::Before),
            Some("after") => Some(Lose::After),
            Some(other) => {
                return Err(format!(
                    "{X_MOCK_LOSE_RESPONSE}: expected before or after, got {other:?}"
                ));
            }
        };
        if let Some(status) = text(X_MOCK_STATUS)? {
            let status = status
                .parse::<u16>()
                .ok()
                .filter(|s| (200..=599).contains(s))
                .and_then(|s| StatusCode::from_u16(s).ok())
                .ok_or_else(|| {
                    format!("{X_MOCK_STATUS}: expected a status 200-599, got {status:?}")
                })?;
            directives.status = Some(status);
        }
        if let Some(size) = text(X_MOCK_BODY_SIZE)? {
            let size = size
                .parse::<u64>()
                .map_err(|_| format!("{X_MOCK_BODY_SIZE}: expected a byte count, got {size:?}"))?;
            directives.body_size = Some(size);
        }
        directives.set_cookies = headers.get_all(X_MOCK_SET_COOKIE).iter().cloned().collect();
        for line in headers.get_all(X_MOCK_HEADER) {
            let invalid = || format!("{X_MOCK_HEADER}: expected \"Name: value\", got {line:?}");
            let (name, value) = line
                .to_str()
                .ok()
                .and_then(|line| line.split_once(':'))
                .ok_or_else(invalid)?;
            let name = HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| invalid())?;
            let value = HeaderValue::from_str(value.trim()).map_err(|_| invalid())?;
            directives.headers.push((name, value));
        }
        Ok(directives)
    }
}
