//! `pdnode start`: run a node with the role its config gives.
//!
//! Loads and validates the config (the same errors as `check-config`, exit 2), logs the
//! effective config, connects to the registry, starts the node runtime (supervision tree,
//! registration under a lease, node gRPC + health) and runs until SIGTERM/SIGINT, then shuts
//! down gracefully (revoke the lease, stop admitting, drain) and exits 0. A duplicate node id,
//! a registry still unreachable after `registry.start_wait_s` (tried while the engine loads) or
//! a node that fails past its restart limits exits 1.

use super::{ConfigArgs, load_config};
use anyhow::Context;
use pdnode_node::Node;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub config: ConfigArgs,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let loaded = load_config(&args.config)?;
    let telemetry = crate::logging::init_node(&loaded.config)?;
    let result = serve(&loaded).await;
    crate::logging::shutdown_telemetry(telemetry).await;
    result
}

async fn serve(loaded: &pdnode_core::config::Loaded) -> anyhow::Result<()> {
    let c = &loaded.config;
    tracing::info!(
        role = %c.node.role,
        cluster = %c.node.cluster,
        config = %loaded.file.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "(defaults)".into()),
        "effective configuration:\n{}",
        loaded.effective_toml()
    );
    if c.node.role == pdnode_core::Role::Router && c.router.sglang.enabled() {
        return super::sglang_router::serve(c).await;
    }
    // The registry is tried (once a second, up to registry.start_wait_s) while the engine loads.
    let registry = async {
        pdnode_registry::connect_waiting(&c.registry)
            .await
            .map_err(|source| pdnode_node::NodeError::RegistryUnreachable {
                endpoints: format!("{:?} {:?}", c.registry.kind, c.registry.endpoints),
                waited_s: c.registry.start_wait_s,
                source: Box::new(source),
            })
    };
    let deps = pdnode_node::assemble::assemble_connecting(c, registry)
        .await
        .context("the node did not start")?;
    let node = Node::start(c, deps)
        .await
        .context("the node did not start")?;
    let report = node.run_until_signal().await?;
    tracing::info!(
        deregistered = report.deregistered,
        in_flight_left = report.in_flight_left,
        elapsed_ms = report.elapsed_ms,
        "shut down"
    );
    Ok(())
}
