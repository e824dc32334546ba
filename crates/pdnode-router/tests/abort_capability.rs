//! The router's aborts present the request's KV capability (the secret of the target the
//! decode node's `ReserveKv` answered): the fake nodes refuse an abort without it, as real nodes
//! do, and record the refusal. A client that leaves while the reservation is being made is
//! aborted once the answer (and its capability) is there, and so is a reservation whose answer
//! came past the router's bound.

use crate::common;

use common::{fakes, request_40_tokens};
use pdnode_core::ErrorKind;
use pdnode_router::testing::{FakeCall, FakeNode};
use pdnode_router::{GenEvent, NodeError, Router};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn refusals(n: &FakeNode) -> usize {
    n.count(|c| matches!(c, FakeCall::AbortRefused(_)))
}

fn aborted(c: &[FakeCall]) -> bool {
    c.iter().any(|c| matches!(c, FakeCall::Abort(_)))
}

/// Waits until the router holds no request and `nodes` no KV block.
async fn all_freed(router: &Router, nodes: &[&Arc<FakeNode>]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while router.inflight() > 0 || nodes.iter().any(|n| n.kv_blocks_held() > 0) {
        assert!(Instant::now() < deadline, "still held");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_during_the_reservation_is_aborted_with_its_capability() {
    let f = fakes(1, 1);
    let (p, d) = (&f.prefill[0], &f.decode[0]);
    d.set(|b| b.reserve_delay = Duration::from_millis(300));
    let router = Router::new(f.deps.clone());
    let g = router.generate(request_40_tokens()).unwrap();
    assert!(
        d.wait_for(Duration::from_secs(5), |c| c
            .iter()
            .any(|c| matches!(c, FakeCall::ReserveKv(_))))
            .await
    );
    let t0 = Instant::now();
    drop(g);
    assert!(
        d.wait_for(Duration::from_secs(5), aborted).await,
        "decode never aborted: {:?}",
        d.calls()
    );
    // The reservation answered first (its delay), then the abort with its capability went out.
    assert!(
        t0.elapsed() >= Duration::from_millis(200),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(refusals(d), 0, "{:?}", d.calls());
    assert_eq!(refusals(p), 0, "{:?}", p.calls());
    assert_eq!(p.count(|c| matches!(c, FakeCall::Prefill(_))), 0);
    all_freed(&router, &[p, d]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborts_after_a_failed_prefill_and_a_client_gone_mid_stream_carry_the_capability() {
    let f = fakes(1, 1);
    let (p, d) = (&f.prefill[0], &f.decode[0]);
    let router = Router::new(f.deps.clone());

    // A prefill that fails for good: the reservation on D is aborted with its capability.
    p.set(|b| {
        b.fail_prefill = Some(NodeError::new(ErrorKind::InvalidRequest, "no"));
    });
    let mut g = router.generate(request_40_tokens()).unwrap();
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(10), g.events.recv())
        .await
        .expect("the request ends")
    {
        if matches!(ev, GenEvent::Error(_) | GenEvent::Done { .. }) {
            break;
        }
    }
    assert!(d.wait_for(Duration::from_secs(5), aborted).await);
    assert_eq!(refusals(d), 0, "{:?}", d.calls());
    all_freed(&router, &[p, d]).await;

    // A client gone while tokens stream: both nodes aborted with the capability.
    p.set(|b| b.fail_prefill = None);
    d.set(|b| b.token_interval = Duration::from_millis(50));
    let before = d.count(|c| matches!(c, FakeCall::Abort(_)));
    let mut g = router.generate(request_40_tokens()).unwrap();
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(10), g.events.recv())
            .await
            .expect("tokens stream")
            .expect("not ended");
        if let GenEvent::Tokens { token_ids, .. } = ev
            && !token_ids.is_empty()
        {
            break;
        }
    }
    drop(g);
    assert!(
        d.wait_for(Duration::from_secs(5), |c| {
            c.iter().filter(|c| matches!(c, FakeCall::Abort(_))).count() > before
        })
        .await,
        "decode never aborted: {:?}",
        d.calls()
    );
    assert_eq!(refusals(d), 0, "{:?}", d.calls());
    assert_eq!(refusals(p), 0, "{:?}", p.calls());
    all_freed(&router, &[p, d]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_answered_past_its_bound_is_aborted_with_its_capability() {
    let mut f = fakes(1, 1);
    f.deps.config.prefill_timeout_s = 1;
    let (p, d) = (&f.prefill[0], &f.decode[0]);
    // The reservation is made at once; its answer arrives after the router's 1 s bound.
    d.set(|b| b.reserve_answer_delay = Duration::from_millis(1_600));
    let router = Router::new(f.deps.clone());
    let mut g = router.generate(request_40_tokens()).unwrap();
    // The request ends (the bound, then a retry that meets the same delay) with an error.
    let ended = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(ev) = g.events.recv().await {
            if matches!(ev, GenEvent::Error(_)) {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(ended, Ok(true), "the request failed cleanly");
    // Every reservation the decode node made is aborted with its capability once its answer
    // lands: no block is left to the lease.
    all_freed(&router, &[p, d]).await;
    assert!(aborted(&d.calls()), "{:?}", d.calls());
}
