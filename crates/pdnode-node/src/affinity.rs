//! CPU pinning of the node process (`engine.cpu_affinity`), e.g. to the NUMA node of its GPUs.

use crate::NodeError;

/// Pins every current thread of the process to `cores`; threads started later inherit it.
/// Linux only; elsewhere it logs and does nothing. An empty list does nothing.
pub fn pin_process(cores: &[u32]) -> Result<(), NodeError> {
    if cores.is_empty() {
        return Ok(());
    }
    imp::pin(cores)
}

/// Applies `engine.cpu_affinity`: a list pins to it; `"auto"` pins to the cores of the NUMA
/// node(s) of the GPUs this node binds (`engine.gpus`, GPU 0 when empty), read from sysfs, so
/// the engine's threads, and the host staging they first touch, sit beside their GPUs. `auto`
/// on a host where the backend resolves to CPU, or whose GPUs report no NUMA node (`-1`: one
/// node, nothing to choose), pins nothing and says so.
pub fn apply(cfg: &pdnode_core::config::Config) -> Result<(), NodeError> {
    use pdnode_core::config::CpuAffinity;
    match &cfg.engine.cpu_affinity {
        CpuAffinity::Cores(cores) => pin_process(cores),
        CpuAffinity::Auto => {
            let gpus = if cfg.engine.gpus.is_empty() {
                vec![0]
            } else {
                cfg.engine.gpus.clone()
            };
            let cuda = matches!(
                pdnode_cuda::select_backend(cfg.engine.backend, &cfg.engine.gpus),
                Ok(pdnode_cuda::BackendChoice::Cuda)
            );
            if !cuda {
                tracing::warn!(
                    "engine.cpu_affinity = \"auto\": the engine runs without a GPU here, so there is no GPU NUMA node to pin to; not pinned"
                );
                return Ok(());
            }
            let err = |reason: String| NodeError::Affinity {
                cores: Vec::new(),
                reason,
            };
            let mut addrs = Vec::new();
            for g in &gpus {
                let a = pdnode_cuda::probe::pci_address(*g)
                    .map_err(|e| err(format!("engine.cpu_affinity = \"auto\": GPU {g}: {e}")))?;
                addrs.push(a);
            }
            match numa_cores(std::path::Path::new("/sys"), &addrs)
                .map_err(|e| err(format!("engine.cpu_affinity = \"auto\": {e}")))?
            {
                Some(pick) => {
                    tracing::info!(?gpus, pci = ?addrs, numa_nodes = ?pick.nodes, cores = pick.cores.len(),
                        "engine.cpu_affinity = \"auto\": pinning to the NUMA node(s) of the GPUs");
                    pin_process(&pick.cores)
                }
                None => {
                    tracing::info!(?gpus, pci = ?addrs,
                        "engine.cpu_affinity = \"auto\": the GPUs report no NUMA node (a one-node host); not pinned");
                    Ok(())
                }
            }
        }
    }
}

/// Why sysfs could not say where some GPUs sit (all fatal at start: the operator asked for
/// `auto`, and a guess would pin the node to the wrong cores).
#[derive(Debug, thiserror::Error)]
pub enum NumaError {
    #[error("{path}: {source}")]
    Read {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {what}")]
    Malformed {
        path: std::path::PathBuf,
        what: String,
    },
    #[error("NUMA node(s) {0:?} list no CPU cores")]
    NoCores(Vec<u32>),
}

/// A kernel CPU list that does not parse.
#[derive(Debug, thiserror::Error)]
#[error("bad CPU list entry {0:?}")]
pub struct CpuListError(String);

/// The NUMA node(s) of some PCI devices and the cores of those nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumaPick {
    pub nodes: Vec<u32>,
    pub cores: Vec<u32>,
}

