//! Talking to an upstream: a pool of HTTP/1.1 connections each (per worker), header rewriting,
//! deadlines, and telling a failure that sent nothing from one that may have acted.
//!
//! That distinction is the whole point of the proxy's unknown-outcome rules (SPEC §4.4): a
//! connect error means the upstream never saw the request, so the claim can be released; a
//! timeout or a reset after sending means it may have acted, so the outcome is unknown. A
//! connection still being made (TCP connect, TLS handshake) when `connect_timeout` or the
//! response deadline runs out is a connect error, never a timeout: nothing was written.
//!
//! Pooled connections that may have been idle for `pool_idle_timeout`, counted from their last
//! response's head, are dropped, never reused (SPEC §4.3): an upstream that closes idle
//! connections would otherwise race the proxy's next request.

mod failure;
mod gathered;
mod h2;
mod headers;
mod pool;
mod refusal;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{Request, Response, Uri};
use http_body_util::{BodyExt, BodyStream, StreamBody};
use hyper::body::Frame;
use hyper_util::client::legacy::connect::HttpConnector;
use tokio::time::Instant;

pub(crate) use self::failure::error_chain;
use self::failure::failed;
use self::gathered::Gathered;
use self::h2::H2Pool;
pub(crate) use self::headers::strip_hop_by_hop;
use self::headers::{
    X_FORWARDED_FOR, X_FORWARDED_HOST, X_FORWARDED_PROTO, asks_for_trailers, host_header, push_ip,
};
pub(crate) use self::pool::WriteBy;
use self::pool::{Pool, Responding, SendError};
pub(crate) use self::refusal::refuses_head;
use prometheus_client::metrics::histogram::Histogram;

use crate::body::{self, Body};
use crate::config::{Protocol, UpstreamSettings};

/// What a response body cut off at the upstream's timeout is called in errors.
const UPSTREAM_BODY: &str = "the upstream response (upstreams.*.timeout)";

/// How an upstream call failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum UpstreamError {
    /// The connection could not be made, or not within `connect_timeout` and what was left of
    /// `timeout`: the request was not sent.
    #[error("connect failed: {0}")]
    Connect(String),
    /// The request's send deadline passed before any byte of it was written (SPEC §4.8): it
    /// was not sent, and the connection was reset.
    #[error("{0}")]
    Unsent(String),
    /// No complete response within the timeout: the upstream may have acted.
    #[error("no complete response within {0:?}")]
    Timeout(Duration),
    /// The connection failed after the request was sent: the upstream may have acted.
    #[error("{0}")]
    Failed(String),
    /// The client's streamed request body failed while it was being sent (malformed, broken
    /// off, or past `limits.body_read_timeout`): the client's fault, not the upstream's, and
    /// the upstream never got a whole request.
    #[error("the client's request body failed: {detail}")]
    ClientBody {
        /// What went wrong with the body.
        detail: String,
        /// `Some(limit)` when it missed its deadline of `limit`.
        timed_out: Option<Duration>,
    },
}

/// The trailers of a response read whole ([`Upstream::call_bounded`]), in its head's
/// extensions.
#[derive(Debug, Clone)]
pub(crate) struct Trailers(pub HeaderMap);

/// A response whose body was read up to a bound.
pub(crate) enum Bounded {
    /// The whole body fit.
    Complete(Bytes),
    /// The body is larger than the bound: what was read, and the rest still to stream.
    Over {
        /// The bytes read so far.
        prefix: Bytes,
        /// The rest of the body, still bound by the upstream's timeout.
        rest: Body,
    },
}

/// How requests reach an upstream: a pool of HTTP/1.1 connections, or streams on an HTTP/2
/// connection.
enum Transport {
    Http1(Pool),
    H2(H2Pool),
}

impl Transport {
    fn send(&self, req: Request<Body>, deadline: Instant) -> Responding<'_> {
        match self {
            Transport::Http1(pool) => pool.send(req, deadline),
            Transport::H2(pool) => pool.send(req, deadline),
        }
    }

    fn send_fresh(&self, req: Request<Body>, deadline: Instant) -> Responding<'_> {
        match self {
            Transport::Http1(pool) => pool.send_fresh(req, deadline),
            Transport::H2(pool) => pool.send_fresh(req, deadline),
        }
    }

    fn is_h2(&self) -> bool {
        matches!(self, Transport::H2(_))
    }
}

