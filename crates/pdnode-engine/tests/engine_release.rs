//! What the engine gives back when nobody waits for it: a staging span an engine command still
//! writes into stays allocated until the command ran, and a reservation or park whose caller
//! left is released at once (not at its lease's end). Over the MockBackend, with `engine.rs`'s
//! helpers.

use super::engine::{DEADLINE, assert_drained, collect, engine, next_event, request, timing};
use pdnode_core::RequestId;
use pdnode_engine::engine::EngineEvent;
use pdnode_engine::scheduler::Mode;
use std::time::{Duration, Instant};

/// Records the thread that drops it.
struct DroppedOn(std::sync::Arc<std::sync::Mutex<Option<String>>>);

impl Drop for DroppedOn {
    fn drop(&mut self) {
        let name = std::thread::current().name().unwrap_or("").to_string();
        *self.0.lock().unwrap() = Some(name);
    }
}

/// A gather into a staging span and a staging write keep the span's hold until the engine
/// thread ran them: a caller that stops waiting right after sending (its call dropped) does
/// not free the span under a command still queued, which would copy one request's KV into a
/// span another request took meanwhile. The hold is dropped on the engine thread, after the
/// command, never by the caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staging_commands_keep_their_span_until_the_engine_ran_them() {
    let e = engine(
        Mode::PrefillOnly,
        64,
        timing(1, 1, 4),
        Duration::from_secs(5),
    );
    for write in [false, true] {
        let dropped = std::sync::Arc::new(std::sync::Mutex::new(None));
        let hold: pdnode_engine::engine::SpanHold = std::sync::Arc::new(DroppedOn(dropped.clone()));
        let weak = std::sync::Arc::downgrade(&hold);
        {
            // Sent on the first poll, then dropped: the caller stops waiting at once.
            let call: std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>> = if write {
                Box::pin(e.staging_write(0, 0, vec![0; 16], hold))
            } else {
                Box::pin(e.gather_kv(RequestId(7), 0..1, 0, hold))
            };
            let _ = tokio::time::timeout(Duration::ZERO, call).await;
        }
        let t0 = Instant::now();
        while weak.strong_count() > 0 {
            assert!(t0.elapsed() < DEADLINE, "the engine never ran the command");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let on = dropped.lock().unwrap().clone().expect("dropped");
        assert!(
            on.starts_with("pdnode-engine"),
            "write={write}: the hold was dropped on `{on}`, not by the engine after the command"
        );
    }
    assert!(e.shutdown(Duration::from_secs(5)).await);
}

/// A reservation whose caller stopped waiting (its call dropped or timed out before the answer)
/// is released by the engine at once, not left to its lease (60 s here); the same for a park.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_or_park_nobody_waits_for_is_released_at_once() {
    // A prefill step of ~100 ms (50 tokens at 2 ms) keeps the engine busy while the call
    // queues behind it, so the caller is gone before the engine answers.
    let t = timing(2_000, 2_000, 40);
    let c = engine(Mode::Colocated, 64, t, Duration::from_secs(60));
    let busy = c.add_request(request(1, 50, 2)).unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    let _ = tokio::time::timeout(Duration::ZERO, c.reserve_for_transfer(RequestId(9), 20)).await;
    let (tokens, _) = collect(busy).await;
    assert_eq!(tokens.len(), 2);
    assert_drained(&c).await;
    // A park whose caller left: the request it took out of the batch is freed too.
    let mut s = c.add_request(request(4, 10, 40)).unwrap();
    while !matches!(next_event(&mut s).await, EngineEvent::Token { .. }) {}
    let busy = c.add_request(request(5, 50, 2)).unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    let _ = tokio::time::timeout(Duration::ZERO, c.park(RequestId(4))).await;
    let (tokens, _) = collect(busy).await;
    assert_eq!(tokens.len(), 2);
    drop(s);
    assert_drained(&c).await;
}
