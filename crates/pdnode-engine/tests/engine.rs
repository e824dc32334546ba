//! Engine loop tests over the MockBackend: concurrency, cancellation, PD hand-off, leases,
//! errors. Every test ends with the KV accounting check and an empty pool.

use pdnode_core::config::MockEngineConfig;
use pdnode_core::error::Classify;
use pdnode_core::request::GenerateRequest;
use pdnode_core::{ErrorKind, FinishReason, RequestId, SamplingParams};
use pdnode_engine::backend::Backend;
use pdnode_engine::engine::{
    EngineError, EngineEvent, EngineHandle, EngineLoopConfig, RequestStream, spawn,
};
use pdnode_engine::mock::MockBackend;
use pdnode_engine::scheduler::Mode;
use std::time::{Duration, Instant};

const VOCAB: u32 = 500;
pub(crate) const DEADLINE: Duration = Duration::from_secs(20);

pub(crate) fn timing(prefill_us: u64, decode_us: u64, output_len: u32) -> MockEngineConfig {
    MockEngineConfig {
        prefill_us_per_token: prefill_us,
        decode_us_per_token: decode_us,
        output_len,
        vocab_size: VOCAB,
    }
}

pub(crate) fn loop_cfg(mode: Mode, lease: Duration, output_len: u32) -> EngineLoopConfig {
    EngineLoopConfig {
        mode,
        max_batch_tokens: 64,
        max_running_requests: 16,
        max_queued_requests: 1000,
        context_length: 512,
        prefix_cache: true,
        lease,
        vocab_size: VOCAB as usize,
        eos_token_ids: vec![MockBackend::EOS_TOKEN],
        max_output_tokens: Some(output_len),
        idle_wait: Duration::from_millis(5),
        call_timeout: Duration::from_secs(10),
    }
}

pub(crate) fn engine(
    mode: Mode,
    blocks: u32,
    t: MockEngineConfig,
    lease: Duration,
) -> EngineHandle {
    let out = t.output_len;
    let b = MockBackend::with_pool(&t, 4, blocks).unwrap();
    spawn(Box::new(b), loop_cfg(mode, lease, out), None).unwrap()
}

pub(crate) fn request(id: u64, len: usize, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        id: RequestId(id),
        prompt_token_ids: (0..len as u32)
            .map(|i| 1 + (i * 13 + id as u32) % (VOCAB - 1))
            .collect(),
        sampling: SamplingParams::greedy(max_tokens),
    }
}

/// Collects a colocated/decode stream: tokens and the terminal event.
pub(crate) async fn collect(mut s: RequestStream) -> (Vec<u32>, EngineEvent) {
    let mut tokens = Vec::new();
    let fut = async {
        while let Some(ev) = s.next().await {
            match ev {
                EngineEvent::Token { token, .. } => tokens.push(token),
                other => return other,
            }
        }
        panic!("stream ended without a terminal event");
    };
    let end = tokio::time::timeout(DEADLINE, fut)
        .await
        .expect("stream deadline");
    (tokens, end)
}

pub(crate) async fn next_event(s: &mut RequestStream) -> EngineEvent {
    tokio::time::timeout(DEADLINE, s.next())
        .await
        .expect("event deadline")
        .expect("stream ended")
}

/// The next event of a prefill-only stream that is not a `Prefilling` note, and the notes
/// (start position, tokens) skipped before it.
async fn next_prefill_event(s: &mut RequestStream) -> (EngineEvent, Vec<(usize, usize)>) {
    let mut notes = Vec::new();
    loop {
        match next_event(s).await {
            EngineEvent::Prefilling { start_pos, tokens } => notes.push((start_pos, tokens)),
            ev => return (ev, notes),
        }
    }
}

