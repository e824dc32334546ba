//! [`put_ranks`] over UCX on loopback between two transports of this process: a latent between
//! different tensor-parallel degrees lands whole in every decode rank's span, its fence record
//! behind it, and nothing else of any region changes; key/value KV between different degrees is
//! refused before any byte moves.

use super::*;
use crate::pd::fence::FenceCounters;
use pdnode_core::kv_target::{Placement, RankTarget, SECRET_LEN};
use pdnode_core::{BlockId, DType, KvKind, KvLayout};
use pdnode_transfer::fence::{Landed, Sum, read_record};
use pdnode_transfer::{KvTransport, UcxConfig};
use std::time::Duration;

/// Bytes of each decode rank's region, and where the request's span starts in it.
const REGION: usize = 4096;
const OFFSET: u64 = 640;
const SENTINEL: u8 = 0xee;

fn start(name: &str) -> Option<Arc<UcxTransport>> {
    match UcxTransport::start(UcxConfig {
        name: name.into(),
        tls: Some("tcp".into()),
        net_devices: Some("lo".into()),
        ..UcxConfig::default()
    }) {
        Ok(t) => Some(Arc::new(t)),
        Err(TransferError::Ucx(e)) if e.to_string().contains("not found") => {
            eprintln!("SKIP: libucp not loadable: {e}");
            None
        }
        Err(e) => panic!("UCX transport start: {e}"),
    }
}

/// A tiny layout: 2 layers of 2-token blocks of an 8-value row, bf16: 32 bytes a layer-block.
fn layout(kind: KvKind, tp: u32) -> KvLayout {
    KvLayout {
        dtype: DType::Bf16,
        num_layers: 2,
        block_size: 2,
        kv_heads_per_rank: 1,
        head_dim: 8,
        tp_size: tp,
        model_fingerprint: "tiny".into(),
        kind,
    }
}

/// The decode side's `tp` rank regions, every byte `SENTINEL`, and a target into them.
fn decode_side(d: &UcxTransport, kind: KvKind, tp: u32) -> (Vec<Registration>, KvTarget) {
    let regs: Vec<Registration> = (0..tp)
        .map(|_| {
            let reg = d.allocate_registered(REGION).unwrap();
            copy_into(&reg, 0, &[SENTINEL; REGION]).unwrap();
            reg
        })
        .collect();
    let ranks = regs
        .iter()
        .enumerate()
        .map(|(j, reg)| {
            let desc = reg.descriptor();
            RankTarget {
                rank: j as u32,
                rkey: desc.rkey.clone(),
                base_addr: desc.base_addr,
                region_len: desc.len,
                worker_address: Vec::new(),
                device_memory: false,
            }
        })
        .collect();
    let target = KvTarget {
        request: RequestId(42),
        decode_node: NodeId::new("decode"),
        decode_grpc_addr: String::new(),
        transport: TargetTransport::Ucx,
        worker_address: d.local_address(),
        ranks,
        blocks: vec![BlockId(5), BlockId(2), BlockId(9)],
        layout: layout(kind, tp),
        secret: vec![7; SECRET_LEN],
        lease_deadline_ms: 0,
        placement: Placement::Staging { offset: OFFSET },
        staging_generation: 11,
        fence_record: true,
        verify: true,
    };
    target.validate().unwrap();
    (regs, target)
}

/// Bytes of one rank's share of the request: every layer of its 3 blocks.
fn per_rank(target: &KvTarget) -> usize {
    target.layout.num_layers as usize * target.blocks.len() * target.layout.block_layer_bytes()
}

/// Source rank `s`'s bytes: a pattern of its own (a rank's copy told apart from another's).
fn rank_bytes(s: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + 31 * s + 1) as u8).collect()
}

/// Pushes `sources` ranks' KV (rank `s`'s at `s * stride` of one region, with room for its
/// fence record behind) to `target`.
fn push(p: &Arc<UcxTransport>, target: &KvTarget, sources: usize) -> Result<(), HandoffError> {
    let len = per_rank(target);
    let stride = len + RECORD_LEN;
    let reg = p.allocate_registered(stride * sources).unwrap();
    for s in 0..sources {
        copy_into(&reg, s * stride, &rank_bytes(s, len)).unwrap();
    }
    let srcs: Vec<(&Registration, u64)> =
        (0..sources).map(|s| (&reg, (s * stride) as u64)).collect();
    let until = Instant::now() + Duration::from_secs(30);
    let mut hold = SourceHold::new(Box::new(()), until, Arc::new(FenceCounters::default()));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let r = rt.block_on(put_ranks(
        p,
        target.request,
        target,
        &srcs,
        len as u64,
        PushWait::until(until),
        &mut hold,
        None,
    ));
    drop(hold);
    r
}

