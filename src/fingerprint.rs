//! The request fingerprint: what makes a repeat "the same request".
//!
//! A SHA-256 over the parts the route names (method, path, query, body, `header:NAME`), each
//! tagged and length-prefixed so that moving bytes from one part to another changes the hash.
//! A key reused with a different fingerprint is answered 422: the client is confused, and
//! replaying the first response to a different request would be a lie.

use http::request::Parts;
use sha2::{Digest, Sha256};

use crate::route::FingerprintPart;

/// A request fingerprint.
pub type Fingerprint = [u8; 32];

/// Computes the fingerprint of a request whose body has been read.
pub fn compute(parts: &[FingerprintPart], head: &Parts, body: &[u8]) -> Fingerprint {
    hasher(parts, head, body).finalize().into()
}

/// The fingerprint of a JSON-RPC call (SPEC §4.10): the route's parts of the request head (a
/// `jsonrpc` route lists no body part), then the call's own bytes (its method and canonical
/// params, `jsonrpc::Call::fingerprint_bytes`), under a tag of their own.
pub fn of_call(parts: &[FingerprintPart], head: &Parts, call: &[u8]) -> Fingerprint {
    let mut h = hasher(parts, head, b"");
    h.update([b'c']);
    h.update((call.len() as u64).to_be_bytes());
    h.update(call);
    h.finalize().into()
}

fn hasher(parts: &[FingerprintPart], head: &Parts, body: &[u8]) -> Sha256 {
    let mut h = Sha256::new();
    h.update(b"idemproxy-fp-v1");
    let mut field = |tag: u8, bytes: &[u8]| {
        h.update([tag]);
        h.update((bytes.len() as u64).to_be_bytes());
        h.update(bytes);
    };
    for part in parts {
        match part {
            FingerprintPart::Method => field(b'm', head.method.as_str().as_bytes()),
            FingerprintPart::Path => field(b'p', head.uri.path().as_bytes()),
            FingerprintPart::Query => field(b'q', head.uri.query().unwrap_or("").as_bytes()),
            FingerprintPart::Body => field(b'b', body),
            FingerprintPart::Json => match crate::key_from::canonical_json(body) {
                Some(canonical) => field(b'j', &canonical),
                None => field(b'b', body),
            },
            FingerprintPart::Header(name) => {
                field(b'h', name.as_str().as_bytes());
                let values = head.headers.get_all(name);
                field(b'n', &(values.iter().count() as u64).to_be_bytes());
                for v in values {
                    field(b'v', v.as_bytes());
                }
            }
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn head(method: &str, uri: &str) -> Parts {
        Request::builder()
            .method(method)
            .uri(uri)
            .header("x-tenant", "t1")
            .body(())
            .expect("request")
            .into_parts()
            .0
    }

    fn all() -> Vec<FingerprintPart> {
        vec![
            FingerprintPart::Method,
            FingerprintPart::Path,
            FingerprintPart::Query,
            FingerprintPart::Body,
        ]
    }

    #[test]
    fn equal_requests_equal_fingerprints() {
        let a = compute(&all(), &head("POST", "/b?x=1"), b"{}");
        let b = compute(&all(), &head("POST", "/b?x=1"), b"{}");
        assert_eq!(a, b);
    }

    #[test]
    fn each_part_counts() {
        let base = compute(&all(), &head("POST", "/b?x=1"), b"{}");
        assert_ne!(base, compute(&all(), &head("PUT", "/b?x=1"), b"{}"));
        assert_ne!(base, compute(&all(), &head("POST", "/c?x=1"), b"{}"));
        assert_ne!(base, compute(&all(), &head("POST", "/b?x=2"), b"{}"));
        assert_ne!(base, compute(&all(), &head("POST", "/b?x=1"), b"{ }"));
        // Without `body` in the list, the body does not count.
        let parts = vec![FingerprintPart::Method];
        assert_eq!(
            compute(&parts, &head("POST", "/b"), b"1"),
            compute(&parts, &head("POST", "/c"), b"2")
        );
        let with_header = vec![FingerprintPart::Header(http::HeaderName::from_static(
            "x-tenant",
        ))];
        let mut other = head("POST", "/b");
        other
            .headers
            .insert("x-tenant", http::HeaderValue::from_static("t2"));
        assert_ne!(
            compute(&with_header, &head("POST", "/b"), b""),
            compute(&with_header, &other, b"")
        );
    }
}