/// Waits until the engine has nothing in flight and no leases, then checks the pool is whole.
pub(crate) async fn assert_drained(e: &EngineHandle) {
    let until = Instant::now() + DEADLINE;
    loop {
        let s = e.stats().await.unwrap();
        let sc = s.scheduler;
        if sc.running == 0 && sc.waiting == 0 && sc.transferred == 0 && sc.kv.leases == 0 {
            assert_eq!(sc.kv.available(), sc.kv.total, "blocks leaked: {sc:?}");
            break;
        }
        assert!(Instant::now() < until, "engine did not drain: {sc:?}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    e.check_accounting().await.unwrap().unwrap();
}

#[tokio::test]
async fn many_concurrent_requests_finish_and_match_their_solo_runs() {
    let e = engine(
        Mode::Colocated,
        256,
        timing(2, 50, 24),
        Duration::from_secs(5),
    );
    assert_eq!(e.info().backend_name, "mock");
    let reqs: Vec<GenerateRequest> = (1..=40)
        .map(|i| request(i, 3 + (i as usize * 7) % 40, 1 + (i as u32 * 5) % 30))
        .collect();
    let mut tasks = tokio::task::JoinSet::new();
    for r in &reqs {
        let s = e.add_request(r.clone()).unwrap();
        let id = r.id;
        tasks.spawn(async move { (id, collect(s).await) });
    }
    let mut batched = std::collections::HashMap::new();
    while let Some(r) = tasks.join_next().await {
        let (id, (tokens, end)) = r.unwrap();
        batched.insert(id, tokens);
        let req = &reqs[id.0 as usize - 1];
        let want = req.sampling.max_tokens.min(24) as usize;
        assert_eq!(
            end,
            EngineEvent::Finished {
                reason: FinishReason::Length,
                prompt_tokens: req.prompt_token_ids.len(),
                output_tokens: want
            }
        );
        assert_eq!(batched[&id].len(), want);
    }
    assert_drained(&e).await;
    let stats = e.stats().await.unwrap();
    assert!(stats.steps_total > 0);
    // Every step's forward pass is timed, under the phase it ran: prompts, then decodes.
    let (p, d) = (stats.step_prefill, stats.step_decode);
    assert_eq!(p.count + d.count, stats.steps_total);
    assert!(p.count > 0 && d.count > 0, "{p:?} {d:?}");
    assert!(p.le.windows(2).all(|w| w[0] <= w[1]) && *p.le.last().unwrap() <= p.count);
    // Each request alone on a fresh engine gives the same greedy tokens.
    let solo = engine(
        Mode::Colocated,
        256,
        timing(0, 0, 24),
        Duration::from_secs(5),
    );
    for r in reqs.iter().step_by(7) {
        let (tokens, _) = collect(solo.add_request(r.clone()).unwrap()).await;
        assert_eq!(tokens, batched[&r.id], "{}", r.id);
    }
    assert_drained(&solo).await;
    assert!(e.shutdown(DEADLINE).await);
    assert!(solo.shutdown(DEADLINE).await);
}

#[tokio::test]
async fn a_tight_pool_preempts_and_still_finishes_every_request() {
    // 24 blocks of 4 positions for 10 requests of ~12 + 20 tokens: preemption is certain once
    // they all run together. A decode step takes 1 ms so the ten are queued before the first
    // few finish (with free steps the loop could serve them one by one as they arrive, on a
    // busy machine, and never run out of blocks).
    let e = engine(
        Mode::Colocated,
        24,
        timing(0, 1_000, 20),
        Duration::from_secs(5),
    );
    let reqs: Vec<GenerateRequest> = (1..=10).map(|i| request(i, 12, 20)).collect();
    let streams: Vec<_> = reqs
        .iter()
        .map(|r| e.add_request(r.clone()).unwrap())
        .collect();
    let mut outs = Vec::new();
    for s in streams {
        outs.push(collect(s).await);
    }
    assert!(e.stats().await.unwrap().scheduler.preemptions_total > 0);
    let roomy = engine(
        Mode::Colocated,
        512,
        timing(0, 0, 20),
        Duration::from_secs(5),
    );
    for (r, (tokens, end)) in reqs.iter().zip(outs) {
        assert!(matches!(
            end,
            EngineEvent::Finished {
                reason: FinishReason::Length,
                ..
            }
        ));
        let (alone, _) = collect(roomy.add_request(r.clone()).unwrap()).await;
        assert_eq!(tokens, alone);
    }
    assert_drained(&e).await;
    assert_drained(&roomy).await;
}

#[tokio::test]
async fn cancel_mid_generation_frees_the_blocks() {
    let e = engine(
        Mode::Colocated,
        64,
        timing(10, 500, 10_000),
        Duration::from_secs(5),
    );
    // Dropping the stream aborts.
    let mut s = e.add_request(request(1, 20, 10_000)).unwrap();
    for _ in 0..3 {
        assert!(matches!(
            next_event(&mut s).await,
            EngineEvent::Token { .. }
        ));
    }
    drop(s);
    // An explicit abort ends the stream with `abort`.
    let mut s2 = e.add_request(request(2, 9, 10_000)).unwrap();
    assert!(matches!(
        next_event(&mut s2).await,
        EngineEvent::Token { .. }
    ));
    e.abort(RequestId(2));
    let (_, end) = collect(s2).await;
    assert!(matches!(
        end,
        EngineEvent::Finished {
            reason: FinishReason::Abort,
            ..
        }
    ));
    // Aborting a queued request (a long prefill ahead of it) works too.
    let _long = e.add_request(request(3, 300, 4)).unwrap();
    let s4 = e.add_request(request(4, 5, 4)).unwrap();
    e.abort(RequestId(4));
    let (_, end) = collect(s4).await;
    assert!(matches!(
        end,
        EngineEvent::Finished {
            reason: FinishReason::Abort,
            ..
        }
    ));
    e.abort(RequestId(3));
    assert_drained(&e).await;
}

/// One PD request: decode reserves, prefill computes, the KV is copied, decode continues.
async fn pd_generate(p: &EngineHandle, d: &EngineHandle, r: &GenerateRequest) -> Vec<u32> {
    let blocks = d
        .reserve_for_transfer(r.id, r.prompt_token_ids.len())
        .await
        .unwrap();
    let mut ps = p.add_request(r.clone()).unwrap();
    let (
        EngineEvent::PrefillDone {
            first_token,
            blocks: src,
            finish,
            sampler,
            ..
        },
        notes,
    ) = next_prefill_event(&mut ps).await
    else {
        panic!("expected PrefillDone");
    };
    // One note per chunk, in order, covering the prompt (the queue is never near full here).
    let mut at = notes.first().map_or(0, |n| n.0);
    for &(start, tokens) in &notes {
        assert_eq!(start, at, "{notes:?}");
        at += tokens;
    }
    assert_eq!(at, r.prompt_token_ids.len(), "{notes:?}");
    assert!(ps.next().await.is_none(), "PrefillDone is terminal");
    if finish.is_some() {
        d.release_transfer(r.id).await.unwrap();
        return vec![first_token];
    }
    assert_eq!(src.len(), blocks.len());
    let layers = p.info().kv_layout.num_layers;
    let kv = p.read_kv(r.id, 0..layers).await.unwrap();
    d.write_kv(r.id, 0..layers, kv).await.unwrap();
    p.release_transfer(r.id).await.unwrap();
    let ds = d
        .admit_transferred(r.clone(), first_token, Some(sampler))
        .unwrap();
    let (mut rest, end) = collect(ds).await;
    assert!(matches!(end, EngineEvent::Finished { .. }), "{end:?}");
    let mut all = vec![first_token];
    all.append(&mut rest);
    all
}

#[tokio::test]
async fn pd_hand_off_gives_the_colocated_tokens_and_leaks_nothing() {
    let t = timing(1, 20, 12);
    let lease = Duration::from_secs(5);
    let p = engine(Mode::PrefillOnly, 128, t.clone(), lease);
    let d = engine(Mode::DecodeOnly, 128, t.clone(), lease);
    let c = engine(Mode::Colocated, 128, t, lease);
    for i in 1..=12 {
        let r = request(i, 5 + i as usize * 3, 1 + (i as u32 % 14));
        let (expected, _) = collect(c.add_request(r.clone()).unwrap()).await;
        let got = pd_generate(&p, &d, &r).await;
        assert_eq!(got, expected, "{}", r.id);
    }
    assert_drained(&p).await;
    assert_drained(&d).await;
    assert_drained(&c).await;
}

#[tokio::test]
async fn the_pool_memory_is_published_for_zero_copy() {
    let t = timing(0, 0, 8);
    let b = MockBackend::with_pool(&t, 4, 32).unwrap();
    let bytes = b.kv_layout().block_bytes() * 32;
    let e = pdnode_engine::engine::spawn_with_memory(
        b,
        loop_cfg(Mode::DecodeOnly, Duration::from_secs(5), 8),
        None,
    )
    .unwrap();
    let r = &e.info().kv_regions;
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].len, bytes);
    assert!(
        engine(Mode::Colocated, 8, t, Duration::from_secs(1))
            .info()
            .kv_regions
            .is_empty()
    );
    assert!(e.shutdown(DEADLINE).await);
}

