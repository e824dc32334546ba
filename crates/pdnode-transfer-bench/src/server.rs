//! The bench's receiver (decode role): registers a pool and a receive staging area, reserves
//! blocks under a lease, hands out KV targets (the serving `pdnode_core::KvTarget`, with a
//! staging generation and, on host staging, fence records with CRC32C), and on KvDone checks
//! the fence record as the decode node does (`FenceRecord::check`), scatters, verifies every
//! byte and frees.

use super::devmem::DevBuf;
use super::wire::{self, DoneStatus, Msg};
use super::{HostBuf, Options, pattern};
use pdnode_core::{BlockId, KvLayout, KvTarget, NodeId, Placement, RankTarget, RequestId};
use pdnode_core::{TargetTransport, kv_target};
use pdnode_transfer::fence::{self, RECORD_LEN};
use pdnode_transfer::region::{LocalRegion, MemKind, PoolGeometry, scatter_host};
use pdnode_transfer::{KvTransport, Registration, Secret, TransferError, UcxTransport};
use rand::seq::SliceRandom;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Quarantine after an abort or a lease end while the sender may still write.
const GRACE: Duration = Duration::from_millis(500);

/// One sweep point. Field order matters: the registrations drop before the buffers.
struct Point {
    pool_reg: Registration,
    staging_reg: Registration,
    layout: KvLayout,
    geo: PoolGeometry,
    pool: HostBuf,
    /// The receive staging memory when it is ours (else UCX allocated it).
    _staging_buf: Option<HostBuf>,
    /// Device receive staging (`--mem cuda:N`); read back to host for scatter and verify.
    dev_staging: Option<DevBuf>,
    pool_placement: bool,
    free: Vec<BlockId>,
    reservation: Option<Held>,
    /// Staging generations handed out (one per reservation).
    generation: u64,
}

/// The one open reservation of a sweep point.
struct Held {
    request: RequestId,
    blocks: Vec<BlockId>,
    secret: Secret,
    generation: u64,
    /// Bytes of KV in the staging span (the fence record lies right behind them).
    kv_len: u64,
    fenced: bool,
    lease_end: Instant,
    /// Set at the lease end: the span stays quarantined until the writer's record of this
    /// generation is there (its puts are over) or the grace passed.
    quarantine_until: Option<Instant>,
}

