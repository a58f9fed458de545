//! The admin listener (`admin_listen`): health, readiness, metrics, and the key tooling.
//!
//! | request | answer |
//! | --- | --- |
//! | `GET /healthz` | `200` while the process serves |
//! | `GET /readyz` | `200` when the store answers within `store.timeout`; `503` when it does not, and while draining after SIGTERM (so a load balancer stops sending) |
//! | `HEAD /healthz`, `HEAD /readyz` | the same status and headers, without a body: load balancers that probe with `HEAD` |
//! | `GET /metrics` | Prometheus text (OpenMetrics) |
//! | `GET /keys/ROUTE?key=K&scope=Name:%20value`, `GET /keys/ROUTE?part=V1&part=V2…` (a `key_from` route's part values, in order) or `GET /keys/ROUTE/HASH` | one record: state, fingerprint, saved status, header names, body size, age and remaining TTL; the body only with `&body=true` |
//! | `DELETE /keys/ROUTE?key=K…` or `DELETE /keys/ROUTE/HASH` | forgets a finished record (`409` for a claim in flight, which is never forgotten); logged |
//!
//! The `/keys` endpoints reveal and change records, so they exist only when an admin token is
//! configured (`admin_token_file` or `admin_token_env`, never inline in the YAML), and every
//! call must carry `Authorization: Bearer TOKEN`. Without a token they answer `404`.
//!
//! Every refusal is problem+json ([`AdminProblem`]), with `type`s of its own, listed in the
//! README.

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use serde_json::{Value, json};

use crate::body::{self, Body};
use crate::key::StoreKey;
use crate::problem::AdminProblem;
use crate::proxy::{Proxy, RecordName, RecordNameError};
use crate::record::{DELIVERY_LABEL, Phase, Record, Resolvable, Saved};
use crate::store::{Forgotten, StoreError};