#[tokio::test]
async fn a_missing_kv_transfer_is_an_error_not_wrong_tokens() {
    let t = timing(0, 0, 8);
    let d = engine(Mode::DecodeOnly, 64, t, Duration::from_secs(5));
    let r = request(1, 10, 8);
    d.reserve_for_transfer(r.id, 10).await.unwrap();
    let s = d.admit_transferred(r, 7, None).unwrap();
    let (_, end) = collect(s).await;
    let EngineEvent::Error { error } = end else {
        panic!("expected an error, got {end:?}");
    };
    assert!(matches!(error, EngineError::Backend { .. }));
    assert_drained(&d).await;
}

#[tokio::test]
async fn leases_and_reservations_expire() {
    let t = timing(0, 0, 8);
    let lease = Duration::from_millis(100);
    let p = engine(Mode::PrefillOnly, 64, t.clone(), lease);
    let d = engine(Mode::DecodeOnly, 64, t, lease);
    let mut s = p.add_request(request(1, 10, 8)).unwrap();
    assert!(matches!(
        next_prefill_event(&mut s).await.0,
        EngineEvent::PrefillDone { .. }
    ));
    assert_eq!(p.stats().await.unwrap().scheduler.kv.leases, 1);
    d.reserve_for_transfer(RequestId(2), 30).await.unwrap();
    // Nobody releases them: both expire by themselves.
    assert_drained(&p).await;
    assert_drained(&d).await;
    assert!(matches!(
        p.release_transfer(RequestId(1)).await,
        Err(EngineError::Scheduler(_))
    ));
    let late = p.read_kv(RequestId(1), 0..1).await;
    assert!(matches!(late, Err(EngineError::NoLease { .. })));
    // A lease gone by the time its request comes (expired while it queued) is a timeout, not
    // the client's invalid request.
    assert_eq!(late.unwrap_err().kind(), ErrorKind::Timeout);
}

