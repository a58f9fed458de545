//! JSON-RPC calls (SPEC §4.10) over generated inputs: any body is sorted or refused without a
//! panic; a call's replay carries its `id` byte for byte around the saved member; the
//! fingerprint ignores `_meta` and member order; an event stream cut anywhere reads the same.

use bytes::Bytes;
use idemproxy::jsonrpc::{self, EventStream, Message};
use proptest::prelude::*;

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 256,
        ..ProptestConfig::default()
    }
}

/// An `id` as a client may write it: integers, decimals, exponents, strings with escapes.
fn id() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<i64>().prop_map(|n| n.to_string()),
        (any::<i32>(), 0u32..1000).prop_map(|(a, b)| format!("{a}.{b}")),
        (1u32..100, -5i32..5).prop_map(|(a, e)| format!("{a}e{e}")),
        "[a-zA-Z0-9 _-]{0,12}".prop_map(|s| format!("\"{s}\"")),
        "[a-z]{0,6}".prop_map(|s| format!("\"\\u0041{s}\\n\"")),
    ]
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn any_body_is_sorted_or_refused_without_a_panic(body in proptest::collection::vec(any::<u8>(), 0..200)) {
        match jsonrpc::parse(&body) {
            Ok(_) => {}
            Err(invalid) => prop_assert!(invalid.code == jsonrpc::PARSE_ERROR || invalid.code == jsonrpc::INVALID_REQUEST),
        }
    }

    #[test]
    fn a_replay_carries_the_calls_id_as_written(id in id(), n in any::<u32>()) {
        let body = format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"x"}}}}"#);
        let Ok(Message::Call(call)) = jsonrpc::parse(body.as_bytes()) else {
            return Err(TestCaseError::fail(format!("not a call: {body}")));
        };
        prop_assert_eq!(call.id(), id.as_str());
        let member = format!(r#"{{"result":{{"n":{n}}}}}"#);
        let replay = jsonrpc::replay_body(&call, member.as_bytes()).expect("a member");
        let text = String::from_utf8(replay.to_vec()).expect("UTF-8");
        prop_assert_eq!(&text, &format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{{"n":{n}}}}}"#));
        let reply = format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{{"n":{n}}}}}"#);
        prop_assert!(jsonrpc::find_response(&call, reply.as_bytes()).is_some(), "its own response is found");
    }

    #[test]
    fn meta_and_member_order_do_not_change_the_fingerprint(
        a in any::<i32>(),
        b in "[a-z]{0,8}",
        token in "[a-z0-9]{1,8}",
    ) {
        let one = format!(r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"t","arguments":{{"a":{a},"b":"{b}"}}}}}}"#);
        let two = format!(r#"{{"method":"tools/call","params":{{"_meta":{{"progressToken":"{token}"}},"arguments":{{"b":"{b}","a":{a}}},"name":"t"}},"id":"x","jsonrpc":"2.0"}}"#);
        let (Ok(Message::Call(one)), Ok(Message::Call(two))) = (jsonrpc::parse(one.as_bytes()), jsonrpc::parse(two.as_bytes())) else {
            return Err(TestCaseError::fail("not calls"));
        };
        prop_assert_eq!(one.fingerprint_bytes(), two.fingerprint_bytes());
    }

    #[test]
    fn an_event_stream_cut_anywhere_reads_the_same(
        events in proptest::collection::vec("[a-z{}\":,0-9]{0,20}", 1..5),
        ends in proptest::collection::vec(prop_oneof![Just("\n"), Just("\r"), Just("\r\n")], 1..5),
        cuts in proptest::collection::vec(any::<u8>(), 0..8),
    ) {
        let mut text = String::new();
        let mut expected = Vec::new();
        for (i, event) in events.iter().enumerate() {
            let end = ends[i % ends.len()];
            text.push_str(&format!(": a comment{end}data: {event}{end}{end}"));
            if !event.is_empty() {
                expected.push(Bytes::from(event.clone()));
            } else {
                expected.push(Bytes::new());
            }
        }
        let bytes = text.as_bytes();
        let mut at: Vec<usize> = cuts.iter().map(|c| usize::from(*c) % (bytes.len() + 1)).collect();
        at.sort_unstable();
        let mut parser = EventStream::new(1 << 16);
        let mut got = Vec::new();
        let mut from = 0;
        for cut in at.into_iter().chain(std::iter::once(bytes.len())) {
            parser.feed(&bytes[from..cut], |e| got.push(e)).expect("within the bound");
            from = cut;
        }
        prop_assert_eq!(got, expected);
    }
}
