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