fn region_bytes(reg: &Registration) -> Vec<u8> {
    copy_ranks(reg, 1, REGION, REGION).unwrap()
}

#[test]
fn a_latent_goes_whole_to_every_decode_rank_between_tp_degrees() {
    let (Some(p), Some(d)) = (start("prefill"), start("decode")) else {
        return;
    };
    // (prefill ranks, decode ranks): one of two copies goes; the one copy goes to both; more
    // decode ranks than prefill ranks, cycled; the same degree, each rank its own.
    for (sources, tp) in [(2usize, 1u32), (1, 2), (2, 4), (2, 2)] {
        let (regs, target) = decode_side(&d, KvKind::Latent, tp);
        push(&p, &target, sources).unwrap_or_else(|e| panic!("{sources} -> {tp}: {e}"));
        let len = per_rank(&target);
        let cap = Secret::from_bytes(&target.secret).unwrap();
        let (at, rec) = (OFFSET as usize, OFFSET as usize + len);
        for (j, reg) in regs.iter().enumerate() {
            let tag = format!("{sources} -> {tp}, decode rank {j}");
            let got = region_bytes(reg);
            let want = rank_bytes(j % sources, len);
            assert_eq!(
                &got[at..rec],
                &want[..],
                "{tag}: the span holds its source's KV"
            );
            // nothing before the span, nothing after its fence record
            assert!(
                got[..at].iter().all(|&b| b == SENTINEL),
                "{tag}: before the span"
            );
            assert!(
                got[rec + RECORD_LEN..].iter().all(|&b| b == SENTINEL),
                "{tag}: after the record"
            );
            let Landed::Record(r) = read_record(reg, rec, &cap).unwrap() else {
                panic!("{tag}: no fence record behind the KV");
            };
            let sum = Some(Sum::Crc32c(pdnode_transfer::checksum::crc32c(&want)));
            r.check(j, target.staging_generation, 42, len as u64, sum)
                .unwrap_or_else(|e| panic!("{tag}: {e}"));
        }
    }
}

#[test]
fn key_value_kv_between_tp_degrees_is_refused_before_any_byte_moves() {
    let (Some(p), Some(d)) = (start("prefill-kv"), start("decode-kv")) else {
        return;
    };
    for (sources, tp) in [(2usize, 1u32), (1, 2)] {
        let (regs, target) = decode_side(&d, KvKind::KeyValue, tp);
        match push(&p, &target, sources) {
            Err(HandoffError::Target(TargetError::RankSplit {
                kind: KvKind::KeyValue,
                sources: s,
                targets: t,
            })) => assert_eq!((s, t), (sources, tp as usize)),
            other => panic!("{sources} -> {tp}: {other:?}"),
        }
        for reg in &regs {
            assert!(region_bytes(reg).iter().all(|&b| b == SENTINEL));
        }
    }
    // the same degree goes as before
    let (regs, target) = decode_side(&d, KvKind::KeyValue, 2);
    push(&p, &target, 2).unwrap();
    let len = per_rank(&target);
    for (j, reg) in regs.iter().enumerate() {
        let at = OFFSET as usize;
        assert_eq!(region_bytes(reg)[at..at + len], rank_bytes(j, len)[..]);
    }
}

#[test]
fn in_process_kv_is_laid_out_for_the_decode_ranks() {
    let data: Vec<u8> = (0..8).collect(); // two source ranks of 4 bytes
    assert_eq!(for_target_ranks(data.clone(), 4, &[0, 1]).unwrap(), data);
    assert_eq!(
        for_target_ranks(data.clone(), 4, &[0]).unwrap(),
        [0, 1, 2, 3]
    );
    assert_eq!(
        for_target_ranks(data[..4].to_vec(), 4, &[0, 0]).unwrap(),
        [0, 1, 2, 3, 0, 1, 2, 3]
    );
    assert_eq!(
        for_target_ranks(data.clone(), 4, &[0, 1, 0, 1]).unwrap()[8..],
        data[..]
    );
    // a source rank past the data is an error, never a panic
    assert!(matches!(
        for_target_ranks(data.clone(), 4, &[2]),
        Err(HandoffError::Mismatch(_))
    ));
    assert!(for_target_ranks(data, usize::MAX, &[1]).is_err());
}
