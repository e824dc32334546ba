use super::*;
use crate::negotiation::Secret;
use crate::region::RemoteRegion;
use pdnode_core::{DType, NodeId, RequestId};
use std::time::Duration;

fn layout() -> KvLayout {
    KvLayout {
        dtype: DType::Bf16,
        num_layers: 4,
        block_size: 1,
        kv_heads_per_rank: 1,
        head_dim: 4,
        tp_size: 1,
        model_fingerprint: "m".into(),
    }
}

fn target(placement: Placement) -> KvTarget {
    KvTarget {
        request: RequestId(1),
        decode_node: NodeId::new("decode-0"),
        worker_address: vec![1],
        region: RemoteRegion {
            base_addr: 0,
            len: 1 << 20,
            rkey: vec![1],
        },
        placement,
        blocks: vec![BlockId(5), BlockId(6)],
        layout: layout(),
        secret: Secret::random(),
        lease_deadline_ms: 0,
    }
}

fn geo() -> PoolGeometry {
    PoolGeometry {
        num_layers: 4,
        num_blocks: 8,
        block_layer_bytes: layout().block_layer_bytes() as u64,
    }
}

fn push(now: Instant, placement: Placement, per_put: u32) -> Push {
    Push::received(
        target(placement),
        vec![BlockId(0), BlockId(2)],
        geo(),
        per_put,
        now + Duration::from_secs(5),
    )
}

fn checked(now: Instant, per_put: u32) -> Push {
    let mut p = push(now, Placement::Staging { offset: 64 }, per_put);
    p.check_layout(&layout()).unwrap();
    p
}

#[test]
fn happy_path_layer_by_layer_then_flush_then_done() {
    let t = Instant::now();
    let mut p = checked(t, 1);
    assert_eq!(p.state(), PushState::Checked);
    let plans = p.layers_ready(2, t).unwrap();
    assert_eq!(plans.len(), 2);
    // Layer 1 of 2 blocks x 16 bytes: staging offset 32, remote 64 + 32.
    assert_eq!(
        plans[1].spans,
        vec![Span {
            local_offset: 32,
            remote_offset: 96,
            len: 32
        }]
    );
    assert!(!p.ready_to_flush());
    p.put_finished(Ok(())).unwrap();
    p.put_finished(Ok(())).unwrap();
    assert_eq!(p.layers_ready(4, t).unwrap().len(), 2);
    assert!(!p.ready_to_flush(), "puts still in flight");
    p.put_finished(Ok(())).unwrap();
    p.put_finished(Ok(())).unwrap();
    assert!(p.ready_to_flush());
    p.flush_started().unwrap();
    assert_eq!(p.poll(t), None);
    p.flushed(Ok(())).unwrap();
    p.done_signalled(Ok(())).unwrap();
    assert_eq!(
        p.poll(t),
        Some(PushRelease {
            status: DoneStatus::Ok,
            notify_decode: false
        })
    );
    assert_eq!(p.poll(t), None, "released once");
}

#[test]
fn groups_wait_for_whole_groups_except_the_last() {
    let t = Instant::now();
    let mut p = checked(t, 3);
    assert!(p.layers_ready(2, t).unwrap().is_empty());
    let g = p.layers_ready(3, t).unwrap();
    assert_eq!(g.len(), 1);
    assert_eq!(g[0].layers, 0..3);
    let last = p.layers_ready(4, t).unwrap();
    assert_eq!(last[0].layers, 3..4);
}

#[test]
fn pool_placement_puts_directly_with_merged_runs() {
    let t = Instant::now();
    let mut p = push(t, Placement::Pool { num_blocks: 8 }, 1);
    p.check_layout(&layout()).unwrap();
    let plans = p.layers_ready(1, t).unwrap();
    assert!(!plans[0].staged);
    // Sources 0, 2 are not adjacent: two spans; destinations 5, 6 are.
    assert_eq!(plans[0].spans.len(), 2);
    assert_eq!(plans[0].spans[0].remote_offset, 5 * 16);
}

