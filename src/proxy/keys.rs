//! Which record a key names, for the admin's key tooling: the store key of a key as the client
//! sent it, of a key's hash, or of the part values a `key_from` route derives its key from —
//! computed as admission computes it for a request, through the same matched route.

use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;

use super::matched::Route;
use crate::key::{self, KeyId, StoreKey};
use crate::key_from::{self, Value};

/// How the key tooling names a record on its route.
#[derive(Debug, Clone, Copy)]
pub enum RecordName<'a> {
    /// The key as the client sent it, already parsed (bare and quoted forms are one key).
    Key(&'a str),
    /// The key's hash, as the request log shows it.
    Hash(KeyId),
    /// A `key_from` route's part values, in the configured order; JSON text for `json:` parts.
    Parts(&'a [String]),
}

/// Why a name given to the key tooling names no store key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordNameError {
    /// No route has that name, or it is a pass-through route.
    #[error("no idempotent route with that name")]
    NoRoute,
    /// The part values do not fit the route's `key_from`; the message says how.
    #[error("{0}")]
    Parts(String),
    /// A webhook route whose keys no event id names (its provider signs the body alone, or its
    /// path has `{NAME}` segments): the message says how to find a record instead.
    #[error("{0}")]
    Webhook(String),
}

/// The store keys of every idempotent route, built once per configuration from its matched
/// routes.
pub struct RouteKeys {
    /// Every route, in file order.
    routes: Vec<Arc<Route>>,
}

impl RouteKeys {
    pub(super) fn new(routes: &[Arc<Route>]) -> RouteKeys {
        RouteKeys {
            routes: routes.to_vec(),
        }
    }

    /// The store key that `lookup` names on the idempotent route named `route`, for a caller
    /// whose scope headers are among `scope`.
    pub fn store_key(
        &self,
        route: &str,
        lookup: RecordName<'_>,
        scope: &HeaderMap,
    ) -> Result<StoreKey, RecordNameError> {
        let (route, idem) = self
            .routes
            .iter()
            .find(|r| r.settings.name == route)
            .and_then(|r| Some((r, r.idempotency.as_ref()?)))
            .ok_or(RecordNameError::NoRoute)?;
        let id = match lookup {
            // On a webhook route the key is the event: an id names it where the provider signs
            // one, as admission hashes it (`webhook::Verified::key_text`).
            RecordName::Key(event) if route.settings.webhook.is_some() => {
                let signs_id = route
                    .settings
                    .webhook
                    .as_ref()
                    .is_some_and(|w| w.provider.signs_event_id());
                if !signs_id || route.settings.path.params().next().is_some() {
                    return Err(RecordNameError::Webhook(
                        "this webhook route's keys are not named by an event id (its provider signs the body alone, or its path has {NAME} segments): name the record by the key hash on the delivery's request log line".into(),
                    ));
                }
                let text = format!("webhook:{}", hex::encode(event.as_bytes()));
                key::key_id(&idem.scope, scope, &text)
            }
            RecordName::Key(key) => key::key_id(&idem.scope, scope, key),
            RecordName::Hash(id) => id,
            RecordName::Parts(texts) => {
                if idem.key_from.len() != texts.len() {
                    return Err(RecordNameError::Parts(format!(
                        "the route derives its key from {} part(s) ({}); give one value each, in that order",
                        idem.key_from.len(),
                        idem.key_from
                            .iter()
                            .map(|p| p.describe())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )));
                }
                let values = idem
                    .key_from
                    .iter()
                    .zip(texts)
                    .map(|(part, text)| {
                        Value::from_text(part, text).map_err(|e| {
                            RecordNameError::Parts(format!("{}: {e}", part.describe()))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let derived = key_from::derived_key(&idem.key_from, &values, &idem.scope, scope);
                key_from::derived_id(&derived)
            }
        };
        Ok(route.store_key(id))
    }

    /// The `ttl` of the route a store key belongs to (found by its number: a route's number
    /// follows its name, not its place in the file).
    pub(crate) fn ttl_of(&self, key: &StoreKey) -> Option<Duration> {
        let r = self.routes.iter().find(|r| r.number == key.route())?;
        r.idempotency.as_ref().map(|i| i.ttl)
    }
}
