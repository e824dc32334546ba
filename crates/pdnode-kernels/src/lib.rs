//! pdnode-kernels: the CUDA kernel sources of the CUDA backend (`kernels/*.cu`), the list of entry
//! points the backend launches, and their NVRTC compilation (needs libnvrtc, no GPU).
//!
//! A crate of its own so that editing a `.cu` file rebuilds this crate and the CUDA backend, not
//! the engine (loaders, text, sampling, scheduler) and its tests. The emulator harnesses under
//! `emu/` run kernels on the CPU (`emu/*/run.sh`); `tests/kernels_compile.rs` compiles every
//! source with NVRTC for sm_90 and checks the PTX.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Why the kernels could not be compiled.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("libnvrtc not found")]
    NoNvrtc,
    #[error("NVRTC could not compile the kernels for {arch}: {log}")]
    Compile { arch: String, log: String },
    #[error("the compiled-kernel cache lock is poisoned")]
    CachePoisoned,
}

impl pdnode_core::error::Classify for KernelError {
    fn kind(&self) -> pdnode_core::ErrorKind {
        match self {
            KernelError::NoNvrtc => pdnode_core::ErrorKind::Unavailable,
            KernelError::Compile { .. } | KernelError::CachePoisoned => {
                pdnode_core::ErrorKind::Internal
            }
        }
    }
}

/// The kernel sources by file name, compiled together (in this order) as one NVRTC program.
pub const SOURCES: [(&str, &str); 16] = [
    ("common.cuh", include_str!("../kernels/common.cuh")),
    ("elementwise.cu", include_str!("../kernels/elementwise.cu")),
    ("rope.cu", include_str!("../kernels/rope.cu")),
    ("attention.cu", include_str!("../kernels/attention.cu")),
    (
        "attention_v2.cu",
        include_str!("../kernels/attention_v2.cu"),
    ),
    (
        "attention_v4.cu",
        include_str!("../kernels/attention_v4.cu"),
    ),
    ("kv_copy.cu", include_str!("../kernels/kv_copy.cu")),
    ("prefill.cu", include_str!("../kernels/prefill.cu")),
    (
        "prefill_flash.cu",
        include_str!("../kernels/prefill_flash.cu"),
    ),
    (
        "prefill_flash_v3.cu",
        include_str!("../kernels/prefill_flash_v3.cu"),
    ),
    ("gemv.cu", include_str!("../kernels/gemv.cu")),
    ("sample.cu", include_str!("../kernels/sample.cu")),
    ("crc32c.cu", include_str!("../kernels/crc32c.cu")),
    ("kvh64.cu", include_str!("../kernels/kvh64.cu")),
    ("mla.cu", include_str!("../kernels/mla.cu")),
    ("moe.cu", include_str!("../kernels/moe.cu")),
];

/// Kernel entry points (extern "C" names in the .cu files).
pub const KERNEL_NAMES: [&str; 57] = [
    "gemv_t1",
    "gemv_t2",
    "gemv_t4",
    "gemv_t8",
    "gemv_mma_m1",
    "gemv_mma_m2",
    "gemv_mma_m1_pf",
    "gemv_mma_m2_pf",
    "gemv_mma_glu_m1",
    "gemv_mma_glu_m1_pf",
    "gemv_mma_m1_norm",
    "gemv_mma_m1_pf_norm",
    "paged_attention_v2_d8",
    "paged_attention_v2_d16",
    "paged_attention_v4_d64_g8",
    "paged_attention_v4_d64_g16",
    "paged_attention_v4_d128_g8",
    "paged_attention_v4_d128_g16",
    "paged_attention_v4_d128_g8_w2",
    "transpose_heads",
    "kv_gather_seq",
    "causal_softmax",
    "flash_prefill_hd64_w8",
    "flash_prefill_hd128_w8",
    "flash_prefill_hd64_v3",
    "flash_prefill_hd128_v3",
    "embed_gather",
    "add_rmsnorm",
    "add_rmsnorm_v4",
    "swiglu",
    "swiglu_v8",
    "fill_uniform_bf16",
    "fill_uniform_bf16_2d",
    "fill_f32",
    "rope_qkv",
    "rope_qkv_v4",
    "paged_attention",
    "attention_combine",
    "kv_gather",
    "kv_scatter",
    "argmax_rows",
    "sample_rows",
    "crc32c_chunks",
    "kvh64_words",
    "kv_gather_h64",
    "kv_scatter_h64",
    "mla_rope_latent",
    "mla_attn_split",
    "mla_attn_split_tc",
    "mla_attn_combine",
    "mla_gather_seq",
    "mla_q_head_major",
    "moe_route",
    "moe_gate_up_swiglu",
    "moe_down",
    "moe_combine",
    "gather_rows_bf16",
];

/// The text of kernel source `file` (e.g. `sample.cu`), if it is one of [`SOURCES`].
pub fn source(file: &str) -> Option<&'static str> {
    SOURCES
        .iter()
        .find(|(name, _)| *name == file)
        .map(|(_, text)| *text)
}

/// Compiles the kernel program for `arch` (e.g. "compute_90") and returns its PTX text; needs
/// libnvrtc but no GPU. The CUDA backend does this at start; tests use it to check the sources.
pub fn compile_kernels(arch: &str) -> Result<String, KernelError> {
    Ok(ptx_for(arch)?.to_src())
}

