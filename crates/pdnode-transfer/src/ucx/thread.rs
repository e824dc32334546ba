//! The UCX worker thread: owns every UCP object, executes commands, drives progress, completes
//! operations, and sleeps on the armed event fd (plus a wake-up socket) when idle.

use super::am::{self, Receiver};
use super::{UcxConfig, memory_type};
use crate::TransferError;
use crate::completion::Completer;
use crate::region::{LocalRegion, MemKind, Span};
use std::cell::RefCell;
use std::collections::HashMap;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use ucx_sys::{Context, Endpoint, MemHandle, RemoteKey, Request, RequestState, Ucp, Worker};

mod messages;
mod regions;
use messages::{AwaitAck, Waiter};

type Reply<T> = mpsc::SyncSender<Result<T, TransferError>>;

pub(crate) enum Cmd {
    Register {
        id: u64,
        region: LocalRegion,
        reply: Reply<Vec<u8>>,
    },
    Allocate {
        id: u64,
        len: usize,
        reply: Reply<(usize, Vec<u8>)>,
    },
    Deregister {
        id: u64,
        reply: mpsc::SyncSender<()>,
    },
    Connect {
        id: u64,
        address: Vec<u8>,
        rkey: Vec<u8>,
        base: u64,
        reply: Reply<()>,
    },
    Disconnect {
        id: u64,
    },
    Put {
        local: u64,
        local_addr: usize,
        mem: MemKind,
        target: u64,
        spans: Vec<Span>,
        done: Completer,
    },
    Flush {
        target: u64,
        done: Completer,
    },
    /// `put` (a [`Cmd::Put`]) once `gate` opens, or failed at `deadline`.
    PutWhen {
        put: Box<Cmd>,
        gate: super::Gate,
        deadline: Instant,
    },
    Shutdown,
}

/// A put waiting for its gate.
struct Gated {
    put: Box<Cmd>,
    gate: super::Gate,
    deadline: Instant,
    submitted: Instant,
}

struct Target {
    address: Vec<u8>,
    rkey: Rc<RemoteKey>,
    base: u64,
    /// The peer places host-memory puts itself ([`am`]): they go as active messages.
    am: bool,
    /// Where the target's base is mapped in this process (a peer on this host whose region UCX
    /// allocated in shared memory): host-memory puts are then plain copies into it.
    direct: Option<*mut u8>,
    /// The peer's stream this target's messages go on (see [`Peer::stream`]).
    stream: Rc<Stream>,
}

/// The active-message stream of one endpoint: its id and the last sequence number sent.
struct Stream {
    id: u64,
    seq: std::cell::Cell<u64>,
}

/// An operation in flight: its requests, what they keep alive, and who waits.
struct Pending {
    reqs: Vec<Request>,
    error: Option<TransferError>,
    done: Completer,
    ep: Rc<Endpoint>,
    _keep: Keep,
}

/// Message headers UCX may read until their requests complete: each boxed, so its address
/// stays put while the list grows.
#[allow(clippy::vec_box)]
type Headers = Vec<Box<[u8; am::HEADER_LEN]>>;

/// What an operation in flight keeps alive: the local registration, the remote key (and with
/// it the endpoint), the headers of its messages.
type Keep = (Option<Rc<MemHandle>>, Rc<RemoteKey>, Headers);

/// A remote worker: its endpoint and the remote keys unpacked on it, kept between requests.
///
/// Closing the endpoint when its last target went made the next request to the same peer
/// create a new one, and UCX's CUDA IPC transport drops the peer's mapped memory with its
/// endpoint: the next put re-opened the IPC handle (milliseconds) — the ~17 ms hand-offs of
/// sequential requests on an idle GPU pair. Peers stay until they fail or sit unused for
/// [`PEER_IDLE`]; unpacked keys of one peer are reused for the same packed key.
struct Peer {
    /// Declared before `ep`: keys are destroyed before their endpoint.
    rkeys: HashMap<Vec<u8>, Rc<RemoteKey>>,
    ep: Rc<Endpoint>,
    /// Active messages to this endpoint are numbered on one stream (a new endpoint, a new
    /// stream), so the peer can tell that none went missing or came out of order.
    stream: Rc<Stream>,
    /// The peer answered a message on this endpoint (its wire-up is complete).
    greeted: bool,
    last_used: Instant,
}