fn say(line: String) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Serves clients one at a time until one says `Bye` (or, with `serve_once`, until the first
/// connection ends and its reservations are over).
pub fn run(opts: &Options, transport: &UcxTransport) -> Result<(), TransferError> {
    let listener = TcpListener::bind(&opts.listen).map_err(|e| TransferError::Control {
        reason: format!("bind {}: {e}", opts.listen),
    })?;
    let addr = listener.local_addr().map_err(|e| TransferError::Control {
        reason: e.to_string(),
    })?;
    say(format!("LISTEN {addr}"));
    loop {
        let (stream, peer) = listener.accept().map_err(|e| TransferError::Control {
            reason: format!("accept: {e}"),
        })?;
        tracing::info!(%peer, "bench client connected");
        let bye = serve(stream, transport, opts.ucx_alloc_staging, opts.mem)?;
        if bye || opts.serve_once {
            return Ok(());
        }
    }
}

/// One connection. Returns whether the client said goodbye.
fn serve(
    mut stream: TcpStream,
    transport: &UcxTransport,
    ucx_alloc: bool,
    mem: MemKind,
) -> Result<bool, TransferError> {
    let _ = stream.set_nodelay(true);
    let mut point: Option<Point> = None;
    let mut connected = true;
    loop {
        // Leases and quarantines run on the clock, connected or not.
        if let Some(p) = point.as_mut() {
            end_reservation(p, Instant::now());
        }
        if !connected {
            let open = point.as_ref().is_some_and(|p| p.reservation.is_some());
            if !open {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        stream
            .set_read_timeout(Some(Duration::from_millis(50)))
            .map_err(|e| TransferError::Control {
                reason: e.to_string(),
            })?;
        let msg = match wire::recv(&mut stream) {
            Ok(Some(m)) => m,
            Ok(None) => continue,
            Err(e) => {
                say(format!("CLIENT-GONE {e}"));
                connected = false;
                continue;
            }
        };
        let reply = match msg {
            Msg::Bye => return Ok(true),
            Msg::Hello {
                layout,
                pool_blocks,
                max_request_blocks,
                pool_placement,
                ..
            } => {
                // Free the previous point's registrations before allocating the next.
                point = None;
                match setup(
                    transport,
                    layout,
                    pool_blocks,
                    max_request_blocks,
                    pool_placement,
                    ucx_alloc,
                    mem,
                ) {
                    Ok(p) => {
                        point = Some(p);
                        Msg::Welcome {
                            worker_address: transport.local_address(),
                        }
                    }
                    Err(e) => refused(None, &e),
                }
            }
            Msg::Reserve {
                request,
                blocks,
                lease_ms,
                prefill_layout,
            } => match point.as_mut() {
                None => refused(Some(request), &no_point()),
                Some(p) => match reserve(p, request, blocks, lease_ms, prefill_layout, transport) {
                    Ok(t) => Msg::Target {
                        target: Box::new(t),
                    },
                    Err(e) => refused(Some(request), &e),
                },
            },
            Msg::Done {
                request,
                secret,
                status,
                ..
            } => match point.as_mut() {
                None => refused(Some(request), &no_point()),
                Some(p) => match done(p, request, &secret, &status) {
                    Ok((scatter_us, verify_us)) => Msg::DoneAck {
                        request,
                        scatter_us,
                        verify_us,
                    },
                    Err(e) => refused(Some(request), &e),
                },
            },
            other => refused(
                None,
                &TransferError::Control {
                    reason: format!("unexpected message {other:?}"),
                },
            ),
        };
        if let Err(e) = wire::send(&mut stream, &reply) {
            say(format!("CLIENT-GONE {e}"));
            connected = false;
        }
    }
}

fn no_point() -> TransferError {
    TransferError::Control {
        reason: "no Hello yet".into(),
    }
}

fn refused(request: Option<RequestId>, e: &TransferError) -> Msg {
    say(format!(
        "REFUSED {} {e}",
        request.map(|r| r.to_string()).unwrap_or_default()
    ));
    Msg::Refused {
        request,
        error: e.to_string(),
    }
}

fn setup(
    transport: &UcxTransport,
    layout: KvLayout,
    pool_blocks: u32,
    max_request_blocks: u32,
    pool_placement: bool,
    ucx_alloc: bool,
    mem: MemKind,
) -> Result<Point, TransferError> {
    if max_request_blocks == 0 || max_request_blocks > pool_blocks {
        return Err(TransferError::Geometry {
            reason: format!("{max_request_blocks} blocks per request, pool of {pool_blocks}"),
        });
    }
    let geo = PoolGeometry {
        num_layers: layout.num_layers,
        num_blocks: pool_blocks,
        block_layer_bytes: layout.block_layer_bytes() as u64,
    };
    let mut pool = HostBuf::new(geo.pool_bytes() as usize)?;
    // Room for the fence record behind the KV.
    let staging_len = geo.staging_bytes(max_request_blocks as usize) as usize + RECORD_LEN;
    // SAFETY: the pool moves into the returned Point, whose registrations are declared (and so
    // dropped) before the buffers; a HostBuf's heap memory does not move with it.
    let pool_reg = unsafe { transport.register(LocalRegion::host(pool.bytes_mut())) }?;
    let mut dev_staging = None;
    let (staging_reg, staging_buf) = if let MemKind::Cuda(ordinal) = mem {
        if pool_placement {
            return Err(TransferError::UnsupportedMemory {
                transport: "bench-transfer --pool-placement (device memory uses staging)",
                mem: mem.to_string(),
            });
        }
        let dev = DevBuf::new(ordinal, staging_len)?;
        // SAFETY: the device buffer moves into the returned Point after its registration,
        // which drops first; device memory does not move.
        let reg = unsafe { transport.register(dev.region()) }?;
        dev_staging = Some(dev);
        (reg, None)
    } else if ucx_alloc {
        (transport.allocate_registered(staging_len)?, None)
    } else {
        let mut buf = HostBuf::new(staging_len)?;
        // SAFETY: as for the pool.
        let reg = unsafe { transport.register(LocalRegion::host(buf.bytes_mut())) }?;
        (reg, Some(buf))
    };
    Ok(Point {
        layout,
        geo,
        pool,
        _staging_buf: staging_buf,
        dev_staging,
        pool_reg,
        staging_reg,
        pool_placement,
        free: (0..pool_blocks).map(BlockId).collect(),
        reservation: None,
        generation: 1,
    })
}

fn reserve(
    p: &mut Point,
    request: RequestId,
    n: u32,
    lease_ms: u64,
    prefill_layout: Option<KvLayout>,
    transport: &UcxTransport,
) -> Result<KvTarget, TransferError> {
    if let Some(theirs) = &prefill_layout {
        p.layout
            .check_compatible(theirs)
            .map_err(|mismatch| TransferError::LayoutMismatch { request, mismatch })?;
    }
    if p.reservation.is_some() || n as usize > p.free.len() || n == 0 {
        return Err(TransferError::Geometry {
            reason: format!("cannot reserve {n} blocks now ({} free)", p.free.len()),
        });
    }
    p.free.shuffle(&mut rand::rng());
    let blocks: Vec<BlockId> = p.free.split_off(p.free.len() - n as usize);
    let (reg, placement) = if p.pool_placement {
        (
            &p.pool_reg,
            Placement::Pool {
                num_blocks: p.geo.num_blocks,
            },
        )
    } else {
        (&p.staging_reg, Placement::Staging { offset: 0 })
    };
    // Fence records on host staging, as the decode node asks for them (device staging and
    // the pool carry none).
    let fenced = !p.pool_placement && p.dev_staging.is_none();
    let d = reg.descriptor();
    let secret = Secret::random();
    let generation = p.generation;
    p.generation += 1;
    let target = KvTarget {
        request,
        decode_node: NodeId::new("bench-server"),
        decode_grpc_addr: String::new(),
        transport: TargetTransport::Ucx,
        worker_address: transport.local_address(),
        ranks: vec![RankTarget {
            rank: 0,
            rkey: d.rkey.clone(),
            base_addr: d.base_addr,
            region_len: d.len,
            worker_address: Vec::new(),
            device_memory: p.dev_staging.is_some(),
        }],
        blocks: blocks.clone(),
        layout: p.layout.clone(),
        secret: secret.as_bytes().to_vec(),
        lease_deadline_ms: unix_ms() + lease_ms,
        placement,
        staging_generation: generation,
        fence_record: fenced,
        verify: fenced,
    };
    debug_assert_eq!(target.secret.len(), kv_target::SECRET_LEN);
    say(format!("RESERVED {request} {n} blocks"));
    p.reservation = Some(Held {
        request,
        kv_len: p.geo.staging_bytes(blocks.len()),
        blocks,
        secret,
        generation,
        fenced,
        lease_end: Instant::now() + Duration::from_millis(lease_ms),
        quarantine_until: None,
    });
    Ok(target)
}

fn done(
    p: &mut Point,
    request: RequestId,
    secret: &[u8],
    status: &DoneStatus,
) -> Result<(u64, u64), TransferError> {
    let r = match p.reservation.as_ref() {
        Some(r) if r.request == request && r.quarantine_until.is_none() => r,
        _ => return Err(TransferError::UnknownRequest { request }),
    };
    // A wrong secret leaves the reservation to its rightful caller (it ends at its lease).
    if !r.secret.matches(secret) {
        return Err(TransferError::WrongSecret { request });
    }
    let Some(r) = p.reservation.take() else {
        return Err(TransferError::UnknownRequest { request });
    };
    if let DoneStatus::Failed(reason) = status {
        // The sender's puts are over (it says so after waiting for them): free now.
        say(format!(
            "FREED {request} {} blocks (sender failed)",
            r.blocks.len()
        ));
        p.free.extend(r.blocks);
        return Err(TransferError::RemoteFailed {
            request,
            reason: reason.clone(),
        });
    }
    let t = Instant::now();
    // The serving decode node's check: an intact record of this generation, request and
    // length, and the CRC32C of the landed bytes equal to the sender's.
    let checked = if r.fenced { check_fence(p, &r) } else { Ok(()) };
    let fence_us = t.elapsed().as_micros() as u64;
    if let Err(e) = checked {
        p.free.extend(r.blocks);
        return Err(e);
    }
    let blocks = r.blocks;
    let t = Instant::now();
    if !p.pool_placement {
        let layers = 0..p.layout.num_layers;
        let region = p.staging_reg.region();
        if let Some(dev) = &p.dev_staging {
            // The sender stopped writing (its KvDone came after its flush): read back, scatter.
            let mut host = HostBuf::new(region.len.next_multiple_of(8))?;
            dev.download(0, &mut host.bytes_mut()[..region.len])?;
            scatter_host(&p.geo, host.bytes(), &blocks, layers, p.pool.bytes_mut())?;
        } else {
            // SAFETY: the staging region is valid while its registration (owned by `p`) lives,
            // and the sender stopped writing it (its KvDone came after its flush).
            let staging =
                unsafe { std::slice::from_raw_parts(region.addr as *const u8, region.len) };
            scatter_host(&p.geo, staging, &blocks, layers, p.pool.bytes_mut())?;
        }
    }
    let scatter_us = t.elapsed().as_micros() as u64 + fence_us;
    let t = Instant::now();
    let verified = verify(p, request, &blocks);
    let verify_us = t.elapsed().as_micros() as u64;
    // The bench's "decode" is done with the request at once.
    p.free.extend(blocks);
    verified?;
    Ok((scatter_us, verify_us))
}

/// The fence record behind the span's KV, checked against the reservation (with the CRC32C of
/// the landed bytes).
fn check_fence(p: &Point, r: &Held) -> Result<(), TransferError> {
    let len = usize::try_from(r.kv_len).map_err(|_| TransferError::Geometry {
        reason: "span length overflows".into(),
    })?;
    let bad = |e: fence::FenceError| TransferError::Verify {
        reason: format!("{}: {e}", r.request),
    };
    let record = match fence::read_record(&p.staging_reg, len, &r.secret).map_err(bad)? {
        fence::Landed::Record(rec) => rec,
        fence::Landed::Nothing => return Err(bad(fence::FenceError::Missing { rank: 0 })),
        fence::Landed::Forged => return Err(bad(fence::FenceError::Forged { rank: 0 })),
    };
    let crc = fence::crc_at(&p.staging_reg, 0, len).map_err(bad)?;
    record
        .check(
            0,
            r.generation,
            r.request.0,
            r.kv_len,
            Some(fence::Sum::Crc32c(crc)),
        )
        .map_err(bad)
}

fn verify(p: &Point, request: RequestId, blocks: &[BlockId]) -> Result<(), TransferError> {
    let blb = p.geo.block_layer_bytes as usize;
    for layer in 0..p.layout.num_layers {
        for (i, b) in blocks.iter().enumerate() {
            let off = p.geo.layer_block_offset(layer, *b) as usize;
            pattern::check(&p.pool.bytes()[off..off + blb], request.0, layer, i).map_err(|at| {
                TransferError::Verify {
                    reason: format!(
                        "{request} layer {layer} block #{i} ({b}) differs at byte {at}"
                    ),
                }
            })?;
        }
    }
    Ok(())
}

fn end_reservation(p: &mut Point, now: Instant) {
    let Some(r) = p.reservation.as_mut() else {
        return;
    };
    if r.quarantine_until.is_none() {
        if now < r.lease_end {
            return;
        }
        // The lease ended: the sender may still be writing; quarantine the blocks.
        r.quarantine_until = Some(now + GRACE);
    }
    let written = r.fenced
        && usize::try_from(r.kv_len).is_ok_and(|len| {
            fence::read_record(&p.staging_reg, len, &r.secret)
                .ok()
                .and_then(fence::Landed::record)
                .is_some_and(|rec| rec.generation == r.generation)
        });
    if (written || r.quarantine_until.is_some_and(|q| now >= q))
        && let Some(r) = p.reservation.take()
    {
        say(format!(
            "FREED {} {} blocks (expired)",
            r.request,
            r.blocks.len()
        ));
        p.free.extend(r.blocks);
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
