//! `pdnode bench-transfer`: KV hand-off bandwidth and latency through the serving pieces
//! (`pdnode-transfer-bench`: the core KvTarget, gather into registered staging, UCX put per
//! layer group, flush, the fence record with CRC32C checked before the scatter, KvDone,
//! scatter, verify).
//!
//! `--local` starts a server and a client process (this binary, `--spec JSON`) on loopback and
//! prints the client's table. `--role server|client` runs one side (e.g. on two hosts).

use anyhow::Context;
use pdnode_transfer::MemKind;
use pdnode_transfer_bench::{self as bench, BenchRole, Options};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Start a server and a client process on loopback and print the table.
    #[arg(long, conflicts_with = "role")]
    pub local: bool,
    /// Run one side: `server` (decode role, listens) or `client` (prefill role, connects).
    #[arg(long, value_parser = ["server", "client"])]
    pub role: Option<String>,
    /// Server: control address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Client: the server's control address (printed by the server as `LISTEN addr`).
    #[arg(long)]
    pub connect: Option<String>,
    /// Layers per request.
    #[arg(long, default_value_t = 32)]
    pub layers: u32,
    /// Bytes of one layer-block (K+V of one layer of one block), comma-separated, K/M suffixes;
    /// multiples of 4 KiB (one token of 8 KV heads x 128 x bf16). One table row each.
    #[arg(long, value_delimiter = ',', default_value = "16K,64K,256K,1M", value_parser = parse_size)]
    pub block_bytes: Vec<u64>,
    /// KV blocks per request.
    #[arg(long, default_value_t = 4)]
    pub blocks_per_request: u32,
    /// Measured requests per block size.
    #[arg(long, default_value_t = 10)]
    pub requests: u32,
    /// Unmeasured requests first, per block size.
    #[arg(long, default_value_t = 2)]
    pub warmup: u32,
    /// Layers per put (1: one put per layer, as when pushing while the forward pass runs).
    #[arg(long, default_value_t = 1)]
    pub layers_per_put: u32,
    /// Put straight into the receiver's pool (no receive staging, no scatter).
    #[arg(long)]
    pub pool_placement: bool,
    /// Receive staging in our own registered buffer instead of UCX-allocated memory (over
    /// shared memory, UCX then emulates the puts through the receiver's progress: slow).
    #[arg(long)]
    pub user_staging: bool,
    /// Memory of the KV staging the puts read and write: `host` or `cuda:N` (`cuMemAlloc`;
    /// with `--local` each process then sees only its own GPU).
    #[arg(long, default_value = "host")]
    pub mem: MemKind,
    /// The server's memory when it differs from `--mem` (e.g. `--mem cuda:0 --server-mem cuda:1`).
    #[arg(long)]
    pub server_mem: Option<MemKind>,
    /// libucp to load (default: libucp.so.0, then libucp.so).
    #[arg(long, value_name = "PATH")]
    pub ucx_lib: Option<String>,
    /// UCX_TLS for the `--local` processes (e.g. `tcp`, `sm`, `cuda_ipc,cuda_copy,tcp`).
    #[arg(long)]
    pub tls: Option<String>,
    /// UCX_NET_DEVICES for the `--local` processes.
    #[arg(long, default_value = "lo")]
    pub net_devices: String,
    /// Reservation lease per request (ms).
    #[arg(long, default_value_t = 30_000)]
    pub lease_ms: u64,
    /// Instead of moving KV: the cost of registering a sub-range of `--mem` memory of each
    /// `--registration-sizes` size (`ucp_mem_map` + rkey pack, then `ucp_mem_unmap`), what an
    /// rkey scoped to one reservation would cost per hand-off. In this process, no peer.
    #[arg(long, conflicts_with_all = ["local", "role"])]
    pub registration: bool,
    /// Sizes for `--registration`, comma-separated, K/M/G suffixes.
    #[arg(long, value_delimiter = ',', default_value = "1M,16M,64M,256M", value_parser = parse_size)]
    pub registration_sizes: Vec<u64>,
    /// Deadline of the whole `--local` run (s).
    #[arg(long, default_value_t = 600)]
    pub timeout_s: u64,
    /// One role's options as JSON (how `--local` starts its processes).
    #[arg(long, hide = true)]
    pub spec: Option<String>,
}

