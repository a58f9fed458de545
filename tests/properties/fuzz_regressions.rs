//! What the fuzz targets (`fuzz/`, cargo-fuzz) found, kept as plain tests so that `cargo test`
//! guards it without the fuzz crate or a nightly toolchain; and the record decoder's seed corpus,
//! checked against the current encoder.
//!
//! Each regression reads its input inline, as the minimised bytes libFuzzer reported, and states
//! the invariant that target checks.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request, StatusCode};
use idemproxy::config::Config;
use idemproxy::proxy::admission::check_head;
use idemproxy::record::{Lookup, Phase, Record, Resolvable, Saved, SavedResponse};

/// The record decoder's seeds: one entry of each kind the encoder writes.
fn record_seeds() -> Vec<(&'static str, Record)> {
    let response = |headers: Vec<(&'static str, &'static str)>, body: &'static [u8]| {
        Saved::Response(SavedResponse {
            status: StatusCode::CREATED,
            headers: headers
                .into_iter()
                .map(|(n, v)| (HeaderName::from_static(n), HeaderValue::from_static(v)))
                .collect(),
            body: Bytes::from_static(body),
        })
    };
    vec![
        (
            "in-flight",
            Record::InFlight {
                token: [0x11; 16],
                fingerprint: [0x22; 32],
            },
        ),
        (
            "done-response",
            Record::Finished {
                fingerprint: [0x33; 32],
                saved: response(
                    vec![
                        ("content-type", "application/json"),
                        ("location", "/bookings/bk_1"),
                        ("x-a", "1"),
                        ("x-a", "2"),
                    ],
                    b"{\"id\":\"bk_1\"}",
                ),
            },
        ),
        (
            "done-empty",
            Record::Finished {
                fingerprint: [0; 32],
                saved: response(vec![], b""),
            },
        ),
        (
            "done-binary",
            Record::Finished {
                fingerprint: [0xff; 32],
                saved: response(vec![("etag", "\"v1\"")], b"\x00\x01\xfe\xff"),
            },
        ),
        (
            "not-replayable",
            Record::Finished {
                fingerprint: [0x44; 32],
                saved: Saved::NotReplayable {
                    status: StatusCode::OK,
                },
            },
        ),
        (
            "resolvable-claim",
            Record::Resolvable(Box::new(resolvable())),
        ),
        (
            "resolved-response",
            Record::Finished {
                fingerprint: [0x55; 32],
                saved: match response(vec![("content-type", "application/json")], b"{}") {
                    Saved::Response(r) => Saved::Resolved(r),
                    other => other,
                },
            },
        ),
    ]
}

/// A claim of a `resolve` route (format version 2), being resolved.
fn resolvable() -> Resolvable {
    let mut r = Resolvable::claim(
        [0x66; 16],
        [0x77; 32],
        Lookup {
            upstream: "booking".into(),
            method: http::Method::GET,
            target: "/bookings/by-reference/r-1".into(),
            headers: vec![(
                HeaderName::from_static("authorization"),
                HeaderValue::from_static("Bearer x"),
            )],
        },
        Duration::from_secs(60),
        Duration::from_secs(5),
        Duration::from_secs(600),
    );
    r.lease_until = 1_764_656_010_123;
    r.claimed_at = 1_764_656_000_123;
    r.sent_at = 1_764_656_002_123;
    r.phase = Phase::Resolving;
    r.next_lookup_at = 1_764_656_005_000;
    r
}

/// The committed seeds of `fuzz/corpus/record_decoder` are today's encodings (a format change
/// makes them stale). Regenerate them with
/// `IDEMPROXY_WRITE_FUZZ_SEEDS=1 cargo test --test properties fuzz_regressions`.
#[test]
fn record_decoder_seeds_are_current_encodings() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/record_decoder");
    let write = std::env::var_os("IDEMPROXY_WRITE_FUZZ_SEEDS").is_some();
    for (name, entry) in record_seeds() {
        let path = dir.join(format!("seed-{name}"));
        let bytes = entry.encode();
        assert_eq!(Record::decode(&bytes).as_ref(), Ok(&entry));
        if write {
            std::fs::create_dir_all(&dir).expect("create the seed directory");
            std::fs::write(&path, &bytes).expect("write a seed");
        }
        let committed = std::fs::read(&path).expect("read a committed seed");
        assert_eq!(
            committed,
            &bytes[..],
            "{} is stale; regenerate the seeds with IDEMPROXY_WRITE_FUZZ_SEEDS=1 cargo test --test properties fuzz_regressions",
            path.display()
        );
    }
}

