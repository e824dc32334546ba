//! Router overhead with instant fake nodes: non-streaming completions at a fixed concurrency.
//! Ignored by default (a measurement, not a check):
//! `cargo test -p pdnode-router --release --test all throughput:: -- --ignored --nocapture`

use crate::common;

use common::Harness;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread")]
#[ignore]
async fn router_overhead() {
    let h = Harness::start_with(2, 2, |d| d.config.max_inflight_requests = 10_000).await;
    let client = reqwest::Client::new();
    let url = Arc::new(h.url("/v1/completions"));
    let (total, conc) = (4000usize, 64usize);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..conc {
        let (client, url) = (client.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            for _ in (w..total).step_by(conc) {
                let t = Instant::now();
                let r = client
                    .post(url.as_str())
                    .json(&json!({"prompt": "Say hi to the router", "max_tokens": 8}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status().as_u16(), 200);
                r.bytes().await.unwrap();
                lat.push(t.elapsed());
            }
            lat
        }));
    }
    let mut lat: Vec<Duration> = Vec::new();
    for t in tasks {
        lat.extend(t.await.unwrap());
    }
    let secs = t0.elapsed().as_secs_f64();
    lat.sort();
    println!(
        "router_overhead: {total} requests, concurrency {conc}: {:.0} req/s, p50 {:?}, p99 {:?}",
        total as f64 / secs,
        lat[lat.len() / 2],
        lat[lat.len() * 99 / 100]
    );
    h.stop().await;
}
