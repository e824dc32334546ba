//! The CUDA kernels compile: every `.cu` source is built with NVRTC for Hopper (sm_90) exactly as
//! the CUDA backend builds it at start, and the PTX defines every kernel the backend launches.
//! Needs libnvrtc but no GPU: `scripts/fetch-nvrtc.sh` puts the PyPI wheel's library under
//! `.cache/nvrtc` (the test command runs it), or point `PDNODE_NVRTC_DIR` at a folder holding it.

use pdnode_kernels::{KERNEL_NAMES, WGMMA_KERNEL_NAMES, compile_kernels, ptx_for_wgmma};
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

/// The opcode of a PTX instruction line (`@%p1 bra $L1;` -> `bra`), or None for directives,
/// labels, braces, comments and blank lines.
fn opcode(line: &str) -> Option<&str> {
    let mut l = line.trim();
    if l.is_empty() || l.starts_with('.') || l.starts_with("//") || l.starts_with('{') {
        return None;
    }
    if l.starts_with('}') || l.ends_with(':') {
        return None;
    }
    if l.starts_with('@') {
        l = l.split_once(char::is_whitespace)?.1.trim_start();
    }
    l.split(|c: char| c.is_whitespace() || c == ';').next()
}

/// Reads or writes memory other than the kernel's parameters.
fn touches_memory(op: &str) -> bool {
    let mem = [
        "ld.", "ldu.", "st.", "atom.", "red.", "cp.", "prefetch", "tex.", "sust", "suld",
    ];
    mem.iter().any(|p| op.starts_with(p)) && !op.starts_with("ld.param")
}

/// Programmatic dependent launch (`engine.cuda.pdl`) is only safe because every kernel waits on the
/// previous grid (`griddepcontrol.wait`) before it reads or writes any memory: in the sm_90 PTX,
/// each entry the backend launches has the wait before its first memory instruction, then the
/// `launch_dependents` trigger. Before sm_90 both compile to nothing (the kernels still build).
#[test]
fn every_kernel_waits_on_the_previous_grid_before_touching_memory() {
    let lib = preload_nvrtc().unwrap_or_else(|e| panic!("{e}"));
    let ptx = compile_kernels("sm_90")
        .unwrap_or_else(|e| panic!("NVRTC ({}) rejected the kernels: {e}", lib.display()));
    let bad = pdl_violations(&ptx, &KERNEL_NAMES);
    assert!(bad.is_empty(), "kernels unsafe under PDL: {bad:?}");
    let old = compile_kernels("sm_80")
        .unwrap_or_else(|e| panic!("NVRTC rejected the kernels for sm_80: {e}"));
    assert!(
        !old.contains("griddepcontrol"),
        "griddepcontrol is sm_90+: the PD_GRID_* macros must compile to nothing before it"
    );
}

/// The opcodes of entry `k`'s body in `ptx`, in text order, or `None` without that entry.
fn entry_ops<'a>(ptx: &'a str, k: &str) -> Option<Vec<&'a str>> {
    let at = ptx.find(&format!(".entry {k}("))?;
    let body = &ptx[at..];
    let body = &body[..body[1..].find(".entry ").map_or(body.len(), |e| e + 1)];
    Some(body.lines().skip(1).filter_map(opcode).collect())
}

/// Entries of `names` in `ptx` that touch memory before `griddepcontrol.wait` or lack the wait or
/// the trigger (each as a line saying what).
fn pdl_violations(ptx: &str, names: &[&str]) -> Vec<String> {
    let mut bad = Vec::new();
    for k in names {
        let Some(ops) = entry_ops(ptx, k) else {
            bad.push(format!("{k}: no entry"));
            continue;
        };
        let wait = ops.iter().position(|o| *o == "griddepcontrol.wait");
        let trigger = ops
            .iter()
            .position(|o| *o == "griddepcontrol.launch_dependents");
        let first_mem = ops.iter().position(|o| touches_memory(o));
        match (wait, trigger, first_mem) {
            (None, _, _) => bad.push(format!("{k}: no griddepcontrol.wait")),
            (_, None, _) => bad.push(format!("{k}: no griddepcontrol.launch_dependents")),
            (Some(w), Some(t), _) if t < w => bad.push(format!("{k}: trigger before the wait")),
            (Some(w), _, Some(m)) if m < w => bad.push(format!("{k}: {} before the wait", ops[m])),
            _ => {}
        }
    }
    bad
}

/// The Hopper-only program (wgmma prefill attention) compiles for compute_90a with its real
/// bodies (the feature macro `__CUDA_ARCH_FEAT_SM90_ALL` is defined there: the PTX holds wgmma),
/// defines every entry the backend loads from it, and is as safe under PDL as the main program.
#[test]
fn wgmma_kernels_compile_for_sm90a() {
    let lib = preload_nvrtc().unwrap_or_else(|e| panic!("{e}"));
    let ptx = ptx_for_wgmma()
        .unwrap_or_else(|e| panic!("NVRTC ({}) rejected the wgmma kernels: {e}", lib.display()))
        .to_src();
    for k in WGMMA_KERNEL_NAMES {
        assert!(ptx.contains(&format!(".entry {k}(")), "{k} not in the PTX");
    }
    assert!(ptx.contains("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"));
    assert!(ptx.contains(".target sm_90a"));
    let (stream, rest): (Vec<&str>, Vec<&str>) = WGMMA_KERNEL_NAMES
        .iter()
        .partition(|k| k.starts_with("gemv_stream_"));
    assert_eq!(stream.len(), 3, "gemv_stream_t1/t2/t4");
    let bad = pdl_violations(&ptx, &rest);
    assert!(bad.is_empty(), "wgmma kernels unsafe under PDL: {bad:?}");
    let bad = early_weight_violations(&ptx, &stream);
    assert!(
        bad.is_empty(),
        "gemv_stream kernels unsafe under PDL: {bad:?}"
    );
}