#[tokio::test]
async fn bad_requests_are_refused_with_typed_errors() {
    let t = timing(0, 0, 8);
    let e = engine(Mode::Colocated, 16, t, Duration::from_secs(5));
    let err = e.add_request(request(1, 600, 4)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ContextLengthExceeded);
    let mut bad = request(2, 4, 4);
    bad.sampling.temperature = -1.0;
    assert_eq!(
        e.add_request(bad).unwrap_err().kind(),
        ErrorKind::InvalidRequest
    );
    let mut oov = request(3, 4, 4);
    oov.prompt_token_ids[0] = VOCAB + 5;
    assert_eq!(
        e.add_request(oov).unwrap_err().kind(),
        ErrorKind::InvalidRequest
    );
    // Stop strings need a tokenizer; this engine has none.
    let mut stop = request(4, 4, 4);
    stop.sampling.stop = vec!["x".into()];
    let (_, end) = collect(e.add_request(stop).unwrap()).await;
    assert!(
        matches!(end, EngineEvent::Error { error } if error.kind() == ErrorKind::InvalidRequest)
    );
    // Too large for the KV pool (16 blocks of 4): refused by the scheduler.
    let (_, end) = collect(e.add_request(request(5, 100, 4)).unwrap()).await;
    assert!(
        matches!(end, EngineEvent::Error { error } if error.kind() == ErrorKind::ContextLengthExceeded)
    );
    // A duplicate id while the first is running.
    let slow = engine(
        Mode::Colocated,
        64,
        timing(0, 1000, 50),
        Duration::from_secs(5),
    );
    let first = slow.add_request(request(6, 4, 50)).unwrap();
    let (_, end) = collect(slow.add_request(request(6, 4, 50)).unwrap()).await;
    assert!(matches!(end, EngineEvent::Error { .. }));
    drop(first);
    assert_drained(&slow).await;
    assert_drained(&e).await;
    // Draining refuses new work but keeps serving what is in flight.
    let running = slow.add_request(request(7, 4, 3)).unwrap();
    slow.stop_admitting();
    assert_eq!(
        slow.add_request(request(8, 4, 3)).unwrap_err(),
        EngineError::Draining
    );
    assert!(matches!(
        slow.reserve_for_transfer(RequestId(9), 4).await,
        Err(EngineError::Draining)
    ));
    let (tokens, _) = collect(running).await;
    assert_eq!(tokens.len(), 3);
    assert_eq!(slow.stats().await.unwrap().in_flight(), 0);
    assert!(slow.shutdown(DEADLINE).await);
    assert!(matches!(slow.stats().await, Err(EngineError::Stopped)));
}

