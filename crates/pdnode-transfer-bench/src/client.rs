//! The bench's sender (prefill role): per request, reserve on the server, gather into the
//! registered staging area, put layer group by layer group, flush, then (host staging) the
//! serving hand-off's fence record with the CRC32C of the bytes, flush, KvDone; time every
//! phase.

use super::devmem::DevBuf;
use super::wire::{self, DoneStatus, Msg};
use super::{HostBuf, Options, pattern};
use pdnode_core::{BlockId, DType, KvLayout, KvTarget, NodeId, Placement, RequestId};
use pdnode_transfer::fence::{self, FenceRecord, RECORD_LEN};
use pdnode_transfer::region::gather_host;
use pdnode_transfer::region::{LocalRegion, PoolGeometry, RemoteRegion, Span, direct_spans};
use pdnode_transfer::{
    Completion, KvTransport, Registration, RemoteTarget, Secret, TransferError, UcxTransport,
};
use rand::seq::SliceRandom;
use std::collections::VecDeque;
use std::io::{BufRead, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// One table row.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct PointResult {
    pub block_bytes: u64,
    pub request_bytes: u64,
    pub requests: u32,
    /// Request bytes over the time from the first gather to the flush's completion.
    pub push_gbps: f64,
    /// Request bytes over the whole request (reserve .. DoneAck, without the verification).
    pub e2e_gbps: f64,
    pub push_ms_p50: f64,
    pub latency_ms_p50: f64,
    pub latency_ms_max: f64,
    pub scatter_ms_p50: f64,
}

struct Sample {
    push: Duration,
    total: Duration,
    scatter: Duration,
}

fn say(line: String) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn wait_stdin_line() {
    let mut s = String::new();
    let _ = std::io::stdin().lock().read_line(&mut s);
}

const PREFILL_NODE: &str = "bench-client";

pub fn run(opts: &Options, transport: &UcxTransport) -> Result<Vec<PointResult>, TransferError> {
    let addr = opts.connect.as_deref().ok_or(TransferError::Control {
        reason: "client needs a server address (connect)".into(),
    })?;
    let mut stream = TcpStream::connect(addr).map_err(|e| TransferError::Control {
        reason: format!("connect {addr}: {e}"),
    })?;
    let _ = stream.set_nodelay(true);
    let mut rows = Vec::new();
    for &bb in &opts.block_bytes {
        rows.push(run_point(opts, transport, &mut stream, bb)?);
    }
    wire::send(&mut stream, &Msg::Bye)?;
    Ok(rows)
}

fn mismatched(layout: &KvLayout, field: &str) -> Result<KvLayout, TransferError> {
    let mut l = layout.clone();
    match field {
        "head_dim" => l.head_dim *= 2,
        "block_size" => l.block_size *= 2,
        "num_layers" => l.num_layers += 1,
        "kv_heads_per_rank" => l.kv_heads_per_rank *= 2,
        "tp_size" => l.tp_size += 1,
        "dtype" => l.dtype = DType::F32,
        "model_fingerprint" => l.model_fingerprint.push_str("-other"),
        other => {
            return Err(TransferError::Control {
                reason: format!("unknown layout field {other:?}"),
            });
        }
    }
    Ok(l)
}

