//! Spawned processes, stopped by PID.

use std::process::Child;
use std::time::Duration;

/// Owns a spawned child; kills it (SIGKILL) and reaps it on drop.
#[derive(Debug)]
pub struct ChildGuard {
    child: Option<Child>,
    name: String,
}

impl ChildGuard {
    pub fn new(name: impl Into<String>, child: Child) -> Self {
        Self {
            child: Some(child),
            name: name.into(),
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Sends `signal` (e.g. "TERM", "KILL") to the child by PID.
    pub fn signal(&self, signal: &str) -> std::io::Result<()> {
        match self.pid() {
            Some(pid) => send_signal(pid, signal),
            None => Ok(()),
        }
    }

    /// Returns the exit status if the child has exited.
    pub fn try_wait(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        match self.child.as_mut() {
            Some(c) => c.try_wait(),
            None => Ok(None),
        }
    }

    /// Waits for the child to exit, at most `deadline`; `Ok(None)` if it is still running.
    pub fn wait_timeout(
        &mut self,
        deadline: Duration,
    ) -> std::io::Result<Option<std::process::ExitStatus>> {
        let start = std::time::Instant::now();
        loop {
            if let Some(s) = self.try_wait()? {
                return Ok(Some(s));
            }
            if start.elapsed() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the child with SIGKILL and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Gives up ownership (the process is no longer killed on drop).
    pub fn into_inner(mut self) -> Option<Child> {
        self.child.take()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sends a signal (by name: `TERM`, `KILL`, `STOP`, `CONT`, `INT`, `HUP`, `USR1`, `USR2`) to one
/// process by PID, with the kill(2) system call: no `kill` binary needed (a minimal Debian root
/// has none; procps brings it).
pub fn send_signal(pid: u32, signal: &str) -> std::io::Result<()> {
    let sig = match signal.trim_start_matches("SIG") {
        "TERM" => libc::SIGTERM,
        "KILL" => libc::SIGKILL,
        "STOP" => libc::SIGSTOP,
        "CONT" => libc::SIGCONT,
        "INT" => libc::SIGINT,
        "HUP" => libc::SIGHUP,
        "USR1" => libc::SIGUSR1,
        "USR2" => libc::SIGUSR2,
        other => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("unknown signal {other:?}"),
            ));
        }
    };
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("pid {pid}")))?;
    // SAFETY: kill(2) takes plain integers and touches no memory of ours.
    if unsafe { libc::kill(pid, sig) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn signals_reach_the_process_without_a_kill_binary() {
        let child = Command::new("sleep").arg("30").spawn().unwrap();
        let mut g = ChildGuard::new("sleep", child);
        g.signal("STOP").unwrap();
        g.signal("CONT").unwrap();
        g.signal("TERM").unwrap();
        let st = g.wait_timeout(Duration::from_secs(5)).unwrap().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(st.signal(), Some(libc::SIGTERM));
        assert!(send_signal(1, "BOGUS").is_err());
    }
}
