//! The terminal table of a [`BenchReport`].

use crate::sweep::BenchReport;
use std::fmt::Write;

fn f(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else if x >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

fn r(x: Option<f64>) -> String {
    x.map_or("-".to_string(), |v| format!("{v:.2}x"))
}

/// A fixed-width table: one row per (endpoint, concurrency), then ratios when comparing.
pub fn table(report: &BenchReport) -> String {
    let mut out = String::new();
    let w = &report.workload;
    let _ = writeln!(
        out,
        "workload {} | {} requests per level | rate {} | seed {}{}",
        w.name(),
        report.num_requests,
        report
            .request_rate
            .map_or("unlimited".to_string(), |r| format!("{r} req/s")),
        report.seed,
        if report.ignore_eos {
            " | ignore_eos"
        } else {
            ""
        }
    );
    for e in &report.endpoints {
        let _ = writeln!(out, "{}: {} (model {})", e.label, e.base_url, e.model);
    }
    let header = [
        "ep",
        "conc",
        "ok",
        "fail",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "p90",
        "p99",
        "TPOT p50",
        "p90",
        "p99",
        "ITL p50",
        "p99",
        "E2E p50",
        "p99",
        "goodput",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|s| s.to_string()).collect()];
    for run in &report.runs {
        let s = &run.summary;
        rows.push(vec![
            report.endpoints[run.endpoint].label.clone(),
            run.concurrency.to_string(),
            s.completed.to_string(),
            s.failed.to_string(),
            f(s.request_throughput),
            f(s.output_token_throughput),
            f(s.ttft.p50_ms),
            f(s.ttft.p90_ms),
            f(s.ttft.p99_ms),
            f(s.tpot.p50_ms),
            f(s.tpot.p90_ms),
            f(s.tpot.p99_ms),
            f(s.itl.p50_ms),
            f(s.itl.p99_ms),
            f(s.e2e.p50_ms),
            f(s.e2e.p99_ms),
            f(s.goodput),
        ]);
    }
    push_table(&mut out, &rows);
    let _ = writeln!(
        out,
        "latencies in ms; goodput = requests/s meeting the SLOs{}",
        slo_text(report)
    );
    for run in &report.runs {
        if !run.summary.errors.is_empty() {
            let errs: Vec<String> = run
                .summary
                .errors
                .iter()
                .map(|(k, n)| format!("{k}: {n}"))
                .collect();
            let _ = writeln!(
                out,
                "errors {} @ {}: {}",
                report.endpoints[run.endpoint].label,
                run.concurrency,
                errs.join(", ")
            );
        }
    }
    if !report.comparisons.is_empty() {
        let _ = writeln!(
            out,
            "\nB / A (latency < 1: B faster; throughput > 1: B serves more)"
        );
        let mut rows = vec![
            [
                "conc",
                "TTFT p50",
                "TTFT p99",
                "TPOT p50",
                "TPOT p99",
                "ITL p50",
                "E2E p50",
                "out tok/s",
                "req/s",
                "goodput",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect::<Vec<_>>(),
        ];
        for c in &report.comparisons {
            rows.push(vec![
                c.concurrency.to_string(),
                r(c.ttft_p50),
                r(c.ttft_p99),
                r(c.tpot_p50),
                r(c.tpot_p99),
                r(c.itl_p50),
                r(c.e2e_p50),
                r(c.output_token_throughput),
                r(c.request_throughput),
                r(c.goodput),
            ]);
        }
        push_table(&mut out, &rows);
    }
    out
}

fn slo_text(report: &BenchReport) -> String {
    let Some(run) = report.runs.first() else {
        return String::new();
    };
    let slo = run.summary.slo;
    let mut parts = Vec::new();
    if let Some(t) = slo.ttft_ms {
        parts.push(format!("TTFT <= {t} ms"));
    }
    if let Some(t) = slo.tpot_ms {
        parts.push(format!("TPOT <= {t} ms"));
    }
    if parts.is_empty() {
        " (no SLO given: every completed request)".into()
    } else {
        format!(" ({})", parts.join(", "))
    }
}

fn push_table(out: &mut String, rows: &[Vec<String>]) {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(c, s)| format!("{s:>w$}", w = widths[c]))
            .collect();
        let _ = writeln!(out, "{}", line.join("  "));
    }
}