fn run_point(
    opts: &Options,
    transport: &UcxTransport,
    stream: &mut TcpStream,
    block_bytes: u64,
) -> Result<PointResult, TransferError> {
    let layout = opts.layout_for(block_bytes)?;
    let n = opts.blocks_per_request as usize;
    let pool_blocks = 2 * opts.blocks_per_request;
    let geo = PoolGeometry {
        num_layers: layout.num_layers,
        num_blocks: pool_blocks,
        block_layer_bytes: block_bytes,
    };
    let mut pool = HostBuf::new(geo.pool_bytes() as usize)?;
    // Room for the fence record behind the KV.
    let mut staging = HostBuf::new(geo.staging_bytes(n) as usize + RECORD_LEN)?;
    // SAFETY: the buffers outlive the registrations (declared later, dropped first) and every
    // put is waited for before a registration drops.
    let pool_reg = unsafe { transport.register(LocalRegion::host(pool.bytes_mut())) }?;
    // SAFETY: as above.
    let staging_reg = unsafe { transport.register(LocalRegion::host(staging.bytes_mut())) }?;
    // Device memory: the registered staging the puts read lives on the GPU (the request's KV
    // contiguous per layer, as a pipelined engine would leave it).
    let dev = match opts.mem {
        pdnode_transfer::MemKind::Cuda(ordinal) => {
            Some(DevBuf::new(ordinal, geo.staging_bytes(n) as usize)?)
        }
        pdnode_transfer::MemKind::Host => None,
    };
    let dev_reg = match &dev {
        // SAFETY: `dev` outlives its registration (declared later, dropped first) and every put
        // is waited for before the registration drops.
        Some(d) => Some(unsafe { transport.register(d.region()) }?),
        None => None,
    };
    let ours = match &opts.faults.layout_mismatch {
        Some(f) => mismatched(&layout, f)?,
        None => layout.clone(),
    };
    let deadline = Instant::now() + Duration::from_millis(opts.lease_ms);
    wire::send(
        stream,
        &Msg::Hello {
            layout: layout.clone(),
            pool_blocks,
            max_request_blocks: opts.blocks_per_request,
            pool_placement: opts.pool_placement,
            prefill_node: NodeId::new(PREFILL_NODE),
        },
    )?;
    let peer_address = match wire::recv_until(stream, deadline)? {
        Msg::Welcome { worker_address } => worker_address,
        Msg::Refused { error, .. } => return Err(TransferError::Control { reason: error }),
        other => {
            return Err(TransferError::Control {
                reason: format!("expected Welcome, got {other:?}"),
            });
        }
    };
    let mut remote: Option<(RemoteRegion, RemoteTarget)> = None;
    let mut samples = Vec::new();
    let base = rand::random::<u32>() as u64 * 1_000_000;
    for i in 0..opts.warmup + opts.requests {
        let ctx = Req {
            opts,
            transport,
            layout: &layout,
            ours: &ours,
            geo,
            pool: &mut pool,
            pool_reg: &pool_reg,
            staging: &mut staging,
            staging_reg: &staging_reg,
            dev: dev.as_ref().zip(dev_reg.as_ref()),
            peer_address: &peer_address,
            first: i == 0,
        };
        let s = one_request(ctx, stream, &mut remote, RequestId(base + i as u64))?;
        if i >= opts.warmup {
            samples.push(s);
        }
    }
    drop(remote);
    drop(dev_reg);
    drop(pool_reg);
    drop(staging_reg);
    Ok(summarize(block_bytes, geo.staging_bytes(n), &samples))
}

struct Req<'a> {
    opts: &'a Options,
    transport: &'a UcxTransport,
    layout: &'a KvLayout,
    ours: &'a KvLayout,
    geo: PoolGeometry,
    pool: &'a mut HostBuf,
    pool_reg: &'a Registration,
    staging: &'a mut HostBuf,
    staging_reg: &'a Registration,
    /// Device staging and its registration (`--mem cuda:N`).
    dev: Option<(&'a DevBuf, &'a Registration)>,
    peer_address: &'a [u8],
    first: bool,
}

