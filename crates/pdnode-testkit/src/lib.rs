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

/// A TCP port that was free on 127.0.0.1 a moment ago (bind to port 0, read it, release it).
pub fn free_port() -> std::io::Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}
