//! Real UCX in one process: two workers, a put through an endpoint, flush, compare bytes.
//! Skips (with a message) only when libucp cannot be loaded.

use std::time::{Duration, Instant};
use ucx_sys::{Context, Endpoint, MemHandle, MemoryType, RemoteKey, Ucp, UcxError, Worker};

#[test]
fn missing_library_is_an_error_not_a_panic() {
    let err = Ucp::load(Some("/nonexistent/libucp.so.0"))
        .err()
        .expect("must fail");
    assert!(matches!(err, UcxError::LibraryNotFound { .. }), "{err}");
}

#[test]
fn put_between_two_workers_moves_the_bytes() {
    let ucp = match Ucp::load(None) {
        Ok(u) => u,
        Err(e) => {
            eprintln!("SKIP: libucp not loadable: {e}");
            return;
        }
    };
    let (major, minor, _) = ucp.version();
    assert!(major >= 1 && minor >= 13, "UCX {major}.{minor}");
    let ctx = Context::new(ucp.clone(), "ucx-sys-test", &[("NET_DEVICES", "lo")]).unwrap();
    let a = Worker::new(&ctx).unwrap();
    let b = Worker::new(&ctx).unwrap();
    assert!(a.event_fd().unwrap() >= 0);

    let len = 1 << 20;
    let src: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    let mut dst = vec![0u8; len];
    // SAFETY: dst outlives the handle (dropped at the end of the test, after `mh`).
    let mh = unsafe { MemHandle::map(&ctx, dst.as_mut_ptr(), len, MemoryType::Host) }.unwrap();
    let packed = mh.pack_rkey().unwrap();
    let ep = Endpoint::connect(&a, &b.address().unwrap(), true).unwrap();
    let rkey = RemoteKey::unpack(&ep, &packed).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    // SAFETY: src lives until the request completes (waited on below).
    let put = unsafe { ep.put(src.as_ptr(), len, mh.addr(), &rkey, MemoryType::Host) }.unwrap();
    let flush = ep.flush().unwrap();
    // Both workers need progress (tcp needs the target side to make progress).
    let mut pending = [put, flush];
    while pending.iter().any(|r| {
        r.as_ref()
            .is_some_and(|r| matches!(r.state(), ucx_sys::RequestState::InProgress))
    }) {
        assert!(Instant::now() < deadline, "put/flush timed out");
        a.progress();
        b.progress();
    }
    for r in pending.iter_mut() {
        if let Some(r) = r.take()
            && let ucx_sys::RequestState::Done(res) = r.state()
        {
            res.unwrap();
        }
    }
    assert!(dst == src, "bytes differ after put + flush");
    drop(rkey);
    drop(ep);
    drop(mh);
}