fn one_request(
    mut c: Req<'_>,
    stream: &mut TcpStream,
    remote: &mut Option<(RemoteRegion, RemoteTarget)>,
    request: RequestId,
) -> Result<Sample, TransferError> {
    let n = c.opts.blocks_per_request as usize;
    let mut all: Vec<BlockId> = (0..c.geo.num_blocks).map(BlockId).collect();
    all.shuffle(&mut rand::rng());
    let src: Vec<BlockId> = all[..n].to_vec();
    let blb = c.geo.block_layer_bytes as usize;
    for layer in 0..c.layout.num_layers {
        for (i, b) in src.iter().enumerate() {
            let off = c.geo.layer_block_offset(layer, *b) as usize;
            pattern::fill(&mut c.pool.bytes_mut()[off..off + blb], request.0, layer, i);
        }
    }
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_millis(c.opts.lease_ms);
    wire::send(
        stream,
        &Msg::Reserve {
            request,
            blocks: n as u32,
            lease_ms: c.opts.lease_ms,
            prefill_layout: Some(c.ours.clone()),
        },
    )?;
    let target: KvTarget = match wire::recv_until(stream, deadline)? {
        Msg::Target { target } => *target,
        Msg::Refused { error, .. } => {
            return Err(TransferError::RemoteFailed {
                request,
                reason: format!("reserve refused: {error}"),
            });
        }
        other => {
            return Err(TransferError::Control {
                reason: format!("expected Target, got {other:?}"),
            });
        }
    };
    if c.opts.faults.stall_after_reserve {
        say(format!("STALLED {request}"));
        loop {
            wait_stdin_line();
        }
    }
    let mut inflight: VecDeque<Completion> = VecDeque::new();
    let mut push_time = Duration::ZERO;
    // Set once KvDone went out (the server answered it; no second KvDone follows).
    let mut done_sent = false;
    let result = push(
        &mut c,
        stream,
        remote,
        request,
        &target,
        &src,
        deadline,
        &mut inflight,
        &mut push_time,
        &mut done_sent,
    );
    // No put may still read the source blocks when they go back.
    while let Some(p) = inflight.pop_front() {
        let _ = p.wait(deadline);
    }
    if let Err(e) = &result {
        if !done_sent && !matches!(e, TransferError::PeerGone { .. }) {
            // Tell the receiver its blocks are free (its puts are over: waited for above).
            let _ = wire::send(
                stream,
                &Msg::Done {
                    request,
                    secret: target.secret.clone(),
                    status: DoneStatus::Failed(e.to_string()),
                    bytes: 0,
                    prefill_node: NodeId::new(PREFILL_NODE),
                },
            );
        }
        say(format!("RELEASED {request} {} blocks", src.len()));
    }
    let (scatter_us, verify_us) = result?;
    let total = t0
        .elapsed()
        .saturating_sub(Duration::from_micros(verify_us));
    Ok(Sample {
        push: push_time,
        total,
        scatter: Duration::from_micros(scatter_us),
    })
}

