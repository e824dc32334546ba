//! The decode-liveness watch is one per decode node, not one per request: many long prefills
//! against one decode node cost one `Stats` probe per period, the watch's task ends with the
//! last request waiting on the node, and a lost node still ends every request watching it.
//!
//! Paused tokio time: the router's timers (membership check, probe period, the fake's delays)
//! run on a virtual clock, so the counts below are exact and nothing waits in real time.

use crate::common;

use pdnode_core::{ErrorKind, NodeId};
use pdnode_router::testing::{FakeCall, FakeNode};
use pdnode_router::{GenEvent, Generation, NodeError, Router, RouterError, StaticMembership};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// A router (no servers) over one prefill node and `n_decode` decode nodes.
struct Setup {
    router: Arc<Router>,
    prefill: Arc<FakeNode>,
    decode: Vec<Arc<FakeNode>>,
    membership: Arc<StaticMembership>,
}

fn setup(n_decode: usize) -> Setup {
    let common::Fakes {
        mut prefill,
        decode,
        membership,
        mut deps,
    } = common::fakes(1, n_decode);
    // The router's own deadlines must not be what ends a request.
    deps.config.prefill_timeout_s = 120;
    deps.config.request_timeout_s = 120;
    deps.config.max_inflight_requests = 256;
    Setup {
        router: Router::new(deps),
        prefill: prefill.remove(0),
        decode,
        membership,
    }
}

fn start(r: &Arc<Router>) -> Generation {
    r.generate(common::request_40_tokens()).expect("admitted")
}

fn is_prefill(c: &FakeCall) -> bool {
    matches!(c, FakeCall::Prefill(_))
}

fn is_stats(c: &FakeCall) -> bool {
    matches!(c, FakeCall::Stats)
}

