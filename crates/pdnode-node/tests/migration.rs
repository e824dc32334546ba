//! Live decode migration through a real router over in-process nodes: one prefill node and two
//! decode nodes (`PdNode`s, KV moved in process), the mock engine and the CPU SmolLM2 engine.
//! A decode node asked to drain by migration (`request_migrations`) has each of its streams
//! parked, the KV pushed to the other decode node, and the stream continued there: the client's
//! greedy tokens equal the unmoved run's, none repeated or lost, and no node keeps anything.

use crate::common;
use common::assert_clean;

use futures::future::BoxFuture;
use pdnode_core::RequestId;
use pdnode_core::config::Config;
use pdnode_core::metrics as m;
use pdnode_core::{NodeId, Role, SamplingParams};
use pdnode_engine::engine::EngineHandle;
use pdnode_engine::scheduler::Mode;
use pdnode_node::pd::{self, InProcessDirectory, KvMover, PdNode};
use pdnode_nodeapi::{
    DecodeCall, DecodeStream, KvTarget, MigrateCall, MigrateOutcome, NodeClient, NodeError,
    NodeStats, PrefillCall, PrefillOutcome, ReserveKv,
};
use pdnode_router::testing::fake_card;
use pdnode_router::{GenEvent, GenRequest, Router, RouterDeps, StaticMembership, Worker};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

struct Cluster {
    router: Arc<Router>,
    membership: Arc<StaticMembership>,
    prefill: Arc<PdNode>,
    decodes: Vec<Arc<PdNode>>,
    /// What the router calls for each decode node: the node, with its `ReserveKv` answers
    /// delayed when a test says so.
    decode_clients: Vec<Arc<LateReserve>>,
}

/// A decode node whose `ReserveKv` answers come `delay` after the reservation is made (0: at
/// once), and whose `Migrate` pushes are dropped after their first poll when `drop_push` is
/// set (a router that gave up on the call); every other call goes straight to the node.
struct LateReserve {
    node: Arc<PdNode>,
    delay_ms: AtomicU64,
    drop_push: AtomicBool,
}

impl NodeClient for LateReserve {
    fn reserve_kv(&self, req: ReserveKv) -> BoxFuture<'_, Result<KvTarget, NodeError>> {
        Box::pin(async move {
            let answer = self.node.reserve_kv(req).await;
            let delay = self.delay_ms.load(Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(delay)).await;
            answer
        })
    }
    fn prefill(&self, req: PrefillCall) -> BoxFuture<'_, Result<PrefillOutcome, NodeError>> {
        self.node.prefill(req)
    }
    fn decode(&self, req: DecodeCall) -> BoxFuture<'_, Result<DecodeStream, NodeError>> {
        self.node.decode(req)
    }
    fn abort(
        &self,
        id: RequestId,
        capability: Vec<u8>,
        reason: String,
    ) -> BoxFuture<'_, Result<bool, NodeError>> {
        NodeClient::abort(&*self.node, id, capability, reason)
    }
    fn stats(&self) -> BoxFuture<'_, Result<NodeStats, NodeError>> {
        self.node.stats()
    }
    fn request_migrations(&self) -> usize {
        self.node.request_migrations()
    }
    fn migrate(&self, req: MigrateCall) -> BoxFuture<'_, Result<MigrateOutcome, NodeError>> {
        if req.target.is_none() || !self.drop_push.load(Ordering::Relaxed) {
            return self.node.migrate(req);
        }
        Box::pin(async move {
            // polled once (the parked entry taken, the push begun: it waits on the engine),
            // then dropped
            let mut push = self.node.migrate(req);
            if let std::task::Poll::Ready(done) = futures::poll!(&mut push) {
                panic!("the push ended in its first poll: {done:?}");
            }
            drop(push);
            Err(NodeError::new(
                pdnode_core::ErrorKind::Unavailable,
                "the push call was dropped",
            ))
        })
    }
}

fn cluster(cfg: &Config) -> Cluster {
    cluster_with(cfg, |_| {})
}

