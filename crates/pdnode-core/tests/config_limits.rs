//! The loader's own bounds: the config file's size and encoding, how many bad keys one source
//! reports, and values that pass their types but cannot work (a queue of 0, a load refresh under
//! 50 ms, the mock engine's), and the SLO targets' bounds and where they cannot apply.

use pdnode_core::config::{ConfigError, load, load_from_str};

use crate::common;

use common::{FILE, errors, file_src};

#[test]
fn a_config_file_past_the_size_cap_or_not_text_is_refused_unread() {
    let dir = tempfile::tempdir().unwrap();
    // a comment line past the cap: valid TOML, refused for its size alone
    let big = dir.path().join("big.toml");
    let mut text = "[engine]\nbackend = \"mock\"\n#".to_string();
    text.push_str(&"x".repeat(pdnode_core::config::MAX_CONFIG_BYTES as usize));
    std::fs::write(&big, &text).unwrap();
    let errs = load(Some(&big), &[]).unwrap_err();
    assert!(
        matches!(&errs[0], ConfigError::Io { reason, .. } if reason.contains("bytes")),
        "{errs:?}"
    );
    text.truncate(text.len() - 64);
    std::fs::write(&big, &text).unwrap();
    assert!(load(Some(&big), &[]).is_ok(), "just under the cap loads");

    let bin = dir.path().join("bin.toml");
    std::fs::write(&bin, b"[engine]\nbackend = \"\xff\"\n").unwrap();
    let errs = load(Some(&bin), &[]).unwrap_err();
    assert!(
        matches!(&errs[0], ConfigError::Io { reason, .. } if reason.contains("UTF-8")),
        "{errs:?}"
    );
    // a directory is not a config file (no read of it, no hang on a special file)
    let errs = load(Some(dir.path()), &[]).unwrap_err();
    assert!(matches!(&errs[0], ConfigError::Io { .. }), "{errs:?}");
}

#[test]
fn a_file_of_many_bad_keys_reports_a_bounded_number() {
    use pdnode_core::config::MAX_KEY_ERRORS;
    let mut text = String::new();
    for i in 0..5000 {
        text.push_str(&format!("bad_key_{i} = 1\n"));
    }
    let errs = errors(&text, &[]);
    assert_eq!(errs.len(), MAX_KEY_ERRORS + 1, "{:?}", &errs[..3]);
    assert!(
        errs[..MAX_KEY_ERRORS]
            .iter()
            .all(|e| matches!(e, ConfigError::UnknownKey { .. }))
    );
    assert!(
        matches!(&errs[MAX_KEY_ERRORS], ConfigError::TooManyBadKeys { source_name, max }
            if *source_name == file_src() && *max == MAX_KEY_ERRORS),
        "{:?}",
        errs.last()
    );
    // a handful of bad keys are all reported, each once
    let errs = errors("a = 1\nb = 2\n[engine]\nc = 3\n", &[]);
    assert_eq!(errs.len(), 3, "{errs:?}");
}

#[test]
fn a_queue_of_zero_and_a_load_refresh_under_50_ms_are_refused() {
    for (bad, key) in [
        (
            "[engine]\nmax_queued_requests = 0\n",
            "engine.max_queued_requests",
        ),
        (
            "[router.power_of_two]\nload_refresh_ms = 49\n",
            "router.power_of_two.load_refresh_ms",
        ),
    ] {
        let errs = errors(bad, &[]);
        assert!(errs.iter().any(|e| e.key() == Some(key)), "{errs:?}");
    }
    // the smallest good values load
    let l = load_from_str(FILE, "[engine]\nmax_queued_requests = 1\n", &[]).unwrap();
    assert_eq!(l.config.engine.max_queued_requests, 1);
    let l = load_from_str(FILE, "[router.power_of_two]\nload_refresh_ms = 50\n", &[]).unwrap();
    assert_eq!(l.config.router.power_of_two.load_refresh_ms, 50);
    // each bad mock value is named by its own key
    let errs = errors("[engine.mock]\nvocab_size = 1\noutput_len = 0\n", &[]);
    let keys: Vec<&str> = errs.iter().filter_map(|e| e.key()).collect();
    assert!(keys.contains(&"engine.mock.vocab_size"), "{keys:?}");
    assert!(keys.contains(&"engine.mock.output_len"), "{keys:?}");
}

#[test]
fn slo_targets_load_and_are_bounded() {
    let l = load_from_str(
        FILE,
        "[router.slo]\nttft_ms = 500\ntpot_ms = 40\nqueue_ms = 250\n",
        &[],
    )
    .unwrap();
    assert_eq!(l.config.router.slo.ttft_ms, 500);
    assert_eq!(l.config.router.slo.tpot_ms, 40);
    assert_eq!(l.config.router.slo.queue_ms, 250);
    let errs = errors("[router.slo]\nqueue_ms = 3600001\n", &[]);
    assert!(
        errs.iter()
            .any(|e| matches!(e, ConfigError::Invalid { key, .. } if key == "router.slo.queue_ms")),
        "{errs:?}"
    );
    let d = load_from_str(FILE, "", &[]).unwrap();
    assert_eq!(
        (d.config.router.slo.ttft_ms, d.config.router.slo.tpot_ms),
        (0, 0)
    );
    let errs = errors("[router.slo]\nttft_ms = 3600001\n", &[]);
    assert!(
        errs.iter()
            .any(|e| matches!(e, ConfigError::Invalid { key, .. }
            if key == "router.slo.ttft_ms")),
        "{errs:?}"
    );
    // a router in front of SGLang workers has no loads or step times to predict from: any
    // target is refused, not silently unused
    for slo in ["ttft_ms = 500", "tpot_ms = 40", "queue_ms = 250"] {
        let errs = errors(
            &format!(
                "[node]\nrole = \"router\"\n[router.slo]\n{slo}\n\
                 [[router.sglang.prefill]]\nurl = \"http://127.0.0.1:30000\"\n\
                 [[router.sglang.decode]]\nurl = \"http://127.0.0.1:30001\"\n"
            ),
            &[],
        );
        assert!(
            errs.iter()
                .any(|e| matches!(e, ConfigError::Invalid { key, .. } if key == "router.slo")),
            "{slo}: {errs:?}"
        );
    }
}
