//! Each provider's signature headers, read into what was signed and the signatures to try.
//!
//! Everything here reads text a stranger wrote, before any secret is involved: nothing panics,
//! every list is bounded ([`MAX_SIGNATURES`]), and a header that can't be read is a
//! [`Rejection::Malformed`] naming it.

use base64::Engine as _;
use http::{HeaderMap, HeaderName, HeaderValue};

use super::Rejection;
use crate::route::{BASE64, Encoding, HmacScheme};

/// The most signatures of the expected scheme read from one header. A rotation sends two;
/// more is refused as malformed, so a hostile header can't make the proxy compare thousands.
pub const MAX_SIGNATURES: usize = 16;

/// The messages below say "16".
const _: () = assert!(MAX_SIGNATURES == 16);

/// An HMAC-SHA256 value as received, decoded.
pub(super) type Mac = [u8; 32];

pub(super) const WEBHOOK_ID: HeaderName = HeaderName::from_static("webhook-id");
pub(super) const WEBHOOK_TIMESTAMP: HeaderName = HeaderName::from_static("webhook-timestamp");
pub(super) const WEBHOOK_SIGNATURE: HeaderName = HeaderName::from_static("webhook-signature");
pub(super) const SVIX_ID: HeaderName = HeaderName::from_static("svix-id");
pub(super) const SVIX_TIMESTAMP: HeaderName = HeaderName::from_static("svix-timestamp");
pub(super) const SVIX_SIGNATURE: HeaderName = HeaderName::from_static("svix-signature");
pub(super) const STRIPE_SIGNATURE: HeaderName = HeaderName::from_static("stripe-signature");
pub(super) const X_HUB_SIGNATURE_256: HeaderName = HeaderName::from_static("x-hub-signature-256");
pub(super) const X_SHOPIFY_HMAC_SHA256: HeaderName =
    HeaderName::from_static("x-shopify-hmac-sha256");
pub(super) const X_SLACK_SIGNATURE: HeaderName = HeaderName::from_static("x-slack-signature");
pub(super) const X_SLACK_REQUEST_TIMESTAMP: HeaderName =
    HeaderName::from_static("x-slack-request-timestamp");

/// What a delivery's headers say was signed, and the signatures to check against it.
#[derive(Debug)]
pub(super) struct Signed<'h> {
    /// The signed message is these pieces, then the body (`{id}` `.` `{ts}` `.` for
    /// `standard`, `{t}` `.` for `stripe`, `v0:` `{ts}` `:` for `slack`, nothing for the
    /// schemes that sign the body alone). Pieces of the headers, never copied.
    pub(super) pieces: [&'h [u8]; 4],
    /// The signed timestamp (Unix seconds), for the schemes that sign one.
    pub(super) timestamp: Option<u64>,
    /// The signed event id, for the scheme that signs one (`standard`).
    pub(super) id: Option<&'h [u8]>,
    /// The well-formed signatures of the expected scheme, at most [`MAX_SIGNATURES`].
    pub(super) candidates: Vec<Mac>,
}

impl Signed<'_> {
    fn body_only(candidates: Vec<Mac>) -> Signed<'static> {
        Signed {
            pieces: [b""; 4],
            timestamp: None,
            id: None,
            candidates,
        }
    }
}

/// Standard Webhooks: `webhook-signature: v1,<base64> v1,<base64>…` over
/// `{webhook-id}.{webhook-timestamp}.{body}`. The id is signed, so a delivery without one is
/// malformed, not merely without a key.
///
/// Svix sends the same scheme under its own names (`svix-id`, `svix-timestamp`,
/// `svix-signature`) unless its customer pays for the `webhook-*` ones. One whole set is read:
/// `webhook-*` if any of its headers is present, else `svix-*`; a delivery that mixes the two
/// is malformed, so an unsigned `webhook-id` can never sit beside a signed `svix-id` and choose
/// the key.
pub(super) fn standard(headers: &HeaderMap) -> Result<Signed<'_>, Rejection> {
    let [id_name, ts_name, signature_name] = standard_names(headers)?;
    let signature = signature_text(headers, &signature_name)?;
    let id = companion(headers, &id_name)?;
    if id.is_empty() {
        return Err(malformed(id_name, "is empty"));
    }
    let ts = companion(headers, &ts_name)?;
    let timestamp = timestamp(ts).ok_or_else(|| malformed(ts_name, NOT_UNIX_TIME))?;
    let candidates = standard_list(signature).map_err(|why| malformed(signature_name, why))?;
    Ok(Signed {
        pieces: [id, b".", ts, b"."],
        timestamp: Some(timestamp),
        id: Some(id),
        candidates,
    })
}