fn cluster_with(cfg: &Config, set: impl FnOnce(&mut pdnode_core::config::RouterConfig)) -> Cluster {
    let lease = Duration::from_millis(cfg.transfer.lease_ms);
    let dir = InProcessDirectory::new();
    let build = |mode| tokio::task::block_in_place(|| pd::build_engine(cfg, mode)).unwrap();
    let p = build(Mode::PrefillOnly);
    let prefill = PdNode::new(
        NodeId::new("p0"),
        Role::Prefill,
        p.handle.clone(),
        KvMover::InProcess(dir.clone()),
        lease,
    );
    let mut workers = vec![Worker {
        card: fake_card("p0", Role::Prefill),
        client: prefill.clone(),
    }];
    let mut decodes = Vec::new();
    let mut decode_clients = Vec::new();
    for i in 0..2 {
        let id = format!("d{i}");
        let d = build(Mode::DecodeOnly);
        dir.insert(NodeId::new(&id), d.handle.clone());
        let node = PdNode::new(
            NodeId::new(&id),
            Role::Decode,
            d.handle.clone(),
            KvMover::InProcess(dir.clone()),
            lease,
        );
        let client = Arc::new(LateReserve {
            node: node.clone(),
            delay_ms: AtomicU64::new(0),
            drop_push: AtomicBool::new(false),
        });
        workers.push(Worker {
            card: fake_card(&id, Role::Decode),
            client: client.clone(),
        });
        decodes.push(node);
        decode_clients.push(client);
    }
    let rm = tokio::task::block_in_place(|| pd::router_tokenizer(cfg)).unwrap();
    let mut rc = cfg.router.clone();
    rc.prefill_policy = pdnode_core::config::PolicyName::RoundRobin;
    rc.decode_policy = pdnode_core::config::PolicyName::RoundRobin;
    rc.warm_pairs = false;
    set(&mut rc);
    let membership = Arc::new(StaticMembership::new(workers));
    let router = Router::new(RouterDeps {
        config: rc,
        api_keys: Vec::new(),
        insecure_node_plane: false,
        membership: membership.clone(),
        tokenizer: rm.tokenizer,
        chat: rm.chat,
        model: rm.model,
    });
    Cluster {
        router,
        membership,
        prefill,
        decodes,
        decode_clients,
    }
}

async fn running(e: &EngineHandle) -> usize {
    e.stats().await.unwrap().scheduler.running
}

/// One greedy request; after `move_after` tokens, the decode node running it is asked to drain
/// by migration. Returns the tokens and where the request ran at the end.
async fn generate(
    c: &Cluster,
    ids: &[u32],
    max_tokens: u32,
    move_after: Option<usize>,
) -> Vec<u32> {
    let mut g = c
        .router
        .generate(GenRequest {
            prompt_token_ids: ids.to_vec(),
            sampling: SamplingParams::greedy(max_tokens),
            endpoint: "test",
            routing_key: None,
            slo: Default::default(),
        })
        .unwrap();
    let mut got = Vec::new();
    let mut asked = false;
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(120), g.events.recv())
            .await
            .expect("router stalled");
        match ev {
            Some(GenEvent::Tokens { token_ids, .. }) => got.extend(token_ids),
            Some(GenEvent::Done { usage, .. }) => {
                assert_eq!(usage.completion_tokens as usize, got.len());
                assert_eq!(usage.prompt_tokens as usize, ids.len());
                return got;
            }
            Some(GenEvent::Error(e)) => panic!("request failed: {e}"),
            None => panic!("stream ended without Done"),
        }
        if !asked && move_after.is_some_and(|n| got.len() >= n) {
            asked = true;
            let mut from = None;
            for d in &c.decodes {
                if running(d.engine()).await > 0 {
                    from = Some(d);
                }
            }
            let from = from.expect("a decode node runs the request");
            assert_eq!(from.request_migrations(), 1, "one stream asked to move");
        }
    }
}

