//! The decode node going away while its prefill runs: the router drops the prefill call, aborts
//! it on the prefill node (every KV block free again) and answers the client long before the
//! prefill would have ended; with another decode node it retries there instead.

use crate::common;

use pdnode_core::{ErrorKind, NodeId};
use pdnode_router::testing::FakeCall;
use pdnode_router::{GenEvent, Generation, NodeError, RouterError};
use std::time::{Duration, Instant};

/// How long the fake prefill takes: far beyond anything the tests wait for.
const LONG_PREFILL: Duration = Duration::from_secs(60);

async fn harness(n_decode: usize) -> common::Harness {
    let h = common::Harness::start_with(1, n_decode, |deps| {
        // The router's own deadlines must not be what ends the request.
        deps.config.prefill_timeout_s = 120;
        deps.config.request_timeout_s = 120;
    })
    .await;
    h.prefill[0].set(|b| b.prefill_delay = LONG_PREFILL);
    h
}

fn start(h: &common::Harness) -> Generation {
    h.router
        .generate(common::request_40_tokens())
        .expect("admitted")
}

fn is_prefill(c: &FakeCall) -> bool {
    matches!(c, FakeCall::Prefill(_))
}

/// Waits until the prefill node is computing the request; returns which decode node reserved.
async fn wait_prefilling(h: &common::Harness) -> usize {
    let p = &h.prefill[0];
    assert!(
        p.wait_for(Duration::from_secs(5), |cs| cs.iter().any(is_prefill))
            .await,
        "prefill never started: {:?}",
        p.calls()
    );
    assert_eq!(
        p.kv_blocks_held(),
        3,
        "the running prefill holds its blocks"
    );
    h.decode
        .iter()
        .position(|d| d.count(|c| matches!(c, FakeCall::ReserveKv(_))) > 0)
        .expect("a decode node reserved")
}

/// The next event, at most `within` away.
async fn next_event(g: &mut Generation, within: Duration) -> GenEvent {
    tokio::time::timeout(within, g.events.recv())
        .await
        .unwrap_or_else(|_| panic!("no event within {within:?}"))
        .expect("the flow reports Done or Error")
}

/// Decode node `i` leaves the membership and stops answering (connection refused).
fn gone(h: &common::Harness, i: usize) {
    h.decode[i].set(|b| {
        b.fail_stats = Some(NodeError::new(
            ErrorKind::Unavailable,
            "transport error: connection refused",
        ))
    });
    h.membership.remove(&NodeId::new(format!("d{i}").as_str()));
}

/// Its key gone (a lease that lapsed while etcd was unreachable, or a drain) but the node
/// answering: the request it waits on goes on and completes there.
#[tokio::test]
async fn a_decode_node_out_of_the_membership_that_answers_keeps_its_request() {
    let h = harness(1).await;
    // A prefill that ends while the watch still runs (after the node left and was probed).
    h.prefill[0].set(|b| b.prefill_delay = Duration::from_secs(2));
    let mut g = start(&h);
    assert_eq!(wait_prefilling(&h).await, 0);
    h.membership.remove(&NodeId::new("d0"));
    let mut text = String::new();
    loop {
        match next_event(&mut g, Duration::from_secs(10)).await {
            GenEvent::Tokens { text: t, .. } => text.push_str(&t),
            GenEvent::Done { .. } => break,
            GenEvent::Error(e) => panic!("a node that answers keeps its request: {e}"),
        }
    }
    assert!(!text.is_empty());
    assert_eq!(h.decode[0].count(|c| matches!(c, FakeCall::Decode(_))), 1);
    assert!(
        h.decode[0].count(|c| matches!(c, FakeCall::Stats)) >= 1,
        "it was probed when it left"
    );
    assert_eq!(h.prefill[0].kv_blocks_held(), 0);
    h.stop().await;
}

#[tokio::test]
async fn decode_leaving_membership_aborts_the_prefill_at_once() {
    let h = harness(1).await;
    let mut g = start(&h);
    let d = wait_prefilling(&h).await;
    assert_eq!(d, 0);
    let gone_at = Instant::now();
    // Its key gone and the node itself gone (a node that still answers keeps its requests:
    // `a_decode_node_out_of_the_membership_that_answers_keeps_its_request`).
    gone(&h, 0);

    let ev = next_event(&mut g, Duration::from_secs(3)).await;
    let took = gone_at.elapsed();
    let GenEvent::Error(e) = ev else {
        panic!("expected an error, got {ev:?}")
    };
    assert!(
        matches!(&e, RouterError::DecodeLost { node, .. } if node.as_str() == "d0"),
        "{e:?}"
    );
    assert_eq!(
        pdnode_core::error::Classify::kind(&e),
        ErrorKind::Unavailable
    );
    assert!(e.to_string().contains("left the membership"), "{e}");
    println!("decode removed -> client error in {took:?} (prefill would take {LONG_PREFILL:?})");
    assert!(took < Duration::from_secs(2), "took {took:?}");

    // P got the Abort before the client got the error, and holds no block.
    let p = &h.prefill[0];
    assert_eq!(p.aborts().len(), 1, "{:?}", p.calls());
    assert_eq!(p.kv_blocks_held(), 0);
    assert!(g.events.recv().await.is_none(), "nothing after the error");
    h.stop().await;
}

