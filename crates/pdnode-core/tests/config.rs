//! The layered configuration: order of layers, errors that name the key and the source, and
//! every shipped file in `configs/` loading cleanly. The security keys (node TLS, etcd TLS and
//! auth, `allow_insecure`) are in `config_security.rs`, the GPU keys (`[engine.cuda]`, GPU lists,
//! tensor parallelism) in `config_cuda.rs`.

use pdnode_core::Role;
use pdnode_core::config::{
    Backend, ConfigError, ConfigSource, CpuAffinity, PolicyName, RegistryKind, load, load_from_str,
    load_from_str_with_env,
};
use std::path::{Path, PathBuf};

use crate::common;

use common::{FILE, env, errors, file_src, sets};

#[test]
fn layers_apply_in_order_default_file_env_set() {
    let text = "[engine]\nmax_running_requests = 10\ncontext_length = 1024\nblock_size = 32\n";
    // Defaults only where nothing else sets a key.
    let l = load_from_str_with_env(FILE, text, &[], &[]).unwrap();
    assert_eq!(l.config.engine.mem_fraction, 0.85);
    assert_eq!(l.origin_of("engine.mem_fraction"), ConfigSource::Default);
    assert_eq!(l.config.engine.max_running_requests, 10);
    assert_eq!(l.origin_of("engine.max_running_requests"), file_src());

    // env beats the file, --set beats env.
    let e = env(&[
        ("PDNODE_ENGINE__CONTEXT_LENGTH", "2048"),
        ("PDNODE_ENGINE__MAX_RUNNING_REQUESTS", "20"),
        ("HOME", "/root"),
        ("PDNODE_LOG", "not a config key"),
    ]);
    let l =
        load_from_str_with_env(FILE, text, &e, &sets(&["engine.max_running_requests=30"])).unwrap();
    assert_eq!(l.config.engine.context_length, 2048);
    assert_eq!(
        l.origin_of("engine.context_length"),
        ConfigSource::Env("PDNODE_ENGINE__CONTEXT_LENGTH".into())
    );
    assert_eq!(l.config.engine.max_running_requests, 30);
    assert!(matches!(
        l.origin_of("engine.max_running_requests"),
        ConfigSource::Set(_)
    ));
    // Untouched file keys survive the later layers.
    assert_eq!(l.config.engine.block_size, 32);
}

#[test]
fn env_values_parse_as_toml_or_strings() {
    let e = env(&[
        ("PDNODE_ENGINE__BACKEND", "mock"),
        ("PDNODE_ROUTER__PREFILL_POLICY", "round_robin"),
        ("PDNODE_ENGINE__CPU_AFFINITY", "[0, 2]"),
    ]);
    let l = load_from_str_with_env(FILE, "", &e, &[]).unwrap();
    assert_eq!(l.config.engine.backend, Backend::Mock);
    assert_eq!(l.config.router.prefill_policy, PolicyName::RoundRobin);
    assert_eq!(l.config.engine.cpu_affinity, CpuAffinity::Cores(vec![0, 2]));
}

#[test]
fn unknown_key_in_a_file_names_the_key_and_the_file() {
    let errs = errors("[engine]\nbakend = \"cpu\"\n", &[]);
    assert_eq!(errs.len(), 1, "{errs:?}");
    match &errs[0] {
        ConfigError::UnknownKey {
            source_name,
            key,
            expected,
        } => {
            assert_eq!(key, "engine.bakend");
            assert_eq!(source_name, &file_src());
            assert!(expected.iter().any(|k| k == "backend"), "{expected:?}");
        }
        other => panic!("expected UnknownKey, got {other:?}"),
    }
    let msg = errs[0].to_string();
    assert!(msg.contains("engine.bakend") && msg.contains(FILE), "{msg}");
    assert!(!msg.contains('\n'), "one line: {msg:?}");

    let errs = errors("[nodes]\nrole = \"all\"\n", &[]);
    assert!(matches!(&errs[0], ConfigError::UnknownKey { key, .. } if key == "nodes"));
}

