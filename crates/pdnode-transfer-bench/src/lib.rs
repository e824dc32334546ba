//! `pdnode bench-transfer`: a server (decode role) and a client (prefill role) move KV-shaped
//! payloads through the serving hand-off's pieces — the `pdnode_core::KvTarget` a decode node
//! answers, gather into registered staging, one UCX put per layer group, flush, the fence
//! record with the CRC32C of the bytes (`pdnode_transfer::fence`, checked by the receiver with
//! `FenceRecord::check` as the decode node does), KvDone, scatter on the receiver — verify
//! every byte, and report GB/s and per-request latency per block size.
//!
//! Production code never imports this crate: it is built into `pdnode bench-transfer` and the
//! `pdnode-transfer-peer` binary the multi-process tests start.
//!
//! Roles run in separate processes; [`run_local`] starts both (the same executable, the role's
//! [`Options`] passed as JSON) on loopback and waits for them with a deadline.

mod client;
mod devmem;
mod pattern;
pub mod regcost;
mod server;
pub mod wire;

pub use client::PointResult;

use pdnode_core::{DType, KvLayout};
use pdnode_transfer::TransferError;
use pdnode_transfer::region::MemKind;
use pdnode_transfer::ucx::{UcxConfig, UcxTransport};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BenchRole {
    Server,
    Client,
}

/// Everything a bench process needs (also the JSON handed to child processes).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Options {
    pub role: BenchRole,
    /// Server: where to listen (loopback).
    pub listen: String,
    /// Client: the server's control address.
    pub connect: Option<String>,
    pub layers: u32,
    /// Bytes of one layer-block (K and V of one layer of one block), one table row each.
    pub block_bytes: Vec<u64>,
    pub blocks_per_request: u32,
    /// Measured requests per block size (after `warmup`).
    pub requests: u32,
    pub warmup: u32,
    /// Layers per put (1: one put per layer).
    pub layers_per_put: u32,
    /// Put straight into the receiver's pool instead of its staging area.
    pub pool_placement: bool,
    /// Memory of this role's KV (the client's, and the server's unless `server_mem` is set).
    /// Device memory (`cuda:N`) holds the registered staging areas the puts read and write;
    /// the bench's pattern is written and checked through host copies outside the timing.
    pub mem: MemKind,
    /// The server's memory when it differs from `mem` (e.g. client `cuda:0`, server `cuda:1`).
    pub server_mem: Option<MemKind>,
    pub ucx_lib: Option<String>,
    /// UCX_TLS for the transport (and the child processes of `--local`).
    pub tls: Option<String>,
    /// UCX_NET_DEVICES for the transport (and the child processes of `--local`).
    pub net_devices: Option<String>,
    pub lease_ms: u64,
    /// Server: let UCX allocate the receive staging area (shared memory peers write directly).
    pub ucx_alloc_staging: bool,
    /// Ask UCX for peer-failure handling (falls back to none where no transport has it).
    pub peer_failure: bool,
    /// Server: stop after the first connection ends.
    pub serve_once: bool,
    /// Overall deadline of `--local`.
    pub timeout_s: u64,
    pub faults: Faults,
}

/// Failure injection for the multi-process tests.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Client: after putting this many layers of the first request, print `PAUSED` and wait
    /// for a line on stdin.
    pub pause_after_layers: Option<u32>,
    /// Client: after the first target, print `STALLED` and wait on stdin forever.
    pub stall_after_reserve: bool,
    /// Client: present a wrong secret in KvDone.
    pub wrong_secret: bool,
    /// Client: send a fence record whose CRC32C does not match the bytes it put (as if a byte
    /// flipped on the way): the server must refuse before the scatter.
    pub bad_checksum: bool,
    /// Client: change this layout field (head_dim, block_size, num_layers, dtype,
    /// model_fingerprint) in what it sends and checks.
    pub layout_mismatch: Option<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            role: BenchRole::Client,
            listen: "127.0.0.1:0".into(),
            connect: None,
            layers: 32,
            block_bytes: vec![16 << 10, 64 << 10, 256 << 10, 1 << 20],
            blocks_per_request: 4,
            requests: 10,
            warmup: 2,
            layers_per_put: 1,
            pool_placement: false,
            mem: MemKind::Host,
            server_mem: None,
            ucx_lib: None,
            tls: None,
            net_devices: Some("lo".into()),
            lease_ms: 30_000,
            ucx_alloc_staging: true,
            peer_failure: true,
            serve_once: false,
            timeout_s: 600,
            faults: Faults::default(),
        }
    }
}