/// PTX per target architecture, compiled once per process.
pub fn ptx_for(arch: &str) -> Result<cudarc::nvrtc::Ptx, KernelError> {
    static CACHE: OnceLock<Mutex<HashMap<String, cudarc::nvrtc::Ptx>>> = OnceLock::new();
    compile_cached(&CACHE, &SOURCES, arch, false)
}

/// As [`ptx_for`] with the timeline records compiled in (`PD_TRACE`, see common.cuh): every
/// kernel's blocks append (launch, function, SM, block, reached-wait / wait-returned / returned
/// times) to the program's `pd_trace_buf`. For `bench_decode_trace`; the backend loads it only
/// where asked to (`pdnode_cuda::trace::set_trace_kernels`).
pub fn ptx_traced(arch: &str) -> Result<cudarc::nvrtc::Ptx, KernelError> {
    static CACHE: OnceLock<Mutex<HashMap<String, cudarc::nvrtc::Ptx>>> = OnceLock::new();
    compile_cached(&CACHE, &SOURCES, arch, true)
}

/// Record slots of a traced program's `pd_trace_buf` (`PD_TRACE_CAP`) and u64 words a record
/// (`PD_TRACE_WORDS`), as common.cuh defines them.
pub const TRACE_CAP: usize = 262144;
pub const TRACE_WORDS: usize = 5;

/// The function-name hash a trace record carries (FNV-1a over the name's bytes, as
/// `PdTraceScope` computes it from `__func__`).
pub fn trace_name_hash(name: &str) -> u32 {
    name.bytes()
        .fold(2166136261u32, |h, b| (h ^ b as u32).wrapping_mul(16777619))
}

/// The sources of the Hopper-only program (wgmma), compiled for `compute_90a`: the helpers of
/// common.cuh and prefill_flash.cu, then prefill_flash_wg.cu and the decode GEMV that streams its
/// weights by bulk copies (gemv_stream.cu, which uses the mbarrier helpers of the file before it).
pub const WGMMA_SOURCES: [(&str, &str); 4] = [
    ("common.cuh", include_str!("../kernels/common.cuh")),
    (
        "prefill_flash.cu",
        include_str!("../kernels/prefill_flash.cu"),
    ),
    (
        "prefill_flash_wg.cu",
        include_str!("../kernels/prefill_flash_wg.cu"),
    ),
    ("gemv_stream.cu", include_str!("../kernels/gemv_stream.cu")),
];

/// Entry points of [`WGMMA_SOURCES`] the backend loads on a compute capability 9.0 device.
pub const WGMMA_KERNEL_NAMES: [&str; 6] = [
    "flash_prefill_hd128_wg",
    "flash_prefill_hd128_ws",
    "wgmma_probe",
    "gemv_stream_t1",
    "gemv_stream_t2",
    "gemv_stream_t4",
];

/// The architecture [`ptx_for_wgmma`] compiles for: wgmma exists only on `sm_90a`.
pub const WGMMA_ARCH: &str = "compute_90a";

/// PTX of [`WGMMA_SOURCES`] for [`WGMMA_ARCH`], compiled once per process.
pub fn ptx_for_wgmma() -> Result<cudarc::nvrtc::Ptx, KernelError> {
    static CACHE: OnceLock<Mutex<HashMap<String, cudarc::nvrtc::Ptx>>> = OnceLock::new();
    compile_cached(&CACHE, &WGMMA_SOURCES, WGMMA_ARCH, false)
}

/// [`ptx_for_wgmma`] with the timeline records compiled in (see [`ptx_traced`]).
pub fn ptx_for_wgmma_traced() -> Result<cudarc::nvrtc::Ptx, KernelError> {
    static CACHE: OnceLock<Mutex<HashMap<String, cudarc::nvrtc::Ptx>>> = OnceLock::new();
    compile_cached(&CACHE, &WGMMA_SOURCES, WGMMA_ARCH, true)
}

fn compile_cached(
    cache: &OnceLock<Mutex<HashMap<String, cudarc::nvrtc::Ptx>>>,
    sources: &[(&str, &str)],
    arch: &str,
    trace: bool,
) -> Result<cudarc::nvrtc::Ptx, KernelError> {
    let cache = cache.get_or_init(|| Mutex::new(HashMap::new()));
    let mut guard = cache.lock().map_err(|_| KernelError::CachePoisoned)?;
    if let Some(p) = guard.get(arch) {
        return Ok(p.clone());
    }
    // SAFETY: only tries to dlopen libnvrtc; no symbol is called.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(KernelError::NoNvrtc);
    }
    let src: String = sources.iter().map(|(_, text)| *text).collect();
    let mut options = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "-lineinfo".into(),
    ];
    if trace {
        options.push("-DPD_TRACE".into());
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options,
        ..Default::default()
    };
    let t0 = std::time::Instant::now();
    let ptx =
        cudarc::nvrtc::compile_ptx_with_opts(src, opts).map_err(|e| KernelError::Compile {
            arch: arch.to_string(),
            log: format!("{e:?}"),
        })?;
    tracing::info!(
        arch,
        ms = t0.elapsed().as_millis() as u64,
        "compiled CUDA kernels"
    );
    guard.insert(arch.to_string(), ptx.clone());
    Ok(ptx)
}
