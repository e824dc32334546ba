//! A real etcd server for tests, on free loopback ports, stopped by PID.

use crate::TestkitError;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long [`EtcdServer::start`] waits for etcd to answer `/health`.
const READY_DEADLINE: Duration = Duration::from_secs(30);

/// A running etcd: `etcd --listen-client-urls http://127.0.0.1:{client_port}` with a temporary
/// data dir. Dropping it kills the process by PID and removes the data dir.
#[derive(Debug)]
pub struct EtcdServer {
    bin: PathBuf,
    client_port: u16,
    peer_port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl EtcdServer {
    /// Starts etcd on free loopback ports and waits until it answers (30 s deadline).
    pub fn start() -> Result<Self, TestkitError> {
        let bin = find_etcd()?;
        let dir = tempfile::Builder::new().prefix("pdnode-etcd-").tempdir()?;
        let client_port = crate::free_port()?;
        let mut peer_port = crate::free_port()?;
        while peer_port == client_port {
            peer_port = crate::free_port()?;
        }
        let mut s = Self {
            bin,
            client_port,
            peer_port,
            dir,
            child: None,
        };
        s.spawn()?;
        Ok(s)
    }

    /// `http://127.0.0.1:{client_port}`
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    pub fn client_port(&self) -> u16 {
        self.client_port
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Whether the process is running (started and not stopped).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// The etcd log so far (stdout and stderr).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Kills etcd (SIGKILL) by PID and reaps it; ports and data dir are kept.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts etcd again on the same ports with the same data dir (stopping it first if running).
    pub fn restart(&mut self) -> Result<(), TestkitError> {
        self.stop();
        self.spawn()
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    fn spawn(&mut self) -> Result<(), TestkitError> {
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let child = Command::new(&self.bin)
            .arg("--name")
            .arg("pdnode-test")
            .arg("--data-dir")
            .arg(self.data_dir())
            .arg("--listen-client-urls")
            .arg(&client)
            .arg("--advertise-client-urls")
            .arg(&client)
            .arg("--listen-peer-urls")
            .arg(&peer)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer)
            .arg("--initial-cluster")
            .arg(format!("pdnode-test={peer}"))
            .arg("--log-level")
            .arg("warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| TestkitError::Spawn {
                what: self.bin.display().to_string(),
                reason: e.to_string(),
            })?;
        self.child = Some(child);
        let start = Instant::now();
        loop {
            if health_ok(self.client_port) {
                return Ok(());
            }
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(st)) = c.try_wait()
            {
                self.child = None;
                return Err(TestkitError::Spawn {
                    what: "etcd".into(),
                    reason: format!("exited with {st}; log:\n{}", self.log()),
                });
            }
            if start.elapsed() > READY_DEADLINE {
                self.stop();
                return Err(TestkitError::EtcdNotReady {
                    port: self.client_port,
                    waited: READY_DEADLINE,
                    log: self.log(),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `GET /health` answers `{"health":"true"...}`.
fn health_ok(port: u16) -> bool {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let _ = s.set_write_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.contains("\"health\":\"true\"")
}

fn find_etcd() -> Result<PathBuf, TestkitError> {
    if let Ok(p) = std::env::var("PDNODE_ETCD_BIN") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(TestkitError::EtcdMissing {
                tried: format!("PDNODE_ETCD_BIN={}", p.display()),
            })
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path).chain([PathBuf::from("/usr/bin")]) {
        let c = dir.join("etcd");
        if is_executable(&c) {
            return Ok(c);
        }
    }
    Err(TestkitError::EtcdMissing {
        tried: "`etcd` in PATH and /usr/bin".into(),
    })
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