async fn moved_equals_unmoved(cfg: &Config, ids: Vec<u32>, max_tokens: u32, after: usize) {
    let want = generate(&cluster(cfg), &ids, max_tokens, None).await;
    assert_eq!(want.len(), max_tokens as usize, "{want:?}");
    let c = cluster(cfg);
    let got = generate(&c, &ids, max_tokens, Some(after)).await;
    assert_eq!(
        got, want,
        "the moved stream's tokens differ from the unmoved run's"
    );
    let moved = c
        .router
        .metrics()
        .value(m::ROUTER_MIGRATIONS_TOTAL, &[("outcome", "ok")]);
    assert_eq!(moved, Some(1.0), "the stream moved once");
    // Both decode nodes ran it: the first until the park, the second to the end.
    for d in &c.decodes {
        let s = d.engine().stats().await.unwrap();
        assert!(s.steps_total > 0, "{} ran no step", d.id());
        assert_clean(d.engine()).await;
    }
    assert_clean(c.prefill.engine()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_moved_mid_decode_keeps_its_tokens_on_the_mock_engine() {
    let mut cfg = common::mock_config(3_000, 40, 5_000);
    cfg.engine.num_kv_blocks = 128;
    moved_equals_unmoved(&cfg, common::prompt(), 40, 9).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_moved_mid_decode_keeps_its_tokens_on_the_cpu_smollm2_engine() {
    let Some(mut c) = common::smollm2_config() else {
        return;
    };
    c.engine.cpu_threads = 1;
    // 21 positions before the move: the KV moved spans a whole block and part of the next.
    moved_equals_unmoved(
        &c,
        vec![1, 504, 3458, 282, 4649, 314, 2, 198, 504, 1012],
        24,
        12,
    )
    .await;
}

/// `router.rebalance`: four streams pinned on one decode node (the sticky `manual` policy, one
/// routing key); with `min_gap = 2` the router moves streams to the idle node until the two
/// differ by less than 2 (two moves: 4/0 -> 3/1 -> 2/2), one per interval; every stream keeps
/// its unmoved tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebalancing_moves_streams_to_the_idle_decode_node_until_the_gap_closes() {
    let mut cfg = common::mock_config(20_000, 60, 5_000);
    cfg.engine.num_kv_blocks = 256;
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|k| {
            (0..15 + k * 3)
                .map(|i| (i * 7 + 3 + k * 11) % 200)
                .collect()
        })
        .collect();
    let reference = cluster(&cfg);
    let mut want = Vec::new();
    for p in &prompts {
        want.push(common::greedy(&reference.router, p.clone(), 60, Some("pinned")).await);
    }
    let c = cluster_with(&cfg, |rc| {
        rc.decode_policy = pdnode_core::config::PolicyName::Manual;
        rc.rebalance.min_gap = 2;
        rc.rebalance.interval_ms = 100;
    });
    assert_eq!(c.router.rebalance_now(), None, "nothing to even out yet");
    let runs: Vec<_> = prompts
        .iter()
        .map(|p| {
            let r = c.router.clone();
            let p = p.clone();
            tokio::spawn(async move { common::greedy(&r, p, 60, Some("pinned")).await })
        })
        .collect();
    // Every stream started, all on one node.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let on: Vec<usize> =
            futures::future::join_all(c.decodes.iter().map(|d| running(d.engine()))).await;
        if on.contains(&4) {
            break;
        }
        assert!(Instant::now() < deadline, "streams never all ran: {on:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Looked at until the first stream ends (then the gap is the streams' finishing order).
    let mut asked = Vec::new();
    while !runs.iter().any(|r| r.is_finished()) {
        c.router.refresh_stats(Duration::from_secs(2)).await;
        if let Some(a) = c.router.rebalance_now() {
            asked.push(a);
        }
        tokio::time::sleep(Duration::from_millis(110)).await;
    }
    for (r, w) in runs.into_iter().zip(&want) {
        assert_eq!(
            &r.await.unwrap(),
            w,
            "a stream's tokens changed with the rebalancing"
        );
    }
    let moved = c
        .router
        .metrics()
        .value(m::ROUTER_MIGRATIONS_TOTAL, &[("outcome", "ok")]);
    assert_eq!(moved, Some(2.0), "asked: {asked:?}");
    assert_eq!(asked.len(), 2, "{asked:?}");
    for d in &c.decodes {
        assert_clean(d.engine()).await;
    }
}

/// Runs one greedy 60-token request; after 5 tokens `break_move(to)` prepares the failure of
/// the move to decode node `to` (the other one), and the node running the request is asked to
/// move it. Expects the request to end with an error before its 60 tokens, the move counted
/// `failed`, and no engine to keep anything (within 10 s, far inside the 60 s leases).
async fn a_failed_move(c: &Cluster, break_move: impl FnOnce(usize)) -> String {
    let mut g = c
        .router
        .generate(GenRequest {
            prompt_token_ids: common::prompt(),
            sampling: SamplingParams::greedy(60),
            endpoint: "test",
            routing_key: None,
            slo: Default::default(),
        })
        .unwrap();
    let mut tokens = 0;
    let mut break_move = Some(break_move);
    let err = loop {
        let ev = tokio::time::timeout(Duration::from_secs(60), g.events.recv())
            .await
            .expect("router stalled");
        match ev {
            Some(GenEvent::Tokens { token_ids, .. }) => tokens += token_ids.len(),
            Some(GenEvent::Done { .. }) => panic!("the request ended normally after {tokens}"),
            Some(GenEvent::Error(e)) => break e,
            None => panic!("stream ended without Done or Error"),
        }
        if tokens >= 5
            && let Some(f) = break_move.take()
        {
            let from = if running(c.decodes[0].engine()).await > 0 {
                0
            } else {
                1
            };
            f(1 - from);
            assert_eq!(c.decodes[from].request_migrations(), 1);
        }
    };
    eprintln!("after {tokens} tokens: {err}");
    assert!(tokens < 60, "{tokens}");
    let failed = c
        .router
        .metrics()
        .value(m::ROUTER_MIGRATIONS_TOTAL, &[("outcome", "failed")]);
    assert_eq!(failed, Some(1.0));
    for d in &c.decodes {
        assert_clean(d.engine()).await;
    }
    assert_clean(c.prefill.engine()).await;
    err.to_string()
}

/// A move that fails after the park (the other decode node refuses the reservation: it drains
/// too) ends the request with a clear error, and the parked KV is freed on the node it was
/// parked on: neither engine keeps anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_refused_after_the_park_fails_the_request_and_frees_the_parked_kv() {
    // A 60 s lease: the parked blocks must be freed by the abort, not by their deadline.
    let mut cfg = common::mock_config(5_000, 60, 60_000);
    cfg.engine.num_kv_blocks = 128;
    let c = cluster(&cfg);
    let err = a_failed_move(&c, |to| c.decodes[to].engine().stop_admitting()).await;
    assert!(err.contains("migrat") || err.contains("draining"), "{err}");
}

/// A move whose reservation on the new node answers past the router's bound (1 s here, the
/// answer after 1.6 s): the request ends with a clear error, the parked KV is freed, and the
/// reservation the new node made anyway is aborted with its capability when its answer lands,
/// not left to its 60 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_whose_reservation_answers_late_frees_that_reservation() {
    let mut cfg = common::mock_config(5_000, 60, 60_000);
    cfg.engine.num_kv_blocks = 128;
    let c = cluster_with(&cfg, |rc| rc.prefill_timeout_s = 1);
    a_failed_move(&c, |to| {
        c.decode_clients[to]
            .delay_ms
            .store(1_600, Ordering::Relaxed)
    })
    .await;
}

