//! Receiver-placed puts over UCX active messages, for host-memory targets.
//!
//! UCP RMA over a transport without hardware RMA (`tcp`: every UCX 1.13 put there) is
//! *software* RMA: the target's worker copies the bytes and answers each put with a completion
//! message, and when that answer meets an endpoint that failed (the writer was killed, the link
//! cut) UCX aborts the whole process (`ucp_request.inl`: "Fatal: unexpected error: Endpoint
//! timeout"; the same code in UCX 1.19). A decode node must not die because a prefill node did,
//! so puts into host memory travel as eager active messages that this module places itself:
//!
//! - `DATA` carries the destination address (the peer's registered base plus the span's offset),
//!   the sender's stream and sequence number and the sender's target id; the receiver copies the
//!   bytes only if they lie inside a host region registered on *its* worker right now (a region
//!   deregistered because its request ended takes no more bytes), and only if the sequence number
//!   is the next of its stream. Nothing is answered: a dead sender costs the receiver nothing.
//! - `FLUSH` (sent with a reply endpoint) asks whether every `DATA` of the stream up to its
//!   sequence number arrived in order and whether any of the target's was refused; the receiver
//!   answers `ACK` with the verdict. A flush completes only on that answer, so it still means
//!   "the bytes are in place at the peer". An answer that cannot be sent is dropped (the
//!   flush's owner times out or sees the endpoint fail); it never aborts anything.
//!
//! Device memory still goes by UCX RMA (`cuda_ipc`, RDMA: hardware RMA, no reply from the
//! target). See docs/protocol.md ("KV bytes on the wire").

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::rc::Rc;
use std::time::{Duration, Instant};
use ucx_sys::ffi::{
    UCP_AM_RECV_ATTR_FIELD_REPLY_EP, UCP_AM_RECV_ATTR_FLAG_RNDV, UCP_AM_SEND_FLAG_EAGER,
    UCS_ERR_UNSUPPORTED, UCS_OK, ucp_am_recv_param_t, ucs_status_t,
};
use ucx_sys::{Request, RequestState, Worker};

/// The active-message id pdnode's KV messages use.
pub(crate) const AM_ID: u32 = 0x5044;

/// The descriptor "rkey" of a host region written by active messages: no UCX rkey is handed
/// out for host memory at all.
pub(crate) const AM_TOKEN: &[u8] = b"pdnode-am/1";

/// Largest `DATA` message: a span is cut into pieces of at most this many bytes (the receiver
/// reassembles each message before its handler runs).
pub(crate) const CHUNK: usize = 1 << 20;

/// How long a flush waits for its `ACK` once sent (a peer that is alive answers in
/// microseconds; a dead one fails the endpoint first).
pub(crate) const ACK_TIMEOUT: Duration = Duration::from_secs(60);

/// Streams remembered by a receiver at most; the least recently used go first.
const MAX_STREAMS: usize = 1024;
/// Per-(stream, target) refusal records kept at most.
const MAX_REFUSALS: usize = 4096;

const MAGIC: [u8; 4] = *b"PDKV";
const VERSION: u8 = 1;
pub(crate) const HEADER_LEN: usize = 48;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Data = 1,
    Flush = 2,
    Ack = 3,
}

/// The verdict an `ACK` carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    Ok = 0,
    /// Some of the target's bytes fell outside the receiver's registered host memory.
    Refused = 1,
    /// The stream's messages did not arrive one after the other (or some never did).
    Disorder = 2,
}

/// One message header, `HEADER_LEN` bytes little-endian: magic, version, kind, verdict, 1
/// reserved byte, stream, seq, target, addr (DATA: destination; FLUSH/ACK: token), count
/// (ACK: refused bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: Kind,
    pub verdict: Verdict,
    pub stream: u64,
    pub seq: u64,
    pub target: u64,
    pub addr: u64,
    pub count: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.kind as u8;
        b[6] = self.verdict as u8;
        for (i, v) in [self.stream, self.seq, self.target, self.addr, self.count]
            .into_iter()
            .enumerate()
        {
            b[8 + i * 8..16 + i * 8].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// `None` for anything that is not a header of this version.
    pub fn decode(b: &[u8]) -> Option<Header> {
        if b.len() != HEADER_LEN || b[0..4] != MAGIC || b[4] != VERSION {
            return None;
        }
        let kind = match b[5] {
            1 => Kind::Data,
            2 => Kind::Flush,
            3 => Kind::Ack,
            _ => return None,
        };
        let verdict = match b[6] {
            0 => Verdict::Ok,
            1 => Verdict::Refused,
            2 => Verdict::Disorder,
            _ => return None,
        };
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[8 + i * 8..16 + i * 8]);
            u64::from_le_bytes(w)
        };
        Some(Header {
            kind,
            verdict,
            stream: word(0),
            seq: word(1),
            target: word(2),
            addr: word(3),
            count: word(4),
        })
    }
}

struct StreamIn {
    /// Sequence number of the last `DATA` accepted in order (0: none yet).
    last: u64,
    disorder: bool,
    used: Instant,
}

