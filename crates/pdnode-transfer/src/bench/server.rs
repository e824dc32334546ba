//! The bench's receiver (decode role): registers a pool and a receive staging area, reserves
//! blocks under a lease, hands out KV targets, and on KvDone scatters, verifies and frees.

use super::devmem::DevBuf;
use super::wire::{self, Msg};
use super::{HostBuf, Options, pattern};
use crate::TransferError;
use crate::negotiation::{DoneStatus, KvTarget, Placement, Reservation, ReservationEnd};
use crate::region::{LocalRegion, MemKind, PoolGeometry, scatter_host};
use crate::transport::{KvTransport, Registration};
use crate::ucx::UcxTransport;
use pdnode_core::{BlockId, KvLayout, NodeId, RequestId};
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
    reservation: Option<Reservation>,
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
                prefill_node,
                ..
            } => match point.as_mut() {
                None => refused(Some(request), &no_point()),
                Some(p) => match done(p, request, &secret, &status, &prefill_node) {
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
    let staging_len = geo.staging_bytes(max_request_blocks as usize) as usize;
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
    let now = Instant::now();
    let lease = Duration::from_millis(lease_ms);
    let mut r = Reservation::new(request, blocks.clone(), None, lease, GRACE, now);
    let (region, placement) = if p.pool_placement {
        (
            p.pool_reg.descriptor().clone(),
            Placement::Pool {
                num_blocks: p.geo.num_blocks,
            },
        )
    } else {
        (
            p.staging_reg.descriptor().clone(),
            Placement::Staging { offset: 0 },
        )
    };
    let target = KvTarget {
        request,
        decode_node: NodeId::new("bench-server"),
        worker_address: transport.local_address(),
        region,
        placement,
        blocks,
        layout: p.layout.clone(),
        secret: r.secret().clone(),
        lease_deadline_ms: unix_ms() + lease_ms,
    };
    r.target_sent(now)?;
    say(format!("RESERVED {request} {n} blocks"));
    p.reservation = Some(r);
    Ok(target)
}

fn done(
    p: &mut Point,
    request: RequestId,
    secret: &[u8],
    status: &DoneStatus,
    peer: &NodeId,
) -> Result<(u64, u64), TransferError> {
    let r = match p.reservation.as_mut() {
        Some(r) if r.request() == request => r,
        _ => return Err(TransferError::UnknownRequest { request }),
    };
    r.done(peer, secret, status, Instant::now())?;
    let Some(end) = r.poll(Instant::now()) else {
        return Err(TransferError::Control {
            reason: format!("{request}: reservation still open after done"),
        });
    };
    p.reservation = None;
    let blocks = match end {
        ReservationEnd::Admit(b) => b,
        ReservationEnd::Free(b) => {
            say(format!(
                "FREED {request} {} blocks (sender failed)",
                b.len()
            ));
            p.free.extend(b);
            return Err(TransferError::RemoteFailed {
                request,
                reason: format!("{status:?}"),
            });
        }
    };
    let t = Instant::now();
    if !p.pool_placement {
        let layers = 0..p.layout.num_layers;
        let region = p.staging_reg.region();
        if let Some(dev) = &p.dev_staging {
            // The sender stopped writing (its KvDone came after its flush): read back, scatter.
            let mut host = HostBuf::new(region.len)?;
            dev.download(0, host.bytes_mut())?;
            scatter_host(&p.geo, host.bytes(), &blocks, layers, p.pool.bytes_mut())?;
        } else {
            // SAFETY: the staging region is valid while its registration (owned by `p`) lives,
            // and the sender stopped writing it (its KvDone came after its flush).
            let staging =
                unsafe { std::slice::from_raw_parts(region.addr as *const u8, region.len) };
            scatter_host(&p.geo, staging, &blocks, layers, p.pool.bytes_mut())?;
        }
    }
    let scatter_us = t.elapsed().as_micros() as u64;
    let t = Instant::now();
    let verified = verify(p, request, &blocks);
    let verify_us = t.elapsed().as_micros() as u64;
    // The bench's "decode" is done with the request at once.
    p.free.extend(blocks);
    verified?;
    Ok((scatter_us, verify_us))
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
    if let Some(end) = r.poll(now) {
        let request = r.request();
        let state = r.state().name();
        p.reservation = None;
        match end {
            ReservationEnd::Free(b) => {
                say(format!("FREED {request} {} blocks ({state})", b.len()));
                p.free.extend(b);
            }
            ReservationEnd::Admit(b) => p.free.extend(b),
        }
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
