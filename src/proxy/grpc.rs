//! A call on a gRPC route (SPEC §4.11): a request that is not a gRPC call is `415`, nothing
//! forwarded; a call is admitted (its whole request read, the key from its metadata) and run by
//! the shared flow; and every answer the proxy makes itself on the route — a refusal, a
//! conflict, an unknown outcome — leaves as a gRPC status in a trailers-only response.

use std::sync::Arc;

use http::header;
use http::request::Parts;
use http::{Request, Response};
use hyper::body::Incoming;

use super::context::Context;
use super::matched::{Answer, Route, forward_plain, refuse};
use super::{Proxy, admission, body_with_deadline};
use crate::body::Body;
use crate::grpc;
use crate::metrics::Outcome;
use crate::problem::Problem;

impl Proxy {
    /// A request on a gRPC route: refused unless it is a gRPC call, then claimed and run as
    /// any admitted request; the proxy's own answers rendered as gRPC statuses.
    pub(super) async fn grpc(
        &self,
        context: &Arc<Context>,
        parts: Parts,
        incoming: Incoming,
    ) -> Answer {
        if !grpc::is_call(&parts.method, &parts.headers) {
            let content_type = parts
                .headers
                .get(header::CONTENT_TYPE)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .unwrap_or_default();
            // Not a gRPC client: a plain HTTP answer it can read.
            return refuse(
                Problem::UnsupportedMediaType { content_type },
                Outcome::BadRequest,
            );
        }
        let route = &context.route;
        let (resp, outcome) = match &route.observed {
            Some(observed) => {
                let req = Request::from_parts(parts, incoming);
                self.observed(context, observed, req).await
            }
            None => match admission::admit(context, parts, incoming).await {
                admission::Admission::Admitted(admitted) => {
                    self.run_admitted(context.clone(), admitted).await
                }
                admission::Admission::NoKey(parts, incoming) => {
                    let body = body_with_deadline(incoming, &context.limits);
                    forward_plain(route, parts, body, context.client, None).await
                }
                admission::Admission::Refused(problem, outcome) => refuse(problem, outcome),
            },
        };
        (as_status(resp), outcome)
    }
}

/// `problem` as `route` answers a request with this method and head before its flow runs (a
/// head over the limits): a gRPC status for a gRPC call on a gRPC route, problem+json for
/// anything else — a client that is not a gRPC one gets a plain HTTP answer it can read, as
/// the `415` does.
pub(super) fn refusal(
    route: &Route,
    method: &http::Method,
    headers: &http::HeaderMap,
    problem: &Problem,
) -> Response<Body> {
    if route.settings.grpc.is_some() && grpc::is_call(method, headers) {
        grpc::answer(problem)
    } else {
        problem.response()
    }
}

/// A response of the proxy's own (it carries its problem) as the gRPC status it stands for;
/// any other, the upstream's or a replay, as it is.
fn as_status(resp: Response<Body>) -> Response<Body> {
    let Some(problem) = resp.extensions().get::<Problem>().cloned() else {
        return resp;
    };
    let (parts, _) = resp.into_parts();
    let mut answer = grpc::answer(&problem);
    // The request log's key hash rides in the extensions.
    *answer.extensions_mut() = parts.extensions;
    answer
}
