//! `pdnode nodes`: list the nodes registered in a cluster.
//!
//! `pdnode nodes --etcd http://127.0.0.1:2379 [--cluster C] [--json]`; without `--etcd`, the
//! registry of `--config` (which must be etcd: a memory registry lives inside one process).

use super::{ConfigArgs, UsageError};
use anyhow::Context;
use pdnode_core::NodeCard;
use pdnode_core::config::{RegistryConfig, RegistryKind};
use pdnode_registry::{EtcdRegistry, Registry};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// etcd endpoint(s), e.g. http://127.0.0.1:2379 (repeatable); overrides the config's.
    #[arg(long = "etcd", value_name = "URL")]
    pub etcd: Vec<String>,
    /// Cluster to list; default: the config's node.cluster ("default").
    #[arg(long)]
    pub cluster: Option<String>,
    /// Print the node cards as JSON (one array) instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let loaded = super::load_config(&args.config)?;
    crate::logging::init(&loaded.config.log)?;
    let c = &loaded.config;
    let cluster = args.cluster.unwrap_or_else(|| c.node.cluster.clone());
    let reg = etcd_registry(c, &args.etcd).await?;
    let snap = reg
        .list(&cluster)
        .await
        .with_context(|| format!("cannot list cluster {cluster:?}"))?;
    let now = now_ms();
    if args.json {
        let v: Vec<serde_json::Value> = snap
            .cards
            .iter()
            .map(|card| {
                let mut v = serde_json::to_value(card).unwrap_or_default();
                if let Some(o) = v.as_object_mut() {
                    o.insert(
                        "age_s".into(),
                        (now.saturating_sub(card.started_at_ms) / 1000).into(),
                    );
                }
                v
            })
            .collect();
        println!("{}", serde_json::Value::Array(v));
    } else {
        print!("{}", table(&snap.cards, now));
    }
    Ok(())
}

/// The cluster's etcd: `etcd` when given, else the config's registry (which must be etcd: a
/// memory registry lives inside one process); TLS and credentials from the config's
/// `registry.etcd_*` (the same as the nodes').
pub(super) async fn etcd_registry(
    c: &pdnode_core::config::Config,
    etcd: &[String],
) -> anyhow::Result<EtcdRegistry> {
    let endpoints = if !etcd.is_empty() {
        etcd.to_vec()
    } else if c.registry.kind == RegistryKind::Etcd {
        c.registry.endpoints.clone()
    } else {
        return Err(UsageError(
            "no etcd to ask: pass --etcd URL or a --config with registry.kind = \"etcd\" \
             (a memory registry lives inside one process)"
                .into(),
        )
        .into());
    };
    let reg_cfg = RegistryConfig {
        kind: RegistryKind::Etcd,
        endpoints: endpoints.clone(),
        ..c.registry.clone()
    };
    EtcdRegistry::from_config(&reg_cfg)
        .await
        .with_context(|| format!("cannot reach etcd at {}", endpoints.join(",")))
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn age(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{}s", s / 60, s % 60),
        _ => format!("{}h{}m", s / 3600, (s % 3600) / 60),
    }
}

/// The ROLE cell: the role, and for a role-`all` node whether it is colocated (serves both
/// phases on its node API, so routers pair it with itself) or keeps its engines in process.
fn role_cell(c: &NodeCard) -> String {
    if c.sglang.is_some() {
        return format!("{} (sglang)", c.role);
    }
    match (c.role, c.colocated) {
        (pdnode_core::Role::All, true) => "all (colocated)".into(),
        (pdnode_core::Role::All, false) => "all (in-process)".into(),
        (r, _) => r.to_string(),
    }
}

/// ROLE, ID, MODEL, GRPC, LOAD (running/max, queued, free KV blocks), AGE.
fn table(cards: &[NodeCard], now: u64) -> String {
    let header = ["ROLE", "ID", "MODEL", "GRPC", "LOAD", "AGE"].map(String::from);
    let mut rows = vec![header];
    for c in cards {
        let k = &c.capacity;
        rows.push([
            role_cell(c),
            c.id.to_string(),
            if c.model_id.is_empty() {
                "-".into()
            } else {
                c.model_id.clone()
            },
            // An SGLang worker has no node API: its HTTP URL is where it is reached.
            c.sglang
                .as_ref()
                .map_or_else(|| c.addresses.grpc.clone(), |s| s.url.clone()),
            format!(
                "{}/{} run, {} queued, kv {}/{} free",
                k.running_requests,
                k.max_running_requests,
                k.queued_requests,
                k.kv_blocks_free,
                k.kv_blocks_total
            ),
            age(now.saturating_sub(c.started_at_ms)),
        ]);
    }
    let widths: Vec<usize> = (0..6)
        .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in &rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    if cards.is_empty() {
        out.push_str("(no nodes registered)\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdnode_core::card::{NodeAddresses, NodeCapacity};
    use pdnode_core::{NodeId, Role};

    fn card(id: &str, role: Role, colocated: bool) -> NodeCard {
        NodeCard {
            id: NodeId::new(id),
            role,
            cluster: "default".into(),
            model_id: "m".into(),
            model_fingerprint: "fp".into(),
            kv_layout: None,
            tp_size: 1,
            addresses: NodeAddresses {
                grpc: "127.0.0.1:7000".into(),
                http: None,
                ucx_worker: None,
            },
            capacity: NodeCapacity::default(),
            version: "0".into(),
            started_at_ms: 0,
            colocated,
            sglang: None,
            draining: false,
        }
    }

    #[test]
    fn the_role_column_says_whether_an_all_node_is_colocated() {
        let t = table(
            &[
                card("a0", Role::All, true),
                card("a1", Role::All, false),
                card("p0", Role::Prefill, false),
            ],
            61_000,
        );
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4, "{t}");
        assert!(lines[0].starts_with("ROLE "), "{t}");
        assert!(lines[1].starts_with("all (colocated)   a0 "), "{t}");
        assert!(lines[2].starts_with("all (in-process)  a1 "), "{t}");
        assert!(lines[3].starts_with("prefill           p0 "), "{t}");
        assert!(lines[1].ends_with("1m1s"), "{t}");
    }
}