/// Which set of names a Standard Webhooks delivery uses: `[id, timestamp, signature]`.
fn standard_names(headers: &HeaderMap) -> Result<[HeaderName; 3], Rejection> {
    let standard = [WEBHOOK_ID, WEBHOOK_TIMESTAMP, WEBHOOK_SIGNATURE];
    let svix = [SVIX_ID, SVIX_TIMESTAMP, SVIX_SIGNATURE];
    let any = |set: &[HeaderName; 3]| set.iter().any(|name| headers.contains_key(name));
    match (any(&standard), any(&svix)) {
        (true, true) => Err(malformed(
            WEBHOOK_SIGNATURE,
            "comes with svix-* headers: a delivery uses one set of names, webhook-* or svix-*",
        )),
        (false, true) => Ok(svix),
        // Neither: the signature is missing, named as the standard names it.
        (true, false) | (false, false) => Ok(standard),
    }
}

/// The space-separated `version,signature` list. Versions other than `v1` (`v1a`, a future
/// `v2`) and tokens of another shape are skipped, as the Standard Webhooks libraries skip them.
fn standard_list(value: &str) -> Result<Vec<Mac>, &'static str> {
    let mut candidates = Vec::new();
    let mut seen = 0;
    for token in value.split(' ').filter(|t| !t.is_empty()) {
        let Some(("v1", signature)) = token.split_once(',') else {
            continue;
        };
        seen += 1;
        if seen > MAX_SIGNATURES {
            return Err("holds more than 16 v1 signatures");
        }
        candidates.extend(base64_mac(signature));
    }
    if candidates.is_empty() {
        return Err("holds no well-formed v1 signature (v1,<base64 of 32 bytes>)");
    }
    Ok(candidates)
}

/// Stripe: `Stripe-Signature: t=<ts>,v1=<hex>[,v1=<hex>…]` over `{t}.{body}`. Other schemes
/// (`v0`, a future one) and items without `=` are skipped, as Stripe's libraries skip them.
pub(super) fn stripe(headers: &HeaderMap) -> Result<Signed<'_>, Rejection> {
    let value = signature_text(headers, &STRIPE_SIGNATURE)?;
    let (t, timestamp, candidates) =
        stripe_list(value).map_err(|why| malformed(STRIPE_SIGNATURE, why))?;
    Ok(Signed {
        pieces: [t.as_bytes(), b".", b"", b""],
        timestamp: Some(timestamp),
        id: None,
        candidates,
    })
}

/// The comma-separated `key=value` list: the `t` text as signed, its value, the signatures.
fn stripe_list(value: &str) -> Result<(&str, u64, Vec<Mac>), &'static str> {
    let mut t = None;
    let mut candidates = Vec::new();
    let mut seen = 0;
    for item in value.split(',') {
        let Some((key, value)) = item.trim_matches([' ', '\t']).split_once('=') else {
            continue;
        };
        match key {
            // Two timestamps: which one was signed is anyone's guess.
            "t" if t.is_some() => return Err("has t= more than once"),
            "t" => t = Some(value),
            "v1" => {
                seen += 1;
                if seen > MAX_SIGNATURES {
                    return Err("holds more than 16 v1= signatures");
                }
                candidates.extend(hex_mac(value));
            }
            _ => {}
        }
    }
    let t = t.ok_or("has no t= timestamp")?;
    let timestamp = timestamp(t.as_bytes()).ok_or("has a t= that is not a Unix time in seconds")?;
    if candidates.is_empty() {
        return Err("holds no well-formed v1= signature (64 hex digits)");
    }
    Ok((t, timestamp, candidates))
}

