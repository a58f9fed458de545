//! The mock's answers: a response under construction and the routes' replies.

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use serde_json::{Map, Value, json};

use crate::body::MockBody;

/// A response under construction.
pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: MockBody,
}

impl Reply {
    pub(crate) fn json(status: StatusCode, json: &Value) -> Self {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        Reply {
            status,
            headers,
            body: MockBody::full(Bytes::from(json.to_string())),
        }
    }

    /// Sets a header whose value the mock itself generated.
    pub(crate) fn insert(&mut self, name: HeaderName, value: &str) {
        match HeaderValue::from_str(value) {
            Ok(value) => {
                self.headers.insert(name, value);
            }
            Err(_) => tracing::warn!(%name, value, "mock upstream: unencodable header value"),
        }
    }

    pub(crate) fn finish(self) -> Response<MockBody> {
        let mut response = Response::new(self.body);
        *response.status_mut() = self.status;
        *response.headers_mut() = self.headers;
        response
    }
}

pub(crate) fn echo_reply(parts: &Parts, body: &Bytes) -> Reply {
    let headers: Map<String, Value> = parts
        .headers
        .keys()
        .map(|name| {
            let values = parts.headers.get_all(name).iter();
            let values = values.map(|v| String::from_utf8_lossy(v.as_bytes()));
            (name.as_str().to_owned(), values.collect())
        })
        .collect();
    let echo = json!({
        "method": parts.method.as_str(),
        "path": parts.uri.path(),
        "query": parts.uri.query(),
        "headers": headers,
        "body": body_json(body),
    });
    Reply::json(StatusCode::OK, &echo)
}

pub(crate) fn status_reply(status: StatusCode, parts: &Parts) -> Reply {
    if matches!(status.as_u16(), 204 | 205 | 304) {
        // These statuses carry no body.
        return Reply {
            status,
            headers: HeaderMap::new(),
            body: MockBody::full(Bytes::new()),
        };
    }
    let json = json!({
        "status": status.as_u16(),
        "reason": status.canonical_reason().unwrap_or(""),
        "method": parts.method.as_str(),
        "path": parts.uri.path(),
        "mock": "X-Mock-Status",
    });
    Reply::json(status, &json)
}

pub(crate) fn error_reply(status: StatusCode, message: &str) -> Reply {
    Reply::json(status, &json!({ "error": message }))
}

/// A request body as it is embedded in a JSON answer: the parsed value if the body is JSON,
/// else the body as a (lossy UTF-8) string. What serde_json can't hold as a [`Value`] counts as
/// "not JSON": nesting deeper than its recursion limit (128), a number beyond `f64` (`1e400`),
/// a lone surrogate escape.
pub(crate) fn body_json(body: &[u8]) -> Value {
    serde_json::from_slice(body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_bodies_embed_as_json_or_as_text() {
        for (body, expected) in [
            ("{}", json!({})),
            (
                // Numbers keep their text (serde_json's arbitrary_precision, which the proxy's
                // key derivation needs), so compare a spelling that round-trips.
                " [1, -2500.0, true, false, null, \"a\\u00e9\\n\"] ",
                json!([1, -2500.0, true, false, null, "a\u{e9}\n"]),
            ),
            (r#"{"a":{"b":[{}]}}"#, json!({"a": {"b": [{}]}})),
            ("0", json!(0)),
            ("\"x\"", json!("x")),
        ] {
            assert_eq!(body_json(body.as_bytes()), expected, "{body}");
        }
        for text in [
            "",
            "{",
            "{a:1}",
            "01",
            "[1,]",
            "\"\\x\"",
            "1 2",
            "tru",
            "-",
            "1.",
            "\"\\ud800\"",
        ] {
            assert_eq!(body_json(text.as_bytes()), json!(text), "{text}");
        }
        let deep = format!("{}{}", "[".repeat(1000), "]".repeat(1000));
        assert_eq!(body_json(deep.as_bytes()), json!(deep), "too deep: text");
        assert_eq!(body_json(b"a\xffb"), json!("a\u{fffd}b"), "lossy UTF-8");
    }
}