/// One upstream and its connection pool.
pub(crate) struct Upstream {
    name: String,
    /// The URL's path without a trailing slash ("" for none): requests are appended to it.
    base_path: String,
    /// The `Host` header every request to it carries: the URL's host, and its port unless it
    /// is the scheme's default. Built once here, not formatted for every request.
    host: HeaderValue,
    /// This upstream's connections (on the worker that owns this value).
    pool: Transport,
    /// `http://` or `https://`: an HTTP/2 request's `:scheme`.
    scheme: http::uri::Scheme,
    /// The URL's authority: an HTTP/2 request's `:authority`.
    authority: http::uri::Authority,
    timeout: Duration,
    /// The longest making a connection takes: a request is written within it of its call's
    /// start, or not at all.
    connect_timeout: Duration,
    /// `idemproxy_upstream_duration_seconds` of this upstream.
    duration: Histogram,
    /// The `X-Forwarded-Proto` value: the listener's scheme, fixed at start.
    forwarded_proto: HeaderValue,
}

impl Upstream {
    /// Builds the client. An https upstream trusts what its settings say: the certificates of
    /// `ca_file`, or else the Mozilla roots (webpki-roots).
    pub(crate) fn new(settings: &UpstreamSettings, duration: Histogram) -> Upstream {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        // TCP only, and per address of a name that resolves to several; the pool bounds the
        // whole of making a connection (the TLS handshake too) by it as well.
        http.set_connect_timeout(Some(settings.connect_timeout));
        http.set_nodelay(true);
        let builder = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(settings.tls.client_config())
            .https_or_http();
        // The TLS handshake offers (ALPN) the protocol the upstream is configured to speak.
        let connector = match settings.protocol {
            Protocol::H2 => builder.enable_http2().wrap_connector(http),
            Protocol::Http1 | Protocol::H2c => builder.enable_http1().wrap_connector(http),
        };
        let url = &settings.url;
        let scheme = url.scheme().cloned().unwrap_or(http::uri::Scheme::HTTP);
        let authority = url
            .authority()
            .cloned()
            .unwrap_or_else(|| http::uri::Authority::from_static("localhost"));
        let target = Uri::from_parts({
            let mut target = http::uri::Parts::default();
            target.scheme = Some(scheme.clone());
            target.authority = Some(authority.clone());
            target.path_and_query = Some(PathAndQuery::from_static("/"));
            target
        })
        .unwrap_or_else(|_| Uri::from_static("http://localhost/"));
        let pool = match settings.protocol {
            Protocol::Http1 => Transport::Http1(Pool::new(
                connector,
                target,
                settings.connect_timeout,
                settings.pool_idle_timeout,
            )),
            Protocol::H2c | Protocol::H2 => {
                Transport::H2(H2Pool::new(connector, target, settings.connect_timeout))
            }
        };
        Upstream {
            name: settings.name.clone(),
            pool,
            scheme: scheme.clone(),
            authority: authority.clone(),
            host: host_header(&scheme, &authority),
            base_path: url.path().trim_end_matches('/').to_owned(),
            timeout: settings.timeout,
            connect_timeout: settings.connect_timeout,
            duration,
            forwarded_proto: HeaderValue::from_str(settings.forwarded_proto.as_str())
                .unwrap_or(HeaderValue::from_static("http")),
        }
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Its `connect_timeout`: a request is written within it of its call's start, or never.
    pub(crate) fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// Its `timeout`: on an idempotent route no byte of a request is written once it has
    /// passed since an instant taken before the claim ([`WriteBy`]).
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Builds the upstream request from the client's: the URL rebased on the upstream,
    /// hop-by-hop headers removed, `X-Forwarded-*` set, the key header kept or dropped.
    pub(crate) fn request<B>(
        &self,
        parts: Parts,
        body: B,
        client: SocketAddr,
        drop_header: Option<&HeaderName>,
    ) -> Result<Request<B>, UpstreamError> {
        let Parts {
            method,
            uri,
            mut headers,
            ..
        } = parts;
        // gRPC needs `te: trailers` end to end; hop-by-hop for HTTP/1.1, it is the one value
        // HTTP/2 allows, so an HTTP/2 upstream gets it when the client sent it.
        let te_trailers = self.pool.is_h2() && asks_for_trailers(&headers);
        strip_hop_by_hop(&mut headers);
        if te_trailers {
            headers.insert(header::TE, HeaderValue::from_static("trailers"));
        }
        // HTTP/1 sends Host; HTTP/2 sends the authority in the URI.
        let host = headers.remove(header::HOST).or_else(|| {
            uri.authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        let uri = self.place(self.rebase(&uri)?)?;
        if let Some(name) = drop_header {
            headers.remove(name);
        }
        // Append the client to the chain, keeping every earlier hop (the header may come as
        // several lines).
        let mut xff = String::with_capacity(64);
        for hop in headers
            .get_all(X_FORWARDED_FOR)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
        {
            xff.push_str(hop);
            xff.push_str(", ");
        }
        push_ip(&mut xff, client.ip());
        if let Ok(v) = HeaderValue::from_maybe_shared(Bytes::from(xff)) {
            headers.insert(X_FORWARDED_FOR, v);
        }
        headers.insert(X_FORWARDED_PROTO, self.forwarded_proto.clone());
        match host {
            Some(h) => {
                headers.insert(X_FORWARDED_HOST, h);
            }
            None => {
                headers.remove(X_FORWARDED_HOST);
            }
        }
        self.host_header(&mut headers);
        let mut req = Request::new(body);
        *req.method_mut() = method;
        *req.uri_mut() = uri;
        *req.headers_mut() = headers;
        Ok(req)
    }

    /// Sends a request the proxy makes itself — a lookup of `resolve:` (SPEC §4.8): `method`
    /// on `path_and_query` (rebased on the upstream URL) with `headers` and no body — and reads
    /// its response up to `limit` bytes, bounded like any call (`connect_timeout`, `timeout`).
    /// Never sent twice: a lookup that fails is simply asked again later.
    pub(crate) async fn ask(
        &self,
        method: http::Method,
        path_and_query: &str,
        headers: &[(HeaderName, HeaderValue)],
        limit: u64,
    ) -> Result<(http::response::Parts, Bounded), UpstreamError> {
        let pq = PathAndQuery::try_from(path_and_query)
            .map_err(|e| UpstreamError::Connect(format!("invalid lookup path: {e}")))?;
        let mut req = Request::new(Bytes::new());
        *req.method_mut() = method;
        *req.uri_mut() = self.place(self.rebase(&Uri::from(pq))?)?;
        let map = req.headers_mut();
        for (name, value) in headers {
            map.append(name.clone(), value.clone());
        }
        strip_hop_by_hop(map);
        self.host_header(map);
        self.call_bounded(req, limit, false).await
    }

    /// The request's target as its transport sends it: origin form over HTTP/1.1 (`Host`
    /// names the upstream), absolute over HTTP/2 (its `:scheme` and `:authority`).
    fn place(&self, origin: Uri) -> Result<Uri, UpstreamError> {
        if !self.pool.is_h2() {
            return Ok(origin);
        }
        let mut parts = origin.into_parts();
        parts.scheme = Some(self.scheme.clone());
        parts.authority = Some(self.authority.clone());
        Uri::from_parts(parts)
            .map_err(|e| UpstreamError::Connect(format!("invalid upstream URI: {e}")))
    }

    /// `Host` over HTTP/1.1; none over HTTP/2, whose `:authority` names the upstream.
    fn host_header(&self, headers: &mut HeaderMap) {
        if self.pool.is_h2() {
            headers.remove(header::HOST);
        } else {
            headers.insert(header::HOST, self.host.clone());
        }
    }

    /// The request's path and query on the upstream: appended to the upstream URL's own path.
    fn rebase(&self, uri: &Uri) -> Result<Uri, UpstreamError> {
        let path_and_query = match (uri.path_and_query(), self.base_path.is_empty()) {
            (Some(pq), true) => pq.clone(),
            (pq, _) => {
                let pq = pq.map(|pq| pq.as_str()).unwrap_or("/");
                PathAndQuery::try_from(format!("{}{}", self.base_path, pq))
                    .map_err(|e| UpstreamError::Connect(format!("invalid upstream URI: {e}")))?
            }
        };
        // Origin form: the connection already goes to the upstream's authority, and Host
        // names it.
        Ok(Uri::from(path_and_query))
    }

    /// Sends a request; the response head must arrive within the upstream's timeout, and its
    /// body, streamed, fails if it has not ended by then either. Hop-by-hop headers are
    /// removed from the response.
    pub(crate) async fn send(&self, req: Request<Body>) -> Result<Response<Body>, UpstreamError> {
        let start = Instant::now();
        let deadline = start + self.timeout;
        let resp = self.head(req, deadline).await;
        self.duration.observe(start.elapsed().as_secs_f64());
        let resp = resp?;
        let (mut parts, incoming) = resp.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        Ok(Response::from_parts(
            parts,
            body::with_deadline(incoming, deadline, UPSTREAM_BODY),
        ))
    }

    /// [`Upstream::send`] for a buffered request, which under `resend` is sent once more on a
    /// fresh connection when it got no response on a reused one (see
    /// [`Upstream::head_resending`]): a JSON-RPC call, whose answer may be a stream.
    pub(crate) async fn send_buffered(
        &self,
        req: Request<Bytes>,
        resend: bool,
    ) -> Result<Response<Body>, UpstreamError> {
        let start = Instant::now();
        let deadline = start + self.timeout;
        let resp = self.head_resending(req, resend, deadline).await;
        self.duration.observe(start.elapsed().as_secs_f64());
        let (mut parts, incoming) = resp?.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        Ok(Response::from_parts(
            parts,
            body::with_deadline(incoming, deadline, UPSTREAM_BODY),
        ))
    }

    /// Sends a request and waits for the response head until `deadline`.
    async fn head(
        &self,
        mut req: Request<Body>,
        deadline: Instant,
    ) -> Result<Response<Body>, UpstreamError> {
        let span = crate::traces::Child::upstream(&mut req, &self.authority);
        let resp = self
            .pool
            .send(req, deadline)
            .await
            .map_err(|e| self.classify(e));
        span.end_call(resp.as_ref().ok().map(|r| r.status().as_u16()));
        resp
    }

    /// [`Upstream::head`] for a buffered request that may be sent once more, on a fresh
    /// connection, when it got no response on a reused one (the keep-alive race; SPEC §4.3
    /// allows it under `on_unknown_outcome: release` only, which is what `resend` says).
    async fn head_resending(
        &self,
        mut req: Request<Bytes>,
        resend: bool,
        deadline: Instant,
    ) -> Result<Response<Body>, UpstreamError> {
        let span = crate::traces::Child::upstream(&mut req, &self.authority);
        let resp = self.head_resending_untraced(req, resend, deadline).await;
        span.end_call(resp.as_ref().ok().map(|r| r.status().as_u16()));
        resp
    }

    async fn head_resending_untraced(
        &self,
        req: Request<Bytes>,
        resend: bool,
        deadline: Instant,
    ) -> Result<Response<Body>, UpstreamError> {
        let again = resend.then(|| {
            let mut copy = Request::new(req.body().clone());
            *copy.method_mut() = req.method().clone();
            *copy.uri_mut() = req.uri().clone();
            *copy.version_mut() = req.version();
            *copy.headers_mut() = req.headers().clone();
            if let Some(by) = req.extensions().get::<WriteBy>() {
                copy.extensions_mut().insert(*by);
            }
            copy
        });
        // An HTTP/2 stream the upstream refused was not processed: sent once more, on a fresh
        // connection, under every policy (SPEC §4.11).
        let again = again.or_else(|| {
            self.pool.is_h2().then(|| {
                let mut copy = Request::new(req.body().clone());
                *copy.method_mut() = req.method().clone();
                *copy.uri_mut() = req.uri().clone();
                *copy.headers_mut() = req.headers().clone();
                copy
            })
        });
        let e = match self.pool.send(req.map(body::full), deadline).await {
            Ok(resp) => return Ok(resp),
            Err(e) => e,
        };
        match again {
            Some(again) if matches!(e, SendError::Refused(_)) => {
                tracing::info!(
                    upstream = %self.name,
                    error = %error_chain(&e),
                    "the upstream refused the stream; sending once more on a fresh connection"
                );
                self.pool
                    .send_fresh(again.map(body::full), deadline)
                    .await
                    .map_err(|again| self.classify(again))
            }
            Some(again) if e.unanswered_on_reused() => {
                tracing::info!(
                    upstream = %self.name,
                    error = %error_chain(&e),
                    "no response on a reused connection; sending once more on a fresh one (on_unknown_outcome: release)"
                );
                self.pool
                    .send_fresh(again.map(body::full), deadline)
                    .await
                    .map_err(|again| match again {
                        // Nothing went out the second time, but the first request may have
                        // reached the upstream before its connection failed: that failure is
                        // the one to answer with, not "the request was not sent".
                        SendError::Connect(_) | SendError::Unsent(_) => self.classify(e),
                        again => self.classify(again),
                    })
            }
            _ => Err(self.classify(e)),
        }
    }

    /// Tells a failure that sent nothing (connect) from one after which the upstream may have
    /// acted (a timeout, a failed connection), and both from the client's own body failing on
    /// the way.
    fn classify(&self, e: SendError) -> UpstreamError {
        match e {
            SendError::Connect(detail) => UpstreamError::Connect(detail),
            SendError::TimedOut => UpstreamError::Timeout(self.timeout),
            // Not processed (RFC 9113 §8.7): as for a request never sent.
            SendError::Refused(_) => UpstreamError::Connect(error_chain(&e)),
            SendError::Unsent(detail) => UpstreamError::Unsent(detail),
            SendError::Failed { .. } => failed(&e),
        }
    }

    /// Sends a request and reads the response body up to `limit` bytes, all within the
    /// upstream's timeout. Hop-by-hop headers are removed from the response.
    ///
    /// With `resend`, a request that got no response on a reused connection is sent once more
    /// on a fresh one (see [`Upstream::head_resending`]).
    pub(crate) async fn call_bounded(
        &self,
        req: Request<Bytes>,
        limit: u64,
        resend: bool,
    ) -> Result<(http::response::Parts, Bounded), UpstreamError> {
        let start = Instant::now();
        let result = self
            .read_bounded(req, limit, resend, start + self.timeout)
            .await;
        self.duration.observe(start.elapsed().as_secs_f64());
        result
    }

    async fn read_bounded(
        &self,
        req: Request<Bytes>,
        limit: u64,
        resend: bool,
        deadline: Instant,
    ) -> Result<(http::response::Parts, Bounded), UpstreamError> {
        let resp = self.head_resending(req, resend, deadline).await?;
        let (mut parts, mut incoming) = resp.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        // A declared length (up to the bound) sizes the buffer once, instead of doubling it
        // (and copying what it holds) as frames arrive.
        let declared = http_body::Body::size_hint(&incoming)
            .exact()
            .map_or(0, |n| n.min(limit.saturating_add(1)));
        let mut buf = Gathered::with_capacity(usize::try_from(declared).unwrap_or(0));
        loop {
            let frame = match tokio::time::timeout_at(deadline, incoming.frame()).await {
                Err(_) => return Err(UpstreamError::Timeout(self.timeout)),
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    return Err(UpstreamError::Failed(format!(
                        "response body failed: {}",
                        error_chain(&*e)
                    )));
                }
                Ok(Some(Ok(frame))) => frame,
            };
            let frame = match frame.into_trailers() {
                // Trailers (a gRPC response's status) ride with the head, for whoever reads
                // them: the whole response is the head, the body and these.
                Ok(trailers) => {
                    parts.extensions.insert(Trailers(trailers));
                    continue;
                }
                Err(frame) => frame,
            };
            if let Ok(data) = frame.into_data()
                && buf.push(data) > limit
            {
                return Ok((
                    parts,
                    Bounded::Over {
                        prefix: buf.into_bytes(),
                        rest: body::with_deadline(incoming, deadline, UPSTREAM_BODY),
                    },
                ));
            }
        }
        Ok((parts, Bounded::Complete(buf.into_bytes())))
    }
}

/// A body of `prefix` followed by the rest of an upstream body, streamed.
pub(crate) fn chain(prefix: Bytes, rest: Body) -> Body {
    let head =
        futures_util::stream::once(async move { Ok::<_, body::BoxError>(Frame::data(prefix)) });
    body::boxed(StreamBody::new(head.chain(BodyStream::new(rest))))
}

#[cfg(test)]
mod tests;
