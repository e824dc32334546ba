//! The hosts: one network namespace each, on one bridge that lives in its own namespace (the
//! "switch"), plus direct links ([`LINKS`]: prefill0 <-> decode0 for their KV, router <-> decode1
//! for its node API calls) so that one pair can be cut alone. Addresses are in 10.213.0.0/24, which exists only inside
//! these namespaces: the root namespace gets no interface, route or address.
//!
//! Every namespace is named `{prefix}-{host}`; [`Net`] deletes them (after killing whatever still
//! runs in them, by PID) when dropped. `run.sh` deletes whatever carries the prefix on exit too,
//! so a driver that was SIGKILLed leaves nothing behind.

use anyhow::{Context, Result, bail};
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Every `ip` command must finish within this.
const IP_DEADLINE: Duration = Duration::from_secs(10);

/// A host of the cluster: its name (namespace suffix) and address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Host {
    pub name: &'static str,
    pub ip: &'static str,
}

pub const ETCD: Host = Host {
    name: "etcd",
    ip: "10.213.0.2",
};
pub const ROUTER: Host = Host {
    name: "router",
    ip: "10.213.0.3",
};
pub const PREFILL: [Host; 2] = [
    Host {
        name: "prefill0",
        ip: "10.213.0.11",
    },
    Host {
        name: "prefill1",
        ip: "10.213.0.12",
    },
];
pub const DECODE: [Host; 2] = [
    Host {
        name: "decode0",
        ip: "10.213.0.21",
    },
    Host {
        name: "decode1",
        ip: "10.213.0.22",
    },
];
/// A third prefill host: its namespace exists in every run, its node starts only in the cases
/// that add a host under load (`prefill-join`, `etcd-outage-join`).
pub const SPARE_PREFILL: Host = Host {
    name: "prefill2",
    ip: "10.213.0.13",
};
/// Where the driver itself runs (the load and the checks).
pub const CLIENT: Host = Host {
    name: "client",
    ip: "10.213.0.100",
};

/// A direct link between two hosts beside the bridge, with a host route each way, so their
/// traffic leaves the bridge for it and the link can be cut alone. Cut on `b`'s end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Link {
    /// Interface name on both ends.
    pub name: &'static str,
    pub a: Host,
    pub b: Host,
}

/// prefill0 <-> decode0: their KV pushes (they exchange nothing else).
pub const KV_LINK: Link = Link {
    name: "kv0",
    a: PREFILL[0],
    b: DECODE[0],
};
/// router <-> decode1: the node API calls (ReserveKv, Decode streams, Stats).
pub const ROUTER_LINK: Link = Link {
    name: "rd1",
    a: ROUTER,
    b: DECODE[1],
};
pub const LINKS: [Link; 2] = [KV_LINK, ROUTER_LINK];

/// The interface every host has on the bridge (and the one UCX uses).
pub const HOST_IF: &str = "eth0";

const SWITCH: &str = "switch";

fn hosts() -> Vec<Host> {
    let mut v = vec![ETCD, ROUTER, CLIENT, SPARE_PREFILL];
    v.extend(PREFILL);
    v.extend(DECODE);
    v
}

/// The namespaces of one run; removed on drop.
#[derive(Debug)]
pub struct Net {
    prefix: String,
    created: Vec<String>,
}

