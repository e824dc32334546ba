//! The sending half of receiver-placed puts ([`super::super::am`]): `DATA` messages, the
//! `FLUSH`/`ACK` round trip of a flush (and of a connect to a peer not greeted yet), and what
//! an `ACK` means for its waiter.

use super::super::am::{self, Header, Kind, Verdict};
use super::{Reply, State, Stream, classify, peer_name, reap};
use crate::TransferError;
use crate::completion::Completer;
use crate::region::Span;
use std::rc::Rc;
use std::time::Instant;
use ucx_sys::{Endpoint, MemHandle, RemoteKey, Request};

/// Who waits for an `ACK`.
pub(super) enum Waiter {
    /// A flush of an active-message target.
    Flush(Completer),
    /// A connect to a peer not greeted yet: answered once the peer answered (see
    /// [`State::connect`]).
    Connect { reply: Reply<()>, target: u64 },
}

/// A flush (or greeting) of an active-message target: waits for the peer's `ACK` (and the
/// endpoint's own flush, for puts that went by RMA).
pub(super) struct AwaitAck {
    token: u64,
    done: Waiter,
    pub(super) ep: Rc<Endpoint>,
    address: Vec<u8>,
    /// The stream the flush asks about.
    stream: u64,
    reqs: Vec<Request>,
    error: Option<TransferError>,
    deadline: Instant,
    _keep: (Rc<RemoteKey>, Box<[u8; am::HEADER_LEN]>),
}

impl State {
    /// Answers a connect to a peer not greeted yet only after a `FLUSH` round trip: the
    /// endpoint's wire-up is then complete on both sides. UCX 1.13 aborts a process whose
    /// endpoint fails while its own wire-up answer is still queued (`ucp_request.c:684`
    /// "got REP message", seen when a writer was killed right after connecting), so a peer that
    /// dies later, in the middle of a hand-off, must find that answer long sent. It also warms
    /// the endpoint up before the first hand-off needs it.
    pub(super) fn greet(&mut self, target: u64, reply: Reply<()>) {
        if let Err(e) = self.send_flush(target, Waiter::Connect { reply, target }, Vec::new()) {
            // `send_flush` answered the waiter.
            tracing::debug!(error = %e, "greeting a UCX peer failed");
        }
    }

