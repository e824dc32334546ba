//! Reservations under their KV lease: one nobody claims is freed at its lease end, and a drain
//! waits for the ones not yet claimed (simulated engine, in process).

use crate::common;

use common::{assert_node_clean as assert_clean, prompt};
use pdnode_core::config::Config;
use pdnode_core::{NodeId, RequestId};
use pdnode_node::pd;
use pdnode_router::{NodeClient, ReserveKv};
use std::time::Duration;

fn mock_config() -> Config {
    common::mock_config(100, 12, 5_000)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_nobody_claims_is_freed_at_its_lease() {
    let mut cfg = mock_config();
    cfg.transfer.lease_ms = 400;
    let aio = tokio::task::block_in_place(|| pd::all_in_one(&cfg, &NodeId::new("l"))).unwrap();
    aio.decode
        .reserve_kv(ReserveKv {
            request_id: RequestId(5),
            prompt_token_ids: prompt(),
            max_tokens: 4,
            prefill_node: aio.prefill.id().clone(),
        })
        .await
        .unwrap();
    let s = aio.decode.engine().stats().await.unwrap().scheduler;
    assert!(s.kv.free < s.kv.total, "reservation holds blocks");
    assert_clean(&aio.decode).await;
    // Past the lease the sweep drops the slot (once); a span it had would wait out the fence
    // deadline in quarantine unless its writer's record were there.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while aio.decode.sweep() == 0 {
        assert!(std::time::Instant::now() < deadline, "never swept");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(aio.decode.pending_reservations(), 0);
    assert_eq!(aio.decode.sweep(), 0, "swept twice");
}

/// What a drain waits for (`EngineService::in_flight`) counts a reservation whose `Decode` has
/// not come yet: a decode node drained with `node.drain = "wait"` right after a reservation
/// must stay up for its `Decode` (the full cluster matrix on a fast model caught a drain that
/// left in 0.1 s and failed three such requests).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_waits_for_reservations_not_yet_decoded() {
    use pdnode_node::EngineService;
    use pdnode_node::engine::adapter::EngineHandleService;
    let cfg = mock_config();
    let aio = tokio::task::block_in_place(|| pd::all_in_one(&cfg, &NodeId::new("l"))).unwrap();
    let svc = EngineHandleService::new(aio.decode.engine().clone(), "m".into(), 8);
    assert_eq!(svc.in_flight().await.unwrap(), 0);
    let target = aio
        .decode
        .reserve_kv(ReserveKv {
            request_id: RequestId(6),
            prompt_token_ids: prompt(),
            max_tokens: 4,
            prefill_node: aio.prefill.id().clone(),
        })
        .await
        .unwrap();
    assert_eq!(
        svc.in_flight().await.unwrap(),
        1,
        "the reservation is in flight"
    );
    assert!(
        aio.decode
            .abort(RequestId(6), target.secret.clone(), "test".into())
            .await
            .unwrap()
    );
    assert_eq!(svc.in_flight().await.unwrap(), 0, "aborted: nothing left");
    assert_clean(&aio.decode).await;
}