/// GitHub: `X-Hub-Signature-256: sha256=<hex>` over the body.
pub(super) fn github(headers: &HeaderMap) -> Result<Signed<'static>, Rejection> {
    let value = signature_text(headers, &X_HUB_SIGNATURE_256)?;
    let mac = value
        .strip_prefix("sha256=")
        .and_then(hex_mac)
        .ok_or_else(|| malformed(X_HUB_SIGNATURE_256, "is not sha256=<64 hex digits>"))?;
    Ok(Signed::body_only(vec![mac]))
}

/// Shopify: `X-Shopify-Hmac-Sha256: <base64>` over the body.
pub(super) fn shopify(headers: &HeaderMap) -> Result<Signed<'static>, Rejection> {
    let value = signature_text(headers, &X_SHOPIFY_HMAC_SHA256)?;
    let mac = base64_mac(value)
        .ok_or_else(|| malformed(X_SHOPIFY_HMAC_SHA256, "is not the base64 of 32 bytes"))?;
    Ok(Signed::body_only(vec![mac]))
}

/// Slack: `X-Slack-Signature: v0=<hex>` over `v0:{X-Slack-Request-Timestamp}:{body}`.
pub(super) fn slack(headers: &HeaderMap) -> Result<Signed<'_>, Rejection> {
    let value = signature_text(headers, &X_SLACK_SIGNATURE)?;
    let ts = companion(headers, &X_SLACK_REQUEST_TIMESTAMP)?;
    let timestamp =
        timestamp(ts).ok_or_else(|| malformed(X_SLACK_REQUEST_TIMESTAMP, NOT_UNIX_TIME))?;
    let mac = value
        .strip_prefix("v0=")
        .and_then(hex_mac)
        .ok_or_else(|| malformed(X_SLACK_SIGNATURE, "is not v0=<64 hex digits>"))?;
    Ok(Signed {
        pieces: [b"v0:", ts, b":", b""],
        timestamp: Some(timestamp),
        id: None,
        candidates: vec![mac],
    })
}

/// `hmac`: the configured header, prefix and encoding, over the body.
pub(super) fn hmac<'h>(
    headers: &'h HeaderMap,
    scheme: &HmacScheme,
) -> Result<Signed<'h>, Rejection> {
    let header = &scheme.signature_header;
    let value = signature_text(headers, header)?;
    let Some(encoded) = value.strip_prefix(scheme.prefix.as_str()) else {
        return Err(malformed(
            header.clone(),
            "does not start with the configured prefix",
        ));
    };
    let mac = match scheme.encoding {
        Encoding::Hex => hex_mac(encoded).ok_or("is not 64 hex digits after the prefix"),
        Encoding::Base64 => {
            base64_mac(encoded).ok_or("is not the base64 of 32 bytes after the prefix")
        }
    }
    .map_err(|why| malformed(header.clone(), why))?;
    Ok(Signed::body_only(vec![mac]))
}

const NOT_UNIX_TIME: &str = "is not a Unix time in seconds";

/// A Unix time in whole seconds: ASCII digits only (no sign, no space, no fraction), at most
/// 20 of them, within `u64`. Anything else is malformed, never read "leniently": the text is
/// signed as it stands, and the window is checked on the value read from it.
pub(super) fn timestamp(text: &[u8]) -> Option<u64> {
    if text.is_empty() || text.len() > 20 || !text.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(text).ok()?.parse().ok()
}

/// The signature header's value: exactly one line of visible ASCII.
fn signature_text<'h>(headers: &'h HeaderMap, name: &HeaderName) -> Result<&'h str, Rejection> {
    match one(headers, name) {
        Occurrence::Absent => Err(Rejection::MissingSignature {
            header: name.clone(),
        }),
        Occurrence::Repeated => Err(malformed(name.clone(), "appears more than once")),
        Occurrence::One(value) => value
            .to_str()
            .map(str::trim)
            .map_err(|_| malformed(name.clone(), "is not visible ASCII")),
    }
}

/// A header that is signed with the body (the id, the timestamp): exactly one, as bytes.
fn companion<'h>(headers: &'h HeaderMap, name: &HeaderName) -> Result<&'h [u8], Rejection> {
    match one(headers, name) {
        Occurrence::Absent => Err(malformed(name.clone(), "is missing")),
        Occurrence::Repeated => Err(malformed(name.clone(), "appears more than once")),
        Occurrence::One(value) => Ok(value.as_bytes()),
    }
}

