//! `pdnode check-config`: load and validate a config, print the effective config as TOML.

use super::{ConfigArgs, load_config};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub config: ConfigArgs,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let loaded = load_config(&args.config)?;
    let source = match &loaded.file {
        Some(p) => p.display().to_string(),
        None => "built-in defaults".to_string(),
    };
    println!("# effective configuration of {source} (defaults < file < PDNODE_* env < --set)");
    print!("{}", loaded.effective_toml());
    Ok(())
}
