//! Live decode migration between `pdnode start` processes: etcd (testkit), a router, a prefill
//! node and two decode nodes on the simulated engine, KV over UCX on loopback (the fault tests'
//! cluster, `e2e_faults`). A decode node drained by migration mid-stream, by SIGTERM with
//! `node.drain = "migrate"` or by `pdnode drain NODE --migrate`, moves its stream to the other
//! decode node: the client gets the unmoved text whole, with no gap over 1 s.

use crate::e2e_faults::{await_n, ready, router_gauge, start, stats};
use crate::e2e_support;

use e2e_support::dump;
use pdnode_testkit::{EtcdServer, skip_etcd_tests};
use serde_json::json;
use std::time::{Duration, Instant};

/// Streams one greedy completion; says on `started` once `after` tokens came. Returns each
/// text piece with the time it came, and whether the stream ended with `[DONE]`.
async fn stream_greedy(
    http: String,
    prompt: String,
    max_tokens: u32,
    after: usize,
    started: tokio::sync::mpsc::Sender<()>,
) -> (Vec<(Instant, String)>, bool) {
    let mut resp = e2e_support::client()
        .post(format!("http://{http}/v1/completions"))
        .json(
            &json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": true, "stream_options": {"include_usage": true}}),
        )
        .send()
        .await
        .expect("the router answers");
    let mut buf = String::new();
    let mut pieces = Vec::new();
    let mut done = false;
    let mut said = false;
    while let Ok(Ok(Some(b))) = tokio::time::timeout(Duration::from_secs(10), resp.chunk()).await {
        buf.push_str(&String::from_utf8_lossy(&b));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data:").map(str::trim) else {
                continue;
            };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(data).expect("a JSON event");
            if let Some(t) = v["choices"][0]["text"].as_str() {
                pieces.push((Instant::now(), t.to_string()));
            }
            assert!(v.get("error").is_none(), "an error event: {v}");
        }
        if !said && pieces.len() >= after {
            said = true;
            let _ = started.send(()).await;
        }
    }
    if !said {
        let _ = started.send(()).await;
    }
    (pieces, done)
}

/// How a decode node is told to drain by migration.
#[derive(Clone, Copy, PartialEq)]
enum DrainBy {
    /// `node.drain = "migrate"` in its config, then SIGTERM.
    Sigterm,
    /// `pdnode drain NODE --migrate --wait` (its config says `wait`).
    Command,
}

/// A decode node drained by migration mid-stream moves the stream to the other decode node
/// (parked, its KV pushed over UCX, the stream continued by the router on the same HTTP
/// response): the client gets the unmoved run's text whole, with no gap over 1 s, the drained
/// node exits having nothing left in flight, and the router counts one migration.
async fn drained_by_migration(by: DrainBy) {
    if skip_etcd_tests() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdServer::start().expect("etcd");
    let mock = [
        "engine.mock.decode_us_per_token=20000",
        "engine.mock.output_len=150",
    ];
    let mut decode = vec![mock[0], mock[1], "node.drain_timeout_s=20"];
    if by == DrainBy::Sigterm {
        decode.push("node.drain=\"migrate\"");
    }
    let cluster = match by {
        DrainBy::Sigterm => "migrate",
        DrainBy::Command => "migrate-cli",
    };
    let mut c = start(
        dir.path(),
        &etcd.endpoint(),
        cluster,
        (1, &mock),
        (2, &decode),
        &["router.token_timeout_s=10"],
    );
    ready(&c).await;
    let prompt = "a prompt of some sixty bytes, one mock token per byte, to move".to_string();
    let (tx, _rx) = tokio::sync::mpsc::channel(1);
    let (want, done) = stream_greedy(c.http.clone(), prompt.clone(), 120, usize::MAX, tx).await;
    assert!(done, "the unmoved stream ends with [DONE]{}", c.logs());
    let want: String = want.into_iter().map(|(_, t)| t).collect();

    let (tx, mut rx) = tokio::sync::mpsc::channel(1);
    let run = tokio::spawn(stream_greedy(c.http.clone(), prompt, 120, 20, tx));
    assert!(await_n(&mut rx, 1, Duration::from_secs(30)).await);
    // The decode node running the stream.
    let mut on = None;
    for (i, d) in c.decodes.iter().enumerate() {
        if stats(&d.grpc).await.is_some_and(|s| s.running_requests > 0) {
            on = Some(i);
        }
    }
    let on = on.unwrap_or_else(|| panic!("no decode node runs the stream{}", c.logs()));
    let drained = c.decodes.remove(on);
    let command = match by {
        DrainBy::Sigterm => {
            let pid = drained.node.guard.pid().expect("pid");
            pdnode_testkit::send_signal(pid, "TERM").unwrap();
            None
        }
        DrainBy::Command => {
            let etcd_url = etcd.endpoint();
            // A node the cluster does not have: a usage error (exit 2) that says so.
            let out = std::process::Command::new(e2e_support::BIN)
                .args([
                    "drain",
                    "--etcd",
                    &etcd_url,
                    "--cluster",
                    "migrate-cli",
                    "nosuch",
                ])
                .output()
                .expect("pdnode drain");
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{err}");
            assert!(err.contains("no node \"nosuch\""), "{err}");
            let id = drained.id.clone();
            Some(tokio::task::spawn_blocking(move || {
                std::process::Command::new(e2e_support::BIN)
                    .args(["drain", "--etcd", &etcd_url, "--cluster", "migrate-cli"])
                    .args([id.as_str(), "--migrate", "--wait"])
                    .output()
                    .expect("pdnode drain")
            }))
        }
    };
    let (pieces, done) = run.await.unwrap();
    let mut logs = dump(&[&c.router, &drained.node]);
    logs.push_str(&c.logs());
    assert!(done, "the moved stream ends with [DONE]{logs}");
    let got: String = pieces.iter().map(|(_, t)| t.as_str()).collect();
    assert_eq!(got, want, "the moved stream's text{logs}");
    let gap = pieces
        .windows(2)
        .map(|w| w[1].0.duration_since(w[0].0))
        .max()
        .unwrap_or_default();
    assert!(
        gap < Duration::from_secs(1),
        "a gap of {gap:?} in the stream{logs}"
    );
    let moved = router_gauge(&c.http, "pdnode_router_migrations_total{outcome=\"ok\"}").await;
    assert_eq!(moved, Some(1.0), "{logs}");
    if let Some(cmd) = command {
        let out = cmd.await.unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "pdnode drain: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("moving its decodes"), "{stdout}");
        assert!(stdout.contains("left the cluster"), "{stdout}");
    }
    // The drained node leaves once its stream moved, well within its drain timeout.
    let mut guard = drained.node.guard;
    let status = tokio::task::spawn_blocking(move || guard.wait_timeout(Duration::from_secs(15)))
        .await
        .unwrap()
        .unwrap();
    assert!(
        status.is_some_and(|s| s.success()),
        "the drained node did not exit cleanly: {status:?}{logs}"
    );
    let log = std::fs::read_to_string(&drained.node.log).unwrap_or_default();
    assert!(log.contains("drain by migration"), "{log}");
    assert!(log.contains("left=0"), "{log}");
    drop(etcd);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_node_drained_by_migration_moves_its_stream_whole() {
    drained_by_migration(DrainBy::Sigterm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pdnode_drain_migrate_moves_a_decode_nodes_stream_whole() {
    drained_by_migration(DrainBy::Command).await;
}
