//! `POST /webhooks/{provider}`: where each provider puts a delivery's event id.
//!
//! The handler counts deliveries per event id, so a test or the demo can see how often the
//! "legacy handler" behind the proxy ran for one event. It checks no signature: the proxy
//! does, before anything reaches here.

use http::HeaderMap;
use serde_json::Value;

/// The event id of a delivery to `/webhooks/{provider}`, read where that provider puts it:
///
/// | provider | event id |
/// | --- | --- |
/// | `standard` | the `webhook-id` header |
/// | `github` | the `X-GitHub-Delivery` header |
/// | `shopify` | the `X-Shopify-Webhook-Id` header |
/// | `stripe` | the body's `id` (a JSON string) |
/// | `slack` | the body's `event_id` (a JSON string) |
/// | anything else | the `webhook-id` header, else the body's `id`, else its `event_id` |
pub(crate) fn event_id(provider: &str, headers: &HeaderMap, body: &[u8]) -> Option<String> {
    let header = |name: &str| {
        headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    };
    let field = |name: &str| -> Option<String> {
        let doc: Value = serde_json::from_slice(body).ok()?;
        doc.get(name)?.as_str().map(str::to_owned)
    };
    match provider {
        "standard" => header("webhook-id"),
        "github" => header("x-github-delivery"),
        "shopify" => header("x-shopify-webhook-id"),
        "stripe" => field("id"),
        "slack" => field("event_id"),
        _ => header("webhook-id")
            .or_else(|| field("id"))
            .or_else(|| field("event_id")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_provider_has_its_place() {
        let mut headers = HeaderMap::new();
        headers.insert("webhook-id", "msg_1".parse().expect("valid"));
        headers.insert("x-github-delivery", "gh-1".parse().expect("valid"));
        headers.insert("x-shopify-webhook-id", "sh-1".parse().expect("valid"));
        let body = br#"{"id":"evt_1","event_id":"Ev1"}"#;
        for (provider, want) in [
            ("standard", "msg_1"),
            ("github", "gh-1"),
            ("shopify", "sh-1"),
            ("stripe", "evt_1"),
            ("slack", "Ev1"),
            ("custom", "msg_1"),
        ] {
            assert_eq!(
                event_id(provider, &headers, body).as_deref(),
                Some(want),
                "{provider}"
            );
        }
        let none = HeaderMap::new();
        assert_eq!(event_id("custom", &none, body).as_deref(), Some("evt_1"));
        assert_eq!(
            event_id("custom", &none, br#"{"event_id":"Ev2"}"#).as_deref(),
            Some("Ev2")
        );
        assert_eq!(
            event_id("stripe", &none, br#"{"id":7}"#),
            None,
            "not a string"
        );
        assert_eq!(
            event_id("slack", &none, b"token=x&team_id=T1"),
            None,
            "not JSON"
        );
        assert_eq!(event_id("github", &none, body), None, "no header");
    }
}
