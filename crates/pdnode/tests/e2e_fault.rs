//! Faults of the KV hand-off, separate processes (etcd from the testkit, `pdnode start` router,
//! prefill and decode over UCX on loopback, simulated engine): the prefill node is SIGKILLed
//! while it prefills a request whose KV the decode node has reserved. The request ends with an
//! error within seconds and the decode node ends with every KV block free and nothing running.
//! (The decode node killed between its reservation and `Decode` is
//! `e2e_split::decode_killed_while_prefill_holds_blocks_frees_them_and_fails_the_request`.)

use crate::e2e_support;

use e2e_support::{Node, dump, free_addr};
use pdnode_proto::v1::{StatsRequest, node_client::NodeClient};
use pdnode_testkit::{EtcdServer, skip_etcd_tests, wait_for_async};
use serde_json::json;
use std::time::{Duration, Instant};

const READY: Duration = Duration::from_secs(120);

/// `n` distinct free loopback addresses (two calls in a row may be given the same port).
fn free_addrs(n: usize) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(n);
    let deadline = Instant::now() + Duration::from_secs(10);
    while out.len() < n {
        assert!(Instant::now() < deadline, "no {n} distinct free ports");
        let a = free_addr();
        if !out.contains(&a) {
            out.push(a);
        }
    }
    out
}

async fn stats(addr: &str) -> Option<pdnode_proto::v1::StatsResponse> {
    let r = tokio::time::timeout(Duration::from_secs(2), async {
        let mut c = NodeClient::connect(format!("http://{addr}")).await.ok()?;
        c.stats(StatsRequest {}).await.ok()
    })
    .await
    .ok()??;
    Some(r.into_inner())
}

/// What the decode node's `Stats` said, as a short line (`None`: no answer in 2 s).
fn summary(s: &Option<pdnode_proto::v1::StatsResponse>) -> String {
    match s {
        None => "no answer".into(),
        Some(s) => format!(
            "free {}/{} running {} queued {} quarantined {}",
            s.kv_blocks_free,
            s.kv_blocks_total,
            s.running_requests,
            s.queued_requests,
            s.accounting
                .as_ref()
                .map_or(0, |a| a.staging_spans_quarantined)
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_killed_mid_prefill_ends_the_request_and_frees_the_decode_reservation() {
    if skip_etcd_tests() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdServer::start().expect("etcd");
    let cluster = "e2e-kill-p";
    let common = |role: &str, listen: &str| {
        vec![
            format!("registry.endpoints=[\"{}\"]", etcd.endpoint()),
            format!("node.cluster=\"{cluster}\""),
            format!("node.id=\"{cluster}-{role}\""),
            format!("node.listen=\"{listen}\""),
            "registry.lease_ttl_s=3".to_string(),
            "engine.backend=\"mock\"".to_string(),
            "model.format=\"dummy\"".to_string(),
            "model.preset=\"smollm2-135m\"".to_string(),
            "model.path=\"\"".to_string(),
        ]
    };
    // A 512-token prompt prefilled 32 tokens a step at 10 ms a token: about 5 s with the
    // decode node's reservation held all along.
    let engine = [
        "engine.prefix_cache=false",
        "engine.mock.prefill_us_per_token=10000",
        "engine.max_batch_tokens=32",
        "transfer.lease_ms=3000",
    ]
    .map(String::from);
    let a = free_addrs(7);
    let http = a[0].clone();
    let mut r = common("router", &a[1]);
    r.push(format!("router.http_listen=\"{http}\""));
    r.push(format!("router.grpc_listen=\"{}\"", a[2]));
    let mut p = common("prefill", &a[3]);
    p.push(format!("node.http_listen=\"{}\"", a[4]));
    p.extend(engine.iter().cloned());
    let decode_grpc = a[5].clone();
    let mut d = common("decode", &decode_grpc);
    d.push(format!("node.http_listen=\"{}\"", a[6]));
    d.extend(engine.iter().cloned());
    // The reservation's life (reserve, abort, quarantine, sweep) in the log a failure prints.
    d.push("log.filter=\"info,pdnode_node=debug\"".to_string());
    let prefill = Node::start(dir.path(), "prefill", "configs/cpu-prefill.toml", &p);
    let decode = Node::start(dir.path(), "decode", "configs/cpu-decode.toml", &d);
    let router = Node::start(dir.path(), "router", "configs/cpu-router.toml", &r);
    let nodes = [&router, &prefill, &decode];
    e2e_support::wait_healthy(&http, READY, &nodes).await;
    let before = stats(&decode_grpc).await.expect("decode Stats");
    assert_eq!(before.kv_blocks_free, before.kv_blocks_total, "{before:?}");

    let h = http.clone();
    let request = tokio::spawn(async move {
        let prompt = "0123456789abcdef".repeat(32);
        e2e_support::post_json(
            &h,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 4}),
        )
        .await
    });
    // The decode node reserved the prompt's blocks; the prefill node is part-way through it.
    let addr = decode_grpc.clone();
    let held = wait_for_async("decode reserves KV blocks", Duration::from_secs(10), || {
        let addr = addr.clone();
        async move {
            stats(&addr)
                .await
                .is_some_and(|s| s.kv_blocks_free < s.kv_blocks_total)
        }
    })
    .await;
    if let Err(e) = held {
        panic!("{e}{}", dump(&nodes));
    }
    let killed = Instant::now();
    prefill.guard.signal("KILL").expect("kill -KILL prefill");
    let (st, v) = tokio::time::timeout(Duration::from_secs(15), request)
        .await
        .unwrap_or_else(|_| panic!("the request hung after the kill{}", dump(&nodes)))
        .unwrap();
    eprintln!("after the kill ({:?}): {st} {v}", killed.elapsed());
    assert!(st >= 500, "status {st}: {v}");
    assert!(v["error"]["message"].is_string(), "{v}");

    // Every block of the reservation comes back (the router's abort, or the lease at 3 s).
    // Each change of the decode node's answer is kept, with its time since the kill, for the
    // failure message.
    let addr = decode_grpc.clone();
    let total = before.kv_blocks_total;
    let seen = std::sync::Mutex::new(Vec::<(Duration, String)>::new());
    // 40 s: the abort frees them at once and the fence deadline is 6 s; the margin is for a
    // starved CI machine (stop 26 failed here at 20 s, cause not seen: the trail below shows it).
    let freed = wait_for_async("decode blocks all free", Duration::from_secs(40), || {
        let addr = addr.clone();
        let seen = &seen;
        async move {
            let s = stats(&addr).await;
            let line = summary(&s);
            let mut seen = seen.lock().unwrap();
            if seen.last().is_none_or(|(_, l)| *l != line) {
                seen.push((killed.elapsed(), line));
            }
            s.is_some_and(|s| {
                s.kv_blocks_free == total && s.running_requests == 0 && s.queued_requests == 0
            })
        }
    })
    .await;
    if let Err(e) = freed {
        let now = stats(&decode_grpc).await;
        let seen = seen.lock().unwrap();
        let trail: Vec<String> = seen.iter().map(|(t, l)| format!("{t:?}: {l}")).collect();
        panic!(
            "{e}\nthe decode node's answers since the kill:\n{}\nnow: {now:?}{}",
            trail.join("\n"),
            dump(&nodes)
        );
    }
    drop(etcd);
}
