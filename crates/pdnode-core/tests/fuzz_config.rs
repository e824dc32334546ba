//! Fuzz-style property tests (proptest, stable Rust) of the configuration: TOML files built
//! from the real keys with values of every TOML type and edge numbers, `--set` arguments,
//! `PDNODE_*` variables, and raw text, through parsing, layering and validation. Each input
//! loads or gives errors (at least one, each naming its key or the file), never a panic; a
//! config that loads builds every deadline its durations make without overflow.

use pdnode_core::config::{ConfigError, load_from_str, load_from_str_with_env};
use pdnode_testkit::fuzz::Fuzz;
use pdnode_testkit::fuzz_regressions;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use std::time::{Duration, Instant};

const FILE: &str = "fuzz.toml";

/// Every dotted key of the default configuration (`node.listen`, `router.sglang.breaker_timeout_s`,
/// ...).
fn keys() -> Vec<String> {
    fn walk(prefix: &str, v: &toml::Value, out: &mut Vec<String>) {
        if let toml::Value::Table(t) = v {
            for (k, v) in t {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                if v.is_table() {
                    walk(&key, v, out);
                } else {
                    out.push(key);
                }
            }
        }
    }
    let defaults = load_from_str(FILE, "", &[]).unwrap().effective_toml();
    let mut out = Vec::new();
    walk("", &toml::from_str(&defaults).unwrap(), &mut out);
    out.push("engine.bogus".into());
    out.push("node".into());
    out
}

/// A TOML value as text.
fn values() -> impl Strategy<Value = String> {
    let scalar = prop_oneof![
        prop::sample::select(vec![
            "0",
            "1",
            "-1",
            "2",
            "16",
            "100",
            "65536",
            "4294967296",
            "9223372036854775807",
            "-9223372036854775808",
            "0.0",
            "1.5",
            "-0.5",
            "nan",
            "inf",
            "-inf",
            "1e308",
            "true",
            "false",
            "\"\"",
            "\"all\"",
            "\"prefill\"",
            "\"decode\"",
            "\"router\"",
            "\"mock\"",
            "\"cpu\"",
            "\"cuda\"",
            "\"auto\"",
            "\"etcd\"",
            "\"memory\"",
            "\"ucx\"",
            "\"in-process\"",
            "\"dummy\"",
            "\"smollm2-135m\"",
            "\"127.0.0.1:0\"",
            "\"[::1]:80\"",
            "\"host:99999\"",
            "\"round_robin\"",
            "\"cache_aware\"",
            "\"x y\"",
            "1979-05-27T07:32:00Z",
        ])
        .prop_map(str::to_string),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<String>().prop_map(|s| format!("{s:?}")),
    ];
    scalar.prop_recursive(2, 8, 4, |inner| {
        prop::collection::vec(inner, 0..4).prop_map(|v| format!("[{}]", v.join(", ")))
    })
}

fn check(r: Result<pdnode_core::config::Loaded, Vec<ConfigError>>) -> Result<(), TestCaseError> {
    match r {
        Ok(l) => {
            let c = &l.config;
            let now = Instant::now();
            // Every deadline a node or router builds from one duration, or from a few added.
            let longest = Duration::from_secs(c.router.request_timeout_s)
                + Duration::from_secs(c.router.prefill_timeout_s)
                + Duration::from_secs(c.router.token_timeout_s)
                + Duration::from_millis(c.transfer.lease_ms) * 2
                + Duration::from_secs(c.node.drain_timeout_s)
                + Duration::from_millis(c.registry.timeout_ms)
                + Duration::from_secs(c.registry.lease_ttl_s);
            prop_assert!(now.checked_add(longest).is_some(), "{longest:?}");
            // The effective config of a valid one loads again, to the same config.
            let again = load_from_str(FILE, &l.effective_toml(), &[])
                .map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
            prop_assert_eq!(&again.config, c);
        }
        Err(errs) => {
            prop_assert!(!errs.is_empty());
            for e in &errs {
                prop_assert!(!e.to_string().is_empty());
                if let ConfigError::Invalid { key, .. } = e {
                    prop_assert!(!key.is_empty(), "{e:?}");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn toml_files_of_real_keys_load_or_name_their_errors() {
    let keys = keys();
    let file =
        prop::collection::vec((prop::sample::select(keys), values()), 0..10).prop_map(|kv| {
            // Dotted keys at the top level are TOML for nested tables.
            kv.iter()
                .map(|(k, v)| format!("{k} = {v}\n"))
                .collect::<String>()
        });
    Fuzz::new(fuzz_regressions!("config_toml_files"), 1000)
        .run(&file, |text| check(load_from_str(FILE, &text, &[])))
        .unwrap();
}

#[test]
fn set_arguments_and_env_overlays_load_or_name_their_errors() {
    let keys = keys();
    let input = (
        prop::collection::vec((prop::sample::select(keys.clone()), values()), 0..4),
        prop::collection::vec((prop::sample::select(keys), values()), 0..3),
    );
    Fuzz::new(fuzz_regressions!("config_overlays"), 600)
        .run(&input, |(sets, env)| {
            let sets: Vec<String> = sets.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let env: Vec<(String, String)> = env
                .iter()
                .map(|(k, v)| {
                    let name = format!("PDNODE_{}", k.to_uppercase().replace('.', "__"));
                    (name, v.clone())
                })
                .collect();
            check(load_from_str_with_env(FILE, "", &env, &sets))
        })
        .unwrap();
}

#[test]
fn raw_text_loads_or_names_its_errors() {
    let text = prop_oneof![
        any::<String>(),
        prop::collection::vec(
            prop::sample::select(vec![
                "[node]\n",
                "[engine]\n",
                "[engine.mock]\n",
                "[router.sglang]\n",
                "[[router.sglang.prefill]]\n",
                "url = \"http://h:1\"\n",
                "role = \"router\"\n",
                "x = 1\n",
                "[",
                "]",
                "=",
                "\"",
                "\n",
                "block_size = 0\n",
                "gpus = [0, 0]\n",
                "lease_ms = 18446744073709551615\n",
                "context_length = -1\n",
            ]),
            0..12,
        )
        .prop_map(|v| v.concat()),
    ];
    Fuzz::new(fuzz_regressions!("config_raw_text"), 600)
        .run(&text, |t| check(load_from_str(FILE, &t, &[])))
        .unwrap();
}