fn text(status: StatusCode, body: &'static str) -> Response<Body> {
    let mut resp = Response::new(body::full(Bytes::from_static(body.as_bytes())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

fn json_response(status: StatusCode, doc: &serde_json::Value) -> Response<Body> {
    let mut resp = Response::new(body::full(doc.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// Answers one admin request (the server serves it on its own listener).
pub(crate) async fn handle(
    proxy: &Proxy,
    req: Request<Incoming>,
    peer: SocketAddr,
) -> Response<Body> {
    let path = req.uri().path().to_owned();
    match (req.method(), path.as_str()) {
        // HEAD as GET: hyper writes the head (Content-Length included) and leaves the body out.
        (&Method::GET | &Method::HEAD, "/healthz") => text(StatusCode::OK, "ok\n"),
        (&Method::GET | &Method::HEAD, "/readyz") => readiness(proxy).await,
        (&Method::GET, "/metrics") => {
            let mut resp = Response::new(body::full(proxy.encode_metrics()));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            resp
        }
        (method, p) if p.starts_with("/keys/") => {
            // The token in force: a reload may rotate it.
            let config = proxy.config();
            let Some(token) = config.admin_token.as_deref() else {
                return AdminProblem::KeyToolingOff.response();
            };
            if !authorized(req.headers(), token) {
                return AdminProblem::Unauthorized.response();
            }
            let query = req.uri().query().unwrap_or("").to_owned();
            let rest = &p["/keys/".len()..];
            match *method {
                Method::GET => show(proxy, rest, &query).await,
                Method::DELETE => forget(proxy, rest, &query, peer).await,
                _ => AdminProblem::MethodNotAllowed.response(),
            }
        }
        _ => AdminProblem::NoEndpoint.response(),
    }
}

async fn readiness(proxy: &Proxy) -> Response<Body> {
    if proxy.is_draining() {
        return text(StatusCode::SERVICE_UNAVAILABLE, "draining\n");
    }
    // Every worker's connections: one worker's broken pool is a share of the traffic failing.
    let pings = proxy.stores().map(|store| store.ping());
    for (worker, ping) in futures_util::future::join_all(pings)
        .await
        .into_iter()
        .enumerate()
    {
        if let Err(e) = ping {
            tracing::warn!(worker, error = %e, "readiness: the store does not answer");
            return text(StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n");
        }
    }
    text(StatusCode::OK, "ready\n")
}

/// Compares the bearer token in constant time (for equal lengths).
fn authorized(headers: &HeaderMap, token: &str) -> bool {
    let Some(given) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        // The auth scheme is case-insensitive (RFC 9110 §11.1); the token is not.
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim_start_matches(' '))
    else {
        return false;
    };
    let (a, b) = (given.as_bytes(), token.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A request that names no record: why, in the words of the refusal's detail.
fn unnamed(why: impl Into<String>) -> AdminProblem {
    AdminProblem::InvalidRecordName { detail: why.into() }
}

/// The `scope=Name: value` parameters as headers.
fn scope_headers(pairs: &[(String, String)]) -> Result<HeaderMap, AdminProblem> {
    let mut scope = HeaderMap::new();
    for (_, v) in pairs.iter().filter(|(k, _)| k == "scope") {
        let (name, value) = v
            .split_once(':')
            .ok_or_else(|| unnamed("A scope parameter is Name: value"))?;
        let name = HeaderName::from_bytes(name.trim().as_bytes())
            .map_err(|_| unnamed("A scope parameter names an invalid header"))?;
        let value = HeaderValue::from_str(value.trim_start())
            .map_err(|_| unnamed("A scope parameter has an invalid header value"))?;
        scope.append(name, value);
    }
    Ok(scope)
}

/// Which record a `/keys/…` request names: `ROUTE/HASH`, `ROUTE?key=K&scope=Name: value`, or
/// `ROUTE?part=V1&part=V2…` (a `key_from` route's part values, with the same scope).
fn store_key(proxy: &Proxy, rest: &str, query: &str) -> Result<StoreKey, AdminProblem> {
    let (route, hash) = match rest.split_once('/') {
        Some((route, hash)) => (route, Some(hash)),
        None => (rest, None),
    };
    let pairs: Vec<(String, String)> = form_urlencoded::parse(query.as_bytes())
        .into_owned()
        .collect();
    let scope = match hash {
        Some(_) => HeaderMap::new(),
        None => scope_headers(&pairs)?,
    };
    let parts: Vec<String> = pairs
        .iter()
        .filter(|(k, _)| k == "part")
        .map(|(_, v)| v.clone())
        .collect();
    let key;
    let lookup = match hash {
        Some(hash) => {
            let mut id = [0u8; 32];
            hex::decode_to_slice(hash, &mut id)
                .map_err(|_| unnamed("The key hash is 64 hex digits, as the logs show it"))?;
            RecordName::Hash(id)
        }
        None if !parts.is_empty() => RecordName::Parts(&parts),
        None => {
            key = sent_key(&pairs)?;
            RecordName::Key(&key)
        }
    };
    proxy
        .keys()
        .store_key(route, lookup, &scope)
        .map_err(|e| match lookup {
            // Part values are refused as not fitting, whatever the reason: on an unknown route
            // too, as they always were (400).
            RecordName::Parts(_) => unnamed(format!(
                "The part values do not fit the route's key_from (one value per part, in order; JSON text for json: parts): {e}"
            )),
            RecordName::Key(_) | RecordName::Hash(_) => match e {
                RecordNameError::Webhook(why) => unnamed(why),
                _ => AdminProblem::NoIdempotentRoute,
            },
        })
}

/// The `key=K` parameter, parsed as the request header is: bare or quoted, one key either way
/// (SPEC §4.1).
fn sent_key(pairs: &[(String, String)]) -> Result<String, AdminProblem> {
    let key = pairs
        .iter()
        .find(|(k, _)| k == "key")
        .map(|(_, v)| v.as_str())
        .ok_or_else(|| {
            unnamed("Name the record by ?key=K (and scope=Name: value for each scope header) or by /keys/ROUTE/HASH")
        })?;
    let value =
        HeaderValue::from_str(key).map_err(|_| unnamed("The key is not a valid header value"))?;
    crate::key::parse(&value).map_err(|_| {
        unnamed("The key is not a valid idempotency key (1 to 255 visible ASCII characters, bare or quoted)")
    })
}

async fn show(proxy: &Proxy, rest: &str, query: &str) -> Response<Body> {
    let key = match store_key(proxy, rest, query) {
        Ok(k) => k,
        Err(problem) => return problem.response(),
    };
    let with_body =
        form_urlencoded::parse(query.as_bytes()).any(|(k, v)| k == "body" && v == "true");
    let (record, ttl) = match proxy.store().inspect(&key).await {
        Ok(Some(found)) => found,
        Ok(None) => return AdminProblem::NoRecord.response(),
        Err(e) => return store_unavailable(&e),
    };
    let mut doc = json!({
        "route": rest.split('/').next().unwrap_or(rest),
        "key_hash": key.id_hex(),
        "store_key": key.text(),
        "fingerprint": hex::encode(record.fingerprint()),
        "ttl_remaining_ms": ttl.as_millis() as u64,
    });
    match record {
        Record::InFlight { .. } => {
            doc["state"] = json!("in_flight");
        }
        Record::Resolvable(r) => resolvable_doc(proxy, &key, &r, &mut doc).await,
        Record::Finished { saved, .. } => {
            doc["state"] = json!("finished");
            // A finished record's TTL starts at the route's `ttl` when it is saved.
            if let Some(saved_for) = proxy.keys().ttl_of(&key) {
                doc["age_ms"] = json!(saved_for.saturating_sub(ttl).as_millis() as u64);
            }
            match saved {
                Saved::Response(r) | Saved::Resolved(r) | Saved::Trailed { response: r, .. } => {
                    doc["replayable"] = json!(true);
                    doc["status"] = json!(r.status.as_u16());
                    doc["headers"] = json!(
                        r.headers
                            .iter()
                            .filter(|(n, _)| *n != DELIVERY_LABEL)
                            .map(|(n, _)| n.as_str().to_owned())
                            .collect::<Vec<_>>()
                    );
                    // A webhook delivery's unsigned id: which delivery ran the event.
                    if let Some((_, label)) = r.headers.iter().find(|(n, _)| *n == DELIVERY_LABEL) {
                        doc["delivery"] = json!(String::from_utf8_lossy(label.as_bytes()));
                    }
                    doc["body_bytes"] = json!(r.body.len());
                    if with_body {
                        match std::str::from_utf8(&r.body) {
                            Ok(t) => doc["body"] = json!(t),
                            Err(_) => doc["body_hex"] = json!(hex::encode(&r.body)),
                        }
                    }
                }
                Saved::NotReplayable { status } => {
                    doc["replayable"] = json!(false);
                    doc["status"] = json!(status.as_u16());
                }
            }
        }
    }
    json_response(StatusCode::OK, &doc)
}

/// A claim of a `resolve` route: `in_flight`, or `resolving` with the time of its next lookup
/// (on the store's clock, which the record's times are on: the wait from now, and when that
/// is by this host's clock). The lookup is named by its upstream, method and the names of its
/// copied headers — never their values, which may be credentials.
///
/// A claim whose lease has lapsed has no holder: its instance crashed, drained before the
/// resolution ended, or left it past `limits.max_resolutions`. Nothing asks about it until a
/// repeat of its key arrives and takes it over (SPEC §4.8: the takeover is the claim's atomic
/// step, on demand); until then no lookup is due, whatever time the record holds, and the
/// answer says it is waiting for that repeat.
async fn resolvable_doc(proxy: &Proxy, key: &StoreKey, r: &Resolvable, doc: &mut Value) {
    doc["lookup"] = json!({
        "upstream": r.lookup.upstream,
        "method": r.lookup.method.as_str(),
        "headers": r.lookup.headers.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
    });
    doc["state"] = json!(match r.phase {
        Phase::InFlight => "in_flight",
        Phase::Resolving => "resolving",
    });
    // The store's clock, read once more: a time of the record means nothing without it.
    let Ok(now) = proxy.store().now(key).await else {
        return;
    };
    if r.lease_until <= now {
        doc["lease_lapsed_ms_ago"] = json!(now - r.lease_until);
        doc["waiting_for"] = json!(TAKEOVER);
        return;
    }
    if r.phase == Phase::InFlight {
        return;
    }
    let wait = r.next_lookup_at.saturating_sub(now);
    doc["next_lookup_in_ms"] = json!(wait);
    let at = std::time::SystemTime::now() + std::time::Duration::from_millis(wait);
    if let Ok(unix) = at.duration_since(std::time::UNIX_EPOCH) {
        doc["next_lookup_at_unix_ms"] = json!(unix.as_millis() as u64);
    }
}

/// What a claim without a holder waits for (`waiting_for`).
const TAKEOVER: &str = "a repeat of the key to take it over";

async fn forget(proxy: &Proxy, rest: &str, query: &str, peer: SocketAddr) -> Response<Body> {
    let key = match store_key(proxy, rest, query) {
        Ok(k) => k,
        Err(problem) => return problem.response(),
    };
    let route = rest.split('/').next().unwrap_or(rest);
    match proxy.store().forget(&key).await {
        Ok(Forgotten::Forgotten) => {
            tracing::warn!(
                route,
                key = %key.id_hex(),
                %peer,
                "record forgotten through the admin endpoint: the next request with this key runs again"
            );
            json_response(
                StatusCode::OK,
                &json!({ "forgotten": true, "key_hash": key.id_hex() }),
            )
        }
        Ok(Forgotten::Absent) => AdminProblem::NoRecord.response(),
        Ok(Forgotten::InFlight) => in_flight(proxy, &key).await.response(),
        Ok(Forgotten::NotARecord) => AdminProblem::NotARecord.response(),
        Err(e) => store_unavailable(&e),
    }
}

/// Why a claim is not forgotten: in flight, or being resolved (with when its next lookup is
/// due, on the store's clock), which its lease lapsing does not end.
async fn in_flight(proxy: &Proxy, key: &StoreKey) -> AdminProblem {
    let store = proxy.store();
    if let Ok(Some(Record::Resolvable(r))) = store.get(key).await
        && let Ok(now) = store.now(key).await
    {
        // No holder: waiting for a repeat to take it over (see `resolvable_doc`).
        if r.lease_until <= now {
            return AdminProblem::RecordResolving {
                next_lookup_in: None,
            };
        }
        if r.phase == Phase::Resolving {
            let wait = r.next_lookup_at.saturating_sub(now);
            return AdminProblem::RecordResolving {
                next_lookup_in: Some(std::time::Duration::from_millis(wait)),
            };
        }
    }
    AdminProblem::RecordInFlight
}

fn store_unavailable(e: &StoreError) -> Response<Body> {
    AdminProblem::of_store(e).response()
}

/// A client of a running proxy's admin listener, for `idemproxy health` and `idemproxy keys`.
pub mod client {
    use http::{Method, Request, StatusCode, Uri, header};
    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::TokioIo;
    use tokio::net::TcpStream;

    /// Why an admin call failed before any answer.
    #[derive(Debug, thiserror::Error)]
    pub enum ClientError {
        /// The admin URL is not `http://HOST:PORT`.
        #[error("invalid admin URL {0:?}: expected http://HOST:PORT")]
        Url(String),
        /// The connection or the exchange failed.
        #[error("cannot reach the admin listener at {url}: {why}")]
        Io {
            url: String,
            /// What failed.
            why: String,
        },
    }

    /// Sends one request to `base` (`http://HOST:PORT`) + `path_and_query`, with the bearer
    /// token if any; returns the status and the body.
    pub async fn call(
        base: &str,
        method: Method,
        path_and_query: &str,
        token: Option<&str>,
    ) -> Result<(StatusCode, String), ClientError> {
        let url = format!("{}{path_and_query}", base.trim_end_matches('/'));
        let uri: Uri = url.parse().map_err(|_| ClientError::Url(base.to_owned()))?;
        let authority = match (uri.scheme_str(), uri.authority()) {
            (Some("http"), Some(a)) => a.clone(),
            _ => return Err(ClientError::Url(base.to_owned())),
        };
        let io = |e: &dyn std::fmt::Display| ClientError::Io {
            url: url.clone(),
            why: e.to_string(),
        };
        let port = authority.port_u16().unwrap_or(80);
        let stream = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            TcpStream::connect((authority.host(), port)),
        )
        .await
        .map_err(|e| io(&e))?
        .map_err(|e| io(&e))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| io(&e))?;
        tokio::spawn(conn);
        let mut req = Request::builder()
            .method(method)
            .uri(uri.path_and_query().map(|p| p.as_str()).unwrap_or("/"))
            .header(header::HOST, authority.as_str());
        if let Some(token) = token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let req = req
            .body(Full::new(bytes::Bytes::new()))
            .map_err(|e| io(&e))?;
        let resp =
            tokio::time::timeout(std::time::Duration::from_secs(30), sender.send_request(req))
                .await
                .map_err(|e| io(&e))?
                .map_err(|e| io(&e))?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| io(&e))?
            .to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    }

    /// The `/keys/…` path and query naming a record: by key (with scope values) or by hash.
    pub fn record_path(
        route: &str,
        key: Option<&str>,
        parts: &[String],
        scope: &[String],
        hash: Option<&str>,
        body: bool,
    ) -> String {
        let mut query = form_urlencoded::Serializer::new(String::new());
        if let Some(key) = key {
            query.append_pair("key", key);
        }
        for p in parts {
            query.append_pair("part", p);
        }
        for s in scope {
            query.append_pair("scope", s);
        }
        if body {
            query.append_pair("body", "true");
        }
        let query = query.finish();
        let route: String = form_urlencoded::byte_serialize(route.as_bytes()).collect();
        let mut path = match hash {
            Some(hash) => format!("/keys/{route}/{hash}"),
            None => format!("/keys/{route}"),
        };
        if !query.is_empty() {
            path.push('?');
            path.push_str(&query);
        }
        path
    }
}
