use super::*;

fn all() -> Vec<Problem> {
    vec![
        Problem::NoRoute,
        Problem::MissingKey {
            header: HeaderName::from_static("idempotency-key"),
        },
        Problem::InvalidKey {
            detail: "it is empty".into(),
        },
        Problem::BodyTooLarge { limit: 16 },
        Problem::BadRequestBody {
            detail: "connection reset".into(),
        },
        Problem::KeyReused,
        Problem::UnsupportedMediaType {
            content_type: "application/grpc-web".into(),
        },
        Problem::EventRedeliveredDifferently,
        Problem::InProgress {
            retry_after: Duration::from_millis(1500),
        },
        Problem::NotReplayable {
            status: StatusCode::CREATED,
        },
        Problem::ResultNotKept {
            status: StatusCode::CREATED,
        },
        Problem::StoreUnavailable {
            detail: "timed out".into(),
        },
        Problem::UpstreamUnavailable {
            upstream: "booking".into(),
            detail: "connection refused".into(),
        },
        Problem::UpstreamTimeout {
            upstream: "booking".into(),
        },
        Problem::UpstreamFailed {
            upstream: "booking".into(),
            detail: "reset".into(),
        },
        Problem::HopByHopConflict {
            header: HeaderName::from_static("idempotency-key"),
        },
        Problem::BodyTimeout {
            after: Duration::from_secs(30),
        },
        Problem::Overloaded,
        Problem::Internal,
        Problem::UnreadableKeyPart {
            detail: "key_from part json:/a cannot be read: the body is not JSON".into(),
        },
        Problem::HeadersTooLarge {
            limit: HeadLimit::Count(97),
        },
        Problem::OutcomeUnknown {
            upstream: "booking".into(),
            status: StatusCode::GATEWAY_TIMEOUT,
            last: LastLookup::Failed,
        },
        Problem::WebhookSignatureInvalid {
            detail: "bad signature: no configured secret makes the signature of this body".into(),
        },
    ]
}

#[test]
fn an_unreadable_lookup_part_is_an_unreadable_key_part_that_names_the_lookup() {
    let p = Problem::UnreadableLookupPart {
        detail: "resolve.request part json:/reference cannot be read: absent".into(),
    };
    assert_eq!(
        (p.slug(), p.status()),
        ("unreadable-key-part", StatusCode::BAD_REQUEST)
    );
    assert!(p.detail().contains("lookup") && p.detail().contains("json:/reference"));
}