#[test]
fn layout_mismatch_fails_fast_naming_the_field() {
    let t = Instant::now();
    let mut p = push(t, Placement::Staging { offset: 0 }, 1);
    let mut ours = layout();
    ours.head_dim = 8;
    match p.check_layout(&ours) {
        Err(TransferError::LayoutMismatch { mismatch, .. }) => {
            assert_eq!(mismatch.field, "head_dim")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(p.state(), PushState::Failed);
    let end = p.poll(t).unwrap();
    assert!(end.notify_decode);
    assert!(matches!(end.status, DoneStatus::Failed(m) if m.contains("head_dim")));
    assert!(p.layers_ready(4, t).is_err());
}

#[test]
fn block_count_mismatch_is_refused() {
    let t = Instant::now();
    let mut p = Push::received(
        target(Placement::Staging { offset: 0 }),
        vec![BlockId(0)],
        geo(),
        1,
        t + Duration::from_secs(1),
    );
    assert!(matches!(
        p.check_layout(&layout()),
        Err(TransferError::Geometry { .. })
    ));
}

#[test]
fn put_error_fails_and_releases_after_the_other_puts_finish() {
    let t = Instant::now();
    let mut p = checked(t, 1);
    p.layers_ready(2, t).unwrap();
    let gone = TransferError::PeerGone {
        peer: "decode-0".into(),
        reason: "connection reset".into(),
    };
    assert!(p.put_finished(Err(gone)).is_err());
    assert_eq!(p.state(), PushState::Failed);
    assert_eq!(p.poll(t), None, "one put still reads the source blocks");
    p.put_finished(Ok(())).unwrap();
    let end = p.poll(t).unwrap();
    assert!(!end.notify_decode, "decode is gone");
}

#[test]
fn abort_while_in_flight_waits_for_puts_then_releases_and_notifies() {
    let t = Instant::now();
    let mut p = checked(t, 1);
    p.layers_ready(1, t).unwrap();
    p.abort("client cancelled").unwrap();
    assert_eq!(p.state(), PushState::Aborted);
    assert_eq!(p.poll(t), None);
    p.put_finished(Ok(())).unwrap();
    let end = p.poll(t).unwrap();
    assert!(end.notify_decode);
    assert!(matches!(end.status, DoneStatus::Aborted(_)));
    p.abort("again").unwrap();
    assert!(p.layers_ready(4, t).is_err());
}

#[test]
fn timeout_fails_the_push() {
    let t = Instant::now();
    let mut p = checked(t, 1);
    let late = t + Duration::from_secs(6);
    assert!(matches!(
        p.layers_ready(1, late),
        Err(TransferError::Timeout { .. })
    ));
    assert!(p.poll(late).unwrap().notify_decode);
    let mut q = checked(t, 4);
    q.layers_ready(4, t).unwrap();
    q.put_finished(Ok(())).unwrap();
    q.flush_started().unwrap();
    // Flush never completes: poll at the deadline fails it.
    assert!(matches!(
        q.poll(late),
        Some(PushRelease {
            status: DoneStatus::Failed(_),
            ..
        })
    ));
}

#[test]
fn peer_gone_while_flushing() {
    let t = Instant::now();
    let mut p = checked(t, 4);
    p.layers_ready(4, t).unwrap();
    p.put_finished(Ok(())).unwrap();
    p.flush_started().unwrap();
    p.peer_gone("registry lease lost");
    assert!(p.flushed(Ok(())).is_err(), "late flush after failure");
    assert!(!p.poll(t).unwrap().notify_decode);
}

#[test]
fn refused_done_ack_fails_without_notifying() {
    let t = Instant::now();
    let mut p = checked(t, 4);
    p.layers_ready(4, t).unwrap();
    p.put_finished(Ok(())).unwrap();
    p.flush_started().unwrap();
    p.flushed(Ok(())).unwrap();
    let refused = TransferError::LeaseExpired {
        request: RequestId(1),
    };
    assert!(p.done_signalled(Err(refused)).is_err());
    assert!(!p.poll(t).unwrap().notify_decode);
    assert!(matches!(p.abort("x"), Ok(())));
}

#[test]
fn out_of_order_events_are_refused() {
    let t = Instant::now();
    let mut p = push(t, Placement::Staging { offset: 0 }, 1);
    assert!(p.layers_ready(1, t).is_err());
    assert!(p.flush_started().is_err());
    assert!(p.put_finished(Ok(())).is_err());
    p.check_layout(&layout()).unwrap();
    assert!(p.check_layout(&layout()).is_err());
    assert!(p.flushed(Ok(())).is_err());
    assert!(p.done_signalled(Ok(())).is_err());
    let mut d = checked(t, 4);
    d.layers_ready(4, t).unwrap();
    d.put_finished(Ok(())).unwrap();
    d.flush_started().unwrap();
    d.flushed(Ok(())).unwrap();
    d.done_signalled(Ok(())).unwrap();
    assert!(matches!(
        d.abort("late"),
        Err(TransferError::LateEvent { .. })
    ));
    assert!(matches!(
        d.done_signalled(Ok(())),
        Err(TransferError::LateEvent { .. })
    ));
}
