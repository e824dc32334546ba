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

/// Sends a signal to one process by PID with `kill -SIG PID`.
pub fn send_signal(pid: u32, signal: &str) -> std::io::Result<()> {
    let st = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()?;
    if st.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "kill -{signal} {pid} exited with {st}"
        )))
    }
}