/// How often a header appears.
pub(super) enum Occurrence<'h> {
    Absent,
    One(&'h HeaderValue),
    Repeated,
}

/// A header that must appear at most once: two lines are ambiguous (which one was signed?).
pub(super) fn one<'h>(headers: &'h HeaderMap, name: &HeaderName) -> Occurrence<'h> {
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (None, _) => Occurrence::Absent,
        (Some(value), None) => Occurrence::One(value),
        (Some(_), Some(_)) => Occurrence::Repeated,
    }
}

fn malformed(header: HeaderName, why: &'static str) -> Rejection {
    Rejection::Malformed { header, why }
}

/// 64 hex digits, either case.
fn hex_mac(text: &str) -> Option<Mac> {
    let mut mac = [0; 32];
    hex::decode_to_slice(text, &mut mac).ok()?;
    Some(mac)
}

/// The standard base64 of 32 bytes (44 characters padded, 43 not).
fn base64_mac(text: &str) -> Option<Mac> {
    if text.len() > 44 {
        return None;
    }
    BASE64.decode(text).ok()?.try_into().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_plain_digits() {
        assert_eq!(timestamp(b"1614265330"), Some(1_614_265_330));
        assert_eq!(timestamp(b"0"), Some(0));
        assert_eq!(timestamp(b"18446744073709551615"), Some(u64::MAX));
        for bad in [
            &b""[..],
            b"+1614265330",
            b"-1",
            b" 1",
            b"1.5",
            b"1e9",
            b"18446744073709551616",
            b"000000000000000000001",
            b"\xff",
        ] {
            assert_eq!(timestamp(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn the_standard_list_skips_other_versions_and_is_bounded() {
        let sig = "g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
        let list = format!("v1a,xyz v2,{sig}  v1,{sig} junk v1,short");
        assert_eq!(standard_list(&list).map(|c| c.len()), Ok(1));
        assert!(standard_list("v2,abc v1a,def").is_err());
        assert!(standard_list("").is_err());
        let many = vec![format!("v1,{sig}"); MAX_SIGNATURES + 1].join(" ");
        assert_eq!(
            standard_list(&many),
            Err("holds more than 16 v1 signatures")
        );
        let enough = vec![format!("v1,{sig}"); MAX_SIGNATURES].join(" ");
        assert_eq!(standard_list(&enough).map(|c| c.len()), Ok(MAX_SIGNATURES));
    }

    #[test]
    fn the_stripe_list_reads_t_and_v1_only() {
        let hex = "5257a869e7ecebeda32affa62cdca3fa51cad7e77a0e56ff536d0ce8e108d8bd";
        let header = format!("t=1492774577, v1={hex},v0=abc,,x,v1=nothex");
        let (t, ts, macs) = stripe_list(&header).expect("ok");
        assert_eq!((t, ts, macs.len()), ("1492774577", 1_492_774_577, 1));
        assert_eq!(
            stripe_list(&format!("v1={hex}")),
            Err("has no t= timestamp")
        );
        assert_eq!(
            stripe_list(&format!("t=1,t=2,v1={hex}")),
            Err("has t= more than once")
        );
        assert_eq!(
            stripe_list(&format!("t=now,v1={hex}")),
            Err("has a t= that is not a Unix time in seconds")
        );
        assert!(stripe_list("t=1,v0=abc").is_err());
        let many = format!("t=1,{}", vec![format!("v1={hex}"); 17].join(","));
        assert_eq!(stripe_list(&many), Err("holds more than 16 v1= signatures"));
    }

    #[test]
    fn macs_are_exactly_32_bytes() {
        assert!(hex_mac(&"ab".repeat(32)).is_some());
        assert!(hex_mac(&"AB".repeat(32)).is_some());
        assert!(hex_mac(&"ab".repeat(31)).is_none());
        assert!(hex_mac(&"ab".repeat(33)).is_none());
        assert!(hex_mac(&format!("{}zz", "ab".repeat(31))).is_none());
        let b64 = "g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
        assert!(base64_mac(b64).is_some());
        assert!(base64_mac(b64.trim_end_matches('=')).is_some(), "unpadded");
        assert!(base64_mac("YWJjZA==").is_none(), "4 bytes");
        assert!(base64_mac(&"A".repeat(4000)).is_none());
    }
}