/// Reads `{sysfs}/bus/pci/devices/{addr}/numa_node` for each address and the union of
/// `{sysfs}/devices/system/node/node{N}/cpulist` over the nodes found. `Ok(None)`: every device
/// says `-1` (no NUMA information). A device on `-1` beside devices on real nodes is ignored.
pub fn numa_cores(
    sysfs: &std::path::Path,
    pci_addrs: &[String],
) -> Result<Option<NumaPick>, NumaError> {
    let read = |p: std::path::PathBuf| {
        std::fs::read_to_string(&p).map_err(|source| NumaError::Read { path: p, source })
    };
    let malformed = |p: &std::path::Path, what: String| NumaError::Malformed {
        path: p.to_path_buf(),
        what,
    };
    let mut nodes: Vec<u32> = Vec::new();
    for a in pci_addrs {
        let p = sysfs.join("bus/pci/devices").join(a).join("numa_node");
        let text = read(p.clone())?;
        let n: i64 = text
            .trim()
            .parse()
            .map_err(|_| malformed(&p, format!("not a number: {:?}", text.trim())))?;
        if n < 0 {
            continue;
        }
        let n = u32::try_from(n).map_err(|_| malformed(&p, format!("node {n} out of range")))?;
        if !nodes.contains(&n) {
            nodes.push(n);
        }
    }
    if nodes.is_empty() {
        return Ok(None);
    }
    nodes.sort_unstable();
    let mut cores = Vec::new();
    for n in &nodes {
        let p = sysfs.join(format!("devices/system/node/node{n}/cpulist"));
        let text = read(p.clone())?;
        cores.extend(parse_cpulist(&text).map_err(|e| malformed(&p, e.to_string()))?);
    }
    cores.sort_unstable();
    cores.dedup();
    if cores.is_empty() {
        return Err(NumaError::NoCores(nodes));
    }
    Ok(Some(NumaPick { nodes, cores }))
}

/// Parses a kernel CPU list (`0-15,32-47`, `3`, empty).
pub fn parse_cpulist(text: &str) -> Result<Vec<u32>, CpuListError> {
    let mut out = Vec::new();
    for part in text.trim().split(',').map(str::trim) {
        if part.is_empty() && text.trim().is_empty() {
            continue;
        }
        let num = |s: &str| s.parse::<u32>().map_err(|_| CpuListError(part.to_string()));
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b || b - a > 65_535 {
                    return Err(CpuListError(part.to_string()));
                }
                out.extend(a..=b);
            }
            None => out.push(num(part)?),
        }
    }
    Ok(out)
}

/// The cores this thread may run on (empty where not implemented).
pub fn current_affinity() -> Result<Vec<u32>, NodeError> {
    imp::current()
}

#[cfg(target_os = "linux")]
mod imp {
    use super::NodeError;