/// record_decoder, input minimised by hand from libFuzzer's crash (68 bytes, a header named
/// `eDag`): a finished record whose header name has an upper-case letter decoded, because
/// `HeaderName::from_bytes` lower-cases, and re-encoded to other bytes. The encoder only ever
/// writes lower-case names, so such bytes are not a record idemproxy wrote: "any deviation from
/// a known layout is an error", and one entry must have one encoding.
#[test]
fn a_record_with_an_upper_case_header_name_is_refused() {
    let mut bytes = b"IDP\x01D".to_vec();
    bytes.extend_from_slice(&[0; 32]); // fingerprint
    bytes.extend_from_slice(b"R\x00\xc8"); // a response, status 200
    bytes.extend_from_slice(b"\x00\x01"); // one header
    bytes.extend_from_slice(b"\x00\x01A"); // its name: "A"
    bytes.extend_from_slice(b"\x00\x00\x00\x00"); // an empty value
    bytes.extend_from_slice(&[0; 8]); // an empty body
    let decoded = Record::decode(&bytes);
    if let Ok(entry) = &decoded {
        assert_eq!(
            &entry.encode()[..],
            &bytes[..],
            "decodes to {entry:?}, which encodes to other bytes"
        );
    }
    assert!(
        decoded.is_err(),
        "a record with a header name idemproxy never writes decoded: {decoded:?}"
    );
    // The lower-case spelling is a record idemproxy writes, and it still decodes.
    let lower: Vec<u8> = bytes
        .iter()
        .map(|b| if *b == b'A' { b'a' } else { *b })
        .collect();
    let entry = Record::decode(&lower).expect("the lower-case record decodes");
    assert_eq!(&entry.encode()[..], &lower[..]);
}

/// config_loader, found while writing the target (a target must not name files, so it cannot
/// reach this itself): `admin_token_file` is read whole, whatever it is. `/dev/zero` never
/// ends, so `idemproxy --check` allocates until memory runs out: here, under a 1 GiB
/// address-space limit, it answers "cannot read /dev/zero: out of memory" after a second or
/// two; without a limit it takes the machine's memory. A token is a few dozen bytes: the loader
/// should read a bounded prefix and refuse a longer file, naming the field.
#[test]
#[cfg(target_os = "linux")]
fn an_endless_admin_token_file_is_refused_not_read_whole() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let config = dir.path().join("idemproxy.yaml");
    std::fs::write(
        &config,
        "listen: 127.0.0.1:8080\n\
         admin_listen: 127.0.0.1:9090\n\
         admin_token_file: /dev/zero\n\
         upstreams:\n  booking:\n    url: http://127.0.0.1:8081\n\
         routes:\n  - name: r\n    path: /*\n    upstream: booking\n",
    )
    .expect("write the configuration");
    // The address-space limit keeps a failure from taking the machine's memory with it.
    let mut child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 1048576 && exec \"$0\" --check --config \"$1\"")
        .arg(env!("CARGO_BIN_EXE_idemproxy"))
        .arg(&config)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn idemproxy --check");
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for idemproxy --check") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("idemproxy --check still reading /dev/zero after 60s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr)
        .expect("read stderr");
    assert_eq!(
        status.code(),
        Some(2),
        "idemproxy --check with admin_token_file: /dev/zero ended with {status}: {stderr}"
    );
    assert!(
        stderr.contains("admin_token_file"),
        "the error does not name admin_token_file: {stderr}"
    );
    assert!(
        !stderr.contains("out of memory"),
        "the loader read /dev/zero until memory ran out instead of refusing a long file: {stderr}"
    );
}

/// admission, minimised from the target's crash (the `key_from` route, no key header,
/// `Connection: X-Correlation`): a `Connection` line naming a header the route reads for the
/// key, its scope or its fingerprint is refused (400 hop-by-hop-conflict), because a hop strips
/// that header before the upstream. A `key_from` header is read for the key too, yet the head
/// was admitted and the key derived from a header the upstream never sees.
#[test]
fn a_connection_line_naming_a_key_from_header_is_refused() {
    let yaml = "listen: 127.0.0.1:8080
upstreams:
  booking:
    url: http://127.0.0.1:8081
routes:
  - name: refund
    path: /tickets/{ticket_id}/*
    upstream: booking
    idempotency:
      key_from: [\"path:ticket_id\", \"header:X-Correlation\"]
";
    let config = Config::from_yaml(yaml).expect("a route with key_from loads");
    let idem = config.routes[0]
        .idempotency
        .as_ref()
        .expect("an idempotent route");
    let (parts, ()) = Request::post("/tickets/T-1/refund")
        .header("x-correlation", "c-1")
        .header("connection", "X-Correlation")
        .body(())
        .expect("a request")
        .into_parts();
    match check_head(idem, &parts) {
        Err((problem, _)) => {
            assert_eq!(problem.status(), StatusCode::BAD_REQUEST);
            assert_eq!(problem.slug(), "hop-by-hop-conflict");
        }
        Ok(source) => panic!(
            "admitted ({source:?}) though Connection strips X-Correlation, which the key is derived from"
        ),
    }
}
