//! The prefill node during prefill and the decode node during the stream are watched like the
//! decode node during prefill (`router::node_watch`): a node whose liveness probe fails (e.g. its
//! `Stats` answers UNAVAILABLE because its engine stalled) is lost within about a probe period.
//! A lost prefill node is retried on another one; a lost decode node ends the stream.

use crate::common;

use pdnode_core::ErrorKind;
use pdnode_router::testing::FakeCall;
use pdnode_router::{GenEvent, Generation, NodeError};
use std::time::{Duration, Instant};

fn unavailable() -> NodeError {
    NodeError::new(
        ErrorKind::Unavailable,
        "the engine has not reported its load for 5000 ms",
    )
}

/// Every event until Done or Error, at most `within` in all.
async fn rest(g: &mut Generation, within: Duration) -> Vec<GenEvent> {
    let mut out = Vec::new();
    let until = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(until, g.events.recv()).await {
            Ok(Some(ev)) => {
                let end = !matches!(ev, GenEvent::Tokens { .. });
                out.push(ev);
                if end {
                    return out;
                }
            }
            Ok(None) => return out,
            Err(_) => panic!("no end within {within:?}: {out:?}"),
        }
    }
}

#[tokio::test]
async fn a_prefill_node_lost_mid_prefill_is_retried_on_the_other_one() {
    let h = common::Harness::start_with(2, 1, |deps| {
        deps.config.prefill_timeout_s = 120;
        deps.config.request_timeout_s = 120;
    })
    .await;
    for p in &h.prefill {
        p.set(|b| b.prefill_delay = Duration::from_secs(60));
    }
    let mut g = h
        .router
        .generate(common::request_40_tokens())
        .expect("admitted");
    let is_prefill = |cs: &[FakeCall]| cs.iter().any(|c| matches!(c, FakeCall::Prefill(_)));
    let first = if h.prefill[0]
        .wait_for(Duration::from_secs(5), is_prefill)
        .await
    {
        0
    } else {
        1
    };
    let (lost, other) = (&h.prefill[first], &h.prefill[1 - first]);
    assert!(lost.wait_for(Duration::from_secs(5), is_prefill).await);
    assert_eq!(h.router.prefill_watches(), 1);
    other.set(|b| b.prefill_delay = Duration::ZERO);
    let down_at = Instant::now();
    lost.set(|b| b.fail_stats = Some(unavailable()));
    let events = rest(&mut g, Duration::from_secs(10)).await;
    let took = down_at.elapsed();
    println!("prefill node lost -> retried and done in {took:?}");
    assert!(
        matches!(events.last(), Some(GenEvent::Done { .. })),
        "{events:?}"
    );
    assert!(took < Duration::from_secs(4), "took {took:?}");
    assert_eq!(lost.aborts().len(), 1, "{:?}", lost.calls());
    assert_eq!(
        other.count(|c| matches!(c, FakeCall::Prefill(_))),
        1,
        "the retry ran on the other prefill node"
    );
    h.stop().await;
}

#[tokio::test]
async fn a_decode_node_lost_mid_stream_ends_the_stream() {
    let h = common::Harness::start_with(1, 1, |deps| {
        deps.config.token_timeout_s = 60;
        deps.config.request_timeout_s = 120;
    })
    .await;
    let output: Vec<u32> = (0..200).map(|i| u32::from(b'a') + i % 26).collect();
    for n in h.prefill.iter().chain(&h.decode) {
        n.set(|b| b.output = output.clone());
    }
    // One token, then nothing for a minute: only the watch can end it early.
    h.decode[0].set(|b| b.token_interval = Duration::from_secs(60));
    let mut req = common::request_40_tokens();
    req.sampling.max_tokens = 200;
    let mut g = h.router.generate(req).expect("admitted");
    let first = tokio::time::timeout(Duration::from_secs(5), g.events.recv())
        .await
        .expect("the first token")
        .expect("an event");
    assert!(matches!(first, GenEvent::Tokens { .. }), "{first:?}");
    let decoding = |cs: &[FakeCall]| cs.iter().any(|c| matches!(c, FakeCall::Decode(_)));
    assert!(h.decode[0].wait_for(Duration::from_secs(5), decoding).await);
    assert_eq!(h.router.decode_watches(), 1, "the stream watches its node");
    let down_at = Instant::now();
    h.decode[0].set(|b| b.fail_stats = Some(unavailable()));
    let events = rest(&mut g, Duration::from_secs(10)).await;
    let took = down_at.elapsed();
    println!(
        "decode node lost mid-stream -> {:?} in {took:?}",
        events.last()
    );
    match events.last() {
        Some(GenEvent::Error(e)) => assert!(e.to_string().contains("decode node lost"), "{e}"),
        other => panic!("expected an error, got {other:?}"),
    }
    assert!(took < Duration::from_secs(4), "took {took:?}");
    assert_eq!(h.decode[0].aborts().len(), 1, "{:?}", h.decode[0].calls());
    h.stop().await;
}