/// Why a `--block-bytes` size does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum SizeError {
    #[error("bad size {text:?}: {source}")]
    NotANumber {
        text: String,
        source: std::num::ParseIntError,
    },
    #[error("size {text:?} does not fit in 64 bits")]
    TooLarge { text: String },
}

fn parse_size(s: &str) -> Result<u64, SizeError> {
    let s = s.trim();
    let (num, mul) = match s.char_indices().last() {
        Some((i, 'K' | 'k')) => (&s[..i], 1u64 << 10),
        Some((i, 'M' | 'm')) => (&s[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    let n = num.parse::<u64>().map_err(|source| SizeError::NotANumber {
        text: s.to_string(),
        source,
    })?;
    n.checked_mul(mul).ok_or_else(|| SizeError::TooLarge {
        text: s.to_string(),
    })
}

fn options(args: &Args, role: BenchRole) -> Options {
    Options {
        role,
        listen: args.listen.clone(),
        connect: args.connect.clone(),
        layers: args.layers,
        block_bytes: args.block_bytes.clone(),
        blocks_per_request: args.blocks_per_request,
        requests: args.requests,
        warmup: args.warmup,
        layers_per_put: args.layers_per_put,
        pool_placement: args.pool_placement,
        mem: args.mem,
        server_mem: args.server_mem,
        ucx_lib: args.ucx_lib.clone(),
        tls: args.tls.clone(),
        net_devices: Some(args.net_devices.clone()),
        lease_ms: args.lease_ms,
        timeout_s: args.timeout_s,
        ucx_alloc_staging: !args.user_staging,
        ..Options::default()
    }
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    crate::logging::init_default()?;
    let job = move || -> anyhow::Result<()> {
        if let Some(spec) = &args.spec {
            let opts: Options = serde_json::from_str(spec).context("bad --spec")?;
            bench::run_role(&opts)?;
            return Ok(());
        }
        if args.registration {
            let opts = options(&args, BenchRole::Client);
            let t = opts.transport()?;
            let reps = args.requests.max(1);
            let rows = bench::regcost::run(&opts, &t, &args.registration_sizes, reps)?;
            print!("{}", bench::regcost::table(&opts, &rows, &t));
            return Ok(());
        }
        if args.local {
            let opts = options(&args, BenchRole::Client);
            let exe = std::env::current_exe().context("locate the pdnode binary")?;
            let prefix = ["bench-transfer".to_string(), "--spec".to_string()];
            let code = bench::run_local(&opts, &exe, &prefix)?;
            anyhow::ensure!(code == 0, "bench-transfer client exited with code {code}");
            return Ok(());
        }
        let role = match args.role.as_deref() {
            Some("server") => BenchRole::Server,
            Some("client") => BenchRole::Client,
            _ => {
                return Err(super::UsageError(
                    "bench-transfer needs --local or --role server|client".into(),
                )
                .into());
            }
        };
        bench::run_role(&options(&args, role))?;
        Ok(())
    };
    tokio::task::spawn_blocking(job)
        .await
        .context("bench-transfer thread")?
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(super::parse_size("16K"), Ok(16 << 10));
        assert_eq!(super::parse_size("1M"), Ok(1 << 20));
        assert_eq!(super::parse_size("4096"), Ok(4096));
        assert!(matches!(
            super::parse_size("x"),
            Err(super::SizeError::NotANumber { .. })
        ));
        // 2^34 G overflows u64: an error, not a panic.
        assert!(matches!(
            super::parse_size("17179869184G"),
            Err(super::SizeError::TooLarge { .. })
        ));
    }
}
