//! Crafted configs and headers that name absurd sizes: each is an error naming the file and the
//! key, before anything is sized from it (no wrapped product that passes the shape checks, no
//! allocation that aborts the process), and every real fixture still loads.

use crate::fuzz_loaders::safetensors_bytes;
use crate::loader::{Scratch, copy_dir, fixtures};
use pdnode_engine::loader::gguf::write::{TensorData, gguf_bytes};
use pdnode_engine::loader::gguf::{GgufFile, GgufValue, MAX_ARRAY_ELEMENTS};
use pdnode_engine::loader::hf::spec_from_config;
use pdnode_engine::loader::safetensors_io::SafetensorsSet;
use pdnode_engine::loader::{LoadError, gguf_model, load_path};
use serde_json::{Value, json};
use std::path::Path;

fn config(fixture: &str) -> Value {
    let text = std::fs::read_to_string(fixtures().join(fixture).join("config.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// `r` is a `ConfigValue` error for `key`.
fn assert_key<T: std::fmt::Debug>(r: Result<T, LoadError>, key: &str) {
    match r {
        Err(LoadError::ConfigValue { key: k, .. }) => assert_eq!(k, key),
        other => panic!("{key}: expected a ConfigValue error, got {other:?}"),
    }
}

#[test]
fn every_fixture_model_still_loads() {
    let mut n = 0;
    for e in std::fs::read_dir(fixtures()).unwrap() {
        let p = e.unwrap().path();
        if p.join("config.json").is_file() {
            load_path(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            n += 1;
        }
    }
    for name in ["tiny-f32.gguf", "tiny-q8_0.gguf"] {
        load_path(&fixtures().join("gguf_tiny").join(name)).unwrap();
    }
    assert!(n >= 10, "{n} HF fixtures");
}

/// The audit's case: 2^24 heads of 2^40 dimensions wrapped `q_dim` to 0 in release, which the
/// shape checks of a hidden size of 64 could then pass, and the next allocation aborted.
#[test]
fn head_products_that_would_wrap_are_refused() {
    let src = fixtures().join("llama_gqa");
    let mut c = config("llama_gqa");
    c["num_attention_heads"] = json!(16_777_216);
    c["num_key_value_heads"] = json!(16_777_216);
    c["head_dim"] = json!(1u64 << 40);
    c["hidden_size"] = json!(64);
    assert_key(
        spec_from_config(&c, None, Path::new("config.json")),
        "num_attention_heads",
    );
    // Through the whole loader too: the error names the config file.
    let dir = Scratch::new("wrap");
    copy_dir(&src, &dir.0);
    std::fs::write(dir.0.join("config.json"), c.to_string()).unwrap();
    let e = load_path(&dir.0).unwrap_err();
    assert!(e.to_string().contains("config.json"), "{e}");
    assert_key(Err::<(), _>(e), "num_attention_heads");
    let mut c = config("llama_gqa");
    c["head_dim"] = json!(1u64 << 40);
    assert_key(spec_from_config(&c, None, Path::new("c")), "head_dim");
}

/// `num_hidden_layers` sized the sliding-window table and the layer vectors: 10^15 layers is an
/// error before either is allocated, for the llama family and for DeepSeek.
#[test]
fn a_layer_count_of_ten_to_the_fifteen_is_an_error() {
    let p = Path::new("config.json");
    for fixture in ["mistral_window", "qwen2_window", "llama_gqa", "deepseek_v2"] {
        let mut c = config(fixture);
        c["num_hidden_layers"] = json!(1_000_000_000_000_000u64);
        assert_key(spec_from_config(&c, None, p), "num_hidden_layers");
    }
    for (fixture, key, v) in [
        ("llama_gqa", "vocab_size", json!(0)),
        ("llama_gqa", "intermediate_size", json!(1u64 << 40)),
        ("llama_gqa", "hidden_size", json!(0)),
        ("deepseek_v2", "kv_lora_rank", json!(1u64 << 40)),
        ("deepseek_v2", "qk_nope_head_dim", json!(u64::MAX)),
        ("deepseek_v2", "n_routed_experts", json!(1u64 << 32)),
        ("deepseek_v2", "moe_intermediate_size", json!(1u64 << 40)),
        ("deepseek_v2", "n_shared_experts", json!(1u64 << 40)),
    ] {
        let mut c = config(fixture);
        c[key] = v;
        let want = if key == "qk_nope_head_dim" {
            "qk_nope_head_dim + qk_rope_head_dim"
        } else {
            key
        };
        assert_key(spec_from_config(&c, None, p), want);
    }
}

#[test]
fn rope_and_norm_values_out_of_range_are_errors() {
    let p = Path::new("config.json");
    // The fixtures are transformers 5's: RoPE scaling and theta in `rope_parameters`.
    let llama3 = config("llama3_rope");
    assert!(spec_from_config(&llama3, None, p).is_ok());
    for (key, v) in [
        ("original_max_position_embeddings", json!(-1)),
        ("original_max_position_embeddings", json!(8192.5)),
        ("original_max_position_embeddings", json!(1u64 << 40)),
        ("factor", json!(0.0)),
        ("factor", json!(-8.0)),
        ("high_freq_factor", json!(1.0)),
    ] {
        let mut c = llama3.clone();
        c["rope_parameters"][key] = v.clone();
        assert_key(
            spec_from_config(&c, None, p),
            &format!("rope_parameters.{key}"),
        );
        // transformers < 5 named the object `rope_scaling`.
        let mut old = c.clone();
        old["rope_scaling"] = c["rope_parameters"].clone();
        assert_key(
            spec_from_config(&old, None, p),
            &format!("rope_scaling.{key}"),
        );
    }
    for (key, v) in [
        ("rope_theta", json!(0.0)),
        ("rope_theta", json!(-10000.0)),
        ("rope_theta", json!(1e39)),
        ("rms_norm_eps", json!(-1e-6)),
        ("rms_norm_eps", json!(1e39)),
        ("max_position_embeddings", json!(0)),
    ] {
        let mut c = config("llama_gqa");
        c[key] = v;
        assert_key(spec_from_config(&c, None, p), key);
    }
    let mut c = config("llama_gqa");
    c["rope_parameters"]["rope_theta"] = json!(-1.0);
    assert_key(spec_from_config(&c, None, p), "rope_parameters.rope_theta");
    let mut c = config("deepseek_v2");
    c["rope_parameters"]["beta_fast"] = json!(-32);
    assert_key(spec_from_config(&c, None, p), "rope_parameters.beta_fast");
}

/// GGUF metadata in file order.
type Metadata = Vec<(String, GgufValue)>;

/// The tiny GGUF rewritten with `edit` applied to its metadata and `extra` tensors added.
fn tiny_gguf_with(edit: &dyn Fn(&mut Metadata), extra: Vec<TensorData>) -> Vec<u8> {
    let path = fixtures().join("gguf_tiny/tiny-f32.gguf");
    let f = GgufFile::open(&path).unwrap();
    let mut meta: Metadata = f
        .metadata_order
        .iter()
        .map(|k| (k.clone(), f.get(k).unwrap().clone()))
        .collect();
    edit(&mut meta);
    let mut tensors: Vec<TensorData> = f
        .tensors
        .iter()
        .map(|t| TensorData {
            name: t.name.clone(),
            dims: t.dims.clone(),
            ggml_type: 0, // F32
            data: f.tensor_bytes(t).to_vec(),
        })
        .collect();
    tensors.extend(extra);
    gguf_bytes(&meta, &tensors)
}

fn set(meta: &mut Metadata, key: &str, v: GgufValue) {
    meta.retain(|(k, _)| k != key);
    meta.push((key.to_string(), v));
}

fn gguf_spec(bytes: Vec<u8>) -> Result<(), LoadError> {
    let f = GgufFile::from_bytes(Path::new("crafted.gguf"), bytes)?;
    gguf_model::spec_from_gguf(&f).map(|_| ())
}

#[test]
fn gguf_dimensions_out_of_range_are_errors_naming_the_key() {
    assert!(gguf_spec(tiny_gguf_with(&|_| {}, Vec::new())).is_ok());
    for (key, v) in [
        ("llama.block_count", GgufValue::U64(1 << 50)),
        ("llama.attention.head_count", GgufValue::U64(1 << 24)),
        ("llama.feed_forward_length", GgufValue::U64(0)),
        ("llama.attention.key_length", GgufValue::U64(1 << 40)),
        ("llama.rope.freq_base", GgufValue::F32(-1.0)),
        (
            "llama.attention.layer_norm_rms_epsilon",
            GgufValue::F32(f32::NAN),
        ),
    ] {
        let bytes = tiny_gguf_with(&|m| set(m, key, v.clone()), Vec::new());
        assert_key(gguf_spec(bytes), key);
    }
}

/// A `rope_freqs.weight` tensor made the loader build RoPE tables of `key_length / 2` entries
/// before any shape check: a key length of 2^50 aborted on the allocation.
#[test]
fn gguf_rope_factors_are_checked_before_tables_are_built() {
    let freqs = |n: u64| TensorData {
        name: "rope_freqs.weight".into(),
        dims: vec![n],
        ggml_type: 0,
        data: vec![0; 4 * n as usize],
    };
    let huge = tiny_gguf_with(
        &|m| set(m, "llama.attention.key_length", GgufValue::U64(1 << 50)),
        vec![freqs(4)],
    );
    assert_key(gguf_spec(huge), "llama.attention.key_length");
    // The tiny model's head is 16 wide: 8 factors, not 4.
    match gguf_spec(tiny_gguf_with(&|_| {}, vec![freqs(4)])) {
        Err(LoadError::TensorShape { name, expected, .. }) => {
            assert_eq!((name.as_str(), expected), ("rope_freqs.weight", vec![8]));
        }
        other => panic!("{other:?}"),
    }
    let orig = tiny_gguf_with(
        &|m| {
            set(
                m,
                "llama.rope.scaling.original_context_length",
                GgufValue::U64(1 << 32),
            )
        },
        vec![freqs(8)],
    );
    assert_key(
        gguf_spec(orig),
        "llama.rope.scaling.original_context_length",
    );
}

/// An empty shard list, an FP8 matrix with a zero dimension, an FP8 scale of an FP8 scale: an
/// error or an empty tensor, never a panic (`shards[0]`, rayon's chunks of 0) or a recursion
/// that re-parses the header at every level.
#[test]
fn safetensors_edge_cases_are_errors_not_panics() {
    assert!(matches!(
        SafetensorsSet::open_files(&[]),
        Err(LoadError::Io { .. })
    ));
    let dir = Scratch::new("fp8");
    let file = dir.0.join("model.safetensors");
    let f8 = |shape: [usize; 2], at: usize| json!({"dtype": "F8_E4M3", "shape": shape, "data_offsets": [at, at + shape[0] * shape[1]]});
    let header = json!({
        "w": f8([2, 2], 0),
        "w_scale_inv": f8([1, 1], 4),
        "w_scale_inv_scale_inv": {"dtype": "F32", "shape": [1, 1], "data_offsets": [5, 9]},
        "v": f8([2, 2], 9),
        "v_scale_inv": {"dtype": "BF16", "shape": [1, 1], "data_offsets": [13, 15]},
        "empty": f8([2, 0], 15),
        "empty_scale_inv": {"dtype": "F32", "shape": [1, 0], "data_offsets": [15, 15]},
    });
    // 0x38 is 1.0 in E4M3; 0x4000 is 2.0 in BF16.
    let mut data = vec![0x38u8; 5];
    data.extend_from_slice(&2f32.to_le_bytes());
    data.extend_from_slice(&[0x38; 4]);
    data.extend_from_slice(&0x4000u16.to_le_bytes());
    std::fs::write(&file, safetensors_bytes(&header, &data)).unwrap();
    let mut set = SafetensorsSet::open_files(std::slice::from_ref(&file)).unwrap();
    set.set_fp8_block([2, 2]);
    assert_eq!(set.load("v", &[2, 2]).unwrap().data, vec![2.0; 4]);
    assert_eq!(set.load("empty", &[2, 0]).unwrap().data, Vec::<f32>::new());
    match set.load("w", &[2, 2]) {
        Err(LoadError::Unsupported { reason, .. }) => {
            assert!(reason.contains("w_scale_inv"), "{reason}")
        }
        other => panic!("an F8 scale: {other:?}"),
    }
}

/// A metadata array of one-byte elements took 32 bytes per byte of file: one longer than any
/// real tokenizer array (a few hundred thousand) by far is refused before it is read, naming
/// its key.
#[test]
fn a_gguf_metadata_array_past_the_bound_is_malformed() {
    let image = |n: u64| {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes()); // tensors
        b.extend_from_slice(&1u64.to_le_bytes()); // metadata
        let key = b"tokenizer.ggml.token_type";
        b.extend_from_slice(&(key.len() as u64).to_le_bytes());
        b.extend_from_slice(key);
        b.extend_from_slice(&9u32.to_le_bytes()); // array
        b.extend_from_slice(&0u32.to_le_bytes()); // of u8
        b.extend_from_slice(&n.to_le_bytes());
        b.resize(b.len() + n as usize, 1);
        // The (empty) data section starts aligned.
        b.resize(b.len().next_multiple_of(32), 0);
        b
    };
    let path = Path::new("crafted.gguf");
    let ok = GgufFile::from_bytes(path, image(1000)).unwrap();
    assert_eq!(
        ok.get("tokenizer.ggml.token_type")
            .and_then(|v| v.as_array())
            .map(<[_]>::len),
        Some(1000)
    );
    match GgufFile::from_bytes(path, image(MAX_ARRAY_ELEMENTS + 1)) {
        Err(LoadError::Malformed { reason, .. }) => {
            assert!(reason.contains("tokenizer.ggml.token_type"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}