/// A refusal recorded for one (stream, target) until its flush reports it.
struct Refusal {
    bytes: u64,
    first: String,
}

/// Host regions registered on one worker: start -> length.
#[derive(Debug, Default)]
pub(crate) struct HostRegions(BTreeMap<u64, u64>);

impl HostRegions {
    pub fn insert(&mut self, addr: u64, len: u64) {
        self.0.insert(addr, len);
    }

    pub fn remove(&mut self, addr: u64) {
        self.0.remove(&addr);
    }

    /// Whether `len` bytes at `addr` lie inside one region.
    pub fn contain(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        self.0
            .range(..=addr)
            .next_back()
            .is_some_and(|(start, l)| start.checked_add(*l).is_some_and(|e| end <= e))
    }
}

/// What the active-message handler of one worker knows and records. Lives on the worker's
/// thread; the handler reaches it through a raw pointer that outlives the worker.
pub(crate) struct Receiver {
    worker: Rc<Worker>,
    regions: HostRegions,
    streams: HashMap<u64, StreamIn>,
    refusals: HashMap<(u64, u64), Refusal>,
    /// `ACK`s received for this worker's flushes: token -> (verdict, refused bytes).
    acks: HashMap<u64, (Verdict, u64)>,
    /// `ACK`s being sent: their buffers stay alive until UCX is done with them.
    replies: Vec<(Box<[u8; HEADER_LEN]>, Request)>,
    /// Messages dropped because they were malformed (not a header of ours, or rendezvous).
    pub malformed: u64,
    /// Bytes refused (outside registered host memory).
    pub refused_bytes: u64,
}

impl Receiver {
    pub fn new(worker: Rc<Worker>) -> Rc<RefCell<Receiver>> {
        Rc::new(RefCell::new(Receiver {
            worker,
            regions: HostRegions::default(),
            streams: HashMap::new(),
            refusals: HashMap::new(),
            acks: HashMap::new(),
            replies: Vec::new(),
            malformed: 0,
            refused_bytes: 0,
        }))
    }

    pub fn add_region(&mut self, addr: u64, len: u64) {
        self.regions.insert(addr, len);
    }

    pub fn remove_region(&mut self, addr: u64) {
        self.regions.remove(addr);
    }

    /// Takes the `ACK` of `token`, if it arrived.
    pub fn take_ack(&mut self, token: u64) -> Option<(Verdict, u64)> {
        self.acks.remove(&token)
    }

    /// Puts back an `ACK` taken too early.
    pub fn put_ack(&mut self, token: u64, ack: (Verdict, u64)) {
        self.acks.insert(token, ack);
    }

    /// Drops every reply in flight (shutdown).
    pub fn replies_clear(&mut self) {
        self.replies.clear();
    }

    /// Drops the reply buffers UCX is done with.
    pub fn reap_replies(&mut self) {
        self.replies
            .retain(|(_, r)| matches!(r.state(), RequestState::InProgress));
    }

    fn stream(&mut self, id: u64) -> &mut StreamIn {
        if !self.streams.contains_key(&id) && self.streams.len() >= MAX_STREAMS {
            let oldest = self
                .streams
                .iter()
                .min_by_key(|(_, s)| s.used)
                .map(|(k, _)| *k);
            if let Some(k) = oldest {
                self.streams.remove(&k);
            }
        }
        let s = self.streams.entry(id).or_insert(StreamIn {
            last: 0,
            disorder: false,
            used: Instant::now(),
        });
        s.used = Instant::now();
        s
    }

    fn refuse(&mut self, h: &Header, len: u64, why: String) {
        self.refused_bytes += len;
        if !self.refusals.contains_key(&(h.stream, h.target)) && self.refusals.len() >= MAX_REFUSALS
        {
            self.refusals.clear();
        }
        let r = self
            .refusals
            .entry((h.stream, h.target))
            .or_insert(Refusal {
                bytes: 0,
                first: why.clone(),
            });
        r.bytes += len;
        tracing::warn!(reason = %why, "KV message refused");
    }

    /// Handles `DATA`: returns after copying the bytes into place, or refusing them.
    fn data(&mut self, h: &Header, data: *const u8, len: usize) {
        let s = self.stream(h.stream);
        if h.seq != s.last + 1 {
            s.disorder = true;
        } else {
            s.last = h.seq;
        }
        if !self.regions.contain(h.addr, len as u64) {
            let why = format!(
                "{len} bytes at {:#x} are outside this node's registered host memory",
                h.addr
            );
            return self.refuse(h, len as u64, why);
        }
        if len > 0 {
            // SAFETY: `data` holds `len` bytes (UCX, whole message); the destination lies inside
            // a region registered on this worker, whose owner keeps it allocated until its
            // deregistration, which runs on this thread (so not during this copy). The regions
            // are distinct memory from UCX's receive buffer.
            unsafe { std::ptr::copy_nonoverlapping(data, h.addr as *mut u8, len) };
        }
    }

