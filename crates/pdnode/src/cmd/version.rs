//! `pdnode version`: version, git commit and enabled cargo features.

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print as JSON.
    #[arg(long)]
    pub json: bool,
}

/// The crate version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The git commit the binary was built from (`PDNODE_GIT_COMMIT` at build time, else
/// `git rev-parse`), or "unknown".
pub const GIT_COMMIT: &str = env!("PDNODE_GIT_COMMIT");
/// Enabled cargo features of the `pdnode` crate, comma-separated; empty when none.
pub const FEATURES: &str = env!("PDNODE_FEATURES");

pub async fn run(args: Args) -> anyhow::Result<()> {
    let features: Vec<&str> = FEATURES.split(',').filter(|s| !s.is_empty()).collect();
    if args.json {
        let v = serde_json::json!({
            "version": VERSION,
            "git_commit": GIT_COMMIT,
            "features": features,
        });
        println!("{v}");
    } else {
        println!("pdnode {VERSION}");
        println!("git commit: {GIT_COMMIT}");
        println!(
            "features: {}",
            if features.is_empty() {
                "(none)".to_string()
            } else {
                features.join(", ")
            }
        );
    }
    Ok(())
}