#[test]
fn unknown_key_from_env_or_set_names_that_source() {
    let e = env(&[("PDNODE_ENGINE__GPUZ", "[0]")]);
    let errs = load_from_str_with_env(FILE, "", &e, &[]).unwrap_err();
    assert!(matches!(
        &errs[0],
        ConfigError::UnknownKey { source_name: ConfigSource::Env(v), key, .. }
            if v == "PDNODE_ENGINE__GPUZ" && key == "engine.gpuz"
    ));
    let errs = errors("", &["engine.gpuz=[0]"]);
    assert!(matches!(
        &errs[0],
        ConfigError::UnknownKey { source_name: ConfigSource::Set(_), key, .. } if key == "engine.gpuz"
    ));
}

#[test]
fn wrong_type_names_the_key() {
    let errs = errors("[engine]\ncontext_length = \"long\"\n", &[]);
    assert!(
        matches!(&errs[0], ConfigError::WrongType { key, source_name, .. }
            if key == "engine.context_length" && *source_name == file_src()),
        "{errs:?}"
    );
    let errs = errors("[engine]\ngpus = [0, \"one\"]\n", &[]);
    assert!(
        matches!(&errs[0], ConfigError::WrongType { key, .. } if key.starts_with("engine.gpus")),
        "{errs:?}"
    );
}

#[test]
fn every_error_of_a_file_is_reported_at_once() {
    let text = "[engine]\nbakend = \"cuda\"\ngpus = [0, 1, 1, 2]\ntensor_parallel = 3\n\
                [router]\ndecode_policy = \"fastest\"\n";
    let errs = errors(text, &[]);
    let keys: Vec<&str> = errs.iter().filter_map(|e| e.key()).collect();
    for k in [
        "engine.bakend",
        "router.decode_policy",
        "engine.gpus",
        "engine.tensor_parallel",
    ] {
        assert!(keys.contains(&k), "{k} missing from {keys:?}");
    }
}

#[test]
fn an_unknown_model_preset_is_refused_with_the_known_ones() {
    let dummy =
        |preset: &str| format!("[model]\nformat = \"dummy\"\npath = \"\"\npreset = \"{preset}\"\n");
    let errs = errors(&dummy("llama-9b"), &[]);
    assert!(
        errs.iter()
            .any(|e| matches!(e, ConfigError::Invalid { key, reason, .. }
            if key == "model.preset" && reason.contains("llama-9b")
                && pdnode_core::config::MODEL_PRESETS.iter().all(|p| reason.contains(p)))),
        "{errs:?}"
    );
    // Known names load, in any case.
    for p in ["llama-3.1-8b", "SmolLM2-135M"] {
        load_from_str(FILE, &dummy(p), &[]).unwrap();
    }
    // A dummy model still needs one.
    let errs = errors(&dummy(""), &[]);
    assert!(
        errs.iter()
            .any(|e| matches!(e, ConfigError::Invalid { key, reason, .. }
        if key == "model.preset" && reason.contains("smollm2-135m")))
    );
}

#[test]
fn local_prefill_loads_is_off_by_default_and_is_refused_for_sglang_workers() {
    let l = load_from_str(
        FILE,
        "[router.local_prefill]\nmax_prompt_tokens = 64\nprefill_busy_requests = 8\n",
        &[],
    )
    .unwrap();
    let lp = &l.config.router.local_prefill;
    assert_eq!((lp.max_prompt_tokens, lp.prefill_busy_requests), (64, 8));
    let d = load_from_str(FILE, "", &[]).unwrap();
    let lp = &d.config.router.local_prefill;
    assert_eq!((lp.max_prompt_tokens, lp.prefill_busy_requests), (0, 0));
    let errs = errors(
        "[node]\nrole = \"router\"\n[router.local_prefill]\nmax_prompt_tokens = 64\n\
         [[router.sglang.prefill]]\nurl = \"http://127.0.0.1:30000\"\n\
         [[router.sglang.decode]]\nurl = \"http://127.0.0.1:30001\"\n",
        &[],
    );
    assert!(
        errs.iter()
            .any(|e| matches!(e, ConfigError::Invalid { key, .. }
            if key == "router.local_prefill")),
        "{errs:?}"
    );
    let errs = errors("[router.local_prefill]\nmax_prompt = 64\n", &[]);
    assert!(!errs.is_empty(), "an unknown key is refused");
}

