//! `pdnode nodes`: list the nodes registered in a cluster (owned by the node runtime work).

use super::{ConfigArgs, not_available};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub config: ConfigArgs,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let loaded = super::load_config(&args.config)?;
    crate::logging::init(&loaded.config.log)?;
    Err(not_available(
        "nodes",
        "the registry client (memory and etcd Registry) is not wired into the CLI yet",
    ))
}
