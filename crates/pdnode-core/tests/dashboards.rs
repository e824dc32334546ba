//! docs/grafana/pdnode.json and docs/alerts.yml speak of real metrics: every `pdnode_*` name in
//! them (a histogram's `_bucket`, `_sum`, `_count` series included) is one of
//! `pdnode_core::metrics::ALL`, every one of which some code emits, and both files are well
//! formed.

use pdnode_core::metrics;
use std::collections::BTreeSet;
use std::path::PathBuf;

fn doc(rel: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../docs")
        .join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Every `pdnode_[a-z0-9_]+` token of `text` (a bare `pdnode_`, as in "pdnode_* names", is
/// prose, not a name).
fn metric_tokens(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let b = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("pdnode_") {
        let start = i + at;
        let boundary =
            start == 0 || !(b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_');
        let mut end = start + "pdnode_".len();
        while end < b.len()
            && (b[end].is_ascii_lowercase() || b[end].is_ascii_digit() || b[end] == b'_')
        {
            end += 1;
        }
        if boundary && end > start + "pdnode_".len() {
            out.insert(text[start..end].to_string());
        }
        i = end;
    }
    out
}

/// The metric a series name belongs to: itself, or the histogram of a `_bucket`/`_sum`/`_count`.
fn metric_of(series: &str) -> Option<&'static str> {
    let known = |n: &str| metrics::ALL.iter().copied().find(|m| *m == n);
    known(series).or_else(|| {
        ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suf| series.strip_suffix(suf))
            .and_then(known)
            .filter(|m| m.ends_with("_seconds"))
    })
}

fn check_names(file: &str, text: &str) -> usize {
    let names = metric_tokens(text);
    assert!(!names.is_empty(), "{file}: no pdnode metric at all");
    for n in &names {
        assert!(
            metric_of(n).is_some(),
            "{file}: {n} is not a metric of pdnode_core::metrics::ALL (or its histogram series)"
        );
    }
    names.len()
}

#[test]
fn the_grafana_dashboard_uses_real_metric_names() {
    let text = doc("grafana/pdnode.json");
    let v: serde_json::Value =
        serde_json::from_str(&text).expect("docs/grafana/pdnode.json is JSON");
    assert_eq!(v["uid"], "pdnode-overview");
    let panels = v["panels"].as_array().expect("panels");
    let mut exprs = 0;
    for p in panels.iter().filter(|p| p["type"] != "row") {
        let targets = p["targets"]
            .as_array()
            .unwrap_or_else(|| panic!("{p}: no targets"));
        assert!(!targets.is_empty(), "panel {} has no query", p["title"]);
        for t in targets {
            let e = t["expr"].as_str().unwrap_or_else(|| panic!("{t}: no expr"));
            assert!(!metric_tokens(e).is_empty(), "{e}: no pdnode metric");
            exprs += 1;
        }
    }
    assert!(exprs >= 20, "{exprs} queries");
    check_names("docs/grafana/pdnode.json", &text);
    // The panels the issue asks for.
    for want in [
        "pdnode_router_ttft_seconds_bucket",
        "pdnode_router_tpot_seconds_bucket",
        "pdnode_engine_queue_depth",
        "pdnode_kv_owned_blocks",
        "pdnode_kv_cached_blocks",
        "pdnode_kv_free_blocks",
        "pdnode_transfer_bytes_total",
        "pdnode_transfer_seconds_bucket",
        "pdnode_router_requests_total",
    ] {
        assert!(text.contains(want), "the dashboard has no {want}");
    }
}

#[test]
fn the_alert_rules_use_real_metric_names_and_each_has_an_expression() {
    let text = doc("alerts.yml");
    check_names("docs/alerts.yml", &text);
    // A light structural check (no YAML parser in the workspace): every rule names an alert and
    // has an expression; alert names are unique.
    let mut alerts = BTreeSet::new();
    let mut pending: Option<String> = None;
    for line in text.lines() {
        let t = line.trim_start();
        if let Some(name) = t.strip_prefix("- alert: ") {
            assert!(pending.is_none(), "alert {pending:?} has no expr");
            assert!(alerts.insert(name.to_string()), "alert {name} twice");
            pending = Some(name.to_string());
        } else if t.starts_with("expr:") {
            assert!(pending.take().is_some(), "an expr outside an alert: {line}");
        }
    }
    assert!(pending.is_none(), "alert {pending:?} has no expr");
    assert!(alerts.len() >= 10, "{alerts:?}");
}

#[test]
fn the_scanner_finds_series_and_refuses_unknown_names() {
    let names = metric_tokens(
        "rate(pdnode_router_ttft_seconds_bucket[5m]) + xpdnode_no + pdnode_kv_free_blocks",
    );
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        ["pdnode_kv_free_blocks", "pdnode_router_ttft_seconds_bucket"]
    );
    assert_eq!(
        metric_of("pdnode_router_ttft_seconds_bucket"),
        Some(metrics::ROUTER_TTFT_SECONDS)
    );
    assert_eq!(metric_of("pdnode_kv_free_blocks_bucket"), None);
    assert_eq!(metric_of("pdnode_router_ttft"), None);
}

/// Every name `pdnode_core::metrics` declares is written by some product code: the first
/// argument of a `Metrics` writer (`.set(`, `.inc(`, `.set_counter(`, `.observe(`,
/// `.set_histogram(`, `.set_from(`, after any path) outside the declaring file; a name only
/// logged or imported does not count. No metric in `ALL`, the docs or a dashboard that nothing
/// emits.
#[test]
fn every_declared_metric_is_emitted_somewhere() {
    let crates = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut code = String::new();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&crates)
        .unwrap()
        .map(|e| e.unwrap().path().join("src"))
        .filter(|p| p.is_dir())
        .collect();
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs")
                && !p.ends_with("pdnode-core/src/metrics.rs")
            {
                code.push_str(&std::fs::read_to_string(&p).unwrap());
            }
        }
    }
    let decl = std::fs::read_to_string(crates.join("pdnode-core/src/metrics.rs")).unwrap();
    let consts: Vec<&str> = decl
        .lines()
        .filter_map(|l| {
            l.strip_prefix("pub const ")?
                .split_once(": &str = \"pdnode_")
        })
        .map(|(name, _)| name)
        .collect();
    assert_eq!(
        consts.len(),
        metrics::ALL.len(),
        "a pdnode_* constant missing from ALL"
    );
    // the names a writer call takes first, across line breaks
    let flat: String = code.chars().filter(|c| !c.is_whitespace()).collect();
    let mut written = std::collections::BTreeSet::new();
    for writer in [
        ".set(",
        ".inc(",
        ".set_counter(",
        ".observe(",
        ".set_histogram(",
        ".set_from(",
    ] {
        for (at, _) in flat.match_indices(writer) {
            let arg = &flat[at + writer.len()..];
            let end = arg
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(arg.len());
            if let Some(name) = arg[..end].rsplit("::").next() {
                written.insert(name.to_string());
            }
        }
    }
    let used = |name: &str| written.contains(name);
    let never: Vec<&str> = consts.iter().copied().filter(|n| !used(n)).collect();
    assert!(never.is_empty(), "declared but never emitted: {never:?}");
}
