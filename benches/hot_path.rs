//! The per-request work the proxy does before and after the store round trip: parsing the key,
//! hashing it into a store key, fingerprinting the request, and encoding/decoding the record.
//! Each is reported next to a baseline measured in the same run (SHA-256 over the same bytes,
//! a plain copy of the body), so the numbers read as ratios on a noisy machine.

use std::hint::black_box;

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode};
use idemproxy::config::FingerprintPart;
use idemproxy::key::StoreKey;
use idemproxy::record::{Record, Saved, SavedResponse};
use sha2::{Digest, Sha256};

fn request_parts(body_len: usize) -> (http::request::Parts, Vec<u8>) {
    let (parts, ()) = Request::builder()
        .method("POST")
        .uri("/bookings?source=app")
        .header("authorization", "Bearer 0123456789abcdef")
        .header("idempotency-key", "8e03978e-40d5-43e8-bc93-6894a57f9324")
        .body(())
        .expect("request")
        .into_parts();
    (parts, vec![b'x'; body_len])
}

fn saved(body_len: usize) -> Record {
    Record::Finished {
        fingerprint: [7; 32],
        saved: Saved::Response(SavedResponse {
            status: StatusCode::CREATED,
            headers: vec![
                (
                    HeaderName::from_static("content-type"),
                    HeaderValue::from_static("application/json"),
                ),
                (
                    HeaderName::from_static("location"),
                    HeaderValue::from_static("/bookings/bk_1"),
                ),
                (
                    HeaderName::from_static("etag"),
                    HeaderValue::from_static("\"bk_1.v1\""),
                ),
            ],
            body: Bytes::from(vec![b'y'; body_len]),
        }),
    }
}

fn bench(c: &mut Criterion) {
    let key = HeaderValue::from_static("8e03978e-40d5-43e8-bc93-6894a57f9324");
    let quoted = HeaderValue::from_static("\"8e03978e-40d5-43e8-bc93-6894a57f9324\"");
    c.bench_function("key/parse bare", |b| {
        b.iter(|| idemproxy::key::parse(black_box(&key)))
    });
    c.bench_function("key/parse quoted", |b| {
        b.iter(|| idemproxy::key::parse(black_box(&quoted)))
    });

    let (parts, body) = request_parts(1024);
    let scope = [HeaderName::from_static("authorization")];
    let headers: &HeaderMap = &parts.headers;
    c.bench_function("baseline/sha256 of key and scope", |b| {
        b.iter(|| {
            let mut h = Sha256::new();
            h.update(black_box(b"Bearer 0123456789abcdef"));
            h.update(black_box(key.as_bytes()));
            h.finalize()
        })
    });
    let namespace = idemproxy::key::namespace("idemproxy:", "create-booking");
    c.bench_function("key/store_key", |b| {
        b.iter(|| {
            let id = idemproxy::key::key_id(
                &scope,
                black_box(headers),
                "8e03978e-40d5-43e8-bc93-6894a57f9324",
            );
            StoreKey::new(namespace.clone(), 0, id).text()
        })
    });

    let fp_parts = vec![
        FingerprintPart::Method,
        FingerprintPart::Path,
        FingerprintPart::Query,
        FingerprintPart::Body,
    ];
    c.bench_function("baseline/sha256 of a 1KiB body", |b| {
        b.iter(|| Sha256::digest(black_box(&body)))
    });
    c.bench_function("fingerprint/1KiB body", |b| {
        b.iter(|| idemproxy::fingerprint::compute(&fp_parts, black_box(&parts), &body))
    });

    let entry = saved(1024);
    let encoded = entry.encode();
    c.bench_function("baseline/copy of a 1KiB body", |b| {
        b.iter(|| black_box(&body).clone())
    });
    c.bench_function("record/encode 1KiB response", |b| {
        b.iter(|| black_box(&entry).encode())
    });
    c.bench_function("record/decode 1KiB response", |b| {
        b.iter(|| Record::decode(black_box(&encoded)))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
