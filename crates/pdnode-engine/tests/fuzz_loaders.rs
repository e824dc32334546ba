//! Fuzz-style property tests (proptest, stable Rust) of the model file parsers: GGUF images
//! (the tiny fixtures with random byte edits, splices and truncations, and images written with
//! random metadata) through the header/metadata parser, the model spec, the weights and the
//! tokenizer; safetensors files with random headers and edited fixture headers through the
//! loader. Every input is an error (naming the file) or a model, never a panic. Bounded: a few
//! hundred cases per target.

use pdnode_engine::loader::gguf::write::{TensorData, gguf_bytes};
use pdnode_engine::loader::gguf::{GgufFile, GgufValue};
use pdnode_engine::loader::safetensors_io::SafetensorsSet;
use pdnode_engine::loader::{LoadError, gguf_model, load_path};
use pdnode_engine::text::Tokenizer;
use pdnode_testkit::fuzz::Fuzz;
use pdnode_testkit::fuzz_regressions;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("pdnode-fuzz-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Everything the loader does with a GGUF image: parse, spec, weights, tokenizer. Errors must
/// name the file.
fn load_gguf(path: &Path, bytes: Vec<u8>) -> Result<(), TestCaseError> {
    let r = GgufFile::from_bytes(path, bytes).and_then(|f| {
        let tok = gguf_model::tokenizer_from_gguf(&f);
        if let Ok(src) = &tok {
            // A tokenizer that builds encodes and decodes.
            if let Ok(t) = Tokenizer::from_source(src) {
                let ids = t.encode("Hello wo", true).unwrap_or_default();
                let _ = t.decode(&ids, false);
            }
        }
        gguf_model::from_file(&f).map(|_| ())
    });
    if let Err(e) = r {
        prop_assert!(
            e.to_string().contains(&path.display().to_string()),
            "error does not name the file: {e}"
        );
    }
    Ok(())
}

/// An edit of a file image.
#[derive(Debug, Clone)]
enum Edit {
    /// XOR a byte.
    Flip(prop::sample::Index, u8),
    /// Overwrite 8 bytes with a u64 (counts, lengths, offsets, dims).
    Word(prop::sample::Index, u64),
    /// Overwrite 4 bytes with a u32 (type ids, dimension counts).
    Half(prop::sample::Index, u32),
    /// Cut the image.
    Truncate(prop::sample::Index),
    /// Copy a run of bytes elsewhere.
    Splice(prop::sample::Index, prop::sample::Index, u8),
}

fn edit() -> impl Strategy<Value = Edit> {
    let words = prop_oneof![
        prop::sample::select(vec![
            0u64,
            1,
            2,
            3,
            4,
            u64::from(u32::MAX),
            u64::from(u32::MAX) + 1,
            1 << 40,
            1 << 62,
            u64::MAX,
            u64::MAX - 7,
        ]),
        any::<u64>(),
    ];
    prop_oneof![
        4 => (any::<prop::sample::Index>(), 1u8..).prop_map(|(i, x)| Edit::Flip(i, x)),
        3 => (any::<prop::sample::Index>(), words).prop_map(|(i, w)| Edit::Word(i, w)),
        2 => (any::<prop::sample::Index>(), prop_oneof![0u32..16, any::<u32>()])
            .prop_map(|(i, w)| Edit::Half(i, w)),
        1 => any::<prop::sample::Index>().prop_map(Edit::Truncate),
        1 => (any::<prop::sample::Index>(), any::<prop::sample::Index>(), 1u8..64)
            .prop_map(|(a, b, n)| Edit::Splice(a, b, n)),
    ]
}

/// Applies `e` within the first `region` bytes (the header, where the parser reads).
fn apply(b: &mut Vec<u8>, e: &Edit, region: usize) {
    let n = region.min(b.len());
    if n == 0 {
        return;
    }
    let put = |b: &mut Vec<u8>, at: usize, bytes: &[u8]| {
        let end = (at + bytes.len()).min(b.len());
        b[at..end].copy_from_slice(&bytes[..end - at]);
    };
    match e {
        Edit::Flip(i, x) => {
            let at = i.index(n);
            b[at] ^= x;
        }
        Edit::Word(i, w) => put(b, i.index(n), &w.to_le_bytes()),
        Edit::Half(i, w) => put(b, i.index(n), &w.to_le_bytes()),
        Edit::Truncate(i) => b.truncate(i.index(b.len())),
        Edit::Splice(from, to, len) => {
            let (f, t) = (from.index(n), to.index(n));
            let len = usize::from(*len).min(b.len() - f).min(b.len() - t);
            let run = b[f..f + len].to_vec();
            b[t..t + len].copy_from_slice(&run);
        }
    }
}

#[test]
fn edited_gguf_images_are_errors_or_models() {
    let mut images = Vec::new();
    for name in ["tiny-q8_0.gguf", "tiny-f32.gguf"] {
        let path = fixtures().join("gguf_tiny").join(name);
        let bytes = std::fs::read(&path).unwrap();
        let header = GgufFile::from_bytes(&path, bytes.clone())
            .unwrap()
            .data_offset;
        images.push((path, bytes, header));
    }
    let input = (
        prop::sample::select(vec![0usize, 1]),
        prop::collection::vec(edit(), 1..5),
    );
    Fuzz::new(fuzz_regressions!("gguf_edited"), 400)
        .run(&input, |(which, edits)| {
            let (path, bytes, header) = &images[which];
            let mut b = bytes.clone();
            for e in &edits {
                apply(&mut b, e, *header);
            }
            load_gguf(path, b)
        })
        .unwrap();
}

/// Regression (found by `edited_gguf_images_are_errors_or_models`): a `block_count` far beyond
/// the tensors in the file is an error naming the first missing tensor, not a process abort on
/// a huge allocation.
#[test]
fn a_block_count_beyond_the_tensors_is_an_error_not_an_abort() {
    let path = fixtures().join("gguf_tiny").join("tiny-f32.gguf");
    let f = GgufFile::from_bytes(&path, std::fs::read(&path).unwrap()).unwrap();
    let mut spec = gguf_model::spec_from_gguf(&f).unwrap();
    spec.num_layers = 1 << 40;
    let Err(e) = gguf_model::weights_from_gguf(&f, &spec) else {
        panic!("a model of 2^40 layers from a tiny file");
    };
    assert!(e.to_string().contains("blk."), "{e}");
}

/// GGUF metadata keys the model and tokenizer readers look at.
const GGUF_KEYS: &[&str] = &[
    "general.architecture",
    "general.alignment",
    "general.name",
    "llama.block_count",
    "llama.context_length",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.key_length",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.freq_base",
    "llama.rope.dimension_count",
    "llama.rope.scaling.type",
    "llama.rope.scaling.factor",
    "llama.vocab_size",
    "qwen2.block_count",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
];

fn gguf_value() -> impl Strategy<Value = GgufValue> {
    let leaf = prop_oneof![
        any::<u8>().prop_map(GgufValue::U8),
        any::<i8>().prop_map(GgufValue::I8),
        any::<u32>().prop_map(GgufValue::U32),
        prop_oneof![0u32..8, Just(u32::MAX)].prop_map(GgufValue::U32),
        any::<i32>().prop_map(GgufValue::I32),
        any::<f32>().prop_map(GgufValue::F32),
        any::<bool>().prop_map(GgufValue::Bool),
        prop::sample::select(vec![
            "llama", "qwen2", "gpt2", "llama3", "smollm", "linear", ""
        ])
        .prop_map(|s| GgufValue::String(s.to_string())),
        any::<String>().prop_map(GgufValue::String),
        any::<u64>().prop_map(GgufValue::U64),
        any::<i64>().prop_map(GgufValue::I64),
        any::<f64>().prop_map(GgufValue::F64),
    ];
    leaf.prop_recursive(2, 16, 8, |inner| {
        prop::collection::vec(inner, 0..8).prop_map(GgufValue::Array)
    })
}

/// A tensor to write (`TensorData`, with `Debug` for proptest's reports).
#[derive(Debug, Clone)]
struct GenTensor {
    name: &'static str,
    dims: Vec<u64>,
    ggml_type: u32,
    data: Vec<u8>,
}

impl GenTensor {
    fn data(&self) -> TensorData {
        TensorData {
            name: self.name.to_string(),
            dims: self.dims.clone(),
            ggml_type: self.ggml_type,
            data: self.data.clone(),
        }
    }
}

fn tensor() -> impl Strategy<Value = GenTensor> {
    (
        prop::sample::select(vec![
            "token_embd.weight",
            "output_norm.weight",
            "output.weight",
            "blk.0.attn_q.weight",
            "blk.0.attn_norm.weight",
            "x",
        ]),
        prop::collection::vec(prop_oneof![0u64..9, Just(u64::MAX), Just(1 << 33)], 0..5),
        prop_oneof![
            Just(0u32),
            Just(1),
            Just(8),
            Just(2),
            0u32..40,
            any::<u32>()
        ],
        prop::collection::vec(any::<u8>(), 0..80),
    )
        .prop_map(|(name, dims, ggml_type, data)| GenTensor {
            name,
            dims,
            ggml_type,
            data,
        })
}

#[test]
fn gguf_images_with_random_metadata_and_tensors_are_errors_or_models() {
    let dir = Scratch::new("gguf");
    let path = dir.0.join("random.gguf");
    let meta = prop::collection::vec((prop::sample::select(GGUF_KEYS), gguf_value()), 0..12);
    let input = (meta, prop::collection::vec(tensor(), 0..4));
    Fuzz::new(fuzz_regressions!("gguf_generated"), 400)
        .run(&input, |(meta, tensors)| {
            let meta: Vec<(String, GgufValue)> =
                meta.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            // The writer aligns with `general.alignment`: keep it sane there (the parser gets
            // insane ones through the edits of the other target).
            if meta.iter().any(|(k, v)| {
                k == "general.alignment" && !v.as_u64().is_some_and(|a| (1..=64).contains(&a))
            }) {
                return Ok(());
            }
            let tensors: Vec<TensorData> = tensors.iter().map(GenTensor::data).collect();
            load_gguf(&path, gguf_bytes(&meta, &tensors))
        })
        .unwrap();
}

/// A safetensors image: 8-byte header length, the JSON header, the data.
pub(crate) fn safetensors_bytes(header: &serde_json::Value, data: &[u8]) -> Vec<u8> {
    let h = serde_json::to_vec(header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    out
}

#[test]
fn safetensors_with_random_headers_are_errors_or_tensors() {
    let dir = Scratch::new("st");
    let file = dir.0.join("model.safetensors");
    let entry = (
        prop::sample::select(vec![
            "F32", "F16", "BF16", "I8", "U8", "F64", "BOOL", "Q4", "",
        ]),
        prop::collection::vec(
            prop_oneof![0usize..6, Just(usize::MAX), Just(1 << 40)],
            0..4,
        ),
        (0usize..64, 0usize..64),
    );
    let input = (
        prop::collection::vec(entry, 0..4),
        prop::collection::vec(any::<u8>(), 0..128),
        any::<bool>(),
    );
    Fuzz::new(fuzz_regressions!("safetensors_headers"), 400)
        .run(&input, |(entries, data, with_metadata)| {
            let mut header = serde_json::Map::new();
            if with_metadata {
                header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
            }
            let mut shapes = Vec::new();
            for (i, (dtype, shape, (a, b))) in entries.iter().enumerate() {
                let name = format!("t{i}");
                header.insert(
                    name.clone(),
                    serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [a, b]}),
                );
                shapes.push((name, shape.clone()));
            }
            let bytes = safetensors_bytes(&serde_json::Value::Object(header), &data);
            std::fs::write(&file, bytes).unwrap();
            match SafetensorsSet::open_files(std::slice::from_ref(&file)) {
                Err(e) => prop_assert!(
                    matches!(e, LoadError::Malformed { .. } | LoadError::Io { .. }),
                    "{e}"
                ),
                Ok(set) => {
                    for (name, shape) in &shapes {
                        if let Ok(t) = set.load(name, shape) {
                            prop_assert_eq!(t.shape.as_slice(), shape.as_slice());
                        }
                    }
                }
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn edited_safetensors_models_are_errors_or_models() {
    let src = fixtures().join("llama_gqa");
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let dir = Scratch::new("stmodel");
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(src.join(f), dir.0.join(f)).unwrap();
    }
    let file = dir.0.join("model.safetensors");
    Fuzz::new(fuzz_regressions!("safetensors_edited"), 200)
        .run(&prop::collection::vec(edit(), 1..4), |edits| {
            let mut b = bytes.clone();
            for e in &edits {
                apply(&mut b, e, header_end);
            }
            std::fs::write(&file, &b).unwrap();
            if let Err(e) = load_path(&dir.0) {
                prop_assert!(
                    e.to_string().contains(&dir.0.display().to_string()),
                    "error names neither the file nor the model: {e}"
                );
            }
            Ok(())
        })
        .unwrap();
}
