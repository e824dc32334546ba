//! `Abort` needs the request's KV capability (docs/protocol.md, "Capabilities"): on the decode
//! node against the reservation and the running request, on the prefill node against the
//! target its `Prefill` carries. A wrong or missing one is refused with `PermissionDenied` and
//! the request goes on to its end; the right one stops it and frees its KV blocks and staging.
//! The mock engine in process (role = "all"), and the CPU backend over UCX for staging spans.

use crate::common;

use common::{cpu_prompt, cpu_ucx_config, pd_pair, prompt};
use futures::StreamExt;
use pdnode_core::config::Config;
use pdnode_core::{ErrorKind, NodeId, RequestId, SamplingParams};
use pdnode_node::pd::{self, PdNode};
use pdnode_router::{DecodeCall, KvTarget, NodeClient, PrefillCall, PrefillOutcome, ReserveKv};
use std::time::{Duration, Instant};

/// 20 ms a prompt token (a 23-token prefill takes ~0.5 s), 20 ms a decode step, 30 tokens.
fn slow_config() -> Config {
    let mut c = common::mock_config(20_000, 30, 10_000);
    c.engine.mock.prefill_us_per_token = 20_000;
    c
}

async fn wait_until(what: &str, limit: Duration, mut cond: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond().await {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn in_flight(n: &PdNode) -> usize {
    n.engine().stats().await.unwrap().in_flight()
}

/// Every block of `n`'s pool free (or cached, unreferenced), no lease, accounting consistent.
async fn assert_clean(n: &PdNode) {
    wait_until("every KV block free", Duration::from_secs(10), async || {
        let s = n.engine().stats().await.unwrap().scheduler;
        s.kv.free + s.kv.cached_unreferenced == s.kv.total && s.kv.leases == 0
    })
    .await;
    n.engine().check_accounting().await.unwrap().unwrap();
}

async fn reserve(d: &PdNode, id: RequestId, ids: &[u32]) -> KvTarget {
    d.reserve_kv(ReserveKv {
        request_id: id,
        prefill_node: NodeId::new("p"),
        prompt_token_ids: ids.to_vec(),
        max_tokens: 30,
    })
    .await
    .unwrap()
}

fn prefill_call(id: RequestId, ids: &[u32], t: &KvTarget) -> PrefillCall {
    PrefillCall {
        request_id: id,
        prompt_token_ids: ids.to_vec(),
        sampling: SamplingParams::greedy(30),
        target: t.clone(),
    }
}

fn decode_call(id: RequestId, ids: &[u32], t: &KvTarget, out: &PrefillOutcome) -> DecodeCall {
    DecodeCall {
        request_id: id,
        secret: t.secret.clone(),
        first_token_id: out.first_token_id,
        first_logprob: None,
        sampling: SamplingParams::greedy(30),
        prompt_token_ids: ids.to_vec(),
        sampler: out.sampler,
    }
}

/// Capabilities that are not `t`'s: none, random bytes, one bit off, too short, too long.
fn wrong_capabilities(t: &KvTarget) -> Vec<Vec<u8>> {
    let mut flipped = t.secret.clone();
    flipped[0] ^= 1;
    let mut longer = t.secret.clone();
    longer.push(0);
    vec![
        Vec::new(),
        vec![0x5a; 16],
        flipped,
        t.secret[..15].to_vec(),
        longer,
    ]
}

async fn refused(n: &PdNode, id: RequestId, cap: Vec<u8>) {
    let e = n
        .abort(id, cap.clone(), "not mine".into())
        .await
        .expect_err("an abort without the request's capability is refused");
    assert_eq!(e.kind, ErrorKind::PermissionDenied, "{cap:?}: {e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_or_missing_capability_is_refused_in_every_phase_and_the_request_goes_on() {
    let cfg = slow_config();
    let aio = tokio::task::block_in_place(|| pd::all_in_one(&cfg, &NodeId::new("w"))).unwrap();
    let (p, d) = (aio.prefill.clone(), aio.decode.clone());
    let id = RequestId(0x5eed_0001);
    let t = reserve(&d, id, &prompt()).await;

    // Reserved: refused on the decode node, the reservation stays for its owner.
    for cap in wrong_capabilities(&t) {
        refused(&d, id, cap).await;
    }
    assert_eq!(d.pending_reservations(), 1);

    // Prefilling: refused on the prefill node (and on the decode node), the prefill goes on.
    let call = {
        let (p, t) = (p.clone(), t.clone());
        tokio::spawn(async move { p.prefill(prefill_call(id, &prompt(), &t)).await })
    };
    // Not the engine's stats: they are answered between steps, after the prefill's one step.
    wait_until("the prefill runs", Duration::from_secs(5), async || {
        p.holds_capability(id)
    })
    .await;
    for cap in wrong_capabilities(&t) {
        refused(&p, id, cap.clone()).await;
        refused(&d, id, cap).await;
    }
    let out = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .expect("prefill answers")
        .unwrap()
        .expect("the prefill went on despite the refused aborts");

    // Decoding: refused, the stream goes on to its end.
    let mut s = d
        .decode(decode_call(id, &prompt(), &t, &out))
        .await
        .unwrap();
    let mut tokens = 0;
    let mut refusals_sent = false;
    let finish = loop {
        let c = tokio::time::timeout(Duration::from_secs(10), s.next())
            .await
            .expect("the stream moves")
            .expect("the stream ends with a finish")
            .expect("no error in the stream");
        tokens += c.token_ids.len();
        if !refusals_sent {
            for cap in wrong_capabilities(&t) {
                refused(&d, id, cap).await;
            }
            refusals_sent = true;
        }
        if let Some(f) = c.finish {
            break f;
        }
    };
    assert_eq!(tokens, 29, "every token after the first, finish {finish:?}");
    drop(s);
    assert_clean(&p).await;
    assert_clean(&d).await;
    // Over: nothing to abort, with any capability.
    assert!(!d.abort(id, t.secret.clone(), "late".into()).await.unwrap());
    assert!(!p.abort(id, Vec::new(), "late".into()).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_requests_capability_aborts_it_in_every_phase_and_frees_its_blocks() {
    // 100 ms a prompt token (one 2.3 s step): the abort below lands while the engine runs the
    // prompt even on a loaded machine. One landing after the engine's part (the hand-off) must
    // end the call Cancelled all the same (docs/runtime-semantics.md).
    let mut cfg = slow_config();
    cfg.engine.mock.prefill_us_per_token = 100_000;
    let aio = tokio::task::block_in_place(|| pd::all_in_one(&cfg, &NodeId::new("r"))).unwrap();
    let (p, d) = (aio.prefill.clone(), aio.decode.clone());

    // Reserved.
    let id = RequestId(0x5eed_0010);
    let t = reserve(&d, id, &prompt()).await;
    assert!(in_flight(&d).await > 0);
    assert!(d.abort(id, t.secret.clone(), "gone".into()).await.unwrap());
    assert_eq!(d.pending_reservations(), 0);
    assert_clean(&d).await;
    assert!(
        !d.abort(id, t.secret.clone(), "again".into()).await.unwrap(),
        "aborted already"
    );

    // Prefilling: the prefill node stops it, the decode node frees the reservation.
    let id = RequestId(0x5eed_0011);
    let t = reserve(&d, id, &prompt()).await;
    let call = {
        let (p, t) = (p.clone(), t.clone());
        tokio::spawn(async move { p.prefill(prefill_call(id, &prompt(), &t)).await })
    };
    // Not the engine's stats: they are answered between steps, after the prefill's one step.
    wait_until("the prefill runs", Duration::from_secs(5), async || {
        p.holds_capability(id)
    })
    .await;
    assert!(p.abort(id, t.secret.clone(), "gone".into()).await.unwrap());
    assert!(d.abort(id, t.secret.clone(), "gone".into()).await.unwrap());
    let r = tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .expect("the aborted prefill answers at once")
        .unwrap();
    let e = r.expect_err("an aborted prefill does not hand off");
    assert_eq!(e.kind, ErrorKind::Cancelled, "{e}");
    assert_clean(&p).await;
    assert_clean(&d).await;

    // Decoding: the stream ends early.
    let id = RequestId(0x5eed_0012);
    let t = reserve(&d, id, &prompt()).await;
    let out = p.prefill(prefill_call(id, &prompt(), &t)).await.unwrap();
    let mut s = d
        .decode(decode_call(id, &prompt(), &t, &out))
        .await
        .unwrap();
    let first = s.next().await.unwrap().unwrap();
    assert_eq!(first.token_ids.len(), 1);
    assert!(d.abort(id, t.secret.clone(), "gone".into()).await.unwrap());
    let mut more = 0;
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(c) = s.next().await {
            match c {
                Ok(c) if c.finish.is_none() => more += c.token_ids.len(),
                _ => break,
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the aborted stream ends");
    assert!(more < 28, "the stream was cut short ({more} more tokens)");
    drop(s);
    assert_clean(&d).await;
    assert_clean(&p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_reserve_call_gives_its_blocks_back_before_the_lease() {
    let mut cfg = cpu_ucx_config();
    cfg.engine.kv_staging_tokens = 24;
    // Without the drop the blocks would be held for the whole lease.
    cfg.transfer.lease_ms = 60_000;
    let Some((_p, d)) = pd_pair(&cfg) else { return };
    let da = d.node.staging_arena().expect("decode arena").clone();
    let hold = da.reserve(da.len()).expect("whole decode arena");
    // The reservation waits for arena room (blocks reserved); the router's call is dropped.
    let call = d.node.reserve_kv(ReserveKv {
        request_id: RequestId(5),
        prefill_node: NodeId::new("p"),
        prompt_token_ids: cpu_prompt(0),
        max_tokens: 5,
    });
    let dropped = tokio::time::timeout(Duration::from_millis(300), call).await;
    assert!(dropped.is_err(), "still waiting for arena room");
    assert!(da.wait_counts().0 >= 1);
    assert_clean(&d.node).await;
    assert_eq!(d.node.pending_reservations(), 0);
    drop(hold);
    assert!(da.all_free());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_abort_leaves_the_staging_span_and_the_right_one_frees_it() {
    let mut cfg = cpu_ucx_config();
    // The fence deadline of an aborted span nobody writes: one lease past its lease.
    cfg.transfer.lease_ms = 1_000;
    let ids = cpu_prompt(2);
    let want = common::colocated_tokens(&cfg, &ids, 5).await;
    let Some((p, d)) = pd_pair(&cfg) else { return };
    let arena = d.node.staging_arena().expect("decode arena").clone();

    // A wrong capability leaves the reservation, its span and its blocks to their owner.
    let id = RequestId(21);
    let t = reserve(&d.node, id, &ids).await;
    assert_eq!(d.node.staging_stats().owned, 1);
    for cap in wrong_capabilities(&t) {
        refused(&d.node, id, cap).await;
    }
    assert_eq!(d.node.staging_stats().owned, 1);
    assert_eq!(d.node.pending_reservations(), 1);
    let mut call = prefill_call(id, &ids, &t);
    call.sampling = SamplingParams::greedy(5);
    let out = p.node.prefill(call).await.unwrap();
    let mut dc = decode_call(id, &ids, &t, &out);
    dc.sampling = SamplingParams::greedy(5);
    let mut s = d.node.decode(dc).await.unwrap();
    let mut got = vec![out.first_token_id];
    while let Some(c) = s.next().await {
        let c = c.unwrap();
        got.extend(c.token_ids);
        if c.finish.is_some() {
            break;
        }
    }
    assert_eq!(got, want, "the request went on to its end");
    drop(s);

    // The right one frees the reservation's blocks at once and its span (quarantined: the
    // target went out) by the fence deadline.
    let id = RequestId(22);
    let t = reserve(&d.node, id, &ids).await;
    assert_eq!(d.node.staging_stats().owned, 1);
    assert!(
        d.node
            .abort(id, t.secret.clone(), "gone".into())
            .await
            .unwrap()
    );
    assert_eq!(d.node.staging_stats().owned, 0);
    assert_clean(&d.node).await;
    wait_until("the span is free", Duration::from_secs(5), async || {
        arena.all_free()
    })
    .await;
    assert_clean(&p.node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_call_dropped_during_its_hand_off_frees_its_lease_at_once() {
    let mut cfg = cpu_ucx_config();
    // The hand-off waits a quarter of the lease (15 s) for room in a full prefill arena; the
    // engine is done with the request and holds its blocks under the 60 s lease meanwhile.
    cfg.transfer.lease_ms = 60_000;
    let ids = cpu_prompt(4);
    let Some((p, d)) = pd_pair(&cfg) else { return };
    let pa = p.node.staging_arena().expect("prefill arena").clone();
    let hold = pa.reserve(pa.len()).expect("whole prefill arena");
    let id = RequestId(41);
    let t = reserve(&d.node, id, &ids).await;
    let call = {
        let (p, t, ids) = (p.node.clone(), t.clone(), ids.clone());
        tokio::spawn(async move { p.prefill(prefill_call(id, &ids, &t)).await })
    };
    wait_until(
        "the hand-off waits for arena room",
        Duration::from_secs(10),
        async || pa.wait_counts().0 >= 1,
    )
    .await;
    let s = p.node.engine().stats().await.unwrap().scheduler;
    assert_eq!(
        s.kv.leases, 1,
        "the prompt's blocks are under the hand-off lease"
    );
    // The router's call is dropped (its stream reset): nobody will abort or release it.
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    // Freed within assert_clean's 10 s, not at the lease's 60 s.
    assert_clean(&p.node).await;
    assert!(
        !p.node
            .abort(id, t.secret.clone(), "late".into())
            .await
            .unwrap(),
        "nothing of the request is left on the prefill node"
    );
    assert!(
        d.node
            .abort(id, t.secret.clone(), "gone".into())
            .await
            .unwrap()
    );
    drop(hold);
    assert_clean(&d.node).await;
    wait_until(
        "the prefill arena is free",
        Duration::from_secs(10),
        async || pa.all_free(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_during_the_hand_off_ends_the_prefill_cancelled() {
    let mut cfg = cpu_ucx_config();
    // A hand-off waits a quarter of the lease (1 s) for room in a full prefill arena: the
    // engine is done with the request by then, so an engine abort can no longer stop it.
    cfg.transfer.lease_ms = 4_000;
    let ids = cpu_prompt(3);
    let Some((p, d)) = pd_pair(&cfg) else { return };
    let pa = p.node.staging_arena().expect("prefill arena").clone();
    let hold = pa.reserve(pa.len()).expect("whole prefill arena");
    let id = RequestId(31);
    let t = reserve(&d.node, id, &ids).await;
    let call = {
        let (p, t, ids) = (p.node.clone(), t.clone(), ids.clone());
        let mut call = prefill_call(id, &ids, &t);
        call.sampling = SamplingParams::greedy(5);
        tokio::spawn(async move { p.prefill(call).await })
    };
    wait_until(
        "the hand-off waits for arena room",
        Duration::from_secs(10),
        async || pa.wait_counts().0 >= 1,
    )
    .await;
    assert!(
        p.node
            .abort(id, t.secret.clone(), "gone".into())
            .await
            .unwrap(),
        "the prefill node still runs the request (its hand-off)"
    );
    assert!(
        d.node
            .abort(id, t.secret.clone(), "gone".into())
            .await
            .unwrap()
    );
    let r = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .expect("the aborted prefill answers by its push deadline")
        .unwrap();
    let e = r.expect_err("an abort answered true never ends in a hand-off");
    assert_eq!(e.kind, ErrorKind::Cancelled, "{e}");
    drop(hold);
    assert_clean(&p.node).await;
    assert_clean(&d.node).await;
    wait_until(
        "the prefill arena is free",
        Duration::from_secs(10),
        async || pa.all_free(),
    )
    .await;
    assert!(
        !p.node
            .abort(id, t.secret.clone(), "late".into())
            .await
            .unwrap()
    );
}