/// A move whose push call is dropped midway (after the parked entry was taken): the request
/// ends with a clear error and the parked KV is freed at once on the node it was parked on,
/// not at its 60 s lease (the router's abort finds no parked entry there any more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_whose_push_call_is_dropped_frees_the_parked_kv() {
    let mut cfg = common::mock_config(5_000, 60, 60_000);
    cfg.engine.num_kv_blocks = 128;
    let c = cluster(&cfg);
    a_failed_move(&c, |to| {
        c.decode_clients[1 - to]
            .drop_push
            .store(true, Ordering::Relaxed)
    })
    .await;
}

/// A decode node draining by migration publishes `draining` on its card (still registered):
/// the router sends it no new request and no moved stream. Here d1 drains (card marked, engine
/// refusing as a draining one does) when d0 is asked to move its stream: nowhere else to go,
/// the stream stays on d0 and ends whole, where a move to d1 would have failed it after the
/// park.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_decode_node_takes_no_moved_stream() {
    let cfg = common::mock_config(5_000, 60, 5_000);
    let c = cluster(&cfg);
    c.decodes[1].engine().stop_admitting();
    let mut card = fake_card("d1", Role::Decode);
    card.draining = true;
    c.membership.add(Worker {
        card,
        client: c.decode_clients[1].clone(),
    });
    assert_eq!(c.router.usable_nodes(), (1, 1), "d1 is no candidate");
    let want = generate(&cluster(&cfg), &common::prompt(), 40, None).await;
    let got = generate(&c, &common::prompt(), 40, Some(5)).await;
    assert_eq!(got, want);
    let outcome = |o| {
        c.router
            .metrics()
            .value(m::ROUTER_MIGRATIONS_TOTAL, &[("outcome", o)])
    };
    assert_eq!(outcome("nowhere"), Some(1.0));
    assert_eq!(outcome("failed"), None);
    for d in &c.decodes {
        assert_clean(d.engine()).await;
    }
}

/// One stream moved again and again: both decode nodes asked to drain by migration, so each
/// hands it to the other as soon as it arrives (a move needs one decode step there). Every
/// move after the first parks a request whose prompt, as that node knows it, holds the output
/// before the move; the client still gets the unmoved run's tokens, exactly `max_tokens`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_moved_back_and_forth_keeps_its_tokens() {
    let mut cfg = common::mock_config(3_000, 80, 5_000);
    cfg.engine.num_kv_blocks = 256;
    let want = common::greedy(&cluster(&cfg).router, common::prompt(), 80, None).await;
    let c = cluster(&cfg);
    let run = {
        let r = c.router.clone();
        tokio::spawn(async move { common::greedy(&r, common::prompt(), 80, None).await })
    };
    // Once it runs somewhere, both nodes drain by migration.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut on = 0;
        for d in &c.decodes {
            on += running(d.engine()).await;
        }
        if on > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the stream never ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for d in &c.decodes {
        d.request_migrations();
    }
    let got = run.await.unwrap();
    assert_eq!(got, want, "the moved stream's tokens");
    let moved = c
        .router
        .metrics()
        .value(m::ROUTER_MIGRATIONS_TOTAL, &[("outcome", "ok")])
        .unwrap_or(0.0);
    assert!(moved >= 2.0, "moved {moved} times");
    eprintln!("moved {moved} times");
    for d in &c.decodes {
        assert_clean(d.engine()).await;
    }
}
