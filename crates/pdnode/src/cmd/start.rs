//! `pdnode start`: run a node with the role its config gives.
//!
//! Owned by the node runtime work: this first version loads and validates the config (the same
//! errors as `check-config`, exit 2), logs the effective config, then says what is missing.

use super::{ConfigArgs, load_config, not_available};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub config: ConfigArgs,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let loaded = load_config(&args.config)?;
    crate::logging::init(&loaded.config.log)?;
    let c = &loaded.config;
    tracing::info!(
        role = %c.node.role,
        cluster = %c.node.cluster,
        config = %loaded.file.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "(defaults)".into()),
        "effective configuration:\n{}",
        loaded.effective_toml()
    );
    Err(not_available(
        "start",
        &format!(
            "the node runtime (NodeSupervisor with engine, transfer, registry and router actors) \
             has not landed; the config for role \"{}\" is valid",
            c.node.role
        ),
    ))
}
