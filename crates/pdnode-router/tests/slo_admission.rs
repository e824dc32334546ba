//! SLO admission (`router.slo`, headers `X-SLO-TTFT-Ms` / `X-SLO-TPOT-Ms`): a request that would
//! miss its target, as the router predicts from what it measured, is refused at once with 429,
//! a reason and `Retry-After`; a looser target, or nothing measured yet, admits it. Fake nodes
//! (the router's own test doubles), a real router.

use crate::common::{self, Harness};

use pdnode_core::{ErrorKind, SamplingParams};
use pdnode_router::{GenEvent, GenRequest, Router, RouterError, Slo};
use std::sync::Arc;
use std::time::Duration;

fn request(slo: Slo) -> GenRequest {
    GenRequest {
        prompt_token_ids: vec![u32::from(b'x'); 32],
        sampling: SamplingParams {
            max_tokens: 6,
            ..SamplingParams::default()
        },
        endpoint: "completions",
        routing_key: None,
        slo,
    }
}

fn refused(r: &Router) -> f64 {
    r.metrics()
        .value(
            pdnode_core::metrics::ROUTER_REQUESTS_TOTAL,
            &[("endpoint", "completions"), ("outcome", "overloaded")],
        )
        .unwrap_or(0.0)
}

async fn run(r: &Arc<Router>, slo: Slo) -> Result<(), RouterError> {
    to_the_end(r.generate(request(slo))?).await
}

/// Reads a generation's events to its end.
async fn to_the_end(mut g: pdnode_router::Generation) -> Result<(), RouterError> {
    loop {
        match tokio::time::timeout(Duration::from_secs(10), g.events.recv())
            .await
            .expect("an event within 10 s")
        {
            Some(GenEvent::Tokens { .. }) => {}
            Some(GenEvent::Done { .. }) => return Ok(()),
            Some(GenEvent::Error(e)) => panic!("request failed: {e}"),
            None => panic!("stream ended without Done or Error"),
        }
    }
}

#[tokio::test]
async fn a_request_predicted_to_miss_its_ttft_target_is_refused_until_a_looser_one() {
    let f = common::fakes(1, 1);
    let mut deps = f.deps;
    deps.config.slo.ttft_ms = 50;
    let router = Router::new(deps);
    f.prefill[0].set(|b| b.prefill_delay = Duration::from_millis(120));
    // Nothing measured yet: admitted, and measured (~120 ms to the first token).
    run(&router, Slo::default()).await.unwrap();
    match run(&router, Slo::default()).await {
        Err(RouterError::SloUnmet {
            what,
            predicted_ms,
            target_ms,
            retry_after_s,
        }) => {
            assert_eq!(what, "time to first token");
            assert!(predicted_ms >= 100, "predicted {predicted_ms} ms");
            assert_eq!(target_ms, 50);
            assert!(retry_after_s >= 1);
        }
        other => panic!("expected SloUnmet, got {other:?}"),
    }
    // The client's own, looser target wins over the config's.
    let loose = Slo {
        ttft_ms: Some(1000),
        tpot_ms: None,
    };
    run(&router, loose).await.unwrap();
    // A refusal reads as overloaded (HTTP 429), and is counted with the requests.
    let before = refused(&router);
    assert!(before >= 1.0, "the first refusal was counted too");
    let e = run(&router, Slo::default()).await.unwrap_err();
    assert_eq!(
        pdnode_core::error::Classify::kind(&e),
        ErrorKind::Overloaded
    );
    assert_eq!(refused(&router), before + 1.0);
    // No target at all: nothing is refused.
    let f = common::fakes(1, 1);
    let router = Router::new(f.deps);
    f.prefill[0].set(|b| b.prefill_delay = Duration::from_millis(120));
    for _ in 0..3 {
        run(&router, Slo::default()).await.unwrap();
    }
}

#[tokio::test]
async fn a_request_is_refused_while_every_decode_node_runs_above_its_tpot_target() {
    let f = common::fakes(1, 2);
    let mut deps = f.deps;
    deps.config.slo.tpot_ms = 10;
    let router = Router::new(deps);
    for d in &f.decode {
        d.set(|b| b.token_interval = Duration::from_millis(25));
    }
    // Until both decode nodes have measured streams, requests are admitted.
    run(&router, Slo::default()).await.unwrap();
    run(&router, Slo::default()).await.unwrap();
    match run(&router, Slo::default()).await {
        Err(RouterError::SloUnmet {
            what, predicted_ms, ..
        }) => {
            assert_eq!(what, "time per output token");
            assert!(predicted_ms >= 20, "{predicted_ms}");
        }
        other => panic!("expected SloUnmet, got {other:?}"),
    }
    let loose = Slo {
        ttft_ms: None,
        tpot_ms: Some(100),
    };
    run(&router, loose).await.unwrap();
}