/// Waits (virtual time) until `cond` holds, at most `within`.
async fn until(what: &str, within: Duration, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + within;
    while !cond() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until the prefill node computes `n` requests.
async fn wait_prefilling(s: &Setup, n: usize) {
    let p = &s.prefill;
    assert!(
        p.wait_for(Duration::from_secs(5), |cs| cs
            .iter()
            .filter(|c| is_prefill(c))
            .count()
            >= n)
            .await,
        "{n} prefills never started: {:?}",
        p.calls()
    );
}

/// The request's end: its text, or its error.
async fn outcome(g: &mut Generation, within: Duration) -> Result<String, RouterError> {
    let deadline = Instant::now() + within;
    let mut text = String::new();
    loop {
        let ev = tokio::time::timeout_at(deadline, g.events.recv())
            .await
            .unwrap_or_else(|_| panic!("no end within {within:?}"))
            .expect("the flow reports Done or Error");
        match ev {
            GenEvent::Tokens { text: t, .. } => text.push_str(&t),
            GenEvent::Done { .. } => return Ok(text),
            GenEvent::Error(e) => return Err(e),
        }
    }
}

/// `n` prefills of 60 s wait on one decode node for 3.5 s; the probes its watch sent then.
async fn probes_in_window(n: usize) -> usize {
    let s = setup(1);
    s.prefill.set(|b| b.prefill_delay = Duration::from_secs(60));
    let gens: Vec<_> = (0..n).map(|_| start(&s.router)).collect();
    wait_prefilling(&s, n).await;
    assert_eq!(s.router.decode_watches(), 1, "one watch for {n} requests");
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let probes = s.decode[0].count(is_stats);
    assert_eq!(s.router.decode_watches(), 1);
    // The clients leave; so does the watch.
    drop(gens);
    until("the watch ends", Duration::from_secs(2), || {
        s.router.decode_watches() == 0
    })
    .await;
    until("every request ends", Duration::from_secs(2), || {
        s.router.inflight() == 0
    })
    .await;
    assert_eq!(s.prefill.kv_blocks_held(), 0);
    probes
}

#[tokio::test(start_paused = true)]
async fn many_long_prefills_cost_one_probe_per_period() {
    let one = probes_in_window(1).await;
    let many = probes_in_window(64).await;
    println!("Stats probes to the decode node in 3.5 s: 1 prefill -> {one}, 64 prefills -> {many}");
    // From 1 s in, one a second: at 1, 2 and 3 s.
    assert_eq!(one, 3);
    assert_eq!(many, one, "the probe count does not grow with the requests");
}

#[tokio::test(start_paused = true)]
async fn overlapping_short_prefills_send_no_probe() {
    let s = setup(1);
    s.prefill
        .set(|b| b.prefill_delay = Duration::from_millis(300));
    // A new request every 100 ms for 3 s: the node is watched all along, never for a second
    // by the same request.
    let mut gens = Vec::new();
    for _ in 0..30 {
        gens.push(start(&s.router));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(s.router.decode_watches() <= 1);
    }
    for g in &mut gens {
        let text = outcome(g, Duration::from_secs(5)).await.expect("served");
        assert_eq!(text, "Hello from the fake ");
    }
    assert_eq!(s.decode[0].count(is_stats), 0, "{:?}", s.decode[0].calls());
    until("the watch ends", Duration::from_secs(1), || {
        s.router.decode_watches() == 0
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn the_watch_ends_with_the_last_request_waiting_on_the_node() {
    let s = setup(1);
    s.prefill.set(|b| b.prefill_delay = Duration::from_secs(5));
    let mut gens: Vec<_> = (0..8).map(|_| start(&s.router)).collect();
    wait_prefilling(&s, 8).await;
    let d = &s.decode[0];
    assert!(
        d.wait_for(Duration::from_secs(3), |cs| cs.iter().any(is_stats))
            .await
    );

    // Half the clients go away: their prefills are aborted, the watch goes on for the rest.
    let rest = gens.split_off(4);
    drop(gens);
    assert!(
        s.prefill
            .wait_for(Duration::from_secs(2), |cs| cs
                .iter()
                .filter(|c| matches!(c, FakeCall::Abort(_)))
                .count()
                == 4)
            .await
    );
    assert_eq!(s.router.decode_watches(), 1);
    let probes = d.count(is_stats);
    assert!(
        d.wait_for(Duration::from_secs(3), |cs| cs
            .iter()
            .filter(|c| is_stats(c))
            .count()
            > probes)
            .await,
        "still probing for the requests left"
    );

    // The rest finish normally.
    for mut g in rest {
        let text = outcome(&mut g, Duration::from_secs(10))
            .await
            .expect("served");
        assert_eq!(text, "Hello from the fake ");
    }
    until("the watch ends", Duration::from_secs(1), || {
        s.router.decode_watches() == 0
    })
    .await;
    // No task left probing: the count stays put.
    let probes = d.count(is_stats);
    println!("probes while 8 requests prefilled 5 s: {probes}");
    assert!(probes <= 5, "{probes}");
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(d.count(is_stats), probes);
    assert_eq!(s.router.inflight(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_node_leaving_mid_prefill_ends_every_request_watching_it() {
    let s = setup(1);
    s.prefill.set(|b| b.prefill_delay = Duration::from_secs(60));
    let n = 16;
    let mut gens: Vec<_> = (0..n).map(|_| start(&s.router)).collect();
    wait_prefilling(&s, n).await;
    assert_eq!(s.prefill.kv_blocks_held(), 3 * n as u64);
    let gone_at = Instant::now();
    // Its key gone and the node with it (a node out of the membership that still answers keeps
    // its requests: decode_lost.rs).
    s.decode[0].set(|b| {
        b.fail_stats = Some(NodeError::new(
            ErrorKind::Unavailable,
            "transport error: connection refused",
        ))
    });
    s.membership.remove(&NodeId::new("d0"));

    for g in &mut gens {
        let e = outcome(g, Duration::from_secs(2))
            .await
            .expect_err("the node is gone");
        assert!(
            matches!(&e, RouterError::DecodeLost { node, .. } if node.as_str() == "d0"),
            "{e:?}"
        );
        assert!(e.to_string().contains("left the membership"), "{e}");
    }
    let took = gone_at.elapsed();
    println!("d0 removed -> {n} clients got DecodeLost within {took:?}");
    assert!(took <= Duration::from_millis(400), "took {took:?}");
    assert_eq!(s.prefill.aborts().len(), n);
    assert_eq!(s.prefill.kv_blocks_held(), 0);
    until("the watch ends", Duration::from_secs(1), || {
        s.router.decode_watches() == 0
    })
    .await;
    assert_eq!(
        s.decode[0].count(is_stats),
        1,
        "one probe when it left, shared by every request"
    );
}

#[tokio::test(start_paused = true)]
async fn one_failed_probe_moves_every_request_to_the_other_decode_node() {
    let s = setup(2);
    s.prefill.set(|b| b.prefill_delay = Duration::from_secs(3));
    let n = 16;
    let mut gens: Vec<_> = (0..n).map(|_| start(&s.router)).collect();
    wait_prefilling(&s, n).await;
    let on_d0 = s.decode[0].count(|c| matches!(c, FakeCall::ReserveKv(_)));
    assert_eq!(on_d0, n / 2, "round robin splits the requests");
    assert_eq!(s.router.decode_watches(), 2);
    // d0 stays in the membership but stops answering; retried prefills are quick.
    s.decode[0].set(|b| {
        b.fail_stats = Some(NodeError::new(
            pdnode_core::ErrorKind::Unavailable,
            "transport error: connection refused",
        ))
    });
    s.prefill.set(|b| b.prefill_delay = Duration::ZERO);

    for g in &mut gens {
        let text = outcome(g, Duration::from_secs(10)).await.expect("served");
        assert_eq!(text, "Hello from the fake ");
    }
    // One probe judged d0 for all its requests; each of them was retried on d1.
    assert_eq!(s.decode[0].count(is_stats), 1, "{:?}", s.decode[0].calls());
    assert_eq!(s.decode[0].count(|c| matches!(c, FakeCall::Decode(_))), 0);
    assert_eq!(s.decode[1].count(|c| matches!(c, FakeCall::Decode(_))), n);
    assert_eq!(s.prefill.count(is_prefill), n + n / 2);
    assert_eq!(s.prefill.kv_blocks_held(), 0);
    until("the watches end", Duration::from_secs(1), || {
        s.router.decode_watches() == 0
    })
    .await;
}