#[tokio::test]
async fn stop_token_ids_end_with_stop() {
    let e = engine(
        Mode::Colocated,
        64,
        timing(0, 0, 20),
        Duration::from_secs(5),
    );
    let r = request(1, 6, 20);
    let (tokens, _) = collect(e.add_request(r.clone()).unwrap()).await;
    let mut r2 = r.clone();
    r2.id = RequestId(2);
    r2.sampling.stop_token_ids = vec![tokens[3]];
    let (got, end) = collect(e.add_request(r2).unwrap()).await;
    let cut = tokens.iter().position(|t| *t == tokens[3]).unwrap();
    assert_eq!(got, tokens[..=cut].to_vec());
    assert!(matches!(
        end,
        EngineEvent::Finished {
            reason: FinishReason::Stop,
            ..
        }
    ));
    assert_drained(&e).await;
}

/// Scheduler + loop overhead with a zero-cost mock (a figure, not a timed assertion):
/// `cargo test -p pdnode-engine --test all -- --ignored --nocapture engine::mock_throughput`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn mock_throughput() {
    let vocab: u32 = std::env::var("MOCK_VOCAB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(32_000);
    let t = MockEngineConfig {
        vocab_size: vocab,
        ..timing(0, 0, 128)
    };
    let b = MockBackend::with_pool(&t, 16, 16_384).unwrap();
    let mut cfg = loop_cfg(Mode::Colocated, Duration::from_secs(5), 128);
    cfg.vocab_size = vocab as usize;
    cfg.max_running_requests = 256;
    cfg.max_batch_tokens = 8192;
    let e = spawn(Box::new(b), cfg, None).unwrap();
    let n = 1000u64;
    let t0 = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let s = e.add_request(request(i + 1, 200, 128)).unwrap();
        tasks.spawn(collect(s));
    }
    let mut tokens = 0;
    while let Some(r) = tasks.join_next().await {
        tokens += r.unwrap().0.len();
    }
    let dt = t0.elapsed().as_secs_f64();
    let st = e.stats().await.unwrap();
    println!(
        "mock (vocab {vocab}): {n} requests x 200 prompt + 128 output tokens, 256 running: {:.0} output tok/s, {:.0} req/s, {} steps, {:.1} us/step",
        tokens as f64 / dt,
        n as f64 / dt,
        st.steps_total,
        dt * 1e6 / st.steps_total as f64
    );
    assert_drained(&e).await;
}

#[tokio::test]
async fn a_mock_engine_from_the_node_config_caps_outputs_at_output_len() {
    use pdnode_core::config::{Backend as Kind, EngineConfig};
    let cfg = EngineConfig {
        backend: Kind::Mock,
        num_kv_blocks: 0,
        max_running_requests: 4,
        context_length: 64,
        mock: timing(0, 0, 5),
        ..EngineConfig::default()
    };
    let b = MockBackend::new(&cfg).unwrap();
    assert_eq!(b.num_kv_blocks(), 4 * 64 / 16);
    let lc = EngineLoopConfig::from_config(
        &cfg,
        Mode::Colocated,
        Duration::from_secs(5),
        VOCAB as usize,
        vec![MockBackend::EOS_TOKEN],
    );
    assert_eq!(lc.max_output_tokens, Some(5));
    let e = spawn(Box::new(b), lc, None).unwrap();
    let (tokens, end) = collect(e.add_request(request(1, 10, 100)).unwrap()).await;
    assert_eq!(tokens.len(), 5);
    assert!(matches!(
        end,
        EngineEvent::Finished {
            reason: FinishReason::Length,
            ..
        }
    ));
    assert_drained(&e).await;
}

