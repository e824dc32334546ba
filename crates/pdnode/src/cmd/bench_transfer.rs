//! `pdnode bench-transfer`: KV transfer bandwidth (owned by the transfer work).

use super::not_available;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Transfer size in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    pub bytes: u64,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    crate::logging::init_default()?;
    let _ = args.bytes;
    Err(not_available(
        "bench-transfer",
        "the KV transfer (UCX and in-process KvTransport) has not landed",
    ))
}
