use super::*;

#[test]
fn outcome_and_op_tables_are_in_declaration_order() {
    for (i, o) in Outcome::ALL.iter().enumerate() {
        assert_eq!(*o as usize, i, "{o:?}");
    }
    for (i, op) in StoreOp::ALL.iter().enumerate() {
        assert_eq!(*op as usize, i, "{op:?}");
    }
}

#[test]
fn handed_out_series_are_the_registered_ones() {
    let m = Metrics::new();
    let r = m.route("create-booking");
    r.request(Outcome::Replayed, Duration::from_millis(1));
    r.request(Outcome::Replayed, Duration::from_millis(1));
    r.lost_lease();
    m.store_op(StoreOp::Claim, Duration::from_millis(1), true);
    let text = m.encode();
    let requests = |outcome: &str| {
        format!(r#"idemproxy_requests_total{{route="create-booking",outcome="{outcome}"}}"#)
    };
    assert!(
        text.contains(&format!("{} 2\n", requests("replayed"))),
        "{text}"
    );
    assert!(
        text.contains(&format!("{} 0\n", requests("forwarded"))),
        "{text}"
    );
    assert!(
        text.contains(r#"idemproxy_store_errors_total{op="claim"} 1"#),
        "{text}"
    );
    assert!(text.contains(r#"idemproxy_lost_leases_total{route="create-booking"} 1"#));
}

#[test]
fn what_no_route_matched_has_only_its_request_series() {
    let m = Metrics::new();
    let unrouted = m.route_of("", RouteKind::Unrouted);
    unrouted.request(Outcome::NoRoute, Duration::from_millis(1));
    let text = m.encode();
    let series: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains(r#"route="""#))
        .collect();
    assert!(!series.is_empty(), "{text}");
    for line in series {
        assert!(
            line.starts_with("idemproxy_requests_total")
                || line.starts_with("idemproxy_request_duration_seconds"),
            "a route=\"\" series that no request without a route can move: {line}"
        );
    }
}
