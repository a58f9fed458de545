use super::*;

fn call(body: &str) -> Call {
    match parse(body.as_bytes()) {
        Ok(Message::Call(call)) => call,
        other => panic!("{body}: not a call: {other:?}"),
    }
}

#[test]
fn bodies_are_sorted_into_calls_notifications_responses_and_refusals() {
    assert!(matches!(
        parse(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#),
        Ok(Message::Notification { .. })
    ));
    assert!(matches!(
        parse(br#"{"jsonrpc":"2.0","id":3,"result":{}}"#),
        Ok(Message::Response)
    ));
    let code = |b: &str| parse(b.as_bytes()).expect_err("refused").code;
    assert_eq!(code("{not json"), PARSE_ERROR);
    assert_eq!(code(""), PARSE_ERROR);
    assert_eq!(
        code(r#"[{"jsonrpc":"2.0","id":1,"method":"a"}]"#),
        INVALID_REQUEST
    );
    assert_eq!(code(r#"{"id":1,"method":"a"}"#), INVALID_REQUEST);
    assert_eq!(
        code(r#"{"jsonrpc":"1.0","id":1,"method":"a"}"#),
        INVALID_REQUEST
    );
    assert_eq!(
        code(r#"{"jsonrpc":"2.0","id":1,"method":7}"#),
        INVALID_REQUEST
    );
    assert_eq!(
        code(r#"{"jsonrpc":"2.0","id":null,"method":"a"}"#),
        INVALID_REQUEST
    );
    assert_eq!(code(r#"{"jsonrpc":"2.0","id":1}"#), INVALID_REQUEST);
    assert_eq!(code("42"), INVALID_REQUEST);
}

#[test]
fn the_fingerprint_is_the_method_and_params_without_meta() {
    let a = call(
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"book","arguments":{"a":1,"b":"x"},"_meta":{"progressToken":1}}}"#,
    );
    let b = call(
        r#"{"id":"other","method":"tools/call","jsonrpc":"2.0","params":{"_meta":{"idempotency-key":"k"},"arguments":{"b":"x","a":1.0},"name":"book"}}"#,
    );
    assert_eq!(a.fingerprint_bytes(), b.fingerprint_bytes());
    let c = call(
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"book","arguments":{"a":2,"b":"x"}}}"#,
    );
    assert_ne!(a.fingerprint_bytes(), c.fingerprint_bytes());
    let d = call(
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"name":"book","arguments":{"a":1,"b":"x"}}}"#,
    );
    assert_ne!(a.fingerprint_bytes(), d.fingerprint_bytes());
}

#[test]
fn the_response_to_a_call_matches_its_id_as_a_json_value() {
    let one = call(r#"{"jsonrpc":"2.0","id":1,"method":"m"}"#);
    let found = find_response(&one, br#"{"jsonrpc":"2.0","id":1.0,"result":{"ok":true}}"#)
        .expect("1 = 1.0");
    assert_eq!(&found.member[..], br#"{"result":{"ok":true}}"#);
    assert!(find_response(&one, br#"{"jsonrpc":"2.0","id":"1","result":{}}"#).is_none());
    assert!(find_response(&one, br#"{"jsonrpc":"2.0","id":2,"result":{}}"#).is_none());
    assert!(
        find_response(
            &one,
            br#"{"jsonrpc":"2.0","id":1,"method":"x","params":{}}"#
        )
        .is_none(),
        "a request of the server's is never the response"
    );
    let text = call(r#"{"jsonrpc":"2.0","id":"a\u0062","method":"m"}"#);
    assert!(
        find_response(
            &text,
            br#"{"jsonrpc":"2.0","id":"ab","error":{"code":-1,"message":"x"}}"#
        )
        .is_some()
    );
    let err = find_response(
        &one,
        br#"{"jsonrpc":"2.0","id":1,"error":{"code":-32001,"message":"busy"}}"#,
    )
    .expect("an error");
    assert_eq!(err.error_code, Some(-32001));
    assert!(err.releases(&[-32001]) && !err.releases(&[]));
    let input = find_response(
        &one,
        br#"{"jsonrpc":"2.0","id":1,"result":{"resultType":"input_required"}}"#,
    )
    .expect("a result");
    assert!(input.releases(&[]));
}

#[test]
fn a_replay_carries_the_repeats_id_as_it_was_written() {
    for id in ["7", "\"7\"", "1.0", "\"a\\u0062\"", "-3e2"] {
        let c = call(&format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"m"}}"#));
        let body = replay_body(&c, br#"{"result":{"n":1}}"#).expect("a member");
        assert_eq!(
            String::from_utf8_lossy(&body),
            format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{{"n":1}}}}"#)
        );
    }
    let c = call(r#"{"jsonrpc":"2.0","id":1,"method":"m"}"#);
    assert!(replay_body(&c, b"{\"type\":\"x\"}").is_none());
}

#[test]
fn accept_chooses_json_or_an_event() {
    let mut c = call(r#"{"jsonrpc":"2.0","id":1,"method":"m"}"#);
    c.accept(Some(b"application/json, text/event-stream"));
    assert!(c.wants_json());
    c.accept(Some(b"text/event-stream"));
    assert!(!c.wants_json());
    c.accept(None);
    assert!(c.wants_json());
    c.accept(Some(b"application/json;q=0, text/event-stream"));
    assert!(!c.wants_json());
}

#[test]
fn event_streams_are_read_by_the_grammar() {
    let stream = b": comment\r\nevent: message\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\nid: 2\ndata: x\n\ndata:y\r\r";
    // Fed one byte at a time, a CR and its LF split across chunks.
    let mut events = Vec::new();
    let mut parser = EventStream::new(1024);
    for b in stream {
        parser
            .feed(std::slice::from_ref(b), |e| events.push(e))
            .expect("within the bound");
    }
    assert_eq!(
        events,
        vec![
            Bytes::from_static(b"{\"a\":\n1}"),
            Bytes::from_static(b"x"),
            Bytes::from_static(b"y")
        ]
    );
    let mut small = EventStream::new(4);
    assert!(small.feed(b"data: 123456\n\n", |_| {}).is_err());
}

#[test]
fn the_proxys_answers_have_the_codes_of_the_table() {
    for (slug, code) in [
        ("missing-idempotency-key", -32090),
        ("request-in-progress", -32091),
        ("idempotency-key-reused", -32092),
        ("request-too-large", -32093),
        ("store-unavailable", -32094),
        ("upstream-timeout", -32095),
        ("response-not-replayable", -32096),
    ] {
        assert_eq!(code_of(slug), code, "{slug}");
    }
    let member = error_member(&Problem::InProgress {
        retry_after: std::time::Duration::from_secs(1),
    });
    let v: serde_json::Value = serde_json::from_slice(&member).expect("JSON");
    assert_eq!(v["error"]["code"], -32091);
    assert_eq!(v["error"]["data"]["status"], 409);
    assert_eq!(v["error"]["data"]["retry_after"], 1);
}

#[test]
fn an_sdk_result_event_is_the_response() {
    let c = call(r#"{"jsonrpc":"2.0","id":"s-1","method":"tools/call","params":{}}"#);
    let data = br#"{"jsonrpc":"2.0","id":"s-1","result":{"resultType":"complete","content":[{"type":"text","text":"booked R-sse #1"}],"isError":false}}"#;
    assert!(find_response(&c, data).is_some());
    let mut parser = EventStream::new(1 << 20);
    let mut found = None;
    let mut frame = b"data: ".to_vec();
    frame.extend_from_slice(data);
    frame.extend_from_slice(b"\n\n");
    parser
        .feed(&frame, |e| found = find_response(&c, &e))
        .expect("read");
    assert!(found.is_some());
}
