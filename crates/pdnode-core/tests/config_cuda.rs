//! The GPU keys of the configuration: GPU lists and tensor parallelism, and the `[engine.cuda]`
//! switches, fusion limits and kernel choices (names and types checked, defaults as documented).

use pdnode_core::config::{
    AttentionKernel, ConfigError, ConfigSource, LinearKernel, PrefillAttention, load_from_str,
    load_from_str_with_env,
};

use crate::common;

use common::{FILE, env, errors, file_src, sets};

#[test]
fn gpu_listed_twice_is_an_error() {
    let errs = errors(
        "[engine]\nbackend = \"cuda\"\ngpus = [0, 1, 1, 3]\ntensor_parallel = 4\n",
        &[],
    );
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(
        matches!(&errs[0], ConfigError::Invalid { key, source_name, reason }
        if key == "engine.gpus" && *source_name == file_src() && reason.contains("twice"))
    );
}

#[test]
fn tensor_parallel_must_divide_the_gpus() {
    let errs = errors(
        "[engine]\nbackend = \"cuda\"\ngpus = [0, 1, 2, 3]\ntensor_parallel = 3\n",
        &[],
    );
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(
        matches!(&errs[0], ConfigError::Invalid { key, .. } if key == "engine.tensor_parallel")
    );
    let msg = errs[0].to_string();
    assert!(
        msg.contains(FILE) && msg.contains("engine.tensor_parallel"),
        "{msg}"
    );
    // And 4 divides 4.
    load_from_str(
        FILE,
        "[engine]\nbackend = \"cuda\"\ngpus = [0, 1, 2, 3]\ntensor_parallel = 4\n",
        &[],
    )
    .unwrap();
}

fn reason_of(e: &ConfigError) -> &str {
    match e {
        ConfigError::Invalid { reason, .. } => reason,
        other => panic!("expected ConfigError::Invalid, got {other:?}"),
    }
}

#[test]
fn cuda_binds_exactly_the_gpus_it_lists() {
    let cfg = |backend: &str, gpus: &str, tp: u32| {
        format!("[engine]\nbackend = \"{backend}\"\ngpus = {gpus}\ntensor_parallel = {tp}\n")
    };
    // One rank per listed GPU, in any order, with gaps.
    for (gpus, tp) in [
        ("[4, 5, 6, 7]", 4),
        ("[1, 0]", 2),
        ("[0, 2]", 2),
        ("[7]", 1),
    ] {
        for backend in ["cuda", "auto"] {
            let text = cfg(backend, gpus, tp);
            let l = load_from_str(FILE, &text, &[]).unwrap_or_else(|e| panic!("{text}: {e:?}"));
            assert_eq!(l.config.engine.gpus.len(), tp as usize);
        }
    }
    // More GPUs than ranks: never a silent subset; the error suggests one node per group.
    for backend in ["cuda", "auto"] {
        let errs = errors(&cfg(backend, "[0, 1, 2, 3]", 2), &[]);
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].key(), Some("engine.tensor_parallel"));
        let reason = reason_of(&errs[0]);
        assert!(
            reason.contains("one node per group") && reason.contains("[0, 1], [2, 3]"),
            "{reason}"
        );
    }
    let errs = errors(&cfg("cuda", "[0, 1]", 1), &[]);
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(errs[0].key(), Some("engine.tensor_parallel"));
    assert!(reason_of(&errs[0]).contains("[0]"), "{errs:?}");
    // Fewer GPUs than ranks (and a count tp does not divide).
    for (gpus, tp) in [("[0]", 2), ("[0, 1, 2]", 2), ("[0, 1]", 4)] {
        let errs = errors(&cfg("cuda", gpus, tp), &[]);
        assert_eq!(errs.len(), 1, "{gpus} tp {tp}: {errs:?}");
        assert_eq!(errs[0].key(), Some("engine.tensor_parallel"));
        assert!(
            reason_of(&errs[0]).contains(&format!("exactly {tp} GPUs")),
            "{errs:?}"
        );
    }
    // No list at TP > 1.
    let errs = errors("[engine]\nbackend = \"auto\"\ntensor_parallel = 2\n", &[]);
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(errs[0].key(), Some("engine.tensor_parallel"));
    // Duplicates are still refused, also when the count matches.
    let errs = errors(&cfg("cuda", "[3, 3]", 2), &[]);
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(errs[0].key(), Some("engine.gpus"));
    // cpu and mock keep their rules: the list is not bound, tp must divide it.
    load_from_str(FILE, &cfg("cpu", "[0, 1]", 1), &[]).unwrap();
    load_from_str(FILE, &cfg("mock", "[0, 1, 2, 3]", 2), &[]).unwrap();
    let errs = errors(&cfg("mock", "[0, 1, 2]", 2), &[]);
    assert!(reason_of(&errs[0]).contains("does not divide"), "{errs:?}");
}

#[test]
fn cuda_switches_are_config_keys_with_checked_names_and_types() {
    let d = load_from_str(FILE, "", &[]).unwrap().config.engine.cuda;
    assert!(
        d.gpu_sampling && !d.pdl,
        "defaults: device sampling on, PDL off"
    );
    let c = load_from_str(
        FILE,
        "[engine.cuda]\ngpu_sampling = false\n",
        &sets(&["engine.cuda.pdl=true"]),
    )
    .unwrap()
    .config
    .engine
    .cuda;
    assert!(!c.gpu_sampling && c.pdl);
    let errs = errors("", &["engine.cuda.pdll=true"]);
    assert!(
        matches!(&errs[0], ConfigError::UnknownKey { key, expected, .. }
            if key == "engine.cuda.pdll" && expected.iter().any(|k| k == "pdl")),
        "{errs:?}"
    );
    let errs = errors("[engine.cuda]\npdl = \"on\"\n", &[]);
    assert!(
        matches!(&errs[0], ConfigError::WrongType { key, .. } if key == "engine.cuda.pdl"),
        "{errs:?}"
    );
}