    /// A put to an active-message target: every span in pieces of at most [`am::CHUNK`]
    /// bytes, each a `DATA` message numbered on the peer's stream, eager (the receiver copies
    /// it into place; no answer travels back).
    pub(super) fn put_messages(
        &mut self,
        local_addr: usize,
        target: u64,
        spans: &[Span],
        done: Completer,
        mh: Option<Rc<MemHandle>>,
    ) {
        let Some(t) = self.targets.get(&target) else {
            return done.complete(Err(TransferError::UnknownTarget { id: target }));
        };
        let ep = t.rkey.endpoint().clone();
        let mut reqs = Vec::new();
        let mut headers = Vec::new();
        let mut error = None;
        let mut broken_stream = None;
        'spans: for s in spans {
            let mut off = 0u64;
            while off < s.len {
                let n = (s.len - off).min(am::CHUNK as u64);
                let seq = t.stream.seq.get() + 1;
                t.stream.seq.set(seq);
                let header = Box::new(
                    Header {
                        kind: Kind::Data,
                        verdict: Verdict::Ok,
                        stream: t.stream.id,
                        seq,
                        target,
                        addr: t.base + s.remote_offset + off,
                        count: 0,
                    }
                    .encode(),
                );
                let src = local_addr + (s.local_offset + off) as usize;
                // SAFETY: the span lies inside the registered local host region (checked by
                // the caller); the region stays registered while `mh` (kept in `Pending`) lives,
                // and the header box is kept there too until the request completes.
                let r = unsafe {
                    ep.am_send(
                        am::AM_ID,
                        &header[..],
                        src as *const u8,
                        n as usize,
                        ucx_sys::ffi::UCP_AM_SEND_FLAG_EAGER,
                    )
                };
                headers.push(header);
                match r {
                    Ok(Some(req)) => reqs.push(req),
                    Ok(None) => {}
                    Err(e) => {
                        error = Some(classify(&ep, &t.address, e));
                        // Its number is spent: the peer sees a gap on this stream from now on.
                        broken_stream = Some((t.address.clone(), t.stream.id));
                        break 'spans;
                    }
                }
                off += n;
            }
        }
        let rkey = t.rkey.clone();
        self.track(reqs, error, done, ep, mh, rkey, headers);
        if let Some((address, stream)) = broken_stream {
            self.renew_stream(&address, stream);
        }
    }

    /// The peer at `address` numbers its later messages on a new stream, if `stream` is still
    /// its current one: a stream with a gap (a message whose number was spent but that was never
    /// sent) or that the peer found out of order would fail every later flush on it.
    pub(super) fn renew_stream(&mut self, address: &[u8], stream: u64) {
        if let Some(p) = self.peers.get_mut(address)
            && p.stream.id == stream
        {
            self.next_stream = self.next_stream.wrapping_add(1);
            p.stream = Rc::new(Stream {
                id: self.next_stream,
                seq: std::cell::Cell::new(0),
            });
            tracing::debug!(
                stream,
                "a KV message stream broke: the next pushes use a new one"
            );
        }
    }

    /// Sends `FLUSH` for `target` (whether every message of its stream so far arrived, in
    /// order, and landed) and waits for the answer with `done`, and for `reqs` too. When it
    /// cannot be sent, `done` is answered with the error (also returned).
    pub(super) fn send_flush(
        &mut self,
        target: u64,
        done: Waiter,
        mut reqs: Vec<Request>,
    ) -> Result<(), TransferError> {
        let Some(t) = self.targets.get(&target) else {
            let e = TransferError::UnknownTarget { id: target };
            self.answer(done, Err(e.clone()), &[]);
            return Err(e);
        };
        let ep = t.rkey.endpoint().clone();
        let token = self.next_token;
        self.next_token += 1;
        let header = Box::new(
            Header {
                kind: Kind::Flush,
                verdict: Verdict::Ok,
                stream: t.stream.id,
                seq: t.stream.seq.get(),
                target,
                addr: token,
                count: 0,
            }
            .encode(),
        );
        // SAFETY: header only (no data); the box is kept in `AwaitAck` until it completes.
        match unsafe {
            ep.am_send(
                am::AM_ID,
                &header[..],
                std::ptr::null(),
                0,
                ucx_sys::ffi::UCP_AM_SEND_FLAG_EAGER | ucx_sys::ffi::UCP_AM_SEND_FLAG_REPLY,
            )
        } {
            Ok(r) => reqs.extend(r),
            Err(e) => {
                let e = classify(&ep, &t.address, e);
                let address = t.address.clone();
                self.answer(done, Err(e.clone()), &address);
                return Err(e);
            }
        }
        let a = AwaitAck {
            token,
            done,
            ep,
            stream: t.stream.id,
            address: t.address.clone(),
            reqs,
            error: None,
            deadline: Instant::now() + am::ACK_TIMEOUT,
            _keep: (t.rkey.clone(), header),
        };
        self.awaiting.push(a);
        Ok(())
    }

    /// Answers whoever waited for an `ACK` from the peer at `address`.
    fn answer(&mut self, done: Waiter, r: Result<(), TransferError>, address: &[u8]) {
        match done {
            Waiter::Flush(done) => done.complete(r),
            Waiter::Connect { reply, target } => {
                if r.is_ok()
                    && let Some(p) = self.peers.get_mut(address)
                {
                    p.greeted = true;
                }
                // A failed connect, or one whose caller stopped waiting (its call timed out:
                // nobody will ever disconnect it), keeps no target.
                if r.is_err() || reply.send(r).is_err() {
                    self.targets.remove(&target);
                }
            }
        }
    }

    /// Completes the flushes whose `ACK` came, whose endpoint failed or whose deadline passed.
    pub(super) fn poll_acks(&mut self) {
        self.receiver.borrow_mut().reap_replies();
        if self.awaiting.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut i = 0;
        while i < self.awaiting.len() {
            let a = &mut self.awaiting[i];
            if let Some(e) = reap(&mut a.reqs)
                && a.error.is_none()
            {
                a.error = Some(classify(&a.ep, &a.address, e));
            }
            let mut disordered = None;
            let verdict = match a.error.take() {
                Some(e) => Some(Err(e)),
                None => match self.receiver.borrow_mut().take_ack(a.token) {
                    Some(ack) if a.reqs.is_empty() => {
                        if ack.0 == Verdict::Disorder {
                            disordered = Some(a.stream);
                        }
                        Some(ack_result(ack, &a.address))
                    }
                    Some(ack) => {
                        // The answer came before our own flush request finished: keep it.
                        self.receiver.borrow_mut().put_ack(a.token, ack);
                        None
                    }
                    None => match a.ep.failure() {
                        Some(f) => Some(Err(TransferError::PeerGone {
                            peer: peer_name(&a.address),
                            reason: f.to_string(),
                        })),
                        None if now >= a.deadline => Some(Err(TransferError::Timeout {
                            what: "the peer's answer to a KV flush".into(),
                        })),
                        None => None,
                    },
                },
            };
            match verdict {
                Some(r) => {
                    let a = self.awaiting.swap_remove(i);
                    if let Some(stream) = disordered {
                        self.renew_stream(&a.address, stream);
                    }
                    self.answer(a.done, r, &a.address);
                }
                None => i += 1,
            }
        }
    }
}

/// What a flush's `ACK` means for its caller.
fn ack_result((verdict, refused): (Verdict, u64), address: &[u8]) -> Result<(), TransferError> {
    match verdict {
        Verdict::Ok => Ok(()),
        Verdict::Refused => Err(TransferError::Refused {
            peer: peer_name(address),
            reason: format!(
                "{refused} bytes fell outside its registered host memory (a region already \
                 released, or a span it never granted)"
            ),
        }),
        Verdict::Disorder => Err(TransferError::Refused {
            peer: peer_name(address),
            reason: "the KV messages did not all arrive, in order".into(),
        }),
    }
}