#[test]
fn an_outcome_being_resolved_is_its_failure_with_a_detail_that_says_so() {
    let cause = Problem::UpstreamTimeout {
        upstream: "booking".into(),
    };
    let resolving = Problem::BeingResolved(Box::new(cause.clone()));
    assert_eq!(
        (resolving.slug(), resolving.status()),
        (cause.slug(), cause.status())
    );
    assert!(resolving.detail().starts_with(&cause.detail()));
    assert!(resolving.detail().contains("asking the upstream"));
    let failed = Problem::OutcomeUnknown {
        upstream: "booking".into(),
        status: StatusCode::BAD_GATEWAY,
        last: LastLookup::Failed,
    };
    assert_eq!(failed.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(failed.slug(), "outcome-unknown");
    assert!(
        failed.detail().contains("got no answer"),
        "{}",
        failed.detail()
    );
}

/// A resolution whose lookups answered a status in neither `found` nor `absent` did get an
/// answer: its detail names that status and the lists, never "no answer".
#[test]
fn an_outcome_unknown_after_another_status_names_it_and_the_lists() {
    let p = Problem::OutcomeUnknown {
        upstream: "booking".into(),
        status: StatusCode::BAD_GATEWAY,
        last: LastLookup::Other {
            status: 200,
            found: vec![201],
            absent: vec![404, 410],
        },
    };
    let detail = p.detail();
    assert!(
        detail.contains("answered status 200")
            && detail.contains("resolve.found [201]")
            && detail.contains("resolve.absent [404, 410]"),
        "{detail}"
    );
    assert!(!detail.contains("no answer"), "{detail}");
    let early = Problem::OutcomeUnknown {
        upstream: "booking".into(),
        status: StatusCode::GATEWAY_TIMEOUT,
        last: LastLookup::EarlyAbsent { status: 404 },
    };
    assert!(
        early.detail().contains("status 404") && early.detail().contains("settle_after"),
        "{}",
        early.detail()
    );
}

#[test]
fn a_head_over_either_limit_is_one_type_and_the_detail_names_the_limit() {
    let count = Problem::HeadersTooLarge {
        limit: HeadLimit::Count(97),
    };
    let bytes = Problem::HeadersTooLarge {
        limit: HeadLimit::Bytes(65536),
    };
    assert_eq!(count.slug(), bytes.slug());
    assert_eq!(bytes.status(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    assert!(count.detail().contains("more than 97 header fields"));
    assert!(bytes.detail().contains("larger than 65536 bytes"));
}

#[test]
fn every_problem_is_a_complete_rfc9457_document_with_its_own_type() {
    let mut types = std::collections::HashSet::new();
    for p in all() {
        let resp = p.response();
        assert_eq!(resp.status(), p.status());
        assert_eq!(
            resp.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        let doc: serde_json::Value = serde_json::from_slice(&p.body()).expect("JSON");
        assert_eq!(doc["status"], p.status().as_u16());
        let ty = doc["type"].as_str().expect("type");
        assert!(ty.starts_with(TYPE_PREFIX) && ty.ends_with(p.slug()));
        // A webhook event redelivered with another body is the key reused, said of an event.
        if !matches!(p, Problem::EventRedeliveredDifferently) {
            assert!(types.insert(ty.to_owned()), "{ty} is used twice");
        }
        assert!(!doc["title"].as_str().unwrap_or("").is_empty());
        assert!(!doc["detail"].as_str().unwrap_or("").is_empty());
        assert_eq!(p.saved().body, p.body(), "saved and sent documents agree");
    }
}

fn all_admin() -> Vec<AdminProblem> {
    vec![
        AdminProblem::NoEndpoint,
        AdminProblem::KeyToolingOff,
        AdminProblem::Unauthorized,
        AdminProblem::MethodNotAllowed,
        AdminProblem::InvalidRecordName {
            detail: "scope is Name: value".into(),
        },
        AdminProblem::NoIdempotentRoute,
        AdminProblem::NoRecord,
        AdminProblem::RecordInFlight,
        AdminProblem::NotARecord,
        AdminProblem::StoreUnavailable {
            detail: "timed out".into(),
        },
    ]
}

#[test]
fn every_admin_problem_is_a_complete_document_with_a_type_of_its_own() {
    let mut types: std::collections::HashSet<String> = all()
        .iter()
        .map(|p| format!("{TYPE_PREFIX}{}", p.slug()))
        .collect();
    for p in all_admin() {
        let resp = p.response();
        assert_eq!(resp.status(), p.kind().status);
        assert_eq!(
            resp.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        assert!(resp.headers().get(header::RETRY_AFTER).is_none());
        let body = document(&p.kind(), &p.detail());
        let doc: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(doc["status"], p.kind().status.as_u16());
        let ty = doc["type"].as_str().expect("type");
        assert!(types.insert(ty.to_owned()), "{ty} is used twice");
        assert!(!doc["title"].as_str().unwrap_or("").is_empty());
        assert!(!doc["detail"].as_str().unwrap_or("").is_empty());
    }
}

#[test]
fn retry_after_on_409_in_progress_and_503s_only() {
    for p in all() {
        let resp = p.response();
        let retry = resp.headers().get(header::RETRY_AFTER);
        match p {
            Problem::InProgress { .. } => {
                assert_eq!(retry.map(|v| v.as_bytes()), Some(&b"2"[..]))
            }
            Problem::StoreUnavailable { .. } | Problem::Overloaded => {
                assert_eq!(retry.map(|v| v.as_bytes()), Some(&b"1"[..]))
            }
            _ => assert!(retry.is_none(), "{p:?}"),
        }
    }
}

#[test]
fn a_key_being_resolved_says_so_with_its_next_lookup() {
    let p = Problem::BeingResolvedNow {
        next_lookup_in: Duration::from_secs(3),
    };
    // The kind of a claim in flight, with its own detail and Retry-After.
    assert_eq!(p.slug(), "request-in-progress");
    assert_eq!(p.status(), StatusCode::CONFLICT);
    let resp = p.response();
    assert_eq!(
        resp.headers()
            .get(header::RETRY_AFTER)
            .map(|v| v.as_bytes()),
        Some(&b"3"[..])
    );
    let detail = p.detail();
    assert!(detail.contains("being resolved"), "{detail}");
    assert!(detail.contains("next at 20"), "an RFC 3339 time: {detail}");
    assert!(!detail.contains("lock_ttl"), "{detail}");
    let forget = AdminProblem::RecordResolving {
        next_lookup_in: Some(Duration::from_secs(3)),
    }
    .detail();
    assert!(
        forget.contains("being resolved") && !forget.contains("lock_ttl"),
        "{forget}"
    );
    // Without a holder, no lookup is due: it says what takes it over, not "next in 0ms".
    let orphan = AdminProblem::RecordResolving {
        next_lookup_in: None,
    }
    .detail();
    assert!(
        orphan.contains("no instance is resolving it")
            && orphan.contains("repeat of the key takes it over")
            && !orphan.contains("next at"),
        "{orphan}"
    );
}
