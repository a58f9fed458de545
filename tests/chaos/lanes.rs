//! The lanes of proxy B and the upstream: each sleeps until its planned faults and injects them,
//! noting on the timeline what happened (the store's lane is in `store.rs`).

use super::*;

/// Runs the proxy-B faults; returns the running process and the logs of those killed.
pub(crate) async fn proxy_lane(
    plan: Vec<Planned>,
    mut b: ProxyProcess,
    yaml: String,
    port: u16,
    clock: Clock,
    tl: Arc<Timeline>,
) -> (ProxyProcess, Vec<String>) {
    let lane = "proxy-b";
    let mut logs = Vec::new();
    for p in plan {
        let Fault::ProxyKill { down } = p.fault else {
            unreachable!("not a proxy fault: {:?}", p.fault);
        };
        tokio::time::sleep_until(clock.at(p.at)).await;
        let start = clock.now();
        b.signal("-KILL");
        tl.note(start, lane, "SIGKILL".into());
        tl.window(start, start, Loss::ClaimsOfB, "proxy B killed".into());
        tokio::task::block_in_place(|| b.wait(Duration::from_secs(5)));
        logs.push(b.log());
        tokio::time::sleep(down).await;
        b = tokio::task::block_in_place(|| ProxyProcess::spawn_on(&yaml, port));
        let end = clock.now();
        tl.note(
            end,
            lane,
            format!("restarted on the same port, down {:?}", end - start),
        );
    }
    (b, logs)
}

/// Runs the upstream faults.
pub(crate) async fn upstream_lane(
    plan: Vec<Planned>,
    relay: Arc<Relay>,
    clock: Clock,
    tl: Arc<Timeline>,
) {
    let lane = "upstream";
    for p in plan {
        tokio::time::sleep_until(clock.at(p.at)).await;
        let start = clock.now();
        tl.note(start, lane, p.what.clone());
        match p.fault {
            Fault::UpstreamLatency { up, down, lasting } => {
                relay.set_latency(up, down);
                tl.window(
                    start,
                    start + lasting,
                    Loss::Delay(up),
                    "upstream delayed".into(),
                );
                tokio::time::sleep(lasting).await;
                relay.set_latency(Duration::ZERO, Duration::ZERO);
            }
            Fault::UpstreamBlackhole(d) => {
                relay.blackhole();
                tokio::time::sleep(d).await;
                relay.pass();
            }
            Fault::UpstreamReset => relay.reset_all(),
            Fault::UpstreamRefuse(d) => {
                relay.refuse();
                tokio::time::sleep(d).await;
                relay.pass();
            }
            Fault::UpstreamCut {
                dir,
                after,
                lasting,
            } => {
                relay.cut_after(dir, Some(after));
                tokio::time::sleep(lasting).await;
                relay.cut_after(dir, None);
            }
            other => unreachable!("not an upstream fault: {other:?}"),
        }
        if p.fault.lasting() > Duration::ZERO {
            tl.note(clock.now(), lane, "healthy again".into());
        }
    }
}
