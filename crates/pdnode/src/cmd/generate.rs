//! `pdnode generate`: generate text from a prompt with a local model (owned by the engine work).

use super::{ConfigArgs, not_available};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// The prompt.
    #[arg(long, short = 'p')]
    pub prompt: String,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    crate::logging::init_default()?;
    let _ = (args.config, args.prompt);
    Err(not_available(
        "generate",
        "the engine (model loader, CPU/CUDA backend, sampler) has not landed",
    ))
}