#[tokio::test]
async fn over_http_a_refusal_is_429_with_retry_after_and_bad_targets_are_400() {
    let h = Harness::start_with(1, 1, |d| d.config.slo.ttft_ms = 50).await;
    h.prefill[0].set(|b| b.prefill_delay = Duration::from_millis(120));
    let body = serde_json::json!({"model": "fake-model", "prompt": "hello there", "max_tokens": 3});
    let post = |hdr: Option<(&'static str, &'static str)>| {
        let mut r = reqwest::Client::new()
            .post(h.url("/v1/completions"))
            .json(&body);
        if let Some((k, v)) = hdr {
            r = r.header(k, v);
        }
        r.send()
    };
    assert_eq!(post(None).await.unwrap().status().as_u16(), 200);
    let r = post(None).await.unwrap();
    assert_eq!(r.status().as_u16(), 429);
    let after: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(after >= 1);
    let j: serde_json::Value = r.json().await.unwrap();
    assert_eq!(j["error"]["code"], "slo_unmet");
    assert!(
        j["error"]["message"]
            .as_str()
            .unwrap()
            .contains("time to first token"),
        "{j}"
    );
    let r = post(Some(("x-slo-ttft-ms", "2000"))).await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    for bad in ["abc", "0", "3600001"] {
        let r = post(Some(("x-slo-ttft-ms", bad))).await.unwrap();
        assert_eq!(r.status().as_u16(), 400, "x-slo-ttft-ms: {bad}");
    }
    h.stop().await;
}

/// Runs a request admitted by [`Router::generate_queued`] (the HTTP and gRPC path) to its end.
async fn run_queued(r: &Arc<Router>, slo: Slo) -> Result<(), RouterError> {
    let g = r
        .generate_queued(request(slo), pdnode_telemetry::Remote::default())
        .await?;
    to_the_end(g).await
}

/// Two prompts without a target put in flight (each ~150 ms of prefill with the fakes these
/// tests set), 20 ms before the caller goes on.
async fn two_ahead(router: &Arc<Router>) -> Vec<tokio::task::JoinHandle<Result<(), RouterError>>> {
    let ahead = (0..2)
        .map(|_| {
            let r = router.clone();
            tokio::spawn(async move { run(&r, Slo::default()).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(20)).await;
    ahead
}

/// `router.slo.queue_ms`: a request predicted over its TTFT target because of the prompts in
/// flight ahead of it waits for them instead of being refused, and is admitted when what is
/// left of its target holds; a target the wait itself uses up is refused at the end of it;
/// without a queue the same request is refused at once.
#[tokio::test]
async fn with_a_queue_a_request_waits_for_the_prompts_ahead_instead_of_being_refused() {
    let f = common::fakes(1, 1);
    let mut deps = f.deps;
    deps.config.slo.queue_ms = 2_000;
    let router = Router::new(deps);
    f.prefill[0].set(|b| b.prefill_delay = Duration::from_millis(150));
    // Measured: ~150 ms for a 32-token prompt.
    run(&router, Slo::default()).await.unwrap();
    let target = |ms| Slo {
        ttft_ms: Some(ms),
        tpot_ms: None,
    };
    // Two prompts in flight: a third is predicted at ~450 ms, over a 400 ms target.
    let ahead = two_ahead(&router).await;
    assert!(
        matches!(
            router.generate(request(target(400))),
            Err(RouterError::SloUnmet { .. })
        ),
        "without waiting it is refused"
    );
    let t = std::time::Instant::now();
    run_queued(&router, target(400)).await.unwrap();
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(100),
        "admitted after the prompts ahead: {waited:?}"
    );
    for a in ahead {
        a.await.unwrap().unwrap();
    }
    // A target the wait would use up (the prompts ahead take ~150 ms of its 160): refused, at
    // the end of the wait, not at once.
    let ahead = two_ahead(&router).await;
    let t = std::time::Instant::now();
    let r = run_queued(&router, target(160)).await;
    assert!(matches!(r, Err(RouterError::SloUnmet { .. })), "{r:?}");
    assert!(
        t.elapsed() >= Duration::from_millis(50),
        "{:?}",
        t.elapsed()
    );
    for a in ahead {
        a.await.unwrap().unwrap();
    }
}

/// At most `max_inflight_requests` requests wait at admission at once: one more is refused at
/// once, as without a queue, and every place is given back when its wait ends.
#[tokio::test]
async fn the_admission_queue_holds_at_most_max_inflight_requests() {
    let f = common::fakes(1, 1);
    let mut deps = f.deps;
    deps.config.slo.queue_ms = 2_000;
    deps.config.max_inflight_requests = 3;
    let router = Router::new(deps);
    f.prefill[0].set(|b| b.prefill_delay = Duration::from_millis(150));
    run(&router, Slo::default()).await.unwrap();
    let target = Slo {
        ttft_ms: Some(400),
        tpot_ms: None,
    };
    let ahead = two_ahead(&router).await;
    let waiting: Vec<_> = (0..3)
        .map(|_| {
            let r = router.clone();
            tokio::spawn(async move { run_queued(&r, target).await })
        })
        .collect();
    let t = std::time::Instant::now();
    while router.slo_waiting() < 3 {
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{}",
            router.slo_waiting()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let gauge = |r: &Router| {
        r.metrics()
            .value(pdnode_core::metrics::ROUTER_SLO_WAITING_REQUESTS, &[])
    };
    assert_eq!(gauge(&router), Some(3.0));
    let t = std::time::Instant::now();
    let r = run_queued(&router, target).await;
    assert!(matches!(r, Err(RouterError::SloUnmet { .. })), "{r:?}");
    assert!(
        t.elapsed() < Duration::from_millis(50),
        "refused at once: {:?}",
        t.elapsed()
    );
    for a in ahead {
        a.await.unwrap().unwrap();
    }
    // Admitted or refused later (the in-flight limit counts too): either way their places end.
    for w in waiting {
        let _ = w.await.unwrap();
    }
    assert_eq!(router.slo_waiting(), 0);
    assert_eq!(gauge(&router), Some(0.0));
}
