//! The UCX transport: one dedicated OS thread owns the UCP context and worker, drives progress
//! and sleeps on the worker's event fd (armed) when idle. Callers talk to it through a channel;
//! puts and flushes return [`Completion`]s.

mod am;
pub mod cuda_ctx;
mod thread;

use crate::TransferError;
use crate::completion::Completion;
use crate::region::{LocalRegion, MemKind, RemoteRegion, Span, check_spans};
use crate::transport::{KvTransport, Registration, RemoteTarget, TransportKind};
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Says whether the bytes a gated put reads are in place ([`UcxTransport::put_when`]); an error
/// fails the put (as [`crate::TransferError::Control`], naming the cause).
pub type Gate = Box<dyn FnMut() -> Result<bool, GateFailure> + Send>;

/// Why a gate failed: whatever error its owner has (e.g. the engine's).
pub type GateFailure = Box<dyn std::error::Error + Send + Sync>;
use std::time::Duration;
use thread::Cmd;

pub(crate) const NAME: &str = "ucx";

/// Largest accepted worker address or packed rkey (real ones are a few hundred bytes).
const MAX_DESCRIPTOR_BYTES: usize = 64 << 10;

/// How long dropping a registration waits for the worker thread to unmap it.
const DEREGISTER_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest a connect waits for a new peer's greeting (see [`UcxTransport::connect`]).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How the UCX transport starts.
#[derive(Debug, Clone)]
pub struct UcxConfig {
    /// Path of libucp; `None`: `libucp.so.0`, then `libucp.so`.
    pub library: Option<String>,
    /// Name for UCX's logs.
    pub name: String,
    /// Fail operations to a dead peer instead of hanging (UCP_ERR_HANDLING_MODE_PEER).
    pub peer_failure: bool,
    /// `UCX_TLS` for this transport (overrides the environment); None: the environment's.
    pub tls: Option<String>,
    /// `UCX_NET_DEVICES` for this transport (overrides the environment).
    pub net_devices: Option<String>,
    /// Deadline for synchronous calls into the worker thread (register, connect, start).
    pub call_timeout: Duration,
    /// Make this CUDA device's primary context current on the worker thread before UCX starts
    /// (UCX's CUDA transports work in the calling thread's context: without one, a put from
    /// device memory is not done by cuda_copy/cuda_ipc). Needs the `cuda` feature.
    pub cuda_device: Option<u32>,
}

impl Default for UcxConfig {
    fn default() -> Self {
        UcxConfig {
            library: None,
            name: "pdnode".into(),
            peer_failure: true,
            tls: None,
            net_devices: None,
            call_timeout: Duration::from_secs(30),
            cuda_device: None,
        }
    }
}

/// Commands queued for the UCX thread at most. A put or flush that finds the queue full fails
/// at once ([`TransferError::Busy`]): back-pressure on the data path instead of an unbounded
/// queue. Control commands (register, connect, deregister) wait for room: the thread drains the
/// queue continuously, and they wait for its answer anyway.
pub const COMMAND_QUEUE: usize = 4096;

struct Shared {
    tx: mpsc::SyncSender<Cmd>,
    wake: UnixStream,
}

impl Shared {
    fn send(&self, cmd: Cmd) -> Result<(), TransferError> {
        self.tx
            .send(cmd)
            .map_err(|_| TransferError::Closed { transport: NAME })?;
        self.wake();
        Ok(())
    }

    /// As [`Shared::send`], failing with [`TransferError::Busy`] when the queue is full.
    fn try_send(&self, cmd: Cmd) -> Result<(), TransferError> {
        self.tx.try_send(cmd).map_err(|e| match e {
            mpsc::TrySendError::Full(_) => TransferError::Busy {
                transport: NAME,
                queued: COMMAND_QUEUE,
            },
            mpsc::TrySendError::Disconnected(_) => TransferError::Closed { transport: NAME },
        })?;
        self.wake();
        Ok(())
    }

    fn wake(&self) {
        // A full socket buffer already means a pending wake-up.
        let _ = (&self.wake).write(&[1]);
    }
}

/// KV transport over UCX RMA (host memory; CUDA memory where the library has CUDA transports).
pub struct UcxTransport {
    shared: Arc<Shared>,
    address: Vec<u8>,
    version: (u32, u32, u32),
    library: String,
    next_id: AtomicU64,
    call_timeout: Duration,
    thread: Mutex<Option<JoinHandle<()>>>,
    counters: Arc<Counters>,
}

/// What a transport has done so far (see [`UcxTransport::paths`]).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub endpoints: AtomicU64,
    pub rma_puts: AtomicU64,
    pub direct_puts: AtomicU64,
    pub message_puts: AtomicU64,
}

/// How many puts went each way ([`UcxTransport::paths`]; docs/protocol.md section 6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PutPaths {
    /// UCX RMA (device memory).
    pub rma: u64,
    /// Copies into a peer region mapped in this process (shared memory on one host).
    pub direct: u64,
    /// Active messages the receiver places (host memory otherwise).
    pub messages: u64,
}