/// How long a peer with no target and nothing in flight keeps its endpoint.
const PEER_IDLE: Duration = Duration::from_secs(600);
/// Unused remote keys kept per peer (a peer that registers a region per request would
/// otherwise grow the map without bound).
const PEER_SPARE_RKEYS: usize = 32;
/// How often gates are polled while nothing else is in flight.
const GATE_POLL: Duration = Duration::from_micros(50);
/// How often idle peers are looked for.
const SWEEP_EVERY: Duration = Duration::from_secs(5);

struct State {
    worker: Rc<Worker>,
    ctx: Rc<Context>,
    /// The active-message handler's state; its address is the handler's argument, so it is
    /// dropped after the worker (see the end of [`run`]).
    receiver: Rc<RefCell<Receiver>>,
    peer_failure: bool,
    regions: HashMap<u64, Rc<MemHandle>>,
    /// Host regions' start addresses by registration id (to forget them on deregistration).
    host_regions: HashMap<u64, u64>,
    awaiting: Vec<AwaitAck>,
    next_token: u64,
    next_stream: u64,
    peers: HashMap<Vec<u8>, Peer>,
    targets: HashMap<u64, Target>,
    pending: Vec<Pending>,
    gated: Vec<Gated>,
    /// Flushes waiting for the gated puts to their target to go out first (a flush covers
    /// every put submitted before it, gated ones included).
    gated_flushes: Vec<(u64, Completer)>,
    counters: Arc<super::Counters>,
    last_sweep: Instant,
}

fn peer_name(address: &[u8]) -> String {
    let h = address.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x100_0000_01b3)
    });
    format!("ucx-worker-{h:016x}")
}

/// Maps a UCX failure on `ep` to `PeerGone` when the endpoint's error handler fired.
fn classify(ep: &Endpoint, address: &[u8], e: ucx_sys::UcxError) -> TransferError {
    match ep.failure() {
        Some(f) => TransferError::PeerGone {
            peer: peer_name(address),
            reason: f.to_string(),
        },
        None => TransferError::Ucx(e),
    }
}

