//! `pdnode bench`: a serving benchmark against any OpenAI-compatible endpoint.

use super::not_available;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Base URL of the endpoint, e.g. http://127.0.0.1:8000
    #[arg(long)]
    pub url: String,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    crate::logging::init_default()?;
    let _ = args.url;
    Err(not_available("bench", "the load generator has not landed"))
}