    pub fn pin(cores: &[u32]) -> Result<(), NodeError> {
        let err = |reason: String| NodeError::Affinity {
            cores: cores.to_vec(),
            reason,
        };
        // SAFETY: cpu_set_t is a plain bit array; all-zero is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
        for &c in cores {
            if c as usize >= max {
                return Err(err(format!(
                    "core {c} is beyond the {max} cores a cpu set holds"
                )));
            }
            // SAFETY: `c` is below the set's capacity, checked above.
            unsafe { libc::CPU_SET(c as usize, &mut set) };
        }
        let tasks = std::fs::read_dir("/proc/self/task")
            .map_err(|e| err(format!("cannot list /proc/self/task: {e}")))?;
        let mut pinned = 0;
        for t in tasks.flatten() {
            let Some(tid) = t
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<libc::pid_t>().ok())
            else {
                continue;
            };
            // SAFETY: `set` is a valid cpu_set_t of the size passed; `tid` is a thread of this
            // process (a thread that exited meanwhile makes the call fail with ESRCH).
            let rc = unsafe {
                libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set)
            };
            if rc != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::ESRCH) {
                    continue;
                }
                return Err(err(format!("sched_setaffinity(thread {tid}): {e}")));
            }
            pinned += 1;
        }
        tracing::info!(?cores, threads = pinned, "pinned the process to CPU cores");
        Ok(())
    }

    /// The cores the calling thread may run on.
    pub fn current() -> Result<Vec<u32>, NodeError> {
        // SAFETY: as above; sched_getaffinity fills the set we pass with its size.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let rc =
            unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
        if rc != 0 {
            return Err(NodeError::Affinity {
                cores: Vec::new(),
                reason: std::io::Error::last_os_error().to_string(),
            });
        }
        let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: every index is below the set's capacity.
        Ok((0..max)
            .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
            .map(|c| c as u32)
            .collect())
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use super::NodeError;

    pub fn pin(cores: &[u32]) -> Result<(), NodeError> {
        tracing::warn!(
            ?cores,
            "engine.cpu_affinity is only implemented on Linux; ignoring it"
        );
        Ok(())
    }

    pub fn current() -> Result<Vec<u32>, NodeError> {
        Ok(Vec::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_as_the_kernel_writes_them() {
        assert_eq!(
            parse_cpulist("0-3,8,10-11\n").unwrap(),
            vec![0, 1, 2, 3, 8, 10, 11]
        );
        assert_eq!(parse_cpulist("5").unwrap(), vec![5]);
        assert_eq!(parse_cpulist("\n").unwrap(), Vec::<u32>::new());
        for bad in ["3-1", "a", "1-", "0-4294967295", "1,,2"] {
            assert!(parse_cpulist(bad).is_err(), "{bad}");
        }
    }

    /// A fake sysfs: GPUs at PCI addresses on NUMA nodes 0 and 1, one device with no node.
    #[test]
    fn auto_picks_the_cores_of_the_gpus_numa_nodes() {
        let d = tempfile::tempdir().unwrap();
        let dev = |addr: &str, node: &str| {
            let p = d.path().join("bus/pci/devices").join(addr);
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("numa_node"), format!("{node}\n")).unwrap();
        };
        let node = |n: u32, list: &str| {
            let p = d.path().join(format!("devices/system/node/node{n}"));
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("cpulist"), format!("{list}\n")).unwrap();
        };
        dev("0000:19:00.0", "0");
        dev("0000:9b:00.0", "1");
        dev("0000:c3:00.0", "1");
        dev("0000:01:00.0", "-1");
        node(0, "0-3,8-11");
        node(1, "4-7,12-15");
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        // The decode half of the reference host (GPU4-7): node 1 only.
        let pick = numa_cores(d.path(), &s(&["0000:9b:00.0", "0000:c3:00.0"]))
            .unwrap()
            .unwrap();
        assert_eq!(pick.nodes, vec![1]);
        assert_eq!(pick.cores, vec![4, 5, 6, 7, 12, 13, 14, 15]);
        // A group across both nodes: the union.
        let pick = numa_cores(d.path(), &s(&["0000:9b:00.0", "0000:19:00.0"]))
            .unwrap()
            .unwrap();
        assert_eq!(pick.nodes, vec![0, 1]);
        assert_eq!(pick.cores.len(), 16);
        // No NUMA information: nothing to pin to.
        assert_eq!(numa_cores(d.path(), &s(&["0000:01:00.0"])).unwrap(), None);
        // A device sysfs does not know: an error naming the file.
        let e = numa_cores(d.path(), &s(&["0000:aa:00.0"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("0000:aa:00.0/numa_node"), "{e}");
    }

    #[test]
    fn pins_to_an_allowed_core_and_refuses_impossible_ones() {
        assert!(pin_process(&[]).is_ok());
        assert!(matches!(
            pin_process(&[100_000]),
            Err(NodeError::Affinity { .. })
        ));
        // Re-pinning to the cores we may use now leaves the process as it was.
        #[cfg(target_os = "linux")]
        {
            let now = current_affinity().unwrap();
            assert!(!now.is_empty());
            pin_process(&now).unwrap();
            assert_eq!(current_affinity().unwrap(), now);
        }
    }
}