#[test]
fn drain_by_migration_is_a_decode_node_setting() {
    let l = load_from_str(
        FILE,
        "[node]\nrole = \"decode\"\ndrain = \"migrate\"\n[transfer]\nkind = \"ucx\"\n\
         [registry]\nkind = \"etcd\"\nendpoints = [\"http://127.0.0.1:2379\"]\n",
        &[],
    )
    .unwrap();
    assert_eq!(l.config.node.drain, pdnode_core::config::DrainMode::Migrate);
    let d = load_from_str(FILE, "", &[]).unwrap();
    assert_eq!(d.config.node.drain, pdnode_core::config::DrainMode::Wait);
    let errs = errors("[node]\ndrain = \"migrate\"\n", &[]);
    assert!(
        errs.iter()
            .any(|e| matches!(e, ConfigError::Invalid { key, .. } if key == "node.drain")),
        "{errs:?}"
    );
    assert!(!errors("[node]\ndrain = \"move\"\n", &[]).is_empty());
}

#[test]
fn rebalancing_is_off_by_default_and_needs_a_gap_of_two() {
    let l = load_from_str(
        FILE,
        "[router.rebalance]\nmin_gap = 3\ninterval_ms = 500\n",
        &[],
    )
    .unwrap();
    let rb = &l.config.router.rebalance;
    assert_eq!((rb.min_gap, rb.interval_ms), (3, 500));
    let d = load_from_str(FILE, "", &[]).unwrap();
    assert_eq!(d.config.router.rebalance.min_gap, 0);
    for (text, key) in [
        (
            "[router.rebalance]\nmin_gap = 1\n",
            "router.rebalance.min_gap",
        ),
        (
            "[router.rebalance]\ninterval_ms = 50\n",
            "router.rebalance.interval_ms",
        ),
    ] {
        let errs = errors(text, &[]);
        assert!(
            errs.iter()
                .any(|e| matches!(e, ConfigError::Invalid { key: k, .. } if k == key)),
            "{text}: {errs:?}"
        );
    }
}

#[test]
fn the_cost_policy_picks_prefill_nodes_only() {
    let l = load_from_str(FILE, "[router]\nprefill_policy = \"cost\"\n", &[]).unwrap();
    assert_eq!(
        l.config.router.prefill_policy,
        pdnode_core::config::PolicyName::Cost
    );
    let errs = errors("[router]\ndecode_policy = \"cost\"\n", &[]);
    assert!(
        errs.iter()
            .any(|e| matches!(e, ConfigError::Invalid { key, reason, .. }
            if key == "router.decode_policy" && reason.contains("prefill_policy"))),
        "{errs:?}"
    );
    let errs = errors(
        "[node]\nrole = \"router\"\n[router]\nprefill_policy = \"cost\"\n\
         [[router.sglang.prefill]]\nurl = \"http://127.0.0.1:30000\"\n\
         [[router.sglang.decode]]\nurl = \"http://127.0.0.1:30001\"\n",
        &[],
    );
    assert!(
        errs.iter()
            .any(|e| matches!(e, ConfigError::Invalid { key, reason, .. }
            if key == "router.prefill_policy" && reason.contains("SGLang"))),
        "{errs:?}"
    );
}

#[test]
fn unknown_policy_name_is_an_error_not_a_fallback() {
    let errs = errors("[router]\nprefill_policy = \"fastest\"\n", &[]);
    assert!(
        matches!(&errs[0], ConfigError::WrongType { key, reason, .. }
        if key == "router.prefill_policy" && reason.contains("fastest") && reason.contains("cache_aware"))
    );
    let errs = errors("", &["router.decode_policy=least_loaded"]);
    assert!(
        matches!(&errs[0], ConfigError::WrongType { key, source_name: ConfigSource::Set(_), .. }
        if key == "router.decode_policy")
    );
}