/// The push of one request to `target`: the checks, the puts layer group by layer group, the
/// flush, the fence record (host staging), KvDone. Every put goes into `inflight`.
#[allow(clippy::too_many_arguments)]
fn push(
    c: &mut Req<'_>,
    stream: &mut TcpStream,
    remote: &mut Option<(RemoteRegion, RemoteTarget)>,
    request: RequestId,
    target: &KvTarget,
    src: &[BlockId],
    deadline: Instant,
    inflight: &mut VecDeque<Completion>,
    push_time: &mut Duration,
    done_sent: &mut bool,
) -> Result<(u64, u64), TransferError> {
    // A target from the wire is checked before any of its values is used.
    target
        .validate()
        .map_err(|e| TransferError::InvalidDescriptor {
            reason: e.to_string(),
        })?;
    if target.transport != pdnode_core::TargetTransport::Ucx {
        return Err(TransferError::InvalidDescriptor {
            reason: format!(
                "target asks for transport {:?}, the bench moves KV with UCX",
                target.transport
            ),
        });
    }
    if target.request != request {
        return Err(TransferError::InvalidDescriptor {
            reason: format!("target for {}, not {request}", target.request),
        });
    }
    if let Err(mismatch) = c.ours.check_compatible(&target.layout) {
        return Err(TransferError::LayoutMismatch { request, mismatch });
    }
    if target.blocks.len() != src.len() {
        return Err(TransferError::Geometry {
            reason: format!(
                "{} source blocks for {} destination blocks",
                src.len(),
                target.blocks.len()
            ),
        });
    }
    let worker = target
        .worker_for(0)
        .map_err(|e| TransferError::InvalidDescriptor {
            reason: e.to_string(),
        })?;
    if worker != c.peer_address {
        return Err(TransferError::InvalidDescriptor {
            reason: "target names another worker".into(),
        });
    }
    let rank = target
        .rank(0)
        .map_err(|e| TransferError::InvalidDescriptor {
            reason: e.to_string(),
        })?;
    let region = RemoteRegion {
        base_addr: rank.base_addr,
        len: rank.region_len,
        rkey: rank.rkey.clone(),
    };
    if remote.as_ref().is_none_or(|(r, _)| *r != region) {
        let t = c.transport.connect(worker, &region)?;
        *remote = Some((region, t));
    }
    let Some((_, rt)) = remote.as_ref() else {
        return Err(TransferError::Control {
            reason: "no remote target".into(),
        });
    };
    let secret = if c.opts.faults.wrong_secret {
        Secret::random().as_bytes().to_vec()
    } else {
        target.secret.clone()
    };
    let n = src.len();
    let kv_len = c.geo.staging_bytes(n);
    let checked = |e: pdnode_core::TargetError| TransferError::InvalidDescriptor {
        reason: e.to_string(),
    };
    if let Some((dev, _)) = c.dev {
        // Untimed: the request's KV onto the GPU, contiguous per layer.
        let all = 0..c.layout.num_layers;
        gather_host(&c.geo, c.pool.bytes(), src, all, c.staging.bytes_mut())?;
        dev.upload(0, &c.staging.bytes()[..kv_len as usize])?;
    }
    let t_push = Instant::now();
    let layers = c.layout.num_layers;
    let per_put = c.opts.layers_per_put.max(1);
    let mut paused = false;
    let mut next = 0;
    while next < layers {
        if Instant::now() >= deadline {
            return Err(TransferError::Timeout {
                what: format!("push of {request}"),
            });
        }
        let group = next..(next + per_put).min(layers);
        next = group.end;
        let (local, spans) = match target.placement {
            Placement::Staging { .. } => {
                let per_layer = c.geo.staging_layer_bytes(n);
                let at = group.start as u64 * per_layer;
                let len = (group.end - group.start) as u64 * per_layer;
                let span = Span {
                    local_offset: at,
                    remote_offset: target.remote_offset(0, at, len).map_err(checked)?,
                    len,
                };
                let local = if let Some((_, reg)) = c.dev {
                    reg
                } else {
                    gather_host(
                        &c.geo,
                        c.pool.bytes(),
                        src,
                        group.clone(),
                        c.staging.bytes_mut(),
                    )?;
                    c.staging_reg
                };
                (local, vec![span])
            }
            Placement::Pool { num_blocks } => {
                let dst = PoolGeometry {
                    num_layers: layers,
                    num_blocks,
                    block_layer_bytes: c.geo.block_layer_bytes,
                };
                let spans = direct_spans(&c.geo, src, &dst, &target.blocks, group.clone())?;
                (c.pool_reg, spans)
            }
        };
        inflight.push_back(c.transport.put(local, rt, &spans)?);
        if let Some(k) = c.opts.faults.pause_after_layers
            && c.first
            && !paused
            && group.end >= k
        {
            paused = true;
            // Let the puts issued so far land, then wait for the test's go-ahead.
            while let Some(done) = inflight.pop_front() {
                done.wait(deadline)?;
            }
            say(format!("PAUSED {request}"));
            wait_stdin_line();
        }
    }
    while let Some(done) = inflight.pop_front() {
        done.wait(deadline)?;
    }
    c.transport.flush(rt)?.wait(deadline)?;
    if target.fence_record {
        // As the serving prefill node does, after the KV was flushed: the record (generation,
        // request, length, CRC32C of the bytes) right behind the KV, then a flush. The host
        // staging holds the request's bytes on every path that asks for a record.
        let at = usize::try_from(kv_len).map_err(|_| TransferError::Geometry {
            reason: "span length overflows".into(),
        })?;
        let bad = |e: fence::FenceError| TransferError::Verify {
            reason: e.to_string(),
        };
        let sum = if target.verify {
            let crc = fence::crc_at(c.staging_reg, 0, at).map_err(bad)?;
            Some(fence::Sum::Crc32c(if c.opts.faults.bad_checksum {
                !crc
            } else {
                crc
            }))
        } else {
            None
        };
        let record = FenceRecord {
            generation: target.staging_generation,
            request: request.0,
            len: kv_len,
            sum,
            aborted: false,
        };
        let cap = pdnode_transfer::Secret::from_bytes(&target.secret).ok_or_else(|| {
            TransferError::Verify {
                reason: format!("a capability of {} bytes, not 16", target.secret.len()),
            }
        })?;
        fence::write_record(c.staging_reg, at, &record, &cap).map_err(bad)?;
        let span = Span {
            local_offset: kv_len,
            remote_offset: target
                .remote_offset(0, kv_len, RECORD_LEN as u64)
                .map_err(checked)?,
            len: RECORD_LEN as u64,
        };
        c.transport
            .put(c.staging_reg, rt, &[span])?
            .wait(deadline)?;
        c.transport.flush(rt)?.wait(deadline)?;
    }
    *push_time = t_push.elapsed();
    let gone = |e: TransferError| TransferError::PeerGone {
        peer: "bench server".into(),
        reason: e.to_string(),
    };
    wire::send(
        stream,
        &Msg::Done {
            request,
            secret,
            status: DoneStatus::Ok,
            bytes: kv_len,
            prefill_node: NodeId::new(PREFILL_NODE),
        },
    )
    .map_err(gone)?;
    *done_sent = true;
    match wire::recv_until(stream, deadline).map_err(gone)? {
        Msg::DoneAck {
            scatter_us,
            verify_us,
            ..
        } => Ok((scatter_us, verify_us)),
        Msg::Refused { error, .. } => Err(TransferError::RemoteFailed {
            request,
            reason: format!("KvDone refused: {error}"),
        }),
        other => Err(TransferError::Control {
            reason: format!("expected DoneAck, got {other:?}"),
        }),
    }
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn summarize(block_bytes: u64, request_bytes: u64, s: &[Sample]) -> PointResult {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut push: Vec<f64> = s.iter().map(|x| ms(x.push)).collect();
    let mut total: Vec<f64> = s.iter().map(|x| ms(x.total)).collect();
    let mut scatter: Vec<f64> = s.iter().map(|x| ms(x.scatter)).collect();
    for v in [&mut push, &mut total, &mut scatter] {
        v.sort_by(|a, b| a.total_cmp(b));
    }
    let sum_push: f64 = push.iter().sum();
    let sum_total: f64 = total.iter().sum();
    let gbps = |sum_ms: f64| {
        if sum_ms > 0.0 {
            request_bytes as f64 * s.len() as f64 / (sum_ms / 1e3) / 1e9
        } else {
            0.0
        }
    };
    PointResult {
        block_bytes,
        request_bytes,
        requests: s.len() as u32,
        push_gbps: gbps(sum_push),
        e2e_gbps: gbps(sum_total),
        push_ms_p50: pct(&push, 0.5),
        latency_ms_p50: pct(&total, 0.5),
        latency_ms_max: pct(&total, 1.0),
        scatter_ms_p50: pct(&scatter, 0.5),
    }
}

fn human(bytes: u64) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

/// The printed table (with a header naming the setup) and one `RESULT` JSON line per row.
pub fn table(opts: &Options, rows: &[PointResult], t: &UcxTransport) -> String {
    let (a, b, c) = t.version();
    let mut out = format!(
        "bench-transfer: UCX {a}.{b}.{c} ({}), UCX_TLS={}, {} layers x {} blocks/request, \
         {} layer(s)/put, {} placement, verified every byte\n",
        t.library(),
        opts.tls
            .clone()
            .or_else(|| std::env::var("UCX_TLS").ok())
            .unwrap_or_else(|| "(default)".into()),
        opts.layers,
        opts.blocks_per_request,
        opts.layers_per_put,
        if opts.pool_placement {
            "pool"
        } else {
            "staging"
        },
    );
    out.push_str(&format!(
        "{:>10} {:>10} {:>5} {:>10} {:>9} {:>9} {:>11} {:>10} {:>11}\n",
        "layer-blk",
        "request",
        "reqs",
        "push GB/s",
        "e2e GB/s",
        "push ms",
        "latency ms",
        "max ms",
        "scatter ms"
    ));
    for r in rows {
        out.push_str(&format!(
            "{:>10} {:>10} {:>5} {:>10.2} {:>9.2} {:>9.2} {:>11.2} {:>10.2} {:>11.2}\n",
            human(r.block_bytes),
            human(r.request_bytes),
            r.requests,
            r.push_gbps,
            r.e2e_gbps,
            r.push_ms_p50,
            r.latency_ms_p50,
            r.latency_ms_max,
            r.scatter_ms_p50
        ));
    }
    for r in rows {
        out.push_str(&format!(
            "RESULT {}\n",
            serde_json::to_string(r).unwrap_or_default()
        ));
    }
    out
}
