//! What the UCX transport tests share: a transport on loopback, a deadline.

use pdnode_transfer::{TransferError, UcxConfig, UcxTransport};
use std::time::{Duration, Instant};

/// A UCX transport named `name` over `tls` on `lo`; `None` (with a SKIP line) only when libucp
/// cannot be loaded.
pub fn start(name: &str, tls: &str) -> Option<UcxTransport> {
    match UcxTransport::start(UcxConfig {
        name: name.into(),
        tls: Some(tls.into()),
        net_devices: Some("lo".into()),
        ..UcxConfig::default()
    }) {
        Ok(t) => Some(t),
        Err(TransferError::Ucx(e)) if e.to_string().contains("not found") => {
            eprintln!("SKIP: libucp not loadable: {e}");
            None
        }
        Err(e) => panic!("UCX transport start: {e}"),
    }
}

pub fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(30)
}