#[test]
fn fusion_limits_are_checked_config_keys() {
    let c = load_from_str(FILE, "", &[]).unwrap().config.engine.cuda;
    assert_eq!((c.fuse_swiglu_max_tokens, c.fuse_norm_max_tokens), (8, 0));
    let errs = errors("[engine.cuda]\nfuse_norm_max_tokens = 9\n", &[]);
    assert!(
        errs.iter()
            .any(|e| e.to_string().contains("engine.cuda.fuse_norm_max_tokens")),
        "{errs:?}"
    );
    let off = load_from_str(FILE, "", &sets(&["engine.cuda.fuse_swiglu_max_tokens=0"]))
        .unwrap()
        .config
        .engine
        .cuda;
    assert_eq!(off.fuse_swiglu_max_tokens, 0);
}

#[test]
fn kernel_choices_are_config_keys_with_defaults_and_checked_names() {
    let c = load_from_str(FILE, "", &[]).unwrap();
    let d = &c.config.engine.cuda;
    assert_eq!(d.attention, AttentionKernel::Auto);
    assert_eq!((d.attention_v4_waves, d.attention_v4_max_part), (1, 4096));
    assert_eq!(d.prefill_attention, PrefillAttention::Wgmma);
    assert_eq!(d.linear, LinearKernel::Table);
    assert_eq!(d.warm_up_context, 4096);
    for v in [0, 256, 1 << 20] {
        let set = format!("engine.cuda.warm_up_context={v}");
        let l = load_from_str(FILE, "", &sets(&[&set])).unwrap();
        assert_eq!(l.config.engine.cuda.warm_up_context, v, "{set}");
    }
    // check-config prints them (the effective TOML carries every key)
    let toml = c.effective_toml();
    for line in [
        "attention = \"auto\"",
        "attention_v4_waves = 1",
        "attention_v4_max_part = 4096",
        "prefill_attention = \"wgmma\"",
        "linear = \"table\"",
    ] {
        assert!(toml.contains(line), "{line} missing from\n{toml}");
    }

    // every layer sets them: file, environment, --set
    let l = load_from_str_with_env(
        FILE,
        "[engine.cuda]\nattention = \"v2narrow\"\nprefill_attention = \"gemm\"\n",
        &env(&[
            ("PDNODE_ENGINE__CUDA__LINEAR", "cublas"),
            ("PDNODE_ENGINE__CUDA__ATTENTION_V4_WAVES", "4"),
        ]),
        &sets(&["engine.cuda.attention_v4_max_part=8192"]),
    )
    .unwrap();
    let c = &l.config.engine.cuda;
    assert_eq!(c.attention, AttentionKernel::V2narrow);
    assert_eq!(c.prefill_attention, PrefillAttention::Gemm);
    assert_eq!(c.linear, LinearKernel::Cublas);
    assert_eq!((c.attention_v4_waves, c.attention_v4_max_part), (4, 8192));
    for (k, v) in [
        ("attention", "v1"),
        ("attention", "v2"),
        ("attention", "v4"),
    ] {
        let set = format!("engine.cuda.{k}={v}");
        assert!(load_from_str(FILE, "", &sets(&[&set])).is_ok(), "{set}");
    }
    for v in ["flash8", "flashv3", "wgmma"] {
        let set = format!("engine.cuda.prefill_attention={v}");
        assert!(load_from_str(FILE, "", &sets(&[&set])).is_ok(), "{set}");
    }
    for v in ["mma", "gemv", "table"] {
        let set = format!("engine.cuda.linear={v}");
        assert!(load_from_str(FILE, "", &sets(&[&set])).is_ok(), "{set}");
    }

    // unknown names (including the retired variants) are errors naming the key and the choices
    for (key, bad, listed) in [
        ("engine.cuda.attention", "v3", "v4"),
        ("engine.cuda.prefill_attention", "flashv2", "flashv3"),
        ("engine.cuda.prefill_attention", "flash32", "flash8"),
        ("engine.cuda.prefill_attention", "flash", "gemm"),
        ("engine.cuda.linear", "fast", "table"),
    ] {
        let set = format!("{key}={bad}");
        let errs = errors("", &[&set]);
        assert!(
            matches!(&errs[0], ConfigError::WrongType { key: k, reason, source_name: ConfigSource::Set(_) }
                if k == key && reason.contains(bad) && reason.contains(listed)),
            "{set}: {errs:?}"
        );
    }
    // ranges are checked, naming the key
    for (set, key) in [
        (
            "engine.cuda.attention_v4_waves=0",
            "engine.cuda.attention_v4_waves",
        ),
        (
            "engine.cuda.attention_v4_waves=65",
            "engine.cuda.attention_v4_waves",
        ),
        (
            "engine.cuda.attention_v4_max_part=127",
            "engine.cuda.attention_v4_max_part",
        ),
        (
            "engine.cuda.attention_v4_max_part=1048577",
            "engine.cuda.attention_v4_max_part",
        ),
        (
            "engine.cuda.warm_up_context=1048577",
            "engine.cuda.warm_up_context",
        ),
    ] {
        let errs = errors("", &[set]);
        assert!(
            matches!(&errs[0], ConfigError::Invalid { key: k, .. } if k == key),
            "{set}: {errs:?}"
        );
    }
    let errs = errors("[engine.cuda]\nattention_v4_waves = \"many\"\n", &[]);
    assert!(
        matches!(&errs[0], ConfigError::WrongType { key, .. } if key == "engine.cuda.attention_v4_waves"),
        "{errs:?}"
    );
}