impl UcxTransport {
    /// Loads libucp, creates the context and worker on a new thread, and returns once the worker
    /// address is known. A missing library is [`TransferError::Ucx`] naming what was tried.
    pub fn start(cfg: UcxConfig) -> Result<UcxTransport, TransferError> {
        let ucp = ucx_sys::Ucp::load(cfg.library.as_deref())?;
        let version = ucp.version();
        let library = ucp.library.clone();
        let (tx, rx) = mpsc::sync_channel(COMMAND_QUEUE);
        let (wake_tx, wake_rx) = UnixStream::pair().map_err(|e| TransferError::Control {
            reason: format!("wake-up socket: {e}"),
        })?;
        for s in [&wake_tx, &wake_rx] {
            s.set_nonblocking(true)
                .map_err(|e| TransferError::Control {
                    reason: format!("wake-up socket: {e}"),
                })?;
        }
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let thread_cfg = cfg.clone();
        let counters = Arc::new(Counters::default());
        let counter = counters.clone();
        let handle = std::thread::Builder::new()
            .name(format!("ucx-{}", cfg.name))
            .spawn(move || thread::run(ucp, thread_cfg, rx, wake_rx, ready_tx, counter))
            .map_err(|e| TransferError::Control {
                reason: format!("spawn the UCX thread: {e}"),
            })?;
        let address = match ready_rx.recv_timeout(cfg.call_timeout) {
            Ok(Ok(addr)) => addr,
            Ok(Err(e)) => {
                let _ = handle.join();
                return Err(e);
            }
            Err(_) => {
                return Err(TransferError::Timeout {
                    what: "UCX worker start".into(),
                });
            }
        };
        tracing::info!(
            library = %library,
            version = %format!("{}.{}.{}", version.0, version.1, version.2),
            "UCX transport started"
        );
        Ok(UcxTransport {
            shared: Arc::new(Shared { tx, wake: wake_tx }),
            address,
            version,
            library,
            next_id: AtomicU64::new(1),
            call_timeout: cfg.call_timeout,
            thread: Mutex::new(Some(handle)),
            counters,
        })
    }

    /// `(major, minor, release)` of the loaded UCX.
    pub fn version(&self) -> (u32, u32, u32) {
        self.version
    }

    /// UCX endpoints this transport has created so far. Endpoints are kept per peer between
    /// requests (reconnecting drops what the transports cached for the peer, e.g. CUDA IPC
    /// mappings): a steady stream of requests to one peer keeps this at one.
    pub fn endpoints_created(&self) -> u64 {
        self.counters.endpoints.load(Ordering::Relaxed)
    }

    /// How many puts this transport issued by each path so far.
    pub fn paths(&self) -> PutPaths {
        let c = &self.counters;
        PutPaths {
            rma: c.rma_puts.load(Ordering::Relaxed),
            direct: c.direct_puts.load(Ordering::Relaxed),
            messages: c.message_puts.load(Ordering::Relaxed),
        }
    }

    /// As [`KvTransport::put`], but the put is issued only once `gate` says its bytes are in
    /// place: the worker thread polls `gate` (`Ok(true)`: put now; `Ok(false)`: not yet; `Err`:
    /// the operation fails with that reason) between its other work, until `deadline` (then the
    /// operation fails with a timeout). For a GPU node's layer-by-layer hand-off: the gate asks a
    /// CUDA event whether the gather of a layer group into the staging arena has run, so the put
    /// leaves while the prefill step computes later layers.
    pub fn put_when(
        &self,
        local: &Registration,
        remote: &RemoteTarget,
        spans: &[Span],
        gate: Gate,
        deadline: std::time::Instant,
    ) -> Result<Completion, TransferError> {
        check_spans(spans, local.region.len as u64, remote.region.len)?;
        let (completion, done) = Completion::pending("UCX gated put", NAME);
        self.shared.try_send(Cmd::PutWhen {
            put: Box::new(put_cmd(local, remote, spans, done)),
            gate,
            deadline,
        })?;
        Ok(completion)
    }

    /// What was loaded.
    pub fn library(&self) -> &str {
        &self.library
    }