    /// Handles `FLUSH`: answers `ACK` on `reply_ep`.
    fn flush(&mut self, h: &Header, reply_ep: Option<ucx_sys::ffi::ucp_ep_h>) {
        let s = self.stream(h.stream);
        let verdict_in_order = !s.disorder && s.last >= h.seq;
        let refusal = self.refusals.remove(&(h.stream, h.target));
        let (verdict, count) = match (verdict_in_order, refusal) {
            (false, _) => (Verdict::Disorder, 0),
            (true, Some(r)) => {
                tracing::warn!(bytes = r.bytes, first = %r.first, "flush reports refused KV bytes");
                (Verdict::Refused, r.bytes)
            }
            (true, None) => (Verdict::Ok, 0),
        };
        let Some(ep) = reply_ep else {
            self.malformed += 1;
            return;
        };
        let ack = Box::new(
            Header {
                kind: Kind::Ack,
                verdict,
                stream: h.stream,
                seq: h.seq,
                target: h.target,
                addr: h.addr,
                count,
            }
            .encode(),
        );
        // SAFETY: `ep` is the reply endpoint UCX handed to the handler running now; the header
        // box is kept in `replies` until the request completes (or dropped at once when the send
        // completed immediately).
        match unsafe {
            ucx_sys::am_send_raw(
                &self.worker,
                ep,
                AM_ID,
                &ack[..],
                std::ptr::null(),
                0,
                UCP_AM_SEND_FLAG_EAGER,
            )
        } {
            Ok(Some(req)) => self.replies.push((ack, req)),
            Ok(None) => {}
            Err(e) => tracing::debug!(error = %e, "KV flush answer not sent (peer gone?)"),
        }
    }

    fn ack(&mut self, h: &Header) {
        self.acks.insert(h.addr, (h.verdict, h.count));
    }
}

/// The active-message handler: `arg` is the worker's `RefCell<Receiver>`.
pub(crate) unsafe extern "C" fn handler(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    if arg.is_null() || param.is_null() {
        return UCS_OK;
    }
    // SAFETY: arg is the Receiver the worker thread registered, alive until after the worker is
    // destroyed; the handler runs inside that thread's ucp_worker_progress, while no other
    // borrow of the cell is held (progress is never called with one held).
    let cell = unsafe { &*(arg as *const RefCell<Receiver>) };
    let Ok(mut rx) = cell.try_borrow_mut() else {
        return UCS_OK;
    };
    // SAFETY: UCX passes a valid parameter struct.
    let param = unsafe { &*param };
    let h = if header.is_null() || header_length != HEADER_LEN {
        None
    } else {
        // SAFETY: UCX passes `header_length` readable bytes.
        Header::decode(unsafe { std::slice::from_raw_parts(header as *const u8, header_length) })
    };
    let Some(h) = h else {
        rx.malformed += 1;
        return if param.recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV != 0 {
            UCS_ERR_UNSUPPORTED
        } else {
            UCS_OK
        };
    };
    if param.recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV != 0 {
        // pdnode sends eager only; a rendezvous message is not ours to accept.
        rx.malformed += 1;
        rx.refuse(&h, length as u64, "a rendezvous KV message".into());
        return UCS_ERR_UNSUPPORTED;
    }
    match h.kind {
        Kind::Data => rx.data(&h, data as *const u8, length),
        Kind::Flush => {
            let ep = (param.recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP != 0
                && !param.reply_ep.is_null())
            .then_some(param.reply_ep);
            rx.flush(&h, ep)
        }
        Kind::Ack => rx.ack(&h),
    }
    UCS_OK
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_span_must_lie_inside_one_registered_region() {
        let mut r = HostRegions::default();
        r.insert(1000, 100);
        r.insert(1100, 50);
        assert!(r.contain(1000, 100));
        assert!(r.contain(1099, 1));
        assert!(r.contain(1100, 50));
        assert!(!r.contain(1050, 100), "two adjacent regions are not one");
        assert!(!r.contain(999, 2));
        assert!(!r.contain(1149, 2));
        assert!(!r.contain(u64::MAX - 1, 5), "overflow");
        r.remove(1000);
        assert!(!r.contain(1000, 1), "a removed region takes nothing");
        assert!(r.contain(1100, 0));
    }

    #[test]
    fn headers_round_trip_and_reject_what_is_not_one() {
        let h = Header {
            kind: Kind::Flush,
            verdict: Verdict::Refused,
            stream: 0x0102_0304_0506_0708,
            seq: 9,
            target: 10,
            addr: u64::MAX,
            count: 77,
        };
        let b = h.encode();
        assert_eq!(Header::decode(&b), Some(h));
        assert_eq!(Header::decode(&b[..HEADER_LEN - 1]), None);
        let mut bad = b;
        bad[0] = b'X';
        assert_eq!(Header::decode(&bad), None);
        let mut bad = b;
        bad[4] = 2;
        assert_eq!(Header::decode(&bad), None);
        let mut bad = b;
        bad[5] = 9;
        assert_eq!(Header::decode(&bad), None);
        let mut bad = b;
        bad[6] = 3;
        assert_eq!(Header::decode(&bad), None);
    }
}
