//! The UCX transport through the `KvTransport` trait: two transports (two worker threads) in one
//! process, real UCX on loopback. Skips with a message only when libucp cannot be loaded.

use pdnode_transfer::{
    KvTransport, LocalRegion, Span, TransferError, TransportKind, UcxConfig, UcxTransport,
};
use std::time::{Duration, Instant};

mod common;
use common::{deadline, start};

fn round_trip(tls: &str, allocated_target: bool) {
    let (Some(a), Some(b)) = (start("a", tls), start("b", tls)) else {
        return;
    };
    assert_eq!(a.kind(), TransportKind::Ucx);
    let len = 4 << 20;
    let mut src: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
    let mut own_dst = vec![0u8; len];
    // SAFETY: src and own_dst outlive the registrations (dropped at the end of this function,
    // after every completion was waited for).
    let src_reg = unsafe { a.register(LocalRegion::host(&mut src)) }.unwrap();
    let dst_reg = if allocated_target {
        b.allocate_registered(len).unwrap()
    } else {
        // SAFETY: as above.
        unsafe { b.register(LocalRegion::host(&mut own_dst)) }.unwrap()
    };
    let target = a.connect(&b.local_address(), dst_reg.descriptor()).unwrap();
    // Two spans, reordered: [1 MiB..3 MiB) -> 0, [0..1 MiB) -> 3 MiB.
    let mib = 1u64 << 20;
    let spans = [
        Span {
            local_offset: mib,
            remote_offset: 0,
            len: 2 * mib,
        },
        Span {
            local_offset: 0,
            remote_offset: 3 * mib,
            len: mib,
        },
    ];
    a.put(&src_reg, &target, &spans)
        .unwrap()
        .wait(deadline())
        .unwrap();
    a.flush(&target).unwrap().wait(deadline()).unwrap();
    let r = dst_reg.region();
    // SAFETY: the destination region is registered (alive) and the writer flushed.
    let dst = unsafe { std::slice::from_raw_parts(r.addr as *const u8, r.len) };
    let m = mib as usize;
    assert!(dst[..2 * m] == src[m..3 * m], "first span differs");
    assert!(dst[3 * m..4 * m] == src[..m], "second span differs");
    // Host to host never goes by UCX RMA (docs/protocol.md section 6): over tcp the receiver
    // places messages; into shared memory UCX allocated, the sender copies into its mapping.
    let paths = a.paths();
    assert_eq!(paths.rma, 0, "{paths:?}");
    if tls == "tcp" {
        assert_eq!((paths.messages, paths.direct), (1, 0), "{paths:?}");
    } else if allocated_target {
        assert_eq!((paths.messages, paths.direct), (0, 1), "{paths:?}");
    }
    // Out-of-range spans are refused before any put.
    let bad = [Span {
        local_offset: 0,
        remote_offset: 4 * mib - 8,
        len: 16,
    }];
    assert!(matches!(
        a.put(&src_reg, &target, &bad),
        Err(TransferError::SpanOutOfRange { side: "remote", .. })
    ));
    drop(target);
    drop(dst_reg);
    drop(src_reg);
}

#[test]
fn put_and_flush_over_tcp_into_a_registered_buffer() {
    round_trip("tcp", false);
}

#[test]
fn put_and_flush_over_shared_memory_into_ucx_allocated_staging() {
    round_trip("sm,self", true);
}

#[test]
fn empty_or_oversized_descriptors_are_refused() {
    let Some(a) = start("c", "tcp") else {
        return;
    };
    let region = |rkey: Vec<u8>| pdnode_transfer::RemoteRegion {
        base_addr: 4096,
        len: 64,
        rkey,
    };
    assert!(matches!(
        a.connect(&a.local_address(), &region(vec![])),
        Err(TransferError::InvalidDescriptor { .. })
    ));
    assert!(matches!(
        a.connect(&a.local_address(), &region(vec![0; 1 << 20])),
        Err(TransferError::InvalidDescriptor { .. })
    ));
    assert!(a.connect(&[], &region(vec![1, 2, 3])).is_err());
}

#[test]
fn missing_library_is_a_clear_error() {
    let e = UcxTransport::start(UcxConfig {
        library: Some("/nonexistent/libucp.so.0".into()),
        ..UcxConfig::default()
    })
    .err()
    .expect("must fail");
    assert!(e.to_string().contains("UCX library not found"), "{e}");
}