#[tokio::test]
async fn logprobs_and_seeded_sampling_reach_the_stream() {
    let e = engine(Mode::Colocated, 64, timing(0, 0, 6), Duration::from_secs(5));
    let mut r = request(1, 8, 6);
    r.sampling.logprobs = Some(3);
    let mut s = e.add_request(r).unwrap();
    let EngineEvent::Token { token, logprob, .. } = next_event(&mut s).await else {
        panic!("expected a token");
    };
    let lp = logprob.expect("logprobs asked for");
    assert_eq!(lp.token_id, token);
    assert_eq!(lp.top.len(), 3);
    assert_eq!(lp.top[0].0, token, "greedy picks the top token");
    collect(s).await;
    // Same seed, same tokens; temperature sampling goes through the request's sampler.
    let mut a = request(2, 8, 6);
    a.sampling = SamplingParams {
        temperature: 1.0,
        seed: Some(7),
        max_tokens: 6,
        ..SamplingParams::default()
    };
    let mut b = a.clone();
    b.id = RequestId(3);
    let (ta, _) = collect(e.add_request(a).unwrap()).await;
    let (tb, _) = collect(e.add_request(b).unwrap()).await;
    assert_eq!(ta, tb);
    assert_drained(&e).await;
}

/// A consumer that stops reading never blocks the engine thread: once its stream holds
/// `EVENT_QUEUE` events the loop cancels the request (its blocks come back at once), other
/// requests go on, and the stream, once drained, ends with `SlowConsumer`.
#[tokio::test]
async fn a_consumer_that_stops_reading_is_cancelled_not_waited_for() {
    use pdnode_engine::engine::EVENT_QUEUE;
    let t = timing(10, 20, 10_000);
    let b = MockBackend::with_pool(&t, 4, 2048).unwrap();
    let cfg = EngineLoopConfig {
        context_length: 4096,
        ..loop_cfg(Mode::Colocated, Duration::from_secs(5), 10_000)
    };
    let e = spawn(Box::new(b), cfg, None).unwrap();
    let mut stuck = e
        .add_request(request(1, 8, 3 * EVENT_QUEUE as u32))
        .unwrap();
    // Another request completes meanwhile: the engine thread is not waiting on `stuck`.
    let (tokens, end) = collect(e.add_request(request(2, 8, 20)).unwrap()).await;
    assert_eq!(tokens.len(), 20);
    assert!(matches!(end, EngineEvent::Finished { .. }), "{end:?}");
    // The unread request is cancelled by the engine (nobody aborted it) and frees its blocks.
    assert_drained(&e).await;
    let mut got = 0;
    let end = loop {
        match next_event(&mut stuck).await {
            EngineEvent::Token { .. } => got += 1,
            other => break other,
        }
    };
    assert_eq!(got, EVENT_QUEUE, "the stream holds exactly its capacity");
    match end {
        EngineEvent::Error {
            error: EngineError::SlowConsumer { id, capacity },
        } => {
            assert_eq!((id, capacity), (RequestId(1), EVENT_QUEUE));
            assert_eq!(
                EngineError::SlowConsumer { id, capacity }.kind(),
                ErrorKind::Unavailable
            );
        }
        other => panic!("expected SlowConsumer, got {other:?}"),
    }
    assert!(
        tokio::time::timeout(DEADLINE, stuck.next())
            .await
            .unwrap()
            .is_none()
    );
}

