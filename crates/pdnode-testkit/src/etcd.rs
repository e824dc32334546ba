//! A real etcd server for tests, on free loopback ports, stopped by PID; optionally with TLS on
//! its client port ([`EtcdTls`]) and with etcd auth ([`EtcdServer::enable_auth`]).

use crate::TestkitError;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long [`EtcdServer::start`] waits for etcd to answer `/health`.
const READY_DEADLINE: Duration = Duration::from_secs(30);

/// TLS of a test etcd's client port (`--cert-file`, `--key-file`, `--trusted-ca-file`,
/// `--client-cert-auth`). The server certificate must name 127.0.0.1 (an IP SAN).
#[derive(Debug, Clone)]
pub struct EtcdTls {
    /// CA that client certificates must chain to (`--trusted-ca-file`).
    pub ca: PathBuf,
    /// The server's certificate and key.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Require a client certificate signed by `ca` (`--client-cert-auth`).
    pub client_cert_auth: bool,
    /// The CA the harness's own client trusts for the server's certificate (usually `ca`).
    pub server_ca: PathBuf,
    /// The certificate and key the harness's own admin client presents (needed with
    /// `client_cert_auth`).
    pub admin_cert: Option<(PathBuf, PathBuf)>,
}

/// How [`EtcdServer::start_with`] runs etcd.
#[derive(Debug, Clone, Default)]
pub struct EtcdOptions {
    /// TLS on the client port; `None`: plaintext `http://`.
    pub tls: Option<EtcdTls>,
    /// `--auth-token-ttl`, seconds (etcd's default: 300).
    pub auth_token_ttl_s: Option<u32>,
}

/// What an etcd user may do under a key prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EtcdAccess {
    Read,
    ReadWrite,
}

/// A user [`EtcdServer::enable_auth`] creates, with a role of its own that grants `access` to
/// the keys under `prefix`.
#[derive(Debug, Clone)]
pub struct EtcdUser {
    pub name: String,
    pub password: String,
    pub prefix: String,
    pub access: EtcdAccess,
}

/// A running etcd: `etcd --listen-client-urls http(s)://127.0.0.1:{client_port}` with a
/// temporary data dir; readiness is polled on a plaintext metrics port (`/health`), which
/// works whatever the client port demands. Dropping it kills the process by PID and removes
/// the data dir.
#[derive(Debug)]
pub struct EtcdServer {
    bin: PathBuf,
    client_port: u16,
    peer_port: u16,
    metrics_port: u16,
    opts: EtcdOptions,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl EtcdServer {
    /// Starts etcd on free loopback ports and waits until it answers (30 s deadline).
    pub fn start() -> Result<Self, TestkitError> {
        Self::start_with(EtcdOptions::default())
    }

    /// [`Self::start`] with TLS and auth token options.
    pub fn start_with(opts: EtcdOptions) -> Result<Self, TestkitError> {
        let bin = find_etcd()?;
        let dir = tempfile::Builder::new().prefix("pdnode-etcd-").tempdir()?;
        let mut ports = Vec::new();
        while ports.len() < 3 {
            let p = crate::free_port()?;
            if !ports.contains(&p) {
                ports.push(p);
            }
        }
        let mut s = Self {
            bin,
            client_port: ports[0],
            peer_port: ports[1],
            metrics_port: ports[2],
            opts,
            dir,
            child: None,
        };
        s.spawn()?;
        Ok(s)
    }

    /// `http://127.0.0.1:{client_port}`, or `https://` with TLS.
    pub fn endpoint(&self) -> String {
        let scheme = if self.opts.tls.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// Enables etcd auth: a `root` user (password `root_password`, role `root`), each of
    /// `users` with a role `{name}-role` granting its access to its prefix, then
    /// `auth enable`. Runs its own runtime on a thread of its own, so it may be called from
    /// inside or outside a tokio runtime.
    pub fn enable_auth(&self, root_password: &str, users: &[EtcdUser]) -> Result<(), TestkitError> {
        let endpoint = self.endpoint();
        let tls = self.opts.tls.clone();
        let root_password = root_password.to_string();
        let users = users.to_vec();
        let t = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(setup_auth(endpoint, tls, root_password, users))
        });
        t.join().map_err(|_| TestkitError::Etcd {
            op: "enable_auth",
            reason: "the setup thread panicked".into(),
        })?
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
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let metrics = format!("http://127.0.0.1:{}", self.metrics_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let mut cmd = Command::new(&self.bin);
        if let Some(t) = &self.opts.tls {
            cmd.arg("--cert-file")
                .arg(&t.cert)
                .arg("--key-file")
                .arg(&t.key)
                .arg("--trusted-ca-file")
                .arg(&t.ca);
            if t.client_cert_auth {
                cmd.arg("--client-cert-auth");
            }
        }
        if let Some(ttl) = self.opts.auth_token_ttl_s {
            cmd.arg("--auth-token-ttl").arg(ttl.to_string());
        }
        let child = cmd
            .arg("--listen-metrics-urls")
            .arg(&metrics)
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
            if health_ok(self.metrics_port) {
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
                    port: self.metrics_port,
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

/// What [`EtcdServer::enable_auth`] does, as root.
async fn setup_auth(
    endpoint: String,
    tls: Option<EtcdTls>,
    root_password: String,
    users: Vec<EtcdUser>,
) -> Result<(), TestkitError> {
    use etcd_client::{Certificate, Client, ConnectOptions, Identity, Permission, TlsOptions};
    let fail = |op: &'static str| {
        move |e: etcd_client::Error| TestkitError::Etcd {
            op,
            reason: e.to_string(),
        }
    };
    let mut co = ConnectOptions::new().with_connect_timeout(Duration::from_secs(5));
    if let Some(t) = &tls {
        let mut o =
            TlsOptions::new().ca_certificate(Certificate::from_pem(std::fs::read(&t.server_ca)?));
        if let Some((cert, key)) = &t.admin_cert {
            o = o.identity(Identity::from_pem(
                std::fs::read(cert)?,
                std::fs::read(key)?,
            ));
        }
        co = co.with_tls(o);
    }
    let mut c = Client::connect([endpoint], Some(co))
        .await
        .map_err(fail("connect"))?;
    // `auth enable` needs a root user holding the root role (which may exist already).
    c.user_add("root", root_password, None)
        .await
        .map_err(fail("user_add root"))?;
    if let Err(e) = c.role_add("root").await
        && !e.to_string().contains("already exists")
    {
        return Err(fail("role_add root")(e));
    }
    c.user_grant_role("root", "root")
        .await
        .map_err(fail("user_grant_role root"))?;
    for u in &users {
        let role = format!("{}-role", u.name);
        c.role_add(role.clone()).await.map_err(fail("role_add"))?;
        let perm = match u.access {
            EtcdAccess::Read => Permission::read(u.prefix.clone()),
            EtcdAccess::ReadWrite => Permission::read_write(u.prefix.clone()),
        }
        .with_prefix();
        c.role_grant_permission(role.clone(), perm)
            .await
            .map_err(fail("role_grant_permission"))?;
        c.user_add(u.name.clone(), u.password.clone(), None)
            .await
            .map_err(fail("user_add"))?;
        c.user_grant_role(u.name.clone(), role)
            .await
            .map_err(fail("user_grant_role"))?;
    }
    c.auth_enable().await.map_err(fail("auth_enable"))?;
    Ok(())
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