/// The gemv_stream kernels issue their first weight copies before `griddepcontrol.wait` (weights
/// are no kernel's output): before the wait, the only memory instructions allowed are those
/// bulk copies (global -> shared), L2 prefetches of weights and shared-memory ones (barrier
/// setup); any other global access there, or a missing wait or trigger, is a violation.
fn early_weight_violations(ptx: &str, names: &[&str]) -> Vec<String> {
    let mut bad = Vec::new();
    for k in names {
        let Some(ops) = entry_ops(ptx, k) else {
            bad.push(format!("{k}: no entry"));
            continue;
        };
        let Some(wait) = ops.iter().position(|o| *o == "griddepcontrol.wait") else {
            bad.push(format!("{k}: no griddepcontrol.wait"));
            continue;
        };
        if !ops.contains(&"griddepcontrol.launch_dependents") {
            bad.push(format!("{k}: no griddepcontrol.launch_dependents"));
        }
        let early_ok = |o: &str| {
            o.starts_with("cp.async.bulk.shared::cluster.global")
                || o.starts_with("cp.async.bulk.prefetch.L2.global")
                || o.starts_with("st.shared")
                || o.starts_with("ld.shared")
        };
        let copies = ops
            .iter()
            .filter(|o| o.starts_with("cp.async.bulk.shared::cluster.global"));
        if copies.count() == 0 {
            bad.push(format!("{k}: no bulk weight copy"));
        }
        for o in &ops[..wait] {
            if touches_memory(o) && !early_ok(o) {
                bad.push(format!("{k}: {o} before the wait"));
            }
        }
    }
    bad
}

#[test]
fn ptx_opcodes_are_read_as_the_pdl_check_expects() {
    assert_eq!(
        opcode("\tld.param.u64 \t%rd1, [k_param_0];"),
        Some("ld.param.u64")
    );
    assert_eq!(opcode("\t@%p1 bra \t$L__BB0_2;"), Some("bra"));
    assert_eq!(
        opcode("\tgriddepcontrol.wait;"),
        Some("griddepcontrol.wait")
    );
    assert_eq!(opcode("$L__BB0_2:"), None);
    assert_eq!(opcode("\t.reg .b32 \t%r<9>;"), None);
    assert_eq!(opcode("\t// begin inline asm"), None);
    assert!(touches_memory("ld.global.nc.u32"));
    assert!(touches_memory("st.shared.f32"));
    assert!(touches_memory("atom.global.add.u32"));
    assert!(touches_memory("cp.async.cg.shared.global"));
    assert!(!touches_memory("ld.param.u64"));
    assert!(!touches_memory("griddepcontrol.wait"));
    assert!(!touches_memory("mov.u32"));
}

/// The timeline builds (`PD_TRACE`, `bench_decode_trace`) compile, both programs: every entry the
/// backend loads reads `%globaltimer` and appends to its program's record buffer, and is still
/// safe under PDL (the records are written after the wait). The normal builds hold neither.
#[test]
fn traced_builds_record_every_kernel() {
    let lib = preload_nvrtc().unwrap_or_else(|e| panic!("{e}"));
    let main = pdnode_kernels::ptx_traced("compute_90")
        .unwrap_or_else(|e| panic!("NVRTC ({}) rejected the traced kernels: {e}", lib.display()))
        .to_src();
    let wg = pdnode_kernels::ptx_for_wgmma_traced()
        .unwrap_or_else(|e| panic!("NVRTC rejected the traced wgmma kernels: {e}"))
        .to_src();
    let mut bad = Vec::new();
    for (ptx, names) in [(&main, &KERNEL_NAMES[..]), (&wg, &WGMMA_KERNEL_NAMES[..])] {
        for k in names {
            let Some(at) = ptx.find(&format!(".entry {k}(")) else {
                bad.push(format!("{k}: no entry"));
                continue;
            };
            let body = &ptx[at..];
            let body = &body[..body[1..].find(".entry ").map_or(body.len(), |e| e + 1)];
            if !body.contains("%globaltimer") || !body.contains("pd_trace_n") {
                bad.push(format!("{k}: no trace record"));
            }
        }
    }
    assert!(bad.is_empty(), "traced builds: {bad:?}");
    let pdl = pdl_violations(&main, &KERNEL_NAMES);
    assert!(pdl.is_empty(), "traced kernels unsafe under PDL: {pdl:?}");
    let plain = compile_kernels("sm_90").unwrap_or_else(|e| panic!("{e}"));
    let plain_wg = ptx_for_wgmma().unwrap_or_else(|e| panic!("{e}")).to_src();
    for p in [&plain, &plain_wg] {
        assert!(!p.contains("%globaltimer") && !p.contains("pd_trace_buf"));
    }
}
