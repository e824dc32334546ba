//! Records the git commit and the enabled features for `pdnode version`.

use std::path::Path;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=PDNODE_GIT_COMMIT");
    let commit = std::env::var("PDNODE_GIT_COMMIT")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .or_else(git_commit)
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=PDNODE_GIT_COMMIT={commit}");

    let mut features: Vec<String> = std::env::vars()
        .filter_map(|(k, _)| k.strip_prefix("CARGO_FEATURE_").map(|f| f.to_lowercase()))
        .collect();
    features.sort();
    println!("cargo:rustc-env=PDNODE_FEATURES={}", features.join(","));
}

fn git_commit() -> Option<String> {
    let out = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    // Rebuild when HEAD moves: HEAD itself and the ref it points at.
    let git_dir = Command::new("git")
        .args(["rev-parse", "--git-dir"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    if let Some(dir) = git_dir {
        let dir = Path::new(&dir);
        println!("cargo:rerun-if-changed={}", dir.join("HEAD").display());
        if let Ok(head) = std::fs::read_to_string(dir.join("HEAD"))
            && let Some(r) = head.trim().strip_prefix("ref: ")
        {
            let ref_file = dir.join(r);
            // A packed ref has no file of its own; watching a missing file would rebuild always.
            let watched = if ref_file.exists() {
                ref_file
            } else {
                dir.join("packed-refs")
            };
            if watched.exists() {
                println!("cargo:rerun-if-changed={}", watched.display());
            }
        }
    }
    let s = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (!s.is_empty()).then_some(s)
}
