//! The hosts: one network namespace each, on one bridge that lives in its own namespace (the
//! "switch"), plus one direct link between `prefill0` and `decode0` that carries their KV traffic
//! (so that link can go down alone). Addresses are in 10.213.0.0/24, which exists only inside
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
/// Where the driver itself runs (the load and the checks).
pub const CLIENT: Host = Host {
    name: "client",
    ip: "10.213.0.100",
};

/// The direct `prefill0` <-> `decode0` link: interface name on both ends.
pub const PAIR_LINK: &str = "kv0";
/// The interface every host has on the bridge (and the one UCX uses).
pub const HOST_IF: &str = "eth0";

const SWITCH: &str = "switch";

fn hosts() -> Vec<Host> {
    let mut v = vec![ETCD, ROUTER, CLIENT];
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
        // prefill0 <-> decode0: a direct veth with a host route each way, so their traffic (the
        // KV pushes; they exchange nothing else) leaves the bridge for this link.
        let (p, d) = (net.ns(PREFILL[0].name), net.ns(DECODE[0].name));
        ip(&[
            "-n", &p, "link", "add", PAIR_LINK, "type", "veth", "peer", "name", PAIR_LINK, "netns",
            &d,
        ])?;
        ip(&["-n", &p, "link", "set", PAIR_LINK, "up"])?;
        ip(&["-n", &d, "link", "set", PAIR_LINK, "up"])?;
        net.pair_routes()?;
        Ok(net)
    }

    fn pair_routes(&self) -> Result<()> {
        let (p, d) = (self.ns(PREFILL[0].name), self.ns(DECODE[0].name));
        for (ns, to) in [(&p, DECODE[0].ip), (&d, PREFILL[0].ip)] {
            ip(&[
                "-n",
                ns,
                "route",
                "replace",
                &format!("{to}/32"),
                "dev",
                PAIR_LINK,
            ])?;
        }
        Ok(())
    }

    /// Takes the pair link down on decode0's end. decode0 loses its route to prefill0 (an
    /// admin-down link's routes are removed) and answers over the bridge; prefill0 keeps its
    /// route over a link without carrier, so everything it sends to decode0 is dropped: the
    /// pair's TCP connections stall with no reset, as over a dead cable.
    pub fn pair_link_down(&self) -> Result<()> {
        ip(&[
            "-n",
            &self.ns(DECODE[0].name),
            "link",
            "set",
            PAIR_LINK,
            "down",
        ])
    }

    /// Brings the pair link back and restores decode0's route over it.
    pub fn pair_link_up(&self) -> Result<()> {
        ip(&[
            "-n",
            &self.ns(DECODE[0].name),
            "link",
            "set",
            PAIR_LINK,
            "up",
        ])?;
        self.pair_routes()
    }

    /// Bytes prefill0 sent over the pair link so far.
    pub fn pair_link_tx_bytes(&self) -> Result<u64> {
        let out = ip_out(&[
            "-n",
            &self.ns(PREFILL[0].name),
            "-s",
            "link",
            "show",
            PAIR_LINK,
        ])?;
        // "    TX:  bytes packets ..." then the numbers on the next line.
        let mut lines = out.lines();
        while let Some(l) = lines.next() {
            if l.trim_start().starts_with("TX:") {
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
