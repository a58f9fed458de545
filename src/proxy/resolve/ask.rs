//! One lookup: rendered from the request (its template's parts read by `key_from`'s reader,
//! its headers copied), sent to its upstream through the upstream's own pool and bounds, and
//! its answer read as the route's `found` and `absent` statuses say.

use http::StatusCode;
use http::request::Parts;

use crate::key_from::{self, Unreadable};
use crate::metrics::LookupAnswer;
use crate::proxy::replay::saved_headers;
pub(crate) use crate::record::Lookup;
use crate::record::{Saved, SavedResponse};
use crate::route::{IdempotencySettings, PathPattern, ResolveSettings};
use crate::upstream::{Bounded, Upstream};

/// The most a rendered lookup may hold, its path and query and copied headers (names and
/// values) together (SPEC §4.8): every claim of the route carries it in the store.
pub(crate) const MAX_LOOKUP: usize = 16 * 1024;

/// Renders `resolve`'s lookup for a request on a route whose path is `pattern` and whose
/// upstream is `route_upstream`; `key` is the key as the upstream gets it. A part that can't
/// be read is the error, before anything is claimed. The lookup is what it takes to ask about
/// that request later, from any instance, without the request itself: the claim carries it.
pub(crate) fn render(
    resolve: &ResolveSettings,
    route_upstream: &str,
    pattern: &PathPattern,
    head: &Parts,
    body: &[u8],
    key: &str,
) -> Result<Lookup, Unreadable> {
    let target = key_from::render_lookup(&resolve.request, pattern, head, body, key)?;
    let headers: Vec<(http::HeaderName, http::HeaderValue)> = resolve
        .headers
        .iter()
        .flat_map(|name| {
            head.headers
                .get_all(name)
                .iter()
                .map(move |v| (name.clone(), v.clone()))
        })
        .collect();
    let size = target.len()
        + headers
            .iter()
            .map(|(n, v): &(http::HeaderName, http::HeaderValue)| n.as_str().len() + v.len())
            .sum::<usize>();
    if size > MAX_LOOKUP {
        return Err(Unreadable {
            part: "resolve.request".into(),
            why: format!(
                "the rendered lookup (path, query and copied headers) is {size} bytes, over {MAX_LOOKUP}: a claim carries it in the store"
            ),
        });
    }
    Ok(Lookup {
        upstream: resolve
            .upstream
            .clone()
            .unwrap_or_else(|| route_upstream.to_owned()),
        method: resolve.request.method.clone(),
        target,
        headers,
    })
}

/// What one lookup said.
#[derive(Debug)]
pub(crate) enum Answer {
    /// A `found` status: the operation happened, and this is its result, kept under the
    /// rules of a first response (hop-by-hop headers, `Set-Cookie`, `max_response_body`).
    Found(Saved),
    /// An `absent` status (this one): not happened, or not yet.
    Absent(StatusCode),
    /// Another status: ask again.
    Other(StatusCode),
    /// No answer (a connect failure, a reset, the upstream's timeout): ask again.
    Failed(String),
}

impl Answer {
    /// How it is counted in `idemproxy_resolve_lookups_total`.
    pub(crate) fn counted(&self) -> LookupAnswer {
        match self {
            Answer::Found(_) => LookupAnswer::Found,
            Answer::Absent(_) => LookupAnswer::Absent,
            Answer::Other(_) => LookupAnswer::Other,
            Answer::Failed(_) => LookupAnswer::Failed,
        }
    }
}

/// The statuses a route reads a lookup's answer by.
pub(crate) struct Statuses<'a> {
    pub found: &'a [u16],
    pub absent: &'a [u16],
}

/// Sends `lookup` to `upstream` (bounded by its `connect_timeout` and `timeout`, never sent
/// twice) and reads the answer.
pub(crate) async fn ask(
    upstream: &Upstream,
    lookup: &Lookup,
    statuses: &Statuses<'_>,
    idem: &IdempotencySettings,
) -> Answer {
    let sent = crate::traces::within(
        "idemproxy.resolve.lookup",
        upstream.ask(
            lookup.method.clone(),
            &lookup.target,
            &lookup.headers,
            idem.max_response_body,
        ),
    )
    .await;
    let (parts, body) = match sent {
        Ok(answer) => answer,
        Err(e) => return Answer::Failed(e.to_string()),
    };
    classify(&parts, body, statuses, idem)
}

/// The answer of a response to a lookup.
fn classify(
    parts: &http::response::Parts,
    body: Bounded,
    statuses: &Statuses<'_>,
    idem: &IdempotencySettings,
) -> Answer {
    let status = parts.status.as_u16();
    if statuses.found.contains(&status) {
        let saved = match body {
            Bounded::Complete(body) => Saved::Response(SavedResponse {
                status: parts.status,
                headers: saved_headers(&parts.headers, idem),
                body,
            }),
            // As a first response over the bound: its status is the result, but it cannot
            // be replayed (the rest is dropped with the connection).
            Bounded::Over { .. } => Saved::NotReplayable {
                status: parts.status,
            },
        };
        return Answer::Found(saved);
    }
    if statuses.absent.contains(&status) {
        return Answer::Absent(parts.status);
    }
    Answer::Other(parts.status)
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http::Response;

    use super::*;
    use crate::body;

    fn idem() -> IdempotencySettings {
        crate::config::Config::from_yaml(
            "listen: 127.0.0.1:8080\nupstreams: {b: {url: 'http://127.0.0.1:1'}}\nroutes: [{name: r, path: /b, upstream: b, idempotency: {}}]\n",
        )
        .expect("valid")
        .routes[0]
            .idempotency
            .clone()
            .expect("idempotent")
    }

    fn head(status: u16) -> http::response::Parts {
        let resp = Response::builder()
            .status(status)
            .header("set-cookie", "s=1")
            .header("content-length", "2")
            .header("etag", "\"1\"")
            .body(())
            .expect("response");
        resp.into_parts().0
    }

    #[test]
    fn answers_are_read_by_the_routes_statuses_and_found_is_saved_as_a_first_response() {
        let idem = idem();
        let statuses = Statuses {
            found: &[200],
            absent: &[404],
        };
        let complete = || Bounded::Complete(Bytes::from_static(b"ok"));
        match classify(&head(200), complete(), &statuses, &idem) {
            Answer::Found(Saved::Response(saved)) => {
                assert_eq!(saved.status, 200);
                assert_eq!(saved.body, "ok");
                let names: Vec<&str> = saved.headers.iter().map(|(n, _)| n.as_str()).collect();
                assert_eq!(names, ["etag"], "no Set-Cookie, no Content-Length");
            }
            other => panic!("expected a found response, got {other:?}"),
        }
        let over = Bounded::Over {
            prefix: Bytes::from_static(b"o"),
            rest: body::full(Bytes::from_static(b"k")),
        };
        assert!(matches!(
            classify(&head(200), over, &statuses, &idem),
            Answer::Found(Saved::NotReplayable { status }) if status == 200
        ));
        assert!(matches!(
            classify(&head(404), complete(), &statuses, &idem),
            Answer::Absent(s) if s == 404
        ));
        assert!(matches!(
            classify(&head(500), complete(), &statuses, &idem),
            Answer::Other(s) if s == 500
        ));
        assert_eq!(Answer::Failed("x".into()).counted(), LookupAnswer::Failed);
    }
}
