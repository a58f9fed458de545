//! `POST /ledger.v1.Ledger/Transfer`: a gRPC ledger's unary transfer, for the demo's `grpc:`
//! route. It counts its postings by reference, as a ledger must never post twice.
//!
//! gRPC framing and the two small protobuf messages are written here by hand, so the mock takes
//! no gRPC or protobuf dependency (the tests call it, and a tonic-served ledger of the harness,
//! with tonic's own client):
//!
//! ```text
//! message TransferRequest { string reference = 1; int64 amount = 2; }
//! message TransferReply   { string posting_id = 1; uint64 postings = 2; }
//! ```
//!
//! The answer is a gRPC response: `content-type: application/grpc`, one length-prefixed
//! message, and `grpc-status: 0` in the trailers; a request that is not a framed
//! `TransferRequest` is a trailers-only `INVALID_ARGUMENT` (3).

use bytes::{BufMut, Bytes, BytesMut};
use http::StatusCode;
use http::header::{CONTENT_TYPE, HeaderMap, HeaderValue};

use crate::MockBody;
use crate::reply::Reply;

/// The method's path.
pub(crate) const TRANSFER: &str = "/ledger.v1.Ledger/Transfer";

/// A decoded `TransferRequest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Transfer {
    pub(crate) reference: String,
    pub(crate) amount: i64,
}

/// Reads one gRPC message frame holding a `TransferRequest`.
pub(crate) fn read_transfer(body: &[u8]) -> Option<Transfer> {
    let (&compressed, rest) = body.split_first()?;
    if compressed != 0 || rest.len() < 4 {
        return None;
    }
    let len = usize::try_from(u32::from_be_bytes(rest[..4].try_into().ok()?)).ok()?;
    let mut msg = rest.get(4..4 + len)?;
    if rest.len() != 4 + len {
        return None;
    }
    let mut transfer = Transfer {
        reference: String::new(),
        amount: 0,
    };
    while !msg.is_empty() {
        let key = varint(&mut msg)?;
        match (key >> 3, key & 7) {
            (1, 2) => {
                let n = usize::try_from(varint(&mut msg)?).ok()?;
                let text = msg.get(..n)?;
                transfer.reference = String::from_utf8(text.to_vec()).ok()?;
                msg = &msg[n..];
            }
            // int64 as a varint: two's complement in 64 bits.
            (2, 0) => transfer.amount = varint(&mut msg)? as i64,
            // Unknown fields are skipped, as protobuf readers do.
            (_, 0) => {
                varint(&mut msg)?;
            }
            (_, 2) => {
                let n = usize::try_from(varint(&mut msg)?).ok()?;
                msg = msg.get(n..)?;
            }
            _ => return None,
        }
    }
    Some(transfer)
}

/// The answer to a transfer posted as `posting_id`, the reference's `postings`-th.
pub(crate) fn reply(posting_id: &str, postings: u64) -> Reply {
    let mut msg = BytesMut::new();
    msg.put_u8(1 << 3 | 2);
    put_varint(&mut msg, posting_id.len() as u64);
    msg.put_slice(posting_id.as_bytes());
    msg.put_u8(2 << 3);
    put_varint(&mut msg, postings);
    let mut framed = BytesMut::with_capacity(5 + msg.len());
    framed.put_u8(0);
    framed.put_u32(u32::try_from(msg.len()).unwrap_or(u32::MAX));
    framed.put_slice(&msg);
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    Reply {
        status: StatusCode::OK,
        headers: grpc_headers(),
        body: MockBody::with_trailers(framed.freeze(), trailers),
    }
}

/// A trailers-only `INVALID_ARGUMENT`: the request is not a framed `TransferRequest`.
pub(crate) fn invalid() -> Reply {
    let mut headers = grpc_headers();
    headers.insert("grpc-status", HeaderValue::from_static("3"));
    headers.insert(
        "grpc-message",
        HeaderValue::from_static("not a TransferRequest"),
    );
    Reply {
        status: StatusCode::OK,
        headers,
        body: MockBody::full(Bytes::new()),
    }
}

fn grpc_headers() -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers
}

fn varint(b: &mut &[u8]) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let (&byte, rest) = b.split_first()?;
        *b = rest;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

fn put_varint(out: &mut BytesMut, mut value: u64) {
    while value >= 0x80 {
        out.put_u8((value as u8) | 0x80);
        value >>= 7;
    }
    out.put_u8(value as u8);
}

/// A framed `TransferRequest`, as a gRPC client sends it (for the demo's client and tests).
pub fn transfer_request(reference: &str, amount: i64) -> Bytes {
    let mut msg = BytesMut::new();
    msg.put_u8(1 << 3 | 2);
    put_varint(&mut msg, reference.len() as u64);
    msg.put_slice(reference.as_bytes());
    msg.put_u8(2 << 3);
    put_varint(&mut msg, amount as u64);
    let mut framed = BytesMut::with_capacity(5 + msg.len());
    framed.put_u8(0);
    framed.put_u32(u32::try_from(msg.len()).unwrap_or(u32::MAX));
    framed.put_slice(&msg);
    framed.freeze()
}

/// Reads a framed `TransferReply`: its posting id and the reference's postings.
pub fn read_reply(body: &[u8]) -> Option<(String, u64)> {
    let mut msg = body.get(5..)?;
    let (mut id, mut postings) = (String::new(), 0);
    while !msg.is_empty() {
        let key = varint(&mut msg)?;
        match (key >> 3, key & 7) {
            (1, 2) => {
                let n = usize::try_from(varint(&mut msg)?).ok()?;
                id = String::from_utf8(msg.get(..n)?.to_vec()).ok()?;
                msg = &msg[n..];
            }
            (2, 0) => postings = varint(&mut msg)?,
            _ => return None,
        }
    }
    Some((id, postings))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transfer_round_trips() {
        let framed = transfer_request("r-1", -2400);
        assert_eq!(
            read_transfer(&framed),
            Some(Transfer {
                reference: "r-1".into(),
                amount: -2400
            })
        );
        assert_eq!(read_transfer(&framed[..framed.len() - 1]), None);
        assert_eq!(read_transfer(b"\x01\x00\x00\x00\x00"), None, "compressed");
    }
}