/// A full command queue refuses at once (`Busy`, Unavailable) instead of blocking the caller;
/// aborts that find it full are not lost.
#[tokio::test]
async fn a_full_command_queue_is_refused_and_its_aborts_still_land() {
    use pdnode_engine::engine::COMMAND_QUEUE;
    // One 64-token prefill chunk takes ~1.3 s: the loop reads no command meanwhile.
    let e = engine(
        Mode::Colocated,
        4096,
        timing(20_000, 10, 4),
        Duration::from_secs(5),
    );
    let _long = e.add_request(request(1, 200, 4)).unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut streams = Vec::new();
    let mut busy = 0;
    for i in 0..COMMAND_QUEUE as u64 + 64 {
        match e.add_request(request(100 + i, 4, 4)) {
            Ok(s) => streams.push(s),
            Err(err) => {
                assert!(
                    matches!(err, EngineError::Busy { capacity } if capacity == COMMAND_QUEUE),
                    "{err:?}"
                );
                assert_eq!(err.kind(), ErrorKind::Unavailable);
                busy += 1;
            }
        }
    }
    assert!(busy >= 1, "the queue never filled");
    assert!(streams.len() <= COMMAND_QUEUE);
    // Every abort arrives although the queue is full (they wait on the side list).
    e.abort(RequestId(1));
    for s in &streams {
        e.abort(s.id());
    }
    for s in streams {
        let (_, end) = collect(s).await;
        assert!(
            matches!(
                end,
                EngineEvent::Finished {
                    reason: FinishReason::Abort,
                    ..
                } | EngineEvent::Error { .. }
            ),
            "{end:?}"
        );
    }
    assert_drained(&e).await;
}

/// A decode moved mid-stream (the migration's engine part): engine A parks a running request
/// (its blocks under the lease, its stream ended with no finish), its KV is copied into blocks
/// engine B reserved for every computed position, and B continues from A's sampler. The tokens
/// A streamed plus B's equal the unmoved run's, and neither engine keeps anything.
#[tokio::test]
async fn a_parked_request_continues_on_another_engine_with_the_same_tokens() {
    let t = timing(1, 2_000, 24);
    let lease = Duration::from_secs(5);
    let a = engine(Mode::Colocated, 128, t.clone(), lease);
    let b = engine(Mode::DecodeOnly, 128, t.clone(), lease);
    let c = engine(Mode::Colocated, 128, t, lease);
    let layers = a.info().kv_layout.num_layers;
    for i in 1..=4u64 {
        let r = request(i, 7 + i as usize * 5, 24);
        let (want, _) = collect(c.add_request(r.clone()).unwrap()).await;
        assert_eq!(want.len(), 24);
        let mut s = a.add_request(r.clone()).unwrap();
        let mut got = Vec::new();
        while got.len() < 3 + i as usize {
            if let EngineEvent::Token { token, .. } = next_event(&mut s).await {
                got.push(token);
            }
        }
        // Between two steps: a refusal means "in a step now", so ask again.
        let until = Instant::now() + DEADLINE;
        let parked = loop {
            match a.park(r.id).await {
                Ok(p) => break p,
                Err(e) => {
                    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
                    assert!(Instant::now() < until, "never parked: {e}");
                }
            }
        };
        // The stream ends with the tokens sampled before the park, and no finish.
        while let Some(ev) = tokio::time::timeout(DEADLINE, s.next()).await.unwrap() {
            match ev {
                EngineEvent::Token { token, .. } => got.push(token),
                other => panic!("a parked stream ends with no event: {other:?}"),
            }
        }
        assert_eq!(parked.generated, got.len());
        assert_eq!(parked.tokens.len(), r.prompt_token_ids.len() + got.len());
        assert_eq!(parked.computed, parked.tokens.len() - 1);
        assert_eq!(&parked.tokens[parked.prompt_len..], &got[..]);
        assert!(a.park(r.id).await.is_err(), "parked once");
        // B reserves the computed positions, the KV moves, A lets go.
        let blocks = b.reserve_for_transfer(r.id, parked.computed).await.unwrap();
        assert_eq!(blocks.len(), parked.blocks.len());
        let kv = a.read_kv(r.id, 0..layers).await.unwrap();
        b.write_kv(r.id, 0..layers, kv).await.unwrap();
        a.release_transfer(r.id).await.unwrap();
        let mut moved = r.clone();
        moved.prompt_token_ids = parked.tokens[..parked.computed].to_vec();
        moved.sampling.max_tokens = 24 - parked.generated as u32 + 1;
        let first = parked.tokens[parked.computed];
        let (rest, end) = collect(
            b.admit_transferred(moved, first, Some(parked.sampler))
                .unwrap(),
        )
        .await;
        assert!(matches!(end, EngineEvent::Finished { .. }), "{end:?}");
        got.extend(rest);
        assert_eq!(
            got, want,
            "request {i} moved after {} tokens",
            parked.generated
        );
    }
    assert_drained(&a).await;
    assert_drained(&b).await;
    assert_drained(&c).await;
}