    /// Host memory allocated *by UCX* and registered (`UCP_MEM_MAP_ALLOCATE`): on one host,
    /// shared-memory transports map it in the writer and copy straight into it, with no
    /// progress needed from this side (a user buffer over `UCX_TLS=sm` goes through emulated
    /// RMA instead). Use it for receive staging. The memory lives until the registration drops;
    /// its bytes are not initialised.
    pub fn allocate_registered(&self, len: usize) -> Result<Registration, TransferError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (addr, rkey) = self.call("UCX allocate", |reply| Cmd::Allocate { id, len, reply })?;
        let region = LocalRegion {
            addr,
            len,
            mem: MemKind::Host,
        };
        Ok(Registration {
            id,
            region,
            descriptor: RemoteRegion {
                base_addr: addr as u64,
                len: len as u64,
                rkey,
            },
            release: Some(self.release_fn(id)),
        })
    }

    fn release_fn(&self, id: u64) -> Box<dyn FnOnce() + Send + Sync> {
        let shared = self.shared.clone();
        Box::new(move || {
            // Synchronous, so the owner may free the memory right after the drop.
            let (tx, rx) = mpsc::sync_channel(1);
            if shared.send(Cmd::Deregister { id, reply: tx }).is_ok() {
                let _ = rx.recv_timeout(DEREGISTER_TIMEOUT);
            }
        })
    }

    fn call<T>(
        &self,
        what: &'static str,
        make: impl FnOnce(mpsc::SyncSender<Result<T, TransferError>>) -> Cmd,
    ) -> Result<T, TransferError> {
        self.call_within(what, self.call_timeout, make)
    }

    /// [`Self::call`] with its own bound (a late answer is dropped by the UCX thread).
    fn call_within<T>(
        &self,
        what: &'static str,
        timeout: Duration,
        make: impl FnOnce(mpsc::SyncSender<Result<T, TransferError>>) -> Cmd,
    ) -> Result<T, TransferError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.shared.send(make(tx))?;
        match rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                Err(TransferError::Timeout { what: what.into() })
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Err(TransferError::Closed { transport: NAME })
            }
        }
    }
}

impl KvTransport for UcxTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Ucx
    }

    fn local_address(&self) -> Vec<u8> {
        self.address.clone()
    }

    unsafe fn register(&self, region: LocalRegion) -> Result<Registration, TransferError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let rkey = self.call("UCX register", |reply| Cmd::Register { id, region, reply })?;
        Ok(Registration {
            id,
            region,
            descriptor: RemoteRegion {
                base_addr: region.addr as u64,
                len: region.len as u64,
                rkey,
            },
            release: Some(self.release_fn(id)),
        })
    }

    fn connect(
        &self,
        peer_address: &[u8],
        region: &RemoteRegion,
    ) -> Result<RemoteTarget, TransferError> {
        if peer_address.is_empty() || region.rkey.is_empty() || region.len == 0 {
            return Err(TransferError::InvalidDescriptor {
                reason: "empty worker address, rkey or region".into(),
            });
        }
        // UCX parses both without a length: bound them (they come from an authenticated
        // control channel; see docs/protocol.md).
        if peer_address.len() > MAX_DESCRIPTOR_BYTES || region.rkey.len() > MAX_DESCRIPTOR_BYTES {
            return Err(TransferError::InvalidDescriptor {
                reason: format!(
                    "worker address of {} bytes or rkey of {} bytes exceeds {MAX_DESCRIPTOR_BYTES}",
                    peer_address.len(),
                    region.rkey.len()
                ),
            });
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let address = peer_address.to_vec();
        let rkey = region.rkey.clone();
        let base = region.base_addr;
        // A peer not greeted yet answers a FLUSH round trip first (`thread/messages.rs`,
        // `greet`): milliseconds when it lives. A dead or frozen one is given up on after
        // CONNECT_TIMEOUT, not the 30 s call bound: the caller's push holds its request's KV
        // (and its thread, in `block_in_place`) while it waits.
        let timeout = self.call_timeout.min(CONNECT_TIMEOUT);
        self.call_within("UCX connect", timeout, |reply| Cmd::Connect {
            id,
            address,
            rkey,
            base,
            reply,
        })?;
        let shared = self.shared.clone();
        Ok(RemoteTarget {
            id,
            region: region.clone(),
            release: Some(Box::new(move || {
                let _ = shared.send(Cmd::Disconnect { id });
            })),
        })
    }

    fn put(
        &self,
        local: &Registration,
        remote: &RemoteTarget,
        spans: &[Span],
    ) -> Result<Completion, TransferError> {
        check_spans(spans, local.region.len as u64, remote.region.len)?;
        let (completion, done) = Completion::pending("UCX put", NAME);
        self.shared.try_send(put_cmd(local, remote, spans, done))?;
        Ok(completion)
    }

    fn flush(&self, remote: &RemoteTarget) -> Result<Completion, TransferError> {
        let (completion, done) = Completion::pending("UCX flush", NAME);
        self.shared.try_send(Cmd::Flush {
            target: remote.id,
            done,
        })?;
        Ok(completion)
    }
}

impl Drop for UcxTransport {
    fn drop(&mut self) {
        let _ = self.shared.send(Cmd::Shutdown);
        if let Some(h) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = h.join();
        }
    }
}

/// The worker's command for a put of `spans` from `local` to `remote` (checked by the caller).
fn put_cmd(
    local: &Registration,
    remote: &RemoteTarget,
    spans: &[Span],
    done: crate::completion::Completer,
) -> Cmd {
    Cmd::Put {
        local: local.id,
        local_addr: local.region.addr,
        mem: local.region.mem,
        target: remote.id,
        spans: spans.to_vec(),
        done,
    }
}

pub(crate) fn memory_type(mem: MemKind) -> ucx_sys::MemoryType {
    match mem {
        MemKind::Host => ucx_sys::MemoryType::Host,
        MemKind::Cuda(_) => ucx_sys::MemoryType::Cuda,
    }
}
