//! A delivery on a webhook route (SPEC §4.9): its body read (bounded), its signature checked
//! before anything is claimed or forwarded, and then, verified, run under its event id as any
//! admitted request is, in either mode. A delivery that fails the check is a `401`, in `mode:
//! observe` too: a forged delivery must never reach the handler nor claim an event id.

use std::sync::Arc;
use std::time::SystemTime;

use http::request::Parts;
use hyper::body::Incoming;

use super::context::Context;
use super::matched::{Answer, forward_plain, refuse};
use super::{Proxy, admission};
use crate::body;
use crate::metrics::Outcome;
use crate::problem::Problem;
use crate::route::WebhookSettings;
use crate::webhook;

impl Proxy {
    /// Verifies a delivery, then runs it under its event id; one without an id is forwarded
    /// without idempotency and counted as `missing_key`, never refused.
    pub(super) async fn webhook(
        &self,
        context: &Arc<Context>,
        settings: &WebhookSettings,
        parts: Parts,
        incoming: Incoming,
    ) -> Answer {
        let route = &context.route;
        let body = match admission::read_delivery(context, &parts, incoming).await {
            Ok(body) => body,
            Err((problem, outcome)) => return refuse(problem, outcome),
        };
        let path = &route.settings.path;
        let verified = match webhook::verify(settings, &parts, path, &body, SystemTime::now()) {
            Ok(verified) => verified,
            Err(rejection) => {
                self.metrics.webhook(&route.name, rejection.result());
                // The detail names the check, never a secret or a signature.
                tracing::info!(
                    route = %route.name,
                    result = rejection.result(),
                    "webhook delivery refused: {rejection}"
                );
                let problem = Problem::WebhookSignatureInvalid {
                    detail: rejection.detail(),
                };
                return refuse(problem, Outcome::BadRequest);
            }
        };
        self.metrics.webhook(&route.name, "verified");
        let Some(event) = verified.event_id else {
            let (resp, outcome) =
                forward_plain(route, parts, body::full(body), context.client, None).await;
            let outcome = match outcome {
                Outcome::Passthrough => Outcome::MissingKey,
                other => other,
            };
            return (resp, outcome);
        };
        let admitted = match admission::webhook_delivery(context, parts, body, &event) {
            Ok(admitted) => admitted,
            Err(problem) => return refuse(problem, Outcome::InvalidKey),
        };
        match &route.observed {
            Some(observed) => self.observe_admitted(context, observed, admitted).await,
            None => self.run_admitted(context.clone(), admitted).await,
        }
    }
}