/// K and V of one token of one layer for the bench's model shape (8 KV heads x 128, bf16).
const TOKEN_LAYER_BYTES: u64 = 2 * 8 * 128 * 2;

impl Options {
    /// The KV layout whose layer-block is `block_bytes` (Llama-8B-like heads, bf16).
    pub fn layout_for(&self, block_bytes: u64) -> Result<KvLayout, TransferError> {
        if block_bytes == 0 || !block_bytes.is_multiple_of(TOKEN_LAYER_BYTES) {
            return Err(TransferError::Geometry {
                reason: format!(
                    "block bytes {block_bytes} is not a multiple of {TOKEN_LAYER_BYTES} \
                     (K+V of one token: 8 heads x 128 x bf16)"
                ),
            });
        }
        Ok(KvLayout {
            dtype: DType::Bf16,
            num_layers: self.layers,
            block_size: (block_bytes / TOKEN_LAYER_BYTES) as u32,
            kv_heads_per_rank: 8,
            head_dim: 128,
            tp_size: 1,
            model_fingerprint: "bench-transfer".into(),
            kind: pdnode_core::KvKind::KeyValue,
        })
    }

    /// Starts the UCX transport this process uses.
    pub fn transport(&self) -> Result<UcxTransport, TransferError> {
        if self.mem != MemKind::Host && self.pool_placement {
            return Err(TransferError::UnsupportedMemory {
                transport: "bench-transfer --pool-placement (device memory uses staging)",
                mem: self.mem.to_string(),
            });
        }
        UcxTransport::start(UcxConfig {
            library: self.ucx_lib.clone(),
            name: format!("bench-{:?}", self.role).to_lowercase(),
            peer_failure: self.peer_failure,
            tls: self.tls.clone(),
            net_devices: self.net_devices.clone(),
            cuda_device: match self.mem {
                MemKind::Cuda(n) => Some(n),
                MemKind::Host => None,
            },
            ..UcxConfig::default()
        })
    }
}

/// Runs one role in this process. The client prints the table and returns its rows.
pub fn run_role(opts: &Options) -> Result<Vec<PointResult>, TransferError> {
    let transport = opts.transport()?;
    match opts.role {
        BenchRole::Server => server::run(opts, &transport).map(|()| Vec::new()),
        BenchRole::Client => {
            let rows = client::run(opts, &transport)?;
            print!("{}", client::table(opts, &rows, &transport));
            Ok(rows)
        }
    }
}

/// Heap memory for pools and staging: 8-byte aligned, touched (no first-use page faults
/// inside timed sections).
pub(crate) struct HostBuf {
    words: Vec<u64>,
}

impl HostBuf {
    pub(crate) fn new(bytes: usize) -> Result<Self, TransferError> {
        if !bytes.is_multiple_of(8) {
            return Err(TransferError::Geometry {
                reason: format!("buffer of {bytes} bytes is not a multiple of 8"),
            });
        }
        let mut words = Vec::new();
        words
            .try_reserve_exact(bytes / 8)
            .map_err(|e| TransferError::Geometry {
                reason: format!("allocate {bytes} bytes: {e}"),
            })?;
        words.resize(bytes / 8, 0x5a5a_5a5a_5a5a_5a5a);
        Ok(HostBuf { words })
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: u64 storage viewed as bytes: same allocation, length in bytes, u8 has no
        // alignment or validity requirements.
        unsafe {
            std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.words.len() * 8)
        }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, with unique access through &mut self.
        unsafe {
            std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut u8, self.words.len() * 8)
        }
    }
}

