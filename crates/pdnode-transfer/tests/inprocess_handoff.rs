//! The whole negotiation over the in-process transport (role = "all"): decode reserves under a
//! lease, prefill checks the layout, gathers and pushes layer by layer, flushes, signals done;
//! decode checks the secret, scatters and admits. Then the refusals.

use pdnode_core::{BlockId, DType, KvLayout, NodeId, RequestId};
use pdnode_transfer::region::{gather_host, scatter_host};
use pdnode_transfer::{
    BlockGuard, DoneStatus, InProcessTransport, KvTarget, KvTransport, LocalRegion, Placement,
    PoolGeometry, Push, PushState, Reservation, ReservationEnd, TransferError,
};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn layout() -> KvLayout {
    KvLayout {
        dtype: DType::F32,
        num_layers: 3,
        block_size: 2,
        kv_heads_per_rank: 2,
        head_dim: 4,
        tp_size: 1,
        model_fingerprint: "tiny".into(),
    }
}

fn geo(blocks: u32) -> PoolGeometry {
    PoolGeometry {
        num_layers: 3,
        num_blocks: blocks,
        block_layer_bytes: layout().block_layer_bytes() as u64,
    }
}

struct Decode {
    pool: Vec<u8>,
    staging: Vec<u8>,
}

#[test]
fn reserve_push_flush_done_admit_moves_every_byte() {
    let t = InProcessTransport::new();
    let now = Instant::now();
    let (pg, dg) = (geo(6), geo(8));
    let p_pool: Vec<u8> = (0..pg.pool_bytes()).map(|i| (i * 31 % 251) as u8).collect();
    let mut p_staging = vec![0u8; pg.staging_bytes(3) as usize];
    let mut d = Decode {
        pool: vec![0u8; dg.pool_bytes() as usize],
        staging: vec![0u8; dg.staging_bytes(3) as usize],
    };
    // SAFETY: the buffers outlive the registrations (dropped before them at the end).
    let p_reg = unsafe { t.register(LocalRegion::host(&mut p_staging)) }.unwrap();
    // SAFETY: as above.
    let d_reg = unsafe { t.register(LocalRegion::host(&mut d.staging)) }.unwrap();

    // Decode: reserve under a lease, send the target.
    let dst = vec![BlockId(7), BlockId(2), BlockId(5)];
    let prefill = NodeId::new("prefill-0");
    let mut res = Reservation::new(
        RequestId(42),
        dst.clone(),
        Some(prefill.clone()),
        Duration::from_secs(10),
        Duration::from_secs(1),
        now,
    );
    let target = KvTarget {
        request: RequestId(42),
        decode_node: NodeId::new("decode-0"),
        worker_address: t.local_address(),
        region: d_reg.descriptor().clone(),
        placement: Placement::Staging { offset: 0 },
        blocks: dst.clone(),
        layout: layout(),
        secret: res.secret().clone(),
        lease_deadline_ms: 0,
    };
    res.target_sent(now).unwrap();

    // Prefill: check, push layer by layer as "compute" finishes each, flush, done.
    let src = vec![BlockId(1), BlockId(4), BlockId(0)];
    let freed = Arc::new(Mutex::new(Vec::new()));
    let f = freed.clone();
    let guard = BlockGuard::new(src.clone(), move |b| f.lock().unwrap().extend(b));
    let remote = t.connect(&target.worker_address, &target.region).unwrap();
    let mut push = Push::received(
        target.clone(),
        src.clone(),
        pg,
        1,
        now + Duration::from_secs(5),
    );
    push.check_layout(&layout()).unwrap();
    for layer in 1..=3 {
        for plan in push.layers_ready(layer, now).unwrap() {
            gather_host(&pg, &p_pool, &src, plan.layers.clone(), &mut p_staging).unwrap();
            let r = t
                .put(&p_reg, &remote, &plan.spans)
                .unwrap()
                .wait(now + Duration::from_secs(1));
            push.put_finished(r).unwrap();
        }
    }
    push.flush_started().unwrap();
    push.flushed(t.flush(&remote).unwrap().wait(now + Duration::from_secs(1)))
        .unwrap();
    let secret = target.secret.as_bytes().to_vec();
    let ack = res.done(&prefill, &secret, &DoneStatus::Ok, now);
    push.done_signalled(ack).unwrap();
    assert_eq!(push.state(), PushState::Done);
    let rel = push.poll(now).unwrap();
    assert!(!rel.notify_decode);
    guard.release();
    assert_eq!(*freed.lock().unwrap(), src);

    // Decode: admit and scatter.
    let Some(ReservationEnd::Admit(blocks)) = res.poll(now) else {
        panic!("not admitted");
    };
    drop(remote);
    drop(d_reg);
    drop(p_reg);
    scatter_host(&dg, &d.staging, &blocks, 0..3, &mut d.pool).unwrap();
    let blb = dg.block_layer_bytes as usize;
    for l in 0..3 {
        for (s, dd) in src.iter().zip(&dst) {
            let so = pg.layer_block_offset(l, *s) as usize;
            let d_o = dg.layer_block_offset(l, *dd) as usize;
            assert_eq!(
                &d.pool[d_o..d_o + blb],
                &p_pool[so..so + blb],
                "layer {l} {s}->{dd}"
            );
        }
    }
}

#[test]
fn mismatched_layout_or_secret_is_refused_and_everything_is_freed() {
    let now = Instant::now();
    let prefill = NodeId::new("prefill-0");
    let mut res = Reservation::new(
        RequestId(1),
        vec![BlockId(0)],
        Some(prefill.clone()),
        Duration::from_millis(100),
        Duration::from_millis(50),
        now,
    );
    res.target_sent(now).unwrap();
    let target = KvTarget {
        request: RequestId(1),
        decode_node: NodeId::new("decode-0"),
        worker_address: vec![],
        region: pdnode_transfer::RemoteRegion {
            base_addr: 0,
            len: 0,
            rkey: vec![],
        },
        placement: Placement::Staging { offset: 0 },
        blocks: vec![BlockId(0)],
        layout: layout(),
        secret: res.secret().clone(),
        lease_deadline_ms: 0,
    };
    let mut ours = layout();
    ours.dtype = DType::Bf16;
    let mut push = Push::received(
        target,
        vec![BlockId(3)],
        geo(4),
        1,
        now + Duration::from_secs(1),
    );
    match push.check_layout(&ours) {
        Err(TransferError::LayoutMismatch { mismatch, .. }) => assert_eq!(mismatch.field, "dtype"),
        other => panic!("{other:?}"),
    }
    let rel = push.poll(now).unwrap();
    assert!(rel.notify_decode);
    // A KvDone with a wrong secret is refused; the real one (FAILED) frees at once.
    assert!(matches!(
        res.done(&prefill, &[0u8; 16], &rel.status, now),
        Err(TransferError::WrongSecret { .. })
    ));
    let secret = res.secret().as_bytes().to_vec();
    res.done(&prefill, &secret, &rel.status, now).unwrap();
    assert_eq!(res.poll(now), Some(ReservationEnd::Free(vec![BlockId(0)])));
}
