//! The headers the proxy rewrites on the way to an upstream and back: hop-by-hop headers
//! removed, `X-Forwarded-*` set, `Host` named.

use std::fmt::Write as _;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

pub(super) const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub(super) const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub(super) const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// The headers that describe one connection, not the message (RFC 9110 §7.6.1), plus the
/// `Proxy-*` family. Never forwarded, saved or replayed.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// The `Host` header of an upstream URL, as HTTP clients set it: the host, and the port when
/// it is not the scheme's default.
pub(super) fn host_header(
    scheme: &http::uri::Scheme,
    authority: &http::uri::Authority,
) -> HeaderValue {
    let default_port = if *scheme == http::uri::Scheme::HTTPS {
        443
    } else {
        80
    };
    let host = match authority.port_u16() {
        Some(port) if port != default_port => format!("{}:{port}", authority.host()),
        _ => authority.host().to_owned(),
    };
    // The authority was parsed from a URL, so its host is a valid header value.
    HeaderValue::from_str(&host).unwrap_or(HeaderValue::from_static("localhost"))
}

/// Appends `ip` as `X-Forwarded-For` writes it. An IPv4 address, by far the most common, is
/// written digit by digit: `Display` through `core::fmt` costs more than the rest of the
/// header's building (measured with callgrind: ~950 instructions a request).
pub(super) fn push_ip(out: &mut String, ip: std::net::IpAddr) {
    match ip {
        std::net::IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push('.');
                }
                if octet >= 100 {
                    out.push(char::from(b'0' + octet / 100));
                }
                if octet >= 10 {
                    out.push(char::from(b'0' + octet / 10 % 10));
                }
                out.push(char::from(b'0' + octet % 10));
            }
        }
        // Writing into a String cannot fail.
        std::net::IpAddr::V6(v6) => {
            let _ = write!(out, "{v6}");
        }
    }
}

/// Whether the client's `TE` asks for trailers (a gRPC client's `te: trailers`).
pub(super) fn asks_for_trailers(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::TE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("trailers"))
}

/// Removes hop-by-hop headers, including every header that `Connection` names.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the names finds what is there to go (most messages carry none; a gRPC call
    // carries `te`); only those are then removed, by their `HeaderName` rather than looked up by
    // a string each, and in the order this always removed them (which decides the order of the
    // headers left, as they are saved and replayed).
    let present: Vec<HeaderName> = headers
        .keys()
        .filter(|name| {
            let name = name.as_str();
            HOP_BY_HOP.contains(&name) || name.starts_with("proxy-")
        })
        .cloned()
        .collect();
    if present.is_empty() {
        return;
    }
    if present.contains(&header::CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
            .collect();
        for name in named {
            headers.remove(name);
        }
    }
    for hop in HOP_BY_HOP {
        if let Some(name) = present.iter().find(|name| name.as_str() == *hop) {
            headers.remove(name);
        }
    }
    let more_proxy = present
        .iter()
        .any(|name| name.as_str().starts_with("proxy-") && !HOP_BY_HOP.contains(&name.as_str()));
    if more_proxy {
        let proxy: Vec<HeaderName> = headers
            .keys()
            .filter(|k| k.as_str().starts_with("proxy-"))
            .cloned()
            .collect();
        for name in proxy {
            headers.remove(name);
        }
    }
}