#[test]
fn manual_policy_keys_are_read_and_bounded() {
    let l = load_from_str(
        FILE,
        "[router]\nprefill_policy = \"manual\"\n[router.manual]\nmax_idle_secs = 60\nassignment_mode = \"min_load\"\n",
        &[],
    )
    .unwrap();
    let r = &l.config.router;
    assert_eq!(r.prefill_policy, pdnode_core::config::PolicyName::Manual);
    assert_eq!(r.manual.max_idle_secs, 60);
    assert_eq!(
        r.manual.assignment_mode,
        pdnode_core::config::AssignmentMode::MinLoad
    );
    for bad in ["0", "99999999999"] {
        let errs = errors("", &[&format!("router.manual.max_idle_secs={bad}")]);
        assert!(
            errs.iter()
                .any(|e| e.to_string().contains("router.manual.max_idle_secs")),
            "{bad}: {errs:?}"
        );
    }
    let errs = errors("", &["router.manual.assignment_mode=\"fewest\""]);
    assert!(
        errs.iter()
            .any(|e| e.to_string().contains("router.manual.assignment_mode")),
        "{errs:?}"
    );
}

#[test]
fn set_takes_toml_values() {
    let l = load_from_str(
        FILE,
        "",
        &sets(&[
            "engine.backend=cuda",
            "engine.gpus=[0,1]",
            "engine.tensor_parallel=2",
            "engine.mem_fraction=0.5",
            "engine.prefix_cache=false",
            "node.id=\"quoted-id\"",
        ]),
    )
    .unwrap();
    assert_eq!(l.config.engine.gpus, vec![0, 1]);
    assert_eq!(l.config.engine.tensor_parallel, 2);
    assert_eq!(l.config.engine.mem_fraction, 0.5);
    assert!(!l.config.engine.prefix_cache);
    assert_eq!(l.config.node.id, "quoted-id");
    assert!(matches!(l.origin_of("engine.gpus"), ConfigSource::Set(a) if a == "engine.gpus=[0,1]"));
}

#[test]
fn malformed_set_arguments_are_errors() {
    let errs = errors("", &["engine.gpus"]);
    assert!(matches!(&errs[0], ConfigError::BadSet { .. }));
    let errs = errors("", &["engine..gpus=[0]"]);
    assert!(matches!(&errs[0], ConfigError::BadSet { .. }));
}

#[test]
fn syntax_errors_name_the_file() {
    let errs = errors("[engine\nbackend = ", &[]);
    assert_eq!(errs.len(), 1);
    assert!(
        matches!(&errs[0], ConfigError::Syntax { source_name, .. } if *source_name == file_src())
    );
}

#[test]
fn missing_file_is_an_io_error() {
    let errs = load(Some(Path::new("/nonexistent/pdnode.toml")), &[]).unwrap_err();
    assert!(matches!(&errs[0], ConfigError::Io { .. }));
}

#[test]
fn split_roles_need_etcd_and_ucx() {
    let errs = errors("[node]\nrole = \"decode\"\n", &[]);
    let keys: Vec<&str> = errs.iter().filter_map(|e| e.key()).collect();
    assert!(keys.contains(&"registry.kind"), "{keys:?}");
    assert!(keys.contains(&"transfer.kind"), "{keys:?}");
}