#[tokio::test]
async fn a_decode_node_that_stops_answering_aborts_the_prefill() {
    let h = harness(1).await;
    let mut g = start(&h);
    wait_prefilling(&h).await;
    let down_at = Instant::now();
    // Still in the membership (its lease has not run out), but its calls fail.
    h.decode[0].set(|b| {
        b.fail_stats = Some(NodeError::new(
            ErrorKind::Unavailable,
            "transport error: connection refused",
        ))
    });

    let ev = next_event(&mut g, Duration::from_secs(5)).await;
    let took = down_at.elapsed();
    let GenEvent::Error(e) = ev else {
        panic!("expected an error, got {ev:?}")
    };
    assert!(matches!(&e, RouterError::DecodeLost { .. }), "{e:?}");
    assert!(e.to_string().contains("connection refused"), "{e}");
    println!("decode probe failing -> client error in {took:?}");
    // One probe period plus a membership tick, with slack for a loaded machine.
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert_eq!(h.prefill[0].kv_blocks_held(), 0);
    assert_eq!(h.prefill[0].aborts().len(), 1);
    h.stop().await;
}

#[tokio::test]
async fn a_hung_decode_node_is_lost_after_three_unanswered_probes() {
    let h = harness(1).await;
    let mut g = start(&h);
    wait_prefilling(&h).await;
    let hung_at = Instant::now();
    h.decode[0].set(|b| b.stats_delay = Duration::from_secs(600));

    let ev = next_event(&mut g, Duration::from_secs(10)).await;
    let took = hung_at.elapsed();
    let GenEvent::Error(e) = ev else {
        panic!("expected an error, got {ev:?}")
    };
    assert!(e.to_string().contains("3 liveness probes in a row"), "{e}");
    println!("decode hung -> client error in {took:?}");
    // Probes start 1 s into the prefill, one a second, each given 1 s: three misses by ~4 s.
    assert!(took >= Duration::from_secs(3), "took {took:?}");
    assert!(took < Duration::from_secs(6), "took {took:?}");
    assert_eq!(h.prefill[0].kv_blocks_held(), 0);
    h.stop().await;
}

#[tokio::test]
async fn a_lost_decode_node_is_replaced_by_another() {
    let h = harness(2).await;
    let mut g = start(&h);
    let first = wait_prefilling(&h).await;
    let other = 1 - first;
    // The retry's prefill is quick.
    h.prefill[0].set(|b| b.prefill_delay = Duration::ZERO);
    gone(&h, first);

    let mut text = String::new();
    loop {
        match next_event(&mut g, Duration::from_secs(5)).await {
            GenEvent::Tokens { text: t, .. } => text.push_str(&t),
            GenEvent::Done { .. } => break,
            GenEvent::Error(e) => panic!("the retry should have served it: {e}"),
        }
    }
    assert_eq!(
        text, "Hello from the fake ",
        "max_tokens 20 of the fake output"
    );
    let d = &h.decode[other];
    assert_eq!(d.count(|c| matches!(c, FakeCall::Decode(_))), 1);
    assert_eq!(h.prefill[0].count(is_prefill), 2);
    assert_eq!(h.prefill[0].kv_blocks_held(), 0);
    // The finished request released its reservation on the decode node that served it.
    assert!(
        d.wait_for(Duration::from_secs(5), |_| d.kv_blocks_held() == 0)
            .await
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_prefills_share_one_watch_of_their_decode_node() {
    let h = harness(1).await;
    let n = 32;
    let mut gens: Vec<_> = (0..n).map(|_| start(&h)).collect();
    let p = &h.prefill[0];
    assert!(
        p.wait_for(Duration::from_secs(5), |cs| cs
            .iter()
            .filter(|c| is_prefill(c))
            .count()
            == n)
            .await,
        "{:?}",
        p.calls()
    );
    assert_eq!(h.router.decode_watches(), 1);
    // Two probe periods: one request's worth of probes, not n times that.
    let d = &h.decode[0];
    let stats = |cs: &[FakeCall]| cs.iter().filter(|c| matches!(c, FakeCall::Stats)).count();
    assert!(
        d.wait_for(Duration::from_secs(5), |cs| stats(cs) >= 2)
            .await
    );
    let probes = stats(&d.calls());
    println!("{n} prefills waiting on d0: {probes} probes in its first two periods");
    assert!(probes <= 3, "{probes} probes");

    gone(&h, 0);
    for g in &mut gens {
        match next_event(g, Duration::from_secs(3)).await {
            GenEvent::Error(RouterError::DecodeLost { .. }) => {}
            ev => panic!("expected DecodeLost, got {ev:?}"),
        }
    }
    assert_eq!(p.aborts().len(), n);
    assert_eq!(p.kv_blocks_held(), 0);
    let deadline = Instant::now() + Duration::from_secs(2);
    while h.router.decode_watches() > 0 {
        assert!(Instant::now() < deadline, "the watch task did not end");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    h.stop().await;
}
