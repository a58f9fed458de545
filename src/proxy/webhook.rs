//! A delivery on a webhook route (SPEC §4.9): its signature headers checked before its body is
//! read, its body read (bounded), its signature checked before anything is claimed or
//! forwarded, and then, verified, run under its event as any admitted request is, in either
//! mode. A delivery that fails the check is a `401`, in `mode: observe` too: a forged delivery
//! must never reach the handler nor claim an event.

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
use crate::route::{FingerprintPart, WebhookSettings};
use crate::webhook::{self, Rejection};

/// The id a provider sent beside a body it signed alone (`X-GitHub-Delivery`, say), carried in
/// the response's extensions to the request log: unsigned, so a label, never the key.
#[derive(Debug, Clone)]
pub(super) struct DeliveryLabel(pub String);

impl Proxy {
    /// Verifies a delivery, then runs it under its event; one without an event is forwarded
    /// without idempotency and counted as `missing_key`, never refused.
    pub(super) async fn webhook(
        &self,
        context: &Arc<Context>,
        settings: &WebhookSettings,
        parts: Parts,
        incoming: Incoming,
    ) -> Answer {
        let route = &context.route;
        // A header the verification or the key reads, named hop-by-hop, would be stripped on
        // its way upstream: the handler would get a delivery other than the one verified.
        let idem = &context.policy;
        let keyed = |name: &http::HeaderName| {
            idem.scope.contains(name)
                || idem
                    .fingerprint
                    .iter()
                    .any(|p| matches!(p, FingerprintPart::Header(h) if h == name))
        };
        if let Some(header) = webhook::named_in_connection(settings, &parts.headers, keyed) {
            return refuse(Problem::HopByHopConflict { header }, Outcome::InvalidKey);
        }
        // Nothing unsigned is read: a delivery without its signature headers is refused before
        // its body is, so a stranger can't make the proxy hold `max_request_body` for a 401.
        if let Err(rejection) = webhook::check_head(settings, &parts) {
            return self.rejected(context, &rejection);
        }
        let body = match admission::read_delivery(context, &parts, incoming).await {
            Ok(body) => body,
            Err((problem, outcome)) => return refuse(problem, outcome),
        };
        let path = &route.settings.path;
        let verified = match webhook::verify(settings, &parts, path, &body, SystemTime::now()) {
            Ok(verified) => verified,
            Err(rejection) => return self.rejected(context, &rejection),
        };
        self.metrics.webhook(&route.name, "verified");
        // The provider's unsigned delivery id: a label for the request log, never the key.
        let label = verified.label.clone().map(DeliveryLabel);
        let (Some(event), Some(key_text)) = (&verified.event, verified.key_text()) else {
            // Verified, with no event to key it by (Slack's url_verification, say): forwarded
            // without idempotency, counted as `missing_key`, never refused.
            let (resp, outcome) =
                forward_plain(route, parts, body::full(body), context.client, None).await;
            let outcome = match outcome {
                Outcome::Passthrough => Outcome::MissingKey,
                other => other,
            };
            return (resp, outcome);
        };
        let mut admitted = match admission::webhook_delivery(context, parts, body, event, &key_text)
        {
            Ok(admitted) => admitted,
            Err(problem) => return refuse(problem, Outcome::InvalidKey),
        };
        if let Some(label) = &label {
            // Saved with the event's result, for the key tooling (never replayed).
            admitted.parts.extensions.insert(label.clone());
        }
        let (mut resp, outcome) = match &route.observed {
            Some(observed) => self.observe_admitted(context, observed, admitted).await,
            None => self.run_admitted(context.clone(), admitted).await,
        };
        if let Some(label) = label {
            // For the request log (extensions are never sent).
            resp.extensions_mut().insert(label);
        }
        (resp, outcome)
    }

    /// A refused delivery: counted by what failed, logged, `401`.
    fn rejected(&self, context: &Context, rejection: &Rejection) -> Answer {
        let route = &context.route;
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
        // Counted as `bad_request`: a request that could not be used (the metrics table).
        refuse(problem, Outcome::BadRequest)
    }
}
