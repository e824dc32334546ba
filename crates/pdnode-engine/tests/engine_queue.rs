//! The engine's admission limit (`engine.max_queued_requests`) over the MockBackend.

use super::engine::{assert_drained, collect, loop_cfg, next_event, request, timing};
use pdnode_core::error::Classify;
use pdnode_core::{ErrorKind, FinishReason, RequestId};
use pdnode_engine::engine::{EngineError, EngineEvent, EngineLoopConfig, spawn};
use pdnode_engine::mock::MockBackend;
use pdnode_engine::scheduler::Mode;
use std::time::Duration;

/// `engine.max_queued_requests`: with one request running and the queue at its limit, the next
/// request is refused `Overloaded` at once (and keeps nothing); once the queue moves, one is
/// taken again.
#[tokio::test]
async fn requests_past_the_queue_limit_are_refused_overloaded() {
    let t = timing(10, 500, 10_000);
    let cfg = EngineLoopConfig {
        max_running_requests: 1,
        max_queued_requests: 2,
        ..loop_cfg(Mode::Colocated, Duration::from_secs(5), t.output_len)
    };
    let b = MockBackend::with_pool(&t, 4, 64).unwrap();
    let e = spawn(Box::new(b), cfg, None).unwrap();
    // request 1 running (a token came), 2 and 3 waiting behind it
    let mut s1 = e.add_request(request(1, 8, 10_000)).unwrap();
    assert!(matches!(
        next_event(&mut s1).await,
        EngineEvent::Token { .. }
    ));
    let queued: Vec<_> = (2..=3)
        .map(|i| e.add_request(request(i, 8, 3)).unwrap())
        .collect();
    let mut s4 = e.add_request(request(4, 8, 3)).unwrap();
    match next_event(&mut s4).await {
        EngineEvent::Error { error } => {
            assert!(
                matches!(error, EngineError::Overloaded { id, queued: 2 } if id == RequestId(4)),
                "{error:?}"
            );
            assert_eq!(error.kind(), ErrorKind::Overloaded);
        }
        other => panic!("expected Overloaded, got {other:?}"),
    }
    assert_eq!(e.stats().await.unwrap().scheduler.waiting, 2);
    // the running request ends: 2 runs, then 3
    e.abort(RequestId(1));
    let (_, end) = collect(s1).await;
    assert!(matches!(
        end,
        EngineEvent::Finished {
            reason: FinishReason::Abort,
            ..
        }
    ));
    let done = |(tokens, end): (Vec<u32>, EngineEvent)| {
        tokens.len() == 3
            && matches!(
                end,
                EngineEvent::Finished {
                    reason: FinishReason::Length,
                    ..
                }
            )
    };
    let mut queued = queued.into_iter();
    // 2 ran to its end: at most 3 waits now, so the queue takes one more
    let s2 = queued.next().unwrap();
    assert!(done(collect(s2).await));
    let s5 = e.add_request(request(5, 8, 3)).unwrap();
    for s in queued.chain([s5]) {
        assert!(done(collect(s).await));
    }
    assert_drained(&e).await;
}
