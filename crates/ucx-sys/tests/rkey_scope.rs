//! What an rkey bounds, measured on real UCX rather than assumed: over `tcp` the receiving side
//! writes a put wherever its header says, so a put made with the rkey of one small registered
//! region lands in memory outside any registration. This is why pdnode does not narrow the
//! decode arena's rkey to one reservation (it would bound nothing on tcp, and on `cuda_ipc` the
//! peer maps the whole allocation) and why the KV plane must be reachable only from the cluster's
//! nodes (docs/runtime-semantics.md, "Trust"). If a UCX release starts checking, this test fails
//! and that paragraph must be revisited. Skips (with a message) only when libucp cannot be loaded.

use std::time::{Duration, Instant};
use ucx_sys::{Context, Endpoint, MemHandle, MemoryType, RemoteKey, Request, Ucp, Worker};

fn drive(workers: &[&std::rc::Rc<Worker>], reqs: Vec<Option<Request>>) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut pending = reqs;
    while pending.iter().any(|r| {
        r.as_ref()
            .is_some_and(|r| matches!(r.state(), ucx_sys::RequestState::InProgress))
    }) {
        assert!(Instant::now() < deadline, "put/flush timed out");
        for w in workers {
            w.progress();
        }
    }
    for r in pending.iter_mut() {
        if let Some(r) = r.take()
            && let ucx_sys::RequestState::Done(res) = r.state()
        {
            res.unwrap();
        }
    }
}

#[test]
fn over_tcp_a_put_lands_outside_the_rkeys_registration() {
    let ucp = match Ucp::load(None) {
        Ok(u) => u,
        Err(e) => {
            eprintln!("SKIP: libucp not loadable: {e}");
            return;
        }
    };
    let tcp = [("NET_DEVICES", "lo"), ("TLS", "tcp")];
    // Two contexts, as two processes would have: nothing is shared but the wire.
    let victim_ctx = Context::new(ucp.clone(), "victim", &tcp).unwrap();
    let writer_ctx = Context::new(ucp.clone(), "writer", &tcp).unwrap();
    let victim = Worker::new(&victim_ctx).unwrap();
    let writer = Worker::new(&writer_ctx).unwrap();

    // The victim registers one page (a "reservation") inside a larger buffer (an "arena") and
    // keeps an unrelated buffer it never registers.
    let mut arena = vec![0u8; 64 << 10];
    let reservation = &mut arena[16 << 10..20 << 10];
    // SAFETY: `arena` outlives the handle (dropped before it at the end of the test).
    let mh = unsafe {
        MemHandle::map(
            &victim_ctx,
            reservation.as_mut_ptr(),
            reservation.len(),
            MemoryType::Host,
        )
    }
    .unwrap();
    let packed = mh.pack_rkey().unwrap();
    let mut unregistered = vec![0u8; 4096];

    let ep = Endpoint::connect(&writer, &victim.address().unwrap(), true).unwrap();
    let rkey = RemoteKey::unpack(&ep, &packed).unwrap();
    let payload = [0xA5u8; 64];

    // Inside the registration: lands, as it should.
    // SAFETY: payload lives until the requests complete (driven below).
    let put = unsafe { ep.put(payload.as_ptr(), 64, mh.addr(), &rkey, MemoryType::Host) }.unwrap();
    let flush = ep.flush().unwrap();
    drive(&[&writer, &victim], vec![put, flush]);
    assert_eq!(&arena[16 << 10..(16 << 10) + 64], &payload[..]);

    // Same rkey, addresses it was never issued for: the arena beside the reservation, and a buffer
    // the victim never registered. Both land.
    // Raw, writable addresses: the writes below arrive through UCX, behind Rust's back.
    let beside = arena.as_mut_ptr() as u64 + (40 << 10);
    let elsewhere = unregistered.as_mut_ptr() as u64 + 128;
    for addr in [beside, elsewhere] {
        // SAFETY: as above.
        let put = unsafe { ep.put(payload.as_ptr(), 64, addr, &rkey, MemoryType::Host) }.unwrap();
        let flush = ep.flush().unwrap();
        drive(&[&writer, &victim], vec![put, flush]);
    }
    assert_eq!(
        &arena[40 << 10..(40 << 10) + 64],
        &payload[..],
        "UCX's tcp transport now bounds a put by its rkey: revisit docs/runtime-semantics.md"
    );
    assert_eq!(&unregistered[128..192], &payload[..]);
    drop(rkey);
    drop(ep);
    drop(mh);
    drop(arena);
}