/// A `--local` child with device memory sees only its own GPU (cuda_ipc between processes
/// that each see one GPU moved real bytes over NVLink; see GPU.md): `cuda:N` becomes
/// `CUDA_VISIBLE_DEVICES=<N-th visible device>` and `cuda:0` inside the child.
fn one_gpu(role: &Options) -> (Options, Option<String>) {
    let MemKind::Cuda(n) = role.mem else {
        return (role.clone(), None);
    };
    let visible = std::env::var("CUDA_VISIBLE_DEVICES")
        .ok()
        .and_then(|list| {
            list.split(',')
                .nth(n as usize)
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| n.to_string());
    let child = Options {
        mem: MemKind::Cuda(0),
        ..role.clone()
    };
    (child, Some(visible))
}

/// Kills a child on drop (by its own handle, never by name).
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `--local`: starts a server and a client process (`exe` + `prefix` + role JSON), waits for
/// the client with `opts.timeout_s`, stops the server. Returns the client's exit code.
pub fn run_local(opts: &Options, exe: &Path, prefix: &[String]) -> Result<i32, TransferError> {
    let deadline = Instant::now() + Duration::from_secs(opts.timeout_s);
    // Fail here, once and clearly, when the library is missing (the children would both fail).
    ucx_sys::Ucp::load(opts.ucx_lib.as_deref())?;
    let spawn = |role: &Options, stdout: Stdio| -> Result<Child, TransferError> {
        let (role, visible) = one_gpu(role);
        let json = serde_json::to_string(&role).map_err(|e| TransferError::Control {
            reason: e.to_string(),
        })?;
        let mut cmd = Command::new(exe);
        cmd.args(prefix)
            .arg(json)
            .stdout(stdout)
            .stdin(Stdio::null());
        if let Some(t) = &opts.tls {
            cmd.env("UCX_TLS", t);
        }
        if let Some(d) = &opts.net_devices {
            cmd.env("UCX_NET_DEVICES", d);
        }
        if let Some(v) = visible {
            cmd.env("CUDA_VISIBLE_DEVICES", v);
        }
        cmd.spawn().map_err(|e| TransferError::Control {
            reason: format!("spawn {}: {e}", exe.display()),
        })
    };
    let server_opts = Options {
        role: BenchRole::Server,
        listen: "127.0.0.1:0".into(),
        serve_once: true,
        mem: opts.server_mem.unwrap_or(opts.mem),
        server_mem: None,
        ..opts.clone()
    };
    let mut server = ChildGuard(spawn(&server_opts, Stdio::piped())?);
    let stdout = server.0.stdout.take().ok_or(TransferError::Control {
        reason: "server stdout".into(),
    })?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(addr) = line.strip_prefix("LISTEN ") {
                let _ = tx.send(addr.to_string());
            } else {
                eprintln!("[server] {line}");
            }
        }
    });
    let wait = deadline
        .saturating_duration_since(Instant::now())
        .min(Duration::from_secs(60));
    let addr = match rx.recv_timeout(wait) {
        Ok(a) => a,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            return Err(TransferError::Timeout {
                what: "bench server start".into(),
            });
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            let status = server.0.wait().map(|s| s.to_string()).unwrap_or_default();
            return Err(TransferError::Control {
                reason: format!("bench server exited before listening ({status})"),
            });
        }
    };
    let client_opts = Options {
        role: BenchRole::Client,
        connect: Some(addr),
        ..opts.clone()
    };
    let mut client = ChildGuard(spawn(&client_opts, Stdio::inherit())?);
    loop {
        if let Some(status) = client.0.try_wait().map_err(|e| TransferError::Control {
            reason: e.to_string(),
        })? {
            #[cfg(unix)]
            {
                use std::os::unix::process::ExitStatusExt;
                if let Some(sig) = status.signal() {
                    eprintln!("bench-transfer client killed by signal {sig}");
                    return Ok(128 + sig);
                }
            }
            return Ok(status.code().unwrap_or(1));
        }
        if Instant::now() >= deadline {
            return Err(TransferError::Timeout {
                what: "bench client".into(),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
