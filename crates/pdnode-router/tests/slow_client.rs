//! A client that stops reading: the router hands it each event within
//! `router.client_send_timeout_s`, then treats it as gone, aborts the request on both nodes and
//! frees its in-flight slot, instead of holding both forever.

use crate::common;

use common::{fakes, request_40_tokens};
use pdnode_router::Router;
use pdnode_router::testing::FakeCall;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_aborted_and_frees_its_slot() {
    let mut f = fakes(1, 1);
    f.deps.config.client_send_timeout_s = 1;
    // 200 tokens, one event each: far more than the event channel holds.
    let output: Vec<u32> = (0..200).map(|i| u32::from(b'a') + i % 26).collect();
    for n in f.prefill.iter().chain(&f.decode) {
        n.set(|b| b.output = output.clone());
    }
    let router = Router::new(f.deps.clone());
    let mut req = request_40_tokens();
    req.sampling.max_tokens = 200;
    let t0 = Instant::now();
    // The events are never read; the receiver stays alive (the client is connected).
    let generation = router.generate(req).unwrap();
    let aborted = |c: &[FakeCall]| c.iter().any(|c| matches!(c, FakeCall::Abort(_)));
    assert!(
        f.decode[0].wait_for(Duration::from_secs(10), aborted).await,
        "decode never aborted: {:?}",
        f.decode[0].calls()
    );
    assert!(
        f.prefill[0]
            .wait_for(Duration::from_secs(10), aborted)
            .await,
        "prefill never aborted: {:?}",
        f.prefill[0].calls()
    );
    let freed = async {
        while router.inflight() > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), freed)
        .await
        .expect("the slot was never freed");
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(5),
        "{took:?}"
    );
    assert_eq!(f.decode[0].kv_blocks_held(), 0);
    drop(generation);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_within_the_deadline_gets_everything() {
    let mut f = fakes(1, 1);
    f.deps.config.client_send_timeout_s = 1;
    let output: Vec<u32> = (0..200).map(|i| u32::from(b'a') + i % 26).collect();
    for n in f.prefill.iter().chain(&f.decode) {
        n.set(|b| b.output = output.clone());
    }
    let router = Router::new(f.deps.clone());
    let mut req = request_40_tokens();
    req.sampling.max_tokens = 200;
    let mut generation = router.generate(req).unwrap();
    // Stalls shorter than the deadline, while the channel is full.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut tokens = 0;
    let mut done = false;
    while let Ok(Some(ev)) =
        tokio::time::timeout(Duration::from_secs(10), generation.events.recv()).await
    {
        match ev {
            pdnode_router::GenEvent::Tokens { token_ids, .. } => {
                tokens += token_ids.len();
                if tokens % 64 == 0 {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            }
            pdnode_router::GenEvent::Done { .. } => {
                done = true;
                break;
            }
            pdnode_router::GenEvent::Error(e) => panic!("{e}"),
        }
    }
    assert!(done);
    assert_eq!(tokens, 200);
    assert!(f.decode[0].aborts().is_empty());
}
