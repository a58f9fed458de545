//! The HMAC check: does any configured secret sign this message with any received signature?
//!
//! Why it is shaped this way:
//! - **One HMAC over the body per secret**, not one per (secret, received signature): a body
//!   can be megabytes, and a header may carry up to [`super::MAX_SIGNATURES`] signatures.
//! - **Compared in constant time by ring**, never by hand and never with `==`: the computed
//!   signature `C` and a received one `R` are compared as `ring::hmac::verify(K, C, HMAC(K, R))`
//!   under `K`, a random key of this process ([`Secrets`]' comparison key). ring compares the
//!   two HMACs in constant time, and they are equal exactly when `C == R` (HMAC-SHA256 does not
//!   collide). This is the "double HMAC" comparison: even the position of a first differing
//!   byte is hidden behind a key the sender does not know.

use ring::hmac;

use super::signature::Mac;
use crate::route::Secrets;

/// Whether one of `secrets` signs `pieces` followed by `body` with one of `received`.
pub(super) fn any_secret_signs(
    secrets: &Secrets,
    pieces: &[&[u8]],
    body: &[u8],
    received: &[Mac],
) -> bool {
    let compare = secrets.compare_key();
    let received: Vec<hmac::Tag> = received.iter().map(|r| hmac::sign(compare, r)).collect();
    secrets.keys().iter().any(|key| {
        let mut context = hmac::Context::with_key(key);
        for piece in pieces {
            context.update(piece);
        }
        context.update(body);
        let computed = context.sign();
        received
            .iter()
            .any(|r| hmac::verify(compare, computed.as_ref(), r.as_ref()).is_ok())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::Provider;

    #[test]
    fn pieces_and_body_are_one_message() {
        let secrets = Secrets::parse("k1\nk2", &Provider::Github).expect("valid");
        let k2 = hmac::Key::new(hmac::HMAC_SHA256, b"k2");
        let mac: Mac = hmac::sign(&k2, b"a.b.body")
            .as_ref()
            .try_into()
            .expect("32 bytes");
        assert!(any_secret_signs(
            &secrets,
            &[b"a", b".b", b"."],
            b"body",
            &[mac]
        ));
        assert!(any_secret_signs(
            &secrets,
            &[],
            b"a.b.body",
            &[[0; 32], mac]
        ));
        assert!(!any_secret_signs(&secrets, &[b"a.b."], b"bodyx", &[mac]));
        let mut flipped = mac;
        flipped[31] ^= 1;
        assert!(!any_secret_signs(&secrets, &[b"a.b."], b"body", &[flipped]));
        assert!(!any_secret_signs(&secrets, &[b"a.b."], b"body", &[]));
    }
}