/// Sequential requests to one peer reuse its endpoint (and unpacked key): reconnecting per
/// request dropped what UCX cached for the peer (CUDA IPC mappings: ~17 ms per GPU hand-off).
/// A second peer gets its own endpoint; data still lands every time.
#[test]
fn sequential_requests_to_one_peer_reuse_its_endpoint() {
    let (Some(a), Some(b), Some(c)) = (start("a", "tcp"), start("b", "tcp"), start("c", "tcp"))
    else {
        return;
    };
    let len = 1 << 20;
    let mut src = vec![0u8; len];
    let mut dst_b = vec![0u8; len];
    let mut dst_c = vec![0u8; len];
    // SAFETY: the buffers outlive the registrations (dropped at the end of this function, after
    // every completion was waited for).
    let src_reg = unsafe { a.register(LocalRegion::host(&mut src)) }.unwrap();
    // SAFETY: as above.
    let reg_b = unsafe { b.register(LocalRegion::host(&mut dst_b)) }.unwrap();
    // SAFETY: as above.
    let reg_c = unsafe { c.register(LocalRegion::host(&mut dst_c)) }.unwrap();
    let span = [Span {
        local_offset: 0,
        remote_offset: 0,
        len: len as u64,
    }];
    let (rs, rb) = (src_reg.region(), reg_b.region());
    for round in 0..4u8 {
        // SAFETY: the source region is registered (alive) and no operation on it is in flight.
        unsafe { std::ptr::write_bytes(rs.addr as *mut u8, round + 1, rs.len) };
        let target = a.connect(&b.local_address(), reg_b.descriptor()).unwrap();
        a.put(&src_reg, &target, &span)
            .unwrap()
            .wait(deadline())
            .unwrap();
        a.flush(&target).unwrap().wait(deadline()).unwrap();
        drop(target);
        // SAFETY: the destination region is registered (alive) and the writer flushed.
        let got = unsafe { std::slice::from_raw_parts(rb.addr as *const u8, rb.len) };
        assert!(
            got.iter().all(|&x| x == round + 1),
            "round {round}: data differs"
        );
        assert_eq!(
            a.endpoints_created(),
            1,
            "round {round}: the endpoint to b was not kept"
        );
    }
    let target = a.connect(&c.local_address(), reg_c.descriptor()).unwrap();
    a.put(&src_reg, &target, &span)
        .unwrap()
        .wait(deadline())
        .unwrap();
    a.flush(&target).unwrap().wait(deadline()).unwrap();
    assert_eq!(
        a.endpoints_created(),
        2,
        "a second peer needs its own endpoint"
    );
    drop(target);
    drop((src_reg, reg_b, reg_c));
}

/// A gated put leaves only once its gate opens (the data written after the put was submitted
/// arrives), a failing gate fails the put with its reason, and a gate that never opens fails at
/// the deadline; nothing hangs.
#[test]
fn gated_puts_wait_for_their_gate() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    let (Some(a), Some(b)) = (start("a", "tcp"), start("b", "tcp")) else {
        return;
    };
    let len = 1 << 20;
    let mut src = vec![0u8; len];
    let mut dst = vec![0u8; len];
    // SAFETY: the buffers outlive the registrations (dropped at the end of this function, after
    // every completion was waited for).
    let src_reg = unsafe { a.register(LocalRegion::host(&mut src)) }.unwrap();
    // SAFETY: as above.
    let dst_reg = unsafe { b.register(LocalRegion::host(&mut dst)) }.unwrap();
    let target = a.connect(&b.local_address(), dst_reg.descriptor()).unwrap();
    let span = [Span {
        local_offset: 0,
        remote_offset: 0,
        len: len as u64,
    }];
    let (rs, rd) = (src_reg.region(), dst_reg.region());
    let open = Arc::new(AtomicBool::new(false));
    let polls = Arc::new(AtomicU32::new(0));
    let (o, n) = (open.clone(), polls.clone());
    let gate = Box::new(move || {
        n.fetch_add(1, Ordering::Relaxed);
        Ok(o.load(Ordering::Acquire))
    });
    let put = a
        .put_when(&src_reg, &target, &span, gate, deadline())
        .unwrap();
    // The gate is polled and the put does not complete while it is closed.
    let t = Instant::now() + Duration::from_secs(10);
    while polls.load(Ordering::Relaxed) < 3 {
        assert!(Instant::now() < t, "the gate was never polled");
        std::thread::yield_now();
    }
    assert!(
        put.try_result().is_none(),
        "a put went out with its gate closed"
    );
    // A flush covers the gated put: it waits for it to go out.
    let flush = a.flush(&target).unwrap();
    let seen = polls.load(Ordering::Relaxed);
    while polls.load(Ordering::Relaxed) < seen + 3 {
        assert!(Instant::now() < t, "the gate was not polled any more");
        std::thread::yield_now();
    }
    assert!(
        flush.try_result().is_none(),
        "a flush completed before the gated put it covers went out"
    );
    // The data is written only now, then the gate opens: what lands is the new data.
    // SAFETY: the source region is registered (alive) and no put reads it yet (gate closed).
    unsafe { std::ptr::write_bytes(rs.addr as *mut u8, 0x5a, rs.len) };
    open.store(true, Ordering::Release);
    put.wait(deadline()).unwrap();
    flush.wait(deadline()).unwrap();
    // SAFETY: the destination region is registered (alive) and the writer flushed.
    let got = unsafe { std::slice::from_raw_parts(rd.addr as *const u8, rd.len) };
    assert!(
        got.iter().all(|&x| x == 0x5a),
        "the gated put carried stale data"
    );
    // A failing gate fails the put with its reason.
    let failing = Box::new(|| Err("the gather failed".into()));
    let e = a
        .put_when(&src_reg, &target, &span, failing, deadline())
        .unwrap()
        .wait(deadline())
        .unwrap_err();
    assert!(e.to_string().contains("the gather failed"), "{e}");
    // A gate that never opens fails at its deadline, not later.
    let never = Box::new(|| Ok(false));
    let soon = Instant::now() + Duration::from_millis(50);
    let e = a
        .put_when(&src_reg, &target, &span, never, soon)
        .unwrap()
        .wait(deadline())
        .unwrap_err();
    assert!(matches!(e, TransferError::Timeout { .. }), "{e}");
    drop(target);
    drop((src_reg, dst_reg));
}
