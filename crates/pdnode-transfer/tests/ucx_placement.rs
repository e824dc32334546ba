//! Puts into host memory are placed by the receiver (active messages, `ucx::am`): bytes aimed
//! outside the receiver's registered host memory are refused and reported by the flush, and a
//! writer killed in the middle of its puts costs the receiver nothing (UCX's software RMA, which
//! this replaced, aborted the receiving process there: the decode crash of the fault matrix's
//! prefill-kill-pushing case). Real UCX on loopback; skips only when libucp cannot be loaded.

use pdnode_transfer::{KvTransport, LocalRegion, RemoteRegion, Span, TransferError, UcxTransport};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

mod common;
use common::deadline;

fn start(name: &str) -> Option<UcxTransport> {
    common::start(name, "tcp")
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// A released region takes no more bytes: the put's flush fails with `Refused` and the memory
/// (still allocated here, so it can be read) is untouched. The same target's next put into a
/// live region still works: one refusal does not poison the stream.
#[test]
fn bytes_for_a_released_region_are_refused_and_not_written() {
    let (Some(a), Some(b)) = (start("a"), start("b")) else {
        return;
    };
    let len = 3 << 20; // more than one message
    let mut src = vec![7u8; len];
    let mut released = vec![0u8; len];
    let mut live = vec![0u8; len];
    // SAFETY: the buffers outlive the registrations (dropped below, after the completions).
    let src_reg = unsafe { a.register(LocalRegion::host(&mut src)) }.unwrap();
    // SAFETY: as above.
    let gone = unsafe { b.register(LocalRegion::host(&mut released)) }.unwrap();
    // SAFETY: as above.
    let kept = unsafe { b.register(LocalRegion::host(&mut live)) }.unwrap();
    let span = [Span {
        local_offset: 0,
        remote_offset: 0,
        len: len as u64,
    }];
    let to_gone = a.connect(&b.local_address(), gone.descriptor()).unwrap();
    drop(gone);
    a.put(&src_reg, &to_gone, &span)
        .unwrap()
        .wait(deadline())
        .unwrap();
    let e = a.flush(&to_gone).unwrap().wait(deadline()).unwrap_err();
    assert!(
        matches!(e, TransferError::Refused { .. }) && e.to_string().contains("outside"),
        "{e}"
    );
    assert!(
        released.iter().all(|&x| x == 0),
        "a released region was written"
    );

    let to_live = a.connect(&b.local_address(), kept.descriptor()).unwrap();
    a.put(&src_reg, &to_live, &span)
        .unwrap()
        .wait(deadline())
        .unwrap();
    a.flush(&to_live).unwrap().wait(deadline()).unwrap();
    assert!(
        live.iter().all(|&x| x == 7),
        "the live region did not get its bytes"
    );
    drop((to_gone, to_live, kept, src_reg));
}

/// A descriptor naming memory the receiver never registered (a forged base address) gets
/// nothing written there either.
#[test]
fn a_forged_base_address_is_refused() {
    let (Some(a), Some(b)) = (start("a"), start("b")) else {
        return;
    };
    let mut src = vec![9u8; 4096];
    let mut dst = vec![0u8; 4096];
    let mut victim = vec![0u8; 4096];
    // SAFETY: the buffers outlive the registrations.
    let src_reg = unsafe { a.register(LocalRegion::host(&mut src)) }.unwrap();
    // SAFETY: as above.
    let dst_reg = unsafe { b.register(LocalRegion::host(&mut dst)) }.unwrap();
    let forged = RemoteRegion {
        base_addr: victim.as_mut_ptr() as u64,
        ..dst_reg.descriptor().clone()
    };
    let t = a.connect(&b.local_address(), &forged).unwrap();
    let span = [Span {
        local_offset: 0,
        remote_offset: 0,
        len: 4096,
    }];
    a.put(&src_reg, &t, &span)
        .unwrap()
        .wait(deadline())
        .unwrap();
    let e = a.flush(&t).unwrap().wait(deadline()).unwrap_err();
    assert!(matches!(e, TransferError::Refused { .. }), "{e}");
    assert!(
        victim.iter().all(|&x| x == 0),
        "memory never registered was written"
    );
    drop((t, dst_reg, src_reg));
}

/// The child half of the next test: connects to the receiver named in the environment, issues
/// puts without waiting for them, says so, and waits to be killed. A no-op in a normal run.
#[test]
fn writer_child() {
    let Ok(spec) = std::env::var("PDNODE_TEST_UCX_WRITER") else {
        return;
    };
    let parts: Vec<&str> = spec.split(':').collect();
    let (address, rkey) = (unhex(parts[0]), unhex(parts[1]));
    let (base, len): (u64, u64) = (parts[2].parse().unwrap(), parts[3].parse().unwrap());
    let a = start("writer").expect("libucp");
    let mut src = vec![0x5au8; len as usize];
    // SAFETY: src outlives the registration (the process is killed while both live).
    let reg = unsafe { a.register(LocalRegion::host(&mut src)) }.unwrap();
    let t = a
        .connect(
            &address,
            &RemoteRegion {
                base_addr: base,
                len,
                rkey,
            },
        )
        .unwrap();
    let mut inflight = Vec::new();
    for _ in 0..8 {
        let span = [Span {
            local_offset: 0,
            remote_offset: 0,
            len,
        }];
        inflight.push(a.put(&reg, &t, &span).unwrap());
    }
    // libtest prints "test writer_child ... " before a test's own output under --nocapture.
    println!("issued");
    std::thread::sleep(Duration::from_secs(60));
}

/// A writer SIGKILLed while its puts stream in: the receiving process lives on (before, UCX
/// aborted it answering the dead writer's puts), and takes another writer's puts afterwards.
#[test]
fn the_receiver_outlives_a_writer_killed_mid_put() {
    let Some(b) = start("b") else {
        return;
    };
    let len = 16usize << 20;
    let dst = b.allocate_registered(len).unwrap();
    let d = dst.descriptor();
    for round in 0..3 {
        let spec = format!(
            "{}:{}:{}:{}",
            hex(&b.local_address()),
            hex(&d.rkey),
            d.base_addr,
            d.len
        );
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["writer_child", "--exact", "--nocapture", "--test-threads=1"])
            .env("PDNODE_TEST_UCX_WRITER", spec)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let said = lines
            .by_ref()
            .map_while(Result::ok)
            .any(|l| l.ends_with("issued"));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(said, "round {round}: the writer never issued its puts");
        // Let the receiver meet the dead writer's leftovers and its failed endpoint.
        std::thread::sleep(Duration::from_millis(500));
    }
    // Still alive, and still serving.
    let Some(c) = start("c") else {
        return;
    };
    let mut src = vec![3u8; len];
    // SAFETY: src outlives the registration.
    let src_reg = unsafe { c.register(LocalRegion::host(&mut src)) }.unwrap();
    let t = c.connect(&b.local_address(), dst.descriptor()).unwrap();
    let span = [Span {
        local_offset: 0,
        remote_offset: 0,
        len: len as u64,
    }];
    c.put(&src_reg, &t, &span)
        .unwrap()
        .wait(deadline())
        .unwrap();
    c.flush(&t).unwrap().wait(deadline()).unwrap();
    let r = dst.region();
    // SAFETY: the region is registered (alive) and the writer flushed.
    let got = unsafe { std::slice::from_raw_parts(r.addr as *const u8, r.len) };
    assert!(
        got.iter().all(|&x| x == 3),
        "the second writer's bytes did not land"
    );
    drop((t, src_reg, dst));
}
