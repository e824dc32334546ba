//! `pdnode drain NODE`: a graceful shutdown of one node of a cluster, asked over its node API
//! (`Drain`), as SIGTERM on its host would: the node refuses new requests, (`--migrate`, a
//! decode node) has its running decodes moved to other decode nodes, deregisters and exits.
//!
//! `pdnode drain --config router.toml NODE_ID [--migrate] [--wait]`: the node's card comes from
//! the cluster's etcd (`--etcd`, or the config's registry); the call goes with the config's
//! node-plane TLS (a router's certificate: `Drain` is a router's call under mutual TLS).

use super::{ConfigArgs, UsageError};
use anyhow::Context;
use pdnode_core::NodeId;
use pdnode_nodeapi::grpc::{ChannelOptions, GrpcNodeClient};
use pdnode_nodeapi::tls::NodeTls;
use pdnode_registry::Registry;
use std::time::{Duration, Instant};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// The node to drain (its `node.id`).
    pub node: String,
    /// A decode node moves its running decodes to other decode nodes first (as
    /// `node.drain = "migrate"`); other nodes ignore it.
    #[arg(long)]
    pub migrate: bool,
    /// Wait until the node left the registry (at most `node.drain_timeout_s` + 30 s of the
    /// config).
    #[arg(long)]
    pub wait: bool,
    /// etcd endpoint(s) (repeatable); overrides the config's.
    #[arg(long = "etcd", value_name = "URL")]
    pub etcd: Vec<String>,
    /// Cluster; default: the config's node.cluster.
    #[arg(long)]
    pub cluster: Option<String>,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let loaded = super::load_config(&args.config)?;
    crate::logging::init(&loaded.config.log)?;
    let c = &loaded.config;
    let cluster = args
        .cluster
        .clone()
        .unwrap_or_else(|| c.node.cluster.clone());
    let reg = super::nodes::etcd_registry(c, &args.etcd).await?;
    let find = || async {
        reg.list(&cluster)
            .await
            .with_context(|| format!("cannot list cluster {cluster:?}"))
            .map(|s| s.cards.into_iter().find(|k| k.id.as_str() == args.node))
    };
    let card = find().await?.ok_or_else(|| {
        UsageError(format!(
            "no node {:?} in cluster {cluster:?} (`pdnode nodes` lists them)",
            args.node
        ))
    })?;
    if card.sglang.is_some() {
        return Err(UsageError(format!(
            "{} is an SGLang worker: it has no node API to drain",
            args.node
        ))
        .into());
    }
    let tls = NodeTls::from_config(c).context("the node plane's TLS files")?;
    let opts = ChannelOptions::from(&c.router).with_tls(tls);
    let client = GrpcNodeClient::connect_lazy_with(
        NodeId::new(args.node.clone()),
        card.role,
        &card.addresses.grpc,
        &opts,
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let migrate = tokio::time::timeout(Duration::from_secs(10), client.drain(args.migrate))
        .await
        .map_err(|_| anyhow::anyhow!("{} did not answer Drain within 10 s", args.node))?
        .map_err(|e| anyhow::anyhow!("Drain on {}: {e}", args.node))?;
    println!(
        "{}: draining{}",
        args.node,
        if migrate { ", moving its decodes" } else { "" }
    );
    if !args.wait {
        return Ok(());
    }
    let wait = Duration::from_secs(c.node.drain_timeout_s + 30);
    let until = Instant::now() + wait;
    while find()
        .await?
        .is_some_and(|k| k.started_at_ms == card.started_at_ms)
    {
        if Instant::now() > until {
            anyhow::bail!(
                "{} is still registered after {} s (node.drain_timeout_s + 30)",
                args.node,
                wait.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!("{}: left the cluster", args.node);
    Ok(())
}