fn shipped_configs() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    let mut out = Vec::new();
    let mut dirs = vec![root];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let p = entry.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|e| e == "toml") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn every_shipped_config_loads() {
    let files = shipped_configs();
    assert!(files.len() >= 10, "{files:?}");
    // The multi-host files name TLS files under /etc/pdnode/certs (made by `pdnode certs init`
    // on the deployment): stand-ins of the right PEM shape here (whether they chain to the CA
    // and name the node is `pdnode check-config`'s part, tested in crates/pdnode/tests/cli.rs).
    let pems = tempfile::tempdir().unwrap();
    let cert = pems.path().join("cert.pem");
    std::fs::write(
        &cert,
        "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let key = pems.path().join("key.pem");
    std::fs::write(
        &key,
        "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    )
    .unwrap();
    let tls_sets = [
        format!("security.tls_ca={:?}", cert.display().to_string()),
        format!("security.tls_cert={:?}", cert.display().to_string()),
        format!("security.tls_key={:?}", key.display().to_string()),
    ];
    let mut with_tls = 0;
    for f in &files {
        // The process environment might hold PDNODE_* variables; keep this test about the files.
        let text = std::fs::read_to_string(f).unwrap();
        let name = f.display().to_string();
        let sets: &[String] = if text.contains("tls_cert") {
            with_tls += 1;
            // As shipped they name files this host lacks: refused, naming the key.
            let errs = load_from_str_with_env(&name, &text, &[], &[]).unwrap_err();
            assert!(
                errs.iter().any(|e| e.key() == Some("security.tls_cert")),
                "{name}: {errs:?}"
            );
            &tls_sets
        } else {
            &[]
        };
        let l = load_from_str_with_env(&name, &text, &[], sets)
            .unwrap_or_else(|e| panic!("{name}: {e:#?}"));
        // The effective config printed by check-config loads back to the same config.
        let again = load_from_str_with_env("effective.toml", &l.effective_toml(), &[], &[])
            .unwrap_or_else(|e| panic!("{name} effective: {e:#?}"));
        assert_eq!(again.config, l.config, "{name}");
    }
    // configs/multi-host/*.toml: mutual TLS by default.
    assert!(with_tls >= 4, "{with_tls}");
}

#[test]
fn the_reference_layout_is_what_the_files_say() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    let get = |f: &str| {
        let p = root.join(f);
        let text = std::fs::read_to_string(&p).unwrap();
        load_from_str_with_env(f, &text, &[], &[]).unwrap().config
    };
    let local = get("local.toml");
    assert_eq!(local.node.role, Role::All);
    assert_eq!(local.registry.kind, RegistryKind::Memory);
    assert_eq!(local.engine.backend, Backend::Cpu);
    let p = get("prefill.toml");
    let d = get("decode.toml");
    assert_eq!(
        (p.node.role, p.engine.gpus.clone(), p.engine.tensor_parallel),
        (Role::Prefill, vec![0, 1, 2, 3], 4)
    );
    assert_eq!(
        (d.node.role, d.engine.gpus.clone(), d.engine.tensor_parallel),
        (Role::Decode, vec![4, 5, 6, 7], 4)
    );
    assert_eq!(p.engine.block_size, d.engine.block_size);
    assert_eq!(p.model.path, d.model.path);
    assert_eq!(get("router.toml").node.role, Role::Router);
}

fn dotted_keys(prefix: &str, v: &toml::Value, out: &mut Vec<String>) {
    if let toml::Value::Table(t) = v {
        for (k, v) in t {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            if v.is_table() {
                dotted_keys(&key, v, out);
            } else {
                out.push(key);
            }
        }
    }
}

#[test]
fn docs_configuration_md_describes_every_key() {
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/configuration.md"),
    )
    .unwrap();
    let defaults = toml::Value::try_from(pdnode_core::config::Config::default()).unwrap();
    let mut keys = Vec::new();
    dotted_keys("", &defaults, &mut keys);
    assert!(keys.len() > 40, "{keys:?}");
    let missing: Vec<&String> = keys
        .iter()
        .filter(|k| !doc.contains(&format!("| `{k}` |")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/configuration.md lacks a row for {missing:?}"
    );
}

#[test]
fn colocated_engine_only_with_role_all() {
    let errs = errors("[node]\nrole = \"decode\"\n", &["engine.colocated=true"]);
    let keys: Vec<&str> = errs.iter().filter_map(|e| e.key()).collect();
    assert!(keys.contains(&"engine.colocated"), "{keys:?}");
    let ok = load_from_str(
        FILE,
        "[node]\nrole = \"all\"\n",
        &sets(&["engine.colocated=true"]),
    )
    .expect("role all + colocated loads");
    assert!(ok.config.engine.colocated);
}

#[test]
fn router_liveness_keys_load_and_are_validated() {
    let l = load_from_str(
        FILE,
        "[router]\nclient_send_timeout_s = 3\nnode_keepalive_interval_ms = 200\nnode_keepalive_timeout_ms = 400\n",
        &[],
    )
    .unwrap();
    assert_eq!(l.config.router.client_send_timeout_s, 3);
    assert_eq!(l.config.router.node_keepalive_interval_ms, 200);
    assert_eq!(l.config.router.node_keepalive_timeout_ms, 400);
    assert!(l.config.router.warm_pairs, "warm_pairs is on by default");
    let off = load_from_str(FILE, "[router]\nwarm_pairs = false\n", &[]).unwrap();
    assert!(!off.config.router.warm_pairs);
    let errs = errors(
        "[router]\nclient_send_timeout_s = 0\nnode_keepalive_interval_ms = 0\nnode_keepalive_timeout_ms = 5\n",
        &[],
    );
    let keys: Vec<String> = errs
        .iter()
        .map(|e| match e {
            ConfigError::Invalid { key, .. } => key.clone(),
            other => panic!("expected ConfigError::Invalid, got {other:?}"),
        })
        .collect();
    for k in [
        "router.client_send_timeout_s",
        "router.node_keepalive_interval_ms",
        "router.node_keepalive_timeout_ms",
    ] {
        assert!(keys.iter().any(|x| x == k), "{k} not in {keys:?}");
    }
}

#[test]
fn sglang_workers_need_role_router_both_sides_and_http_urls() {
    let ok = "[node]\nrole = \"router\"\n[registry]\nkind = \"memory\"\n\
              [[router.sglang.prefill]]\nurl = \"http://10.0.0.1:30000\"\nbootstrap_port = 8998\n\
              [[router.sglang.decode]]\nurl = \"http://10.0.0.2:30000\"\n";
    let c = load_from_str(FILE, ok, &[]).unwrap().config;
    assert_eq!(c.router.sglang.prefill[0].bootstrap_port, Some(8998));
    let key_of = |text: &str| -> Vec<String> {
        errors(text, &[])
            .iter()
            .filter_map(|e| e.key().map(str::to_string))
            .collect()
    };
    let keys = key_of(&ok.replace("role = \"router\"", "role = \"prefill\""));
    assert!(keys.contains(&"router.sglang".to_string()), "{keys:?}");
    let keys = key_of(&ok.replace(
        "[[router.sglang.decode]]\nurl = \"http://10.0.0.2:30000\"\n",
        "",
    ));
    assert!(keys.contains(&"router.sglang".to_string()), "{keys:?}");
    let keys = key_of(&ok.replace("http://10.0.0.2:30000", "10.0.0.2:30000"));
    assert!(
        keys.contains(&"router.sglang.decode".to_string()),
        "{keys:?}"
    );
    let keys = key_of(&format!(
        "{ok}[router.sglang]\nhealth_check_interval_s = 0\nbreaker_failure_threshold = 0\n"
    ));
    assert!(
        keys.contains(&"router.sglang.health_check_interval_s".to_string()),
        "{keys:?}"
    );
    assert!(
        keys.contains(&"router.sglang.breaker_failure_threshold".to_string()),
        "{keys:?}"
    );
    // Without SGLang workers a router still needs etcd.
    let keys = key_of("[node]\nrole = \"router\"\n[registry]\nkind = \"memory\"\n");
    assert!(keys.contains(&"registry.kind".to_string()), "{keys:?}");
    // Discovery alone is enough workers, with etcd; with the in-process registry it is refused.
    let discover = "[node]\nrole = \"router\"\n[registry]\nkind = \"etcd\"\nendpoints = [\"http://127.0.0.1:2379\"]\n\
                    [router.sglang]\ndiscover = true\n";
    let c = load_from_str(FILE, discover, &[]).unwrap().config;
    assert!(c.router.sglang.discover && c.router.sglang.enabled());
    let keys = key_of(
        &discover
            .replace("kind = \"etcd\"", "kind = \"memory\"")
            .replace("endpoints = [\"http://127.0.0.1:2379\"]\n", ""),
    );
    assert!(
        keys.contains(&"router.sglang.discover".to_string()),
        "{keys:?}"
    );
}

/// Every duration key (named `*_s`, `*_ms`, `*_us`, `*_secs`, `*_us_per_token`) has an upper
/// bound: a huge value is an error naming the key, never a config that makes `Instant +
/// Duration` overflow (a panic) when the node builds a deadline from it.
#[test]
fn every_duration_key_has_an_upper_bound() {
    let defaults = load_from_str(FILE, "", &[]).unwrap();
    let v: toml::Value = toml::from_str(&defaults.effective_toml()).unwrap();
    let mut keys = Vec::new();
    dotted_keys("", &v, &mut keys);
    let durations: Vec<&String> = keys
        .iter()
        .filter(|k| {
            ["_s", "_ms", "_us", "_secs", "_us_per_token"]
                .iter()
                .any(|suffix| k.ends_with(suffix))
        })
        .collect();
    assert!(durations.len() >= 15, "{durations:?}");
    for key in durations {
        for huge in [i64::MAX, 1 << 40] {
            let set = format!("{key}={huge}");
            let errs = errors("", &[set.as_str()]);
            assert!(
                errs.iter()
                    .any(|e| matches!(e, ConfigError::Invalid { key: k, .. } if k == key)),
                "{key} = {huge} is accepted or not named: {errs:?}"
            );
        }
    }
    // The bounds still admit every shipped default and the keys' documented ranges.
    let l = load_from_str(
        FILE,
        "[router]\nrequest_timeout_s = 86400\nnode_keepalive_timeout_ms = 3600000\n\
         [transfer]\nlease_ms = 3600000\n[node]\ndrain_timeout_s = 0\n",
        &[],
    )
    .unwrap();
    assert_eq!(l.config.router.request_timeout_s, 86_400);
    // ... and the longest of them is a deadline that can be built.
    let _ = std::time::Instant::now()
        + std::time::Duration::from_secs(l.config.router.request_timeout_s)
        + std::time::Duration::from_millis(l.config.transfer.lease_ms);
}

#[test]
fn telemetry_is_off_by_default_and_its_keys_load() {
    let d = load_from_str(FILE, "", &[]).unwrap().config.telemetry;
    assert!(!d.enabled(), "traces must be off without [telemetry]");
    assert_eq!(d.sampling_ratio, 1.0);
    let l = load_from_str(
        FILE,
        "[telemetry]\nendpoint = \"http://127.0.0.1:4317\"\nsampling_ratio = 0.25\nservice_name = \"edge-router\"\nbatch_delay_ms = 100\n",
        &[],
    )
    .unwrap();
    let t = &l.config.telemetry;
    assert!(t.enabled());
    assert_eq!(t.endpoint, "http://127.0.0.1:4317");
    assert_eq!(t.sampling_ratio, 0.25);
    assert_eq!(t.service_name, "edge-router");
    assert_eq!(t.batch_delay_ms, 100);
    // A trailing slash is allowed; https is not (the exporter has no TLS roots).
    load_from_str(
        FILE,
        "[telemetry]\nendpoint = \"http://collector.example:4317/\"\n",
        &[],
    )
    .unwrap();
}

#[test]
fn telemetry_keys_are_validated_by_name() {
    let keys_of = |errs: Vec<ConfigError>| -> Vec<String> {
        errs.iter()
            .map(|e| match e {
                ConfigError::Invalid { key, .. } => key.clone(),
                other => panic!("expected ConfigError::Invalid, got {other:?}"),
            })
            .collect()
    };
    for (text, key) in [
        ("endpoint = \"127.0.0.1:4317\"", "telemetry.endpoint"),
        ("endpoint = \"grpc://h:4317\"", "telemetry.endpoint"),
        ("endpoint = \"https://h:4317\"", "telemetry.endpoint"),
        ("endpoint = \"http://h\"", "telemetry.endpoint"),
        (
            "endpoint = \"http://h:4317/v1/traces\"",
            "telemetry.endpoint",
        ),
        ("sampling_ratio = 1.5", "telemetry.sampling_ratio"),
        ("sampling_ratio = -0.1", "telemetry.sampling_ratio"),
        ("sampling_ratio = nan", "telemetry.sampling_ratio"),
        ("service_name = \"a b\"", "telemetry.service_name"),
        ("batch_delay_ms = 0", "telemetry.batch_delay_ms"),
    ] {
        let keys = keys_of(errors(&format!("[telemetry]\n{text}\n"), &[]));
        assert_eq!(keys, vec![key.to_string()], "{text}");
    }
    let e = errors("[telemetry]\nendpont = \"http://h:1\"\n", &[]);
    assert!(
        matches!(&e[0], ConfigError::UnknownKey { .. }),
        "unknown telemetry key: {e:?}"
    );
}

/// `engine.cpu_affinity`: a list of cores or "auto" (the GPUs' NUMA node, resolved at start);
/// "auto" where no GPU is bound would do nothing (refused), any other string is an error naming
/// what is expected, and a core listed twice is refused.
#[test]
fn cpu_affinity_is_a_core_list_or_auto() {
    let cuda = "[engine]\nbackend = \"cuda\"\ngpus = [4, 5]\ntensor_parallel = 2\n";
    for v in ["\"auto\"", "[]", "[0, 3]"] {
        let l = load_from_str(FILE, cuda, &[format!("engine.cpu_affinity={v}")])
            .unwrap_or_else(|e| panic!("{v}: {e:?}"));
        let want = match v {
            "\"auto\"" => CpuAffinity::Auto,
            "[]" => CpuAffinity::Cores(vec![]),
            _ => CpuAffinity::Cores(vec![0, 3]),
        };
        assert_eq!(l.config.engine.cpu_affinity, want);
        // The effective config writes it back in a form that loads to the same value.
        let again = load_from_str(FILE, &l.effective_toml(), &[]).unwrap();
        assert_eq!(again.config.engine.cpu_affinity, want, "{v}");
    }
    let e = env(&[("PDNODE_ENGINE__CPU_AFFINITY", "auto")]);
    let l = load_from_str_with_env(FILE, cuda, &e, &[]).unwrap();
    assert_eq!(l.config.engine.cpu_affinity, CpuAffinity::Auto);

    for bad in ["\"numa\"", "[1, 1]", "[-1]"] {
        let errs = errors(cuda, &[&format!("engine.cpu_affinity={bad}")]);
        assert!(
            errs.iter().any(|e| e.key() == Some("engine.cpu_affinity")
                || e.to_string().contains("cpu_affinity")),
            "{bad}: {errs:?}"
        );
    }
    let errs = errors(cuda, &["engine.cpu_affinity=\"numa\""]);
    assert!(format!("{errs:?}").contains("\\\"auto\\\""), "{errs:?}");
    for backend in ["cpu", "mock"] {
        let errs = errors(
            &format!("[engine]\nbackend = \"{backend}\"\ncpu_affinity = \"auto\"\n"),
            &[],
        );
        assert!(
            errs.iter().any(|e| e.key() == Some("engine.cpu_affinity")),
            "{backend}: {errs:?}"
        );
    }
    // backend "auto" may resolve to CUDA: "auto" affinity is accepted there.
    load_from_str(
        FILE,
        "[engine]\nbackend = \"auto\"\ncpu_affinity = \"auto\"\n",
        &[],
    )
    .unwrap();
}
