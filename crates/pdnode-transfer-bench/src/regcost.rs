//! `pdnode bench-transfer --registration`: what narrowing the rkey of a hand-off would cost.
//! A decode node registers its staging arena once and hands every reservation an rkey for the
//! whole of it (docs/runtime-semantics.md, "Trust"); registering each reservation's span on
//! its own would scope the rkey to that span. This measures that price: `ucp_mem_map` plus
//! `ucp_rkey_pack` (`UcxTransport::register`) and `ucp_mem_unmap` (dropping the
//! registration) of a sub-range of a larger buffer that already exists (host memory, touched;
//! or `cuMemAlloc` device memory), at a different offset each time so that no registration
//! cache hands back an earlier one.

use crate::devmem::DevBuf;
use crate::{HostBuf, Options};
use pdnode_transfer::region::{LocalRegion, MemKind};
use pdnode_transfer::{KvTransport, TransferError, UcxTransport};
use std::time::{Duration, Instant};

/// One size's figures.
#[derive(Debug, Clone)]
pub struct RegRow {
    pub bytes: u64,
    pub reps: u32,
    pub register_p50: Duration,
    pub register_max: Duration,
    pub deregister_p50: Duration,
    pub rkey_bytes: usize,
}

/// The buffer the ranges are cut from.
enum Buf {
    Host(HostBuf),
    Device(DevBuf),
}

impl Buf {
    fn region(&self) -> LocalRegion {
        match self {
            Buf::Host(h) => LocalRegion {
                addr: h.bytes().as_ptr() as usize,
                len: h.bytes().len(),
                mem: MemKind::Host,
            },
            Buf::Device(d) => d.region(),
        }
    }
}

fn p50(v: &mut [Duration]) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Registers `reps` sub-ranges of each size in `sizes` and drops them, timing both.
pub fn run(
    opts: &Options,
    t: &UcxTransport,
    sizes: &[u64],
    reps: u32,
) -> Result<Vec<RegRow>, TransferError> {
    let largest = sizes.iter().copied().max().unwrap_or(0) as usize;
    // Room for every rep's range at its own 64 KiB step past the largest size.
    const STEP: usize = 64 << 10;
    let total =
        largest
            .checked_add(STEP * reps as usize)
            .ok_or_else(|| TransferError::Geometry {
                reason: "registration buffer size overflows".into(),
            })?;
    let buf = match opts.mem {
        MemKind::Host => Buf::Host(HostBuf::new(total.next_multiple_of(8))?),
        MemKind::Cuda(n) => Buf::Device(DevBuf::new(n, total)?),
    };
    let whole = buf.region();
    let mut rows = Vec::with_capacity(sizes.len());
    for &bytes in sizes {
        let (mut reg_t, mut dereg_t) = (Vec::new(), Vec::new());
        let mut rkey_bytes = 0;
        for i in 0..reps as usize {
            let region = LocalRegion {
                addr: whole.addr + i * STEP,
                len: bytes as usize,
                mem: whole.mem,
            };
            let t0 = Instant::now();
            // SAFETY: `region` lies inside `buf` (sized for the largest range at the last
            // step), which outlives the registration dropped below.
            let reg = unsafe { t.register(region)? };
            reg_t.push(t0.elapsed());
            rkey_bytes = reg.descriptor().rkey.len();
            let t1 = Instant::now();
            drop(reg);
            dereg_t.push(t1.elapsed());
        }
        let register_max = reg_t.iter().copied().max().unwrap_or_default();
        rows.push(RegRow {
            bytes,
            reps,
            register_p50: p50(&mut reg_t),
            register_max,
            deregister_p50: p50(&mut dereg_t),
            rkey_bytes,
        });
    }
    drop(buf);
    Ok(rows)
}

/// The table `--registration` prints.
pub fn table(opts: &Options, rows: &[RegRow], t: &UcxTransport) -> String {
    let mut s = format!(
        "registration cost (ucp_mem_map + rkey pack, ucp_mem_unmap) of a sub-range of {} memory, UCX {} (UCX_TLS {})\n\
         | bytes | reps | register p50 (us) | register max (us) | deregister p50 (us) | rkey bytes |\n\
         |---|---|---|---|---|---|\n",
        opts.mem,
        t.library(),
        opts.tls.as_deref().unwrap_or("default"),
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {:.1} | {:.1} | {:.1} | {} |\n",
            r.bytes,
            r.reps,
            r.register_p50.as_secs_f64() * 1e6,
            r.register_max.as_secs_f64() * 1e6,
            r.deregister_p50.as_secs_f64() * 1e6,
            r.rkey_bytes
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_range_registers_and_yields_an_rkey() {
        let opts = Options {
            net_devices: Some("lo".into()),
            ..Options::default()
        };
        let Ok(t) = opts.transport() else {
            eprintln!("no UCX here: skipped");
            return;
        };
        let rows = run(&opts, &t, &[1 << 20, 4 << 20], 3).unwrap();
        assert_eq!(rows.len(), 2);
        for r in &rows {
            assert_eq!(r.reps, 3);
            assert!(r.rkey_bytes > 0, "{r:?}");
            assert!(r.register_max >= r.register_p50, "{r:?}");
        }
        let table = table(&opts, &rows, &t);
        assert!(table.contains("| 4194304 | 3 |"), "{table}");
    }
}
