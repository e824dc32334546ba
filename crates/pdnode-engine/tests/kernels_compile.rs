//! The CUDA kernels compile: every `.cu` source is built with NVRTC for Hopper (sm_90) exactly as
//! the CUDA backend builds it at start, and the PTX defines every kernel the backend launches.
//! Needs libnvrtc but no GPU: `scripts/fetch-nvrtc.sh` puts the PyPI wheel's library under
//! `.cache/nvrtc` (the test command runs it), or point `PDNODE_NVRTC_DIR` at a folder holding it.
#![cfg(feature = "cuda")]

use pdnode_engine::backend::cuda::device::{KERNEL_NAMES, compile_kernels};
use std::path::{Path, PathBuf};

/// Files under `dir` (recursively) whose name starts with `prefix`.
fn find(dir: &Path, prefix: &str, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            find(&p, prefix, out);
        } else if p
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(prefix) && !n.contains(".alt."))
        {
            out.push(p);
        }
    }
}

/// Loads libnvrtc (and the builtins it opens by name) from an absolute path, so that the
/// by-name lookup of the backend finds it already loaded. Returns where it came from.
fn preload_nvrtc() -> Result<PathBuf, String> {
    let dir = std::env::var_os("PDNODE_NVRTC_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/nvrtc"));
    let mut builtins = Vec::new();
    find(&dir, "libnvrtc-builtins.so", &mut builtins);
    let mut libs = Vec::new();
    find(&dir, "libnvrtc.so", &mut libs);
    let (Some(b), Some(l)) = (builtins.first(), libs.first()) else {
        return Err(format!(
            "libnvrtc not found under {} (run scripts/fetch-nvrtc.sh or set PDNODE_NVRTC_DIR)",
            dir.display()
        ));
    };
    for p in [b, l] {
        // SAFETY: loading NVIDIA's NVRTC library runs no code of ours; it stays loaded for the
        // life of the test process (leaked on purpose).
        let lib = unsafe { libloading::Library::new(p) }
            .map_err(|e| format!("loading {}: {e}", p.display()))?;
        std::mem::forget(lib);
    }
    Ok(l.clone())
}

#[test]
fn every_kernel_compiles_for_hopper() {
    let lib = preload_nvrtc().unwrap_or_else(|e| panic!("{e}"));
    let ptx = compile_kernels("sm_90")
        .unwrap_or_else(|e| panic!("NVRTC ({}) rejected the kernels: {e}", lib.display()));
    let missing: Vec<&str> = KERNEL_NAMES
        .iter()
        .copied()
        .filter(|k| !ptx.contains(&format!(".entry {k}(")))
        .collect();
    assert!(
        missing.is_empty(),
        "kernels launched by the backend but not defined in the PTX: {missing:?}"
    );
}