pub(crate) fn run(
    ucp: Arc<Ucp>,
    cfg: UcxConfig,
    rx: mpsc::Receiver<Cmd>,
    mut wake: UnixStream,
    ready: mpsc::SyncSender<Result<Vec<u8>, TransferError>>,
    counters: Arc<super::Counters>,
) {
    let setup = || -> Result<(State, Vec<u8>, i32), TransferError> {
        if let Some(device) = cfg.cuda_device {
            super::cuda_ctx::bind_primary_context(device)?;
        }
        let mut overrides = Vec::new();
        if let Some(t) = cfg.tls.as_deref().filter(|t| !t.is_empty()) {
            overrides.push(("TLS", t));
        }
        if let Some(d) = cfg.net_devices.as_deref().filter(|d| !d.is_empty()) {
            overrides.push(("NET_DEVICES", d));
        }
        let ctx = Context::new(ucp, &cfg.name, &overrides)?;
        let worker = Worker::new(&ctx)?;
        let receiver = Receiver::new(worker.clone());
        // SAFETY: the handler's argument is the receiver's RefCell, which State keeps alive
        // until after the worker is destroyed (end of `run`); the handler runs only inside
        // this thread's progress calls, which never hold a borrow of it.
        unsafe {
            worker.set_am_handler(
                am::AM_ID,
                Some(am::handler),
                Rc::as_ptr(&receiver) as *mut std::ffi::c_void,
            )
        }?;
        let address = worker.address()?;
        let efd = worker.event_fd()?;
        Ok((
            State {
                worker,
                ctx,
                receiver,
                host_regions: HashMap::new(),
                awaiting: Vec::new(),
                next_token: 1,
                next_stream: stream_seed(),
                peer_failure: cfg.peer_failure,
                regions: HashMap::new(),
                peers: HashMap::new(),
                targets: HashMap::new(),
                pending: Vec::new(),
                gated: Vec::new(),
                gated_flushes: Vec::new(),
                counters,
                last_sweep: Instant::now(),
            },
            address,
            efd,
        ))
    };
    let (mut st, efd) = match setup() {
        Ok((st, address, efd)) => {
            let _ = ready.send(Ok(address));
            (st, efd)
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    drop(ready);
    'outer: loop {
        let mut busy = false;
        loop {
            match rx.try_recv() {
                Ok(Cmd::Shutdown) | Err(mpsc::TryRecvError::Disconnected) => break 'outer,
                Ok(cmd) => {
                    busy = true;
                    st.handle(cmd);
                }
                Err(mpsc::TryRecvError::Empty) => break,
            }
        }
        if st.worker.progress() > 0 {
            busy = true;
        }
        st.poll_pending();
        st.poll_acks();
        if st.poll_gated() {
            busy = true;
        }
        if busy {
            continue;
        }
        st.sweep_idle_peers();
        if !st.pending.is_empty() || !st.awaiting.is_empty() {
            // Operations in flight: keep progressing, but let the other threads of a small
            // machine run.
            std::thread::yield_now();
            continue;
        }
        if !st.gated.is_empty() || !st.gated_flushes.is_empty() {
            // Only puts waiting for their data (a prefill step's layer groups, tens of ms
            // apart): look at the gates often enough not to matter, without spinning a core
            // through the whole step.
            std::thread::sleep(GATE_POLL);
            continue;
        }
        match st.worker.arm() {
            Ok(true) => sleep(efd, &mut wake),
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(error = %e, "ucp_worker_arm failed; polling");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }
    // Dropping the pending completers reports `Closed` to their waiters; then UCP objects go in
    // dependency order.
    st.gated.clear();
    st.gated_flushes.clear();
    st.pending.clear();
    st.awaiting.clear();
    st.targets.clear();
    st.peers.clear();
    st.regions.clear();
    st.receiver.borrow_mut().replies_clear();
    // The receiver holds the last reference to the worker: the worker is destroyed inside the
    // receiver's drop, while the receiver's memory (the handler's argument) is still valid.
    let State {
        worker,
        ctx,
        receiver,
        ..
    } = st;
    drop(worker);
    drop(receiver);
    drop(ctx);
}

/// A starting point for stream ids: random, so two processes (or one restarted) do not share
/// ids at a receiver.
fn stream_seed() -> u64 {
    rand::random()
}

/// Sleeps until the worker's event fd or the wake-up socket is readable (at most 1 s).
fn sleep(efd: i32, wake: &mut UnixStream) {
    let mut fds = [
        ucx_sys::ffi::pollfd {
            fd: efd,
            events: ucx_sys::ffi::POLLIN,
            revents: 0,
        },
        ucx_sys::ffi::pollfd {
            fd: wake.as_raw_fd(),
            events: ucx_sys::ffi::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: two valid pollfd entries; both fds are open for the duration of the call.
    unsafe { ucx_sys::ffi::poll(fds.as_mut_ptr(), 2, 1000) };
    let mut buf = [0u8; 64];
    while matches!(wake.read(&mut buf), Ok(n) if n > 0) {}
}

impl State {
    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            // A registration whose caller stopped waiting (its call timed out) would never be
            // deregistered: it is dropped at once.
            Cmd::Register { id, region, reply } => {
                let r = self.register(id, region);
                if let Err(mpsc::SendError(Ok(_))) = reply.send(r) {
                    self.deregister(id);
                }
            }
            Cmd::Allocate { id, len, reply } => {
                let r = self.allocate(id, len);
                if let Err(mpsc::SendError(Ok(_))) = reply.send(r) {
                    self.deregister(id);
                }
            }
            Cmd::Deregister { id, reply } => {
                self.deregister(id);
                let _ = reply.send(());
            }
            Cmd::Connect {
                id,
                address,
                rkey,
                base,
                reply,
            } => match self.connect(id, address, &rkey, base) {
                Ok(true) => self.greet(id, reply),
                r => {
                    // As in `greet`'s answer: a target its caller never got is not kept.
                    if let Err(mpsc::SendError(Ok(()))) = reply.send(r.map(|_| ())) {
                        self.targets.remove(&id);
                    }
                }
            },
            Cmd::Disconnect { id } => {
                if let Some(t) = self.targets.remove(&id) {
                    drop(t.rkey);
                    if let Some(p) = self.peers.get_mut(&t.address) {
                        p.last_used = Instant::now();
                        if p.rkeys.len() > PEER_SPARE_RKEYS {
                            p.rkeys.retain(|_, k| Rc::strong_count(k) > 1);
                        }
                    }
                }
            }
            Cmd::Put {
                local,
                local_addr,
                mem,
                target,
                spans,
                done,
            } => self.put(local, local_addr, mem, target, &spans, done),
            Cmd::Flush { target, done } => {
                if self.gates_target(target) {
                    self.gated_flushes.push((target, done));
                } else {
                    self.flush(target, done);
                }
            }
            Cmd::PutWhen {
                put,
                gate,
                deadline,
            } => self.gated.push(Gated {
                put,
                gate,
                deadline,
                submitted: Instant::now(),
            }),
            Cmd::Shutdown => {}
        }
    }

    /// The peer at `address`, connected now unless a healthy endpoint is kept.
    fn peer(&mut self, address: &[u8]) -> Result<&mut Peer, TransferError> {
        if self
            .peers
            .get(address)
            .is_some_and(|p| p.ep.failure().is_some())
        {
            self.peers.remove(address);
        }
        if !self.peers.contains_key(address) {
            let ep = self.endpoint(address)?;
            self.counters.endpoints.fetch_add(1, Ordering::Relaxed);
            self.next_stream = self.next_stream.wrapping_add(1);
            self.peers.insert(
                address.to_vec(),
                Peer {
                    rkeys: HashMap::new(),
                    ep,
                    stream: Rc::new(Stream {
                        id: self.next_stream,
                        seq: std::cell::Cell::new(0),
                    }),
                    greeted: false,
                    last_used: Instant::now(),
                },
            );
        }
        let p = self
            .peers
            .get_mut(address)
            .ok_or_else(|| TransferError::Control {
                reason: "UCX peer vanished".into(),
            })?;
        p.last_used = Instant::now();
        Ok(p)
    }

    /// Closes endpoints of peers with no target and nothing in flight for [`PEER_IDLE`].
    fn sweep_idle_peers(&mut self) {
        let now = Instant::now();
        if now.duration_since(self.last_sweep) < SWEEP_EVERY {
            return;
        }
        self.last_sweep = now;
        let (targets, pending, awaiting) = (&self.targets, &self.pending, &self.awaiting);
        self.peers.retain(|address, p| {
            now.duration_since(p.last_used) < PEER_IDLE
                || targets.values().any(|t| &t.address == address)
                || pending.iter().any(|q| Rc::ptr_eq(&q.ep, &p.ep))
                || awaiting.iter().any(|q| Rc::ptr_eq(&q.ep, &p.ep))
        });
    }

    fn endpoint(&mut self, address: &[u8]) -> Result<Rc<Endpoint>, TransferError> {
        let ep = match Endpoint::connect(&self.worker, address, self.peer_failure) {
            Ok(ep) => ep,
            Err(e) if self.peer_failure => {
                // Some transports (UCX 1.13's shared memory) have no peer-failure handling:
                // connect without it; a dead peer is then caught by the deadlines and the
                // control channel.
                // Remembered for this worker: UCX logs every failed attempt.
                tracing::warn!(error = %e, "no UCX transport with peer-failure handling; connecting without");
                self.peer_failure = false;
                Endpoint::connect(&self.worker, address, false)?
            }
            Err(e) => return Err(e.into()),
        };
        Ok(ep)
    }

    fn connect(
        &mut self,
        id: u64,
        address: Vec<u8>,
        descriptor: &[u8],
        base: u64,
    ) -> Result<bool, TransferError> {
        let (am, rkey) = match descriptor.strip_prefix(am::AM_TOKEN) {
            Some(rest) => (true, rest),
            None => (false, descriptor),
        };
        if rkey.is_empty() {
            return Err(TransferError::InvalidDescriptor {
                reason: "no UCX rkey after the active-message token".into(),
            });
        }
        let peer = self.peer(&address)?;
        let stream = peer.stream.clone();
        let greet = !peer.greeted;
        let rkey = match peer.rkeys.get(rkey) {
            Some(k) => k.clone(),
            None => {
                let k = Rc::new(RemoteKey::unpack(&peer.ep, rkey)?);
                peer.rkeys.insert(rkey.to_vec(), k.clone());
                k
            }
        };
        let direct = if am { rkey.local_ptr(base) } else { None };
        self.targets.insert(
            id,
            Target {
                address,
                rkey,
                base,
                am,
                direct,
                stream,
            },
        );
        Ok(greet)
    }

    fn put(
        &mut self,
        local: u64,
        local_addr: usize,
        mem: MemKind,
        target: u64,
        spans: &[Span],
        done: Completer,
    ) {
        let Some(mh) = self.regions.get(&local).cloned() else {
            return done.complete(Err(TransferError::UnknownRegion { id: local }));
        };
        let Some(t) = self.targets.get(&target) else {
            return done.complete(Err(TransferError::UnknownTarget { id: target }));
        };
        let ep = t.rkey.endpoint().clone();
        if let (Some(dst), MemKind::Host) = (t.direct, mem) {
            for s in spans {
                // SAFETY: the span lies inside the local registered region and inside the
                // target's region (both checked by the caller against the lengths); `dst` maps
                // the target's base for as long as its rkey (held by the target) lives; the
                // regions are distinct memory.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (local_addr + s.local_offset as usize) as *const u8,
                        dst.add(s.remote_offset as usize),
                        s.len as usize,
                    )
                };
            }
            self.counters.direct_puts.fetch_add(1, Ordering::Relaxed);
            return done.complete(Ok(()));
        }
        if t.am && mem == MemKind::Host {
            self.counters.message_puts.fetch_add(1, Ordering::Relaxed);
            return self.put_messages(local_addr, target, spans, done, Some(mh));
        }
        self.counters.rma_puts.fetch_add(1, Ordering::Relaxed);
        let mut reqs = Vec::new();
        let mut error = None;
        for s in spans {
            // SAFETY: the span lies inside the registered local region (checked by the caller
            // against the registration's length); the region is valid while registered, and the
            // Rc<MemHandle> kept in `Pending` keeps it registered until the request completes.
            let r = unsafe {
                ep.put(
                    (local_addr + s.local_offset as usize) as *const u8,
                    s.len as usize,
                    t.base + s.remote_offset,
                    &t.rkey,
                    memory_type(mem),
                )
            };
            match r {
                Ok(Some(req)) => reqs.push(req),
                Ok(None) => {}
                Err(e) => {
                    error = Some(classify(&ep, &t.address, e));
                    break;
                }
            }
        }
        self.track(reqs, error, done, ep, Some(mh), t.rkey.clone(), Vec::new());
    }

    fn flush(&mut self, target: u64, done: Completer) {
        let Some(t) = self.targets.get(&target) else {
            return done.complete(Err(TransferError::UnknownTarget { id: target }));
        };
        let ep = t.rkey.endpoint().clone();
        let (reqs, error) = match ep.flush() {
            Ok(r) => (r.into_iter().collect::<Vec<_>>(), None),
            Err(e) => (Vec::new(), Some(classify(&ep, &t.address, e))),
        };
        if !t.am || t.direct.is_some() || error.is_some() {
            // Direct copies are done (and visible) when their put completes.
            return self.track(reqs, error, done, ep, None, t.rkey.clone(), Vec::new());
        }
        let _ = self.send_flush(target, Waiter::Flush(done), reqs);
    }

    #[allow(clippy::too_many_arguments)]
    fn track(
        &mut self,
        reqs: Vec<Request>,
        error: Option<TransferError>,
        done: Completer,
        ep: Rc<Endpoint>,
        mh: Option<Rc<MemHandle>>,
        rkey: Rc<RemoteKey>,
        headers: Headers,
    ) {
        if reqs.is_empty() {
            return done.complete(error.map_or(Ok(()), Err));
        }
        self.pending.push(Pending {
            reqs,
            error,
            done,
            ep,
            _keep: (mh, rkey, headers),
        });
    }

    /// Whether a gated put to `target` still waits for its gate.
    fn gates_target(&self, target: u64) -> bool {
        self.gated
            .iter()
            .any(|g| matches!(&*g.put, Cmd::Put { target: t, .. } if *t == target))
    }

    /// Issues the gated puts whose gate opened, fails those whose gate failed or whose
    /// deadline passed, then the flushes no gated put holds back any more. Returns whether any
    /// left the lists.
    fn poll_gated(&mut self) -> bool {
        if self.gated.is_empty() && self.gated_flushes.is_empty() {
            return false;
        }
        let moved = self.poll_gates();
        let mut i = 0;
        let mut flushed = false;
        while i < self.gated_flushes.len() {
            if self.gates_target(self.gated_flushes[i].0) {
                i += 1;
            } else {
                let (target, done) = self.gated_flushes.remove(i);
                self.flush(target, done);
                flushed = true;
            }
        }
        moved || flushed
    }

    fn poll_gates(&mut self) -> bool {
        if self.gated.is_empty() {
            return false;
        }
        let now = Instant::now();
        let mut moved = false;
        let mut i = 0;
        while i < self.gated.len() {
            let g = &mut self.gated[i];
            let verdict = if now >= g.deadline {
                Err(TransferError::Timeout {
                    what: "UCX gated put (its data never became ready)".into(),
                })
            } else {
                (g.gate)().map_err(|e| TransferError::Control {
                    reason: format!("gated put: {e}"),
                })
            };
            match verdict {
                Ok(false) => i += 1,
                Ok(true) => {
                    moved = true;
                    let g = self.gated.remove(i);
                    tracing::debug!(
                        waited_us = g.submitted.elapsed().as_micros() as u64,
                        "gated put issued"
                    );
                    self.handle(*g.put);
                }
                Err(e) => {
                    moved = true;
                    let g = self.gated.remove(i);
                    if let Cmd::Put { done, .. } = *g.put {
                        done.complete(Err(e));
                    }
                }
            }
        }
        moved
    }

    fn poll_pending(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let mut i = 0;
        while i < self.pending.len() {
            let p = &mut self.pending[i];
            let ep = p.ep.clone();
            if let Some(e) = reap(&mut p.reqs)
                && p.error.is_none()
            {
                let address = self
                    .peers
                    .iter()
                    .find(|(_, v)| Rc::ptr_eq(&v.ep, &ep))
                    .map(|(k, _)| k.clone())
                    .unwrap_or_default();
                self.pending[i].error = Some(classify(&ep, &address, e));
            }
            if self.pending[i].reqs.is_empty() {
                let p = self.pending.swap_remove(i);
                p.done.complete(p.error.map_or(Ok(()), Err));
            } else {
                i += 1;
            }
        }
    }
}

/// Drops the finished requests of `reqs`; the first failure among them, if any.
fn reap(reqs: &mut Vec<Request>) -> Option<ucx_sys::UcxError> {
    let mut failure = None;
    reqs.retain(|r| match r.state() {
        RequestState::InProgress => true,
        RequestState::Done(Ok(())) => false,
        RequestState::Done(Err(e)) => {
            failure.get_or_insert(e);
            false
        }
    });
    failure
}
