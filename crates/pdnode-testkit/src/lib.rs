//! pdnode-testkit: test harness helpers.
//!
//! - [`EtcdServer`]: a real `etcd` (Debian `etcd-server`) on free loopback ports with a temporary
//!   data dir, stopped by PID on drop; [`EtcdServer::stop`] and [`EtcdServer::restart`] keep the
//!   ports and the data dir, for restart tests. [`EtcdServer::start_with`] adds TLS on the
//!   client port ([`EtcdTls`]) and a short auth token TTL; [`EtcdServer::enable_auth`] creates
//!   users with prefix roles ([`EtcdUser`]) and turns etcd auth on.
//! - [`ChildGuard`]: kills a spawned process by PID on drop.
//! - [`wait_for`] / [`wait_for_async`]: poll a condition until a deadline.
//! - [`free_port`]: a free TCP port on 127.0.0.1.
//! - [`fuzz::Fuzz`]: a bounded proptest fuzz target (case count and time budget,
//!   `PDNODE_FUZZ_CASES` / `PDNODE_FUZZ_SECS`) that saves its failures to
//!   `tests/regressions/<target>.txt` and replays them first ([`fuzz_regressions!`]).
//!
//! A missing etcd binary is an error ([`TestkitError::EtcdMissing`]), so tests fail where etcd
//! should be installed (CI). Only `PDNODE_SKIP_ETCD_TESTS=1` lets a test skip: see
//! [`skip_etcd_tests`].

mod etcd;
pub mod fuzz;
mod process;
mod wait;

pub mod sglang_mock;

pub use etcd::{EtcdAccess, EtcdOptions, EtcdServer, EtcdTls, EtcdUser};
pub use process::{ChildGuard, send_signal};
pub use wait::{wait_for, wait_for_async};

use std::net::TcpListener;
use std::time::Duration;

/// Everything the harness can fail at.
#[derive(Debug, thiserror::Error)]
pub enum TestkitError {
    #[error(
        "etcd binary not found ({tried}): install Debian `etcd-server` (apt-get install etcd-server) \
         or set PDNODE_ETCD_BIN; set PDNODE_SKIP_ETCD_TESTS=1 to skip etcd tests on purpose"
    )]
    EtcdMissing { tried: String },
    #[error("cannot start {what}: {reason}")]
    Spawn { what: String, reason: String },
    #[error("etcd on 127.0.0.1:{port} did not answer within {waited:?}; its log:\n{log}")]
    EtcdNotReady {
        port: u16,
        waited: Duration,
        log: String,
    },
    #[error("etcd call `{op}` failed: {reason}")]
    Etcd { op: &'static str, reason: String },
    #[error("condition not met within {waited:?}: {what}")]
    Timeout { what: String, waited: Duration },
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

/// Whether etcd tests were asked to skip (`PDNODE_SKIP_ETCD_TESTS=1`). Tests call this first and
/// return early (printing why) only when it is true; otherwise a missing etcd fails them.
pub fn skip_etcd_tests() -> bool {
    let skip = std::env::var("PDNODE_SKIP_ETCD_TESTS").is_ok_and(|v| v == "1");
    if skip {
        eprintln!("PDNODE_SKIP_ETCD_TESTS=1: skipping a test that needs etcd");
    }
    skip
}

/// A TCP port that was free on 127.0.0.1 a moment ago.
///
/// Taken below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`), walking from an
/// offset derived from the process id: a port the kernel hands out for `bind(0)` can be handed
/// out again as the source port of some other connection (etcd clients, UCX, HTTP probes) before
/// the node under test binds it, which failed a node start with "Address already in use" about
/// once in a few hundred runs. Below the ephemeral range only an explicit bind can take the port,
/// and each port is checked by binding it. Falls back to `bind(0)` when that range is too small.
pub fn free_port() -> std::io::Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOW: u32 = 20_000;
    let high = ephemeral_low().unwrap_or(32_768);
    if high > LOW + 1_000 {
        let span = high - LOW;
        let start = std::process::id().wrapping_mul(7_919) % span;
        for _ in 0..span {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let port = (LOW + (start + n) % span) as u16;
            if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    let l = TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// The first port of the kernel's ephemeral range, where Linux says.
fn ephemeral_low() -> Option<u32> {
    let s = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_distinct_bindable_and_below_the_ephemeral_range() {
        let ports: Vec<u16> = (0..50).map(|_| free_port().expect("port")).collect();
        let mut uniq = ports.clone();
        uniq.sort_unstable();
        uniq.dedup();
        assert_eq!(uniq.len(), ports.len(), "repeated ports: {ports:?}");
        if let Some(low) = ephemeral_low().filter(|l| *l > 21_000) {
            assert!(
                ports.iter().all(|p| u32::from(*p) < low && *p >= 20_000),
                "{ports:?}"
            );
        }
        for p in ports {
            drop(TcpListener::bind(("127.0.0.1", p)).expect("still free"));
        }
    }
}
