//! Loader tests: GGUF against the HF reference (un-permuted Q/K), ggml dequantization against
//! gguf-py, corrupted and truncated files (errors naming the file, never a panic), config errors,
//! dummy presets.

use pdnode_core::BlockId;
use pdnode_engine::backend::cpu::{CpuBackend, CpuBackendConfig};
use pdnode_engine::backend::{Backend, ForwardBatch, SeqStep};
use pdnode_engine::loader::gguf::GgufFile;
use pdnode_engine::loader::quant::{GgmlType, dequantize};
use pdnode_engine::loader::{
    DummySpec, LoadError, LoadedModel, ModelWeights, TokenizerSource, gguf_model, load_dummy,
    load_path,
};
use std::path::{Path, PathBuf};

pub(crate) fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A scratch directory under the system temp dir, removed on drop.
pub(crate) struct Scratch(pub(crate) PathBuf);

impl Scratch {
    pub(crate) fn new(tag: &str) -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p =
            std::env::temp_dir().join(format!("pdnode-loader-{}-{tag}-{n}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn reference_logits(name: &str) -> (Vec<u32>, Vec<f32>) {
    let text = std::fs::read_to_string(fixtures().join(name).join("reference.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let prompt = v["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let logits = v["logits"][0]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    (prompt, logits)
}

fn prompt_logits(model: LoadedModel, prompt: &[u32]) -> Vec<f32> {
    let mut b = CpuBackend::from_loaded(
        model,
        CpuBackendConfig {
            block_size: 16,
            num_blocks: 8,
            threads: 2,
        },
    )
    .unwrap();
    let table: Vec<BlockId> = (0..8).map(BlockId).collect();
    let out = b
        .forward(&ForwardBatch {
            seqs: vec![SeqStep {
                tokens: prompt,
                start_pos: 0,
                block_table: &table,
                want_logits: true,
            }],
        })
        .unwrap();
    out.row(0).to_vec()
}

#[test]
fn f32_gguf_with_permuted_qk_matches_the_hf_reference() {
    let (prompt, want) = reference_logits("llama_gqa");
    let model = load_path(&fixtures().join("gguf_tiny/tiny-f32.gguf")).unwrap();
    assert!(!model.spec.tie_word_embeddings);
    let got = prompt_logits(model, &prompt);
    for (a, b) in got.iter().zip(&want) {
        assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "{a} vs {b}");
    }
    // And the HF directory of the same model gives the same tokenizer-free spec shapes.
    let hf = load_path(&fixtures().join("llama_gqa")).unwrap();
    let gg = load_path(&fixtures().join("gguf_tiny/tiny-f32.gguf")).unwrap();
    assert_eq!(hf.spec.q_dim(), gg.spec.q_dim());
    assert_eq!(hf.spec.num_kv_heads, gg.spec.num_kv_heads);
    if let (ModelWeights::Host(a), ModelWeights::Host(b)) = (&hf.weights, &gg.weights) {
        assert_eq!(
            a.layers[1].wq, b.layers[1].wq,
            "wq un-permuted back to HF order"
        );
        assert_eq!(
            a.layers[1].wk, b.layers[1].wk,
            "wk un-permuted back to HF order"
        );
    } else {
        panic!("host weights expected");
    }
}

#[test]
fn q8_0_gguf_is_close_to_the_reference_and_carries_its_tokenizer() {
    let (prompt, want) = reference_logits("llama_gqa");
    let model = load_path(&fixtures().join("gguf_tiny/tiny-q8_0.gguf")).unwrap();
    match &model.tokenizer {
        TokenizerSource::Gguf(t) => {
            assert_eq!(t.model, "gpt2");
            assert_eq!(t.tokens.len(), 128);
            assert_eq!(t.tokens[5], "t5");
            assert_eq!(t.merges, vec!["t 1", "t 2"]);
            assert_eq!(t.token_types[0], 3);
            assert_eq!((t.bos_token_id, t.eos_token_id), (Some(1), Some(2)));
            assert!(t.chat_template.as_deref().unwrap().contains("messages"));
        }
        other => panic!("expected a GGUF tokenizer, got {other:?}"),
    }
    let got = prompt_logits(model, &prompt);
    let max_err = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    // Q8_0 is lossy (so not equal) but close.
    assert!(max_err > 1e-6 && max_err < 0.1, "max error {max_err}");
}

#[test]
fn dequantization_matches_gguf_py_for_every_type() {
    let text = std::fs::read_to_string(fixtures().join("quant_blocks.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let types = [
        ("Q4_0", GgmlType::Q4_0),
        ("Q4_1", GgmlType::Q4_1),
        ("Q5_0", GgmlType::Q5_0),
        ("Q5_1", GgmlType::Q5_1),
        ("Q8_0", GgmlType::Q8_0),
        ("Q4_K", GgmlType::Q4K),
        ("Q5_K", GgmlType::Q5K),
        ("Q6_K", GgmlType::Q6K),
        ("BF16", GgmlType::Bf16),
        ("F16", GgmlType::F16),
    ];
    for (name, ty) in types {
        let case = &v[name];
        let hex = case["bytes"].as_str().unwrap();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let want: Vec<f32> = case["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        let got = dequantize(ty, &bytes, want.len()).unwrap();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                "{name} element {i}: {a} vs gguf-py {b}"
            );
        }
    }
}

fn names_file(e: &LoadError, file: &Path) -> bool {
    e.to_string().contains(&file.display().to_string())
}

/// Truncating a GGUF file anywhere before its last tensor byte is an error naming the file.
#[test]
fn truncated_gguf_is_an_error_never_a_panic() {
    let path = fixtures().join("gguf_tiny/tiny-q8_0.gguf");
    let bytes = std::fs::read(&path).unwrap();
    let full = GgufFile::from_bytes(&path, bytes.clone()).unwrap();
    let data_end = full.tensors.iter().map(|t| t.range.end).max().unwrap();
    let mut cuts: Vec<usize> = (0..full.data_offset.min(4096)).collect();
    cuts.extend((full.data_offset..data_end).step_by(97));
    cuts.push(data_end - 1);
    for cut in cuts {
        let r = GgufFile::from_bytes(&path, bytes[..cut].to_vec())
            .and_then(|f| gguf_model::from_file(&f).map(|_| ()));
        match r {
            Err(e) => assert!(names_file(&e, &path), "cut {cut}: {e}"),
            Ok(()) => panic!("truncated at {cut} of {} but loaded", bytes.len()),
        }
    }
}

/// Flipping header bytes gives an error or (for bytes that do not matter) a model, never a panic.
#[test]
fn corrupted_gguf_header_never_panics() {
    let path = fixtures().join("gguf_tiny/tiny-q8_0.gguf");
    let bytes = std::fs::read(&path).unwrap();
    let data_offset = GgufFile::from_bytes(&path, bytes.clone())
        .unwrap()
        .data_offset;
    let mut errors = 0;
    for i in (0..data_offset).step_by(3) {
        for x in [0xff, 0x80, 0x01] {
            let mut b = bytes.clone();
            b[i] ^= x;
            let r = GgufFile::from_bytes(&path, b).and_then(|f| gguf_model::from_file(&f));
            if let Err(e) = r {
                errors += 1;
                assert!(names_file(&e, &path), "byte {i}: {e}");
            }
        }
    }
    assert!(errors > 100, "only {errors} corruptions detected");
    // Specific corruptions give specific errors.
    let mut b = bytes.clone();
    b[0] = b'X';
    assert!(matches!(
        GgufFile::from_bytes(&path, b),
        Err(LoadError::Malformed { .. })
    ));
    let mut b = bytes.clone();
    b[4] = 9; // version 9
    assert!(matches!(
        GgufFile::from_bytes(&path, b),
        Err(LoadError::Unsupported { .. })
    ));
    let mut b = bytes;
    b[16..24].copy_from_slice(&u64::MAX.to_le_bytes()); // metadata count
    assert!(matches!(
        GgufFile::from_bytes(&path, b),
        Err(LoadError::Malformed { .. })
    ));
}

pub(crate) fn copy_dir(from: &Path, to: &Path) {
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn truncated_or_corrupted_safetensors_is_an_error_naming_the_file() {
    let src = fixtures().join("qwen2_bias");
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    for cut in [0, 4, 8, 100, 1000, bytes.len() / 2, bytes.len() - 1] {
        let dir = Scratch::new("trunc");
        copy_dir(&src, &dir.0);
        let file = dir.0.join("model.safetensors");
        std::fs::write(&file, &bytes[..cut]).unwrap();
        let e = load_path(&dir.0).unwrap_err();
        assert!(names_file(&e, &file), "cut {cut}: {e}");
    }
    // A header length pointing past the end.
    let dir = Scratch::new("hdr");
    copy_dir(&src, &dir.0);
    let file = dir.0.join("model.safetensors");
    let mut b = bytes.clone();
    b[0..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&file, &b).unwrap();
    let e = load_path(&dir.0).unwrap_err();
    assert!(
        matches!(e, LoadError::Malformed { .. }) && names_file(&e, &file),
        "{e}"
    );
}

#[test]
fn config_errors_are_clear() {
    let src = fixtures().join("llama_gqa");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let with = |edit: &dyn Fn(&mut serde_json::Value)| {
        let dir = Scratch::new("cfg");
        copy_dir(&src, &dir.0);
        let mut c = config.clone();
        edit(&mut c);
        std::fs::write(dir.0.join("config.json"), c.to_string()).unwrap();
        let r = load_path(&dir.0).map(|_| ());
        (dir, r)
    };
    let (_d, r) = with(&|c| c["architectures"] = serde_json::json!(["GPT2LMHeadModel"]));
    match r {
        Err(LoadError::UnsupportedArch {
            arch, supported, ..
        }) => {
            assert_eq!(arch, "GPT2LMHeadModel");
            assert!(supported.contains(&"Qwen3ForCausalLM".to_string()));
        }
        other => panic!("{other:?}"),
    }
    let (_d, r) = with(&|c| {
        c.as_object_mut().unwrap().remove("hidden_size");
    });
    assert!(matches!(r, Err(LoadError::Config { .. })), "{r:?}");
    // A shape that disagrees with the stored tensors.
    let (_d, r) = with(&|c| c["intermediate_size"] = serde_json::json!(96));
    assert!(matches!(r, Err(LoadError::TensorShape { .. })), "{r:?}");
    let (_d, r) = with(&|c| c["rope_parameters"]["rope_type"] = serde_json::json!("yarn"));
    assert!(matches!(r, Err(LoadError::Config { .. })), "{r:?}");
    // Missing files.
    let e = load_path(Path::new("/nonexistent/model.gguf")).unwrap_err();
    assert!(matches!(e, LoadError::Io { .. }), "{e}");
}

#[test]
fn dummy_smollm2_runs_on_the_cpu() {
    let m = load_dummy("smollm2-135m", DummySpec { seed: 3, std: 0.02 }, None).unwrap();
    assert!(matches!(m.weights, ModelWeights::Dummy(_)));
    assert_eq!(m.spec.vocab_size, 49152);
    let logits = prompt_logits(m, &[1, 2, 3, 4, 5]);
    assert_eq!(logits.len(), 49152);
    assert!(logits.iter().all(|x| x.is_finite()));
    let spread = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max)
        - logits.iter().cloned().fold(f32::INFINITY, f32::min);
    assert!(spread > 0.0);
    match load_dummy("gpt-9", DummySpec { seed: 0, std: 0.02 }, None) {
        Err(LoadError::UnknownPreset { known, .. }) => {
            assert!(known.contains(&"llama-3.1-8b".to_string()))
        }
        other => panic!("{:?}", other.map(|m| m.name)),
    }
}