impl Net {
    /// Builds the switch, every host and the pair link. On error, what was made is removed.
    pub fn create(prefix: &str) -> Result<Self> {
        if prefix.is_empty()
            || prefix.len() > 12
            || !prefix.chars().all(|c| c.is_ascii_alphanumeric())
        {
            bail!("namespace prefix {prefix:?}: 1-12 ASCII letters or digits");
        }
        let mut net = Self {
            prefix: prefix.to_string(),
            created: Vec::new(),
        };
        let sw = net.ns(SWITCH);
        net.add_ns(&sw)?;
        ip(&["-n", &sw, "link", "set", "lo", "up"])?;
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &sw, "link", "set", "br0", "up"])?;
        for h in hosts() {
            let ns = net.ns(h.name);
            net.add_ns(&ns)?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            // Bridge port names: at most 15 bytes.
            let port = format!("p-{}", h.name);
            ip(&[
                "-n", &sw, "link", "add", &port, "type", "veth", "peer", "name", HOST_IF, "netns",
                &ns,
            ])?;
            ip(&["-n", &sw, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &sw, "link", "set", &port, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", h.ip),
                "dev",
                HOST_IF,
            ])?;
            ip(&["-n", &ns, "link", "set", HOST_IF, "up"])?;
        }
        for l in LINKS {
            let (a, b) = (net.ns(l.a.name), net.ns(l.b.name));
            ip(&[
                "-n", &a, "link", "add", l.name, "type", "veth", "peer", "name", l.name, "netns",
                &b,
            ])?;
            ip(&["-n", &a, "link", "set", l.name, "up"])?;
            ip(&["-n", &b, "link", "set", l.name, "up"])?;
            net.link_routes(l)?;
        }
        Ok(net)
    }

    fn link_routes(&self, l: Link) -> Result<()> {
        for (ns, to) in [(self.ns(l.a.name), l.b.ip), (self.ns(l.b.name), l.a.ip)] {
            ip(&[
                "-n",
                &ns,
                "route",
                "replace",
                &format!("{to}/32"),
                "dev",
                l.name,
            ])?;
        }
        Ok(())
    }

    /// Takes the link down on `b`'s end. `b` loses its route over it (an admin-down link's
    /// routes are removed) and answers over the bridge; `a` keeps its route over a link without
    /// carrier, so everything it sends to `b` is dropped: their TCP connections stall with no
    /// reset, as over a dead cable.
    pub fn link_down(&self, l: Link) -> Result<()> {
        ip(&["-n", &self.ns(l.b.name), "link", "set", l.name, "down"])
    }

    /// Brings the link back and restores `b`'s route over it.
    pub fn link_up(&self, l: Link) -> Result<()> {
        ip(&["-n", &self.ns(l.b.name), "link", "set", l.name, "up"])?;
        self.link_routes(l)
    }

    /// Bytes `a` sent over the link so far.
    pub fn link_tx_bytes(&self, l: Link) -> Result<u64> {
        let out = ip_out(&["-n", &self.ns(l.a.name), "-s", "link", "show", l.name])?;
        // "    TX:  bytes packets ..." then the numbers on the next line.
        let mut lines = out.lines();
        while let Some(line) = lines.next() {
            if line.trim_start().starts_with("TX:") {
                let n = lines
                    .next()
                    .and_then(|v| v.split_whitespace().next())
                    .and_then(|v| v.parse().ok());
                return n.context("ip -s link: no TX bytes");
            }
        }
        bail!("ip -s link: no TX line in {out:?}")
    }

    /// `{prefix}-{host}`
    pub fn ns(&self, host: &str) -> String {
        format!("{}-{host}", self.prefix)
    }

    /// Moves the calling thread into `host`'s namespace. Called before any other thread
    /// exists, so every thread the driver starts later (its runtime) lives there too.
    pub fn enter(&self, host: &str) -> Result<()> {
        let path = format!("/run/netns/{}", self.ns(host));
        let f = std::fs::File::open(&path).with_context(|| format!("open {path}"))?;
        // SAFETY: setns(2) takes a descriptor we own and a flag; it touches no memory of ours.
        if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error()).context("setns into the client namespace");
        }
        Ok(())
    }

    fn add_ns(&mut self, ns: &str) -> Result<()> {
        ip(&["netns", "add", ns])?;
        self.created.push(ns.to_string());
        Ok(())
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.created.iter().rev() {
            if let Ok(out) = ip_out(&["netns", "pids", ns]) {
                for pid in out.split_whitespace().filter_map(|p| p.parse::<u32>().ok()) {
                    if pid != std::process::id() {
                        let _ = pdnode_testkit::send_signal(pid, "KILL");
                    }
                }
            }
            if let Err(e) = ip(&["netns", "del", ns]) {
                eprintln!("cluster: could not delete namespace {ns}: {e:#}");
            }
        }
    }
}

/// Runs `ip ARGS`, at most [`IP_DEADLINE`]; its output on success.
fn ip_out(args: &[&str]) -> Result<String> {
    let mut child = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("spawn `ip` (Debian iproute2)")?;
    let start = Instant::now();
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if start.elapsed() > IP_DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            bail!("`ip {}` took longer than {IP_DEADLINE:?}", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "`ip {}`: {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn ip(args: &[&str]) -> Result<()> {
    ip_out(args).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_address_is_in_the_private_range_and_unique() {
        let hs = hosts();
        for h in &hs {
            assert!(h.ip.starts_with("10.213.0."), "{h:?}");
            assert!(format!("p-{}", h.name).len() <= 15, "{h:?}");
        }
        for l in LINKS {
            assert!(
                l.name.len() <= 15 && l.name != HOST_IF && l.a != l.b,
                "{l:?}"
            );
        }
        let mut ips: Vec<_> = hs.iter().map(|h| h.ip).collect();
        ips.sort();
        ips.dedup();
        assert_eq!(ips.len(), hs.len());
    }

    #[test]
    fn a_bad_prefix_is_refused_before_anything_is_made() {
        for p in ["", "has space", "a-b", "waytoolongprefix"] {
            assert!(Net::create(p).is_err(), "{p:?}");
        }
    }
}
