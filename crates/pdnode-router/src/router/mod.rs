//! The router: admission, pair selection and the prefill/decode flow of `docs/protocol.md`.
//!
//! [`Router::generate`] admits a tokenized request and spawns its flow, which reports
//! [`GenEvent`]s on a channel. Dropping the receiver is how a frontend says its client went away:
//! the flow notices at once and aborts the request on both nodes.

mod attempt;
mod booking;
mod calls;
mod cost;
mod flow;
mod here;
mod migrate;
mod node_watch;
mod prefill;
mod rebalance;
mod state;
mod warm;

pub use state::RouterState;

use crate::error::RouterError;
use crate::membership::Membership;
use crate::metrics::Metrics;
use crate::policy::build_policy;
use crate::tokenize::{ChatRender, Tokenize};
use parking_lot::Mutex;
use pdnode_core::config::RouterConfig;
use pdnode_core::metrics as m;
use pdnode_core::request::TokenLogprob;
use pdnode_core::{ErrorKind, FinishReason, NodeId, RequestId, Role, SamplingParams};
use pdnode_telemetry::Remote;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;
use tokio::sync::mpsc;
use tracing::Instrument;

/// How long new picks avoid a node after it looked unreachable: a call or a step's deadline
/// failed on it (connection lost: its channel's keepalive went unanswered), or its `Stats` did
/// (`UNAVAILABLE`: e.g. its engine stalled; or no answer within the refresh's deadline).
pub(crate) const SUSPECT_FOR: Duration = Duration::from_secs(5);

/// What the frontends say about the served model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    /// The name clients pass as `model`.
    pub served_name: String,
    /// Longest prompt + output, tokens.
    pub context_length: u32,
    /// Set for a simulated engine (`"mock"`): shown in `/v1/models` so nobody mistakes it.
    pub simulated: Option<String>,
}

/// Everything the router needs from the process that hosts it.
#[derive(Clone)]
pub struct RouterDeps {
    pub config: RouterConfig,
    /// Bearer keys accepted by both frontends; empty: no authentication.
    pub api_keys: Vec<String>,
    /// This process's node API listens beyond loopback in plaintext
    /// (`security.allow_insecure`): `/health` says so.
    pub insecure_node_plane: bool,
    pub membership: Arc<dyn Membership>,
    pub tokenizer: Arc<dyn Tokenize>,
    pub chat: Arc<dyn ChatRender>,
    pub model: ModelInfo,
}

/// A tokenized, validated request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    pub prompt_token_ids: Vec<u32>,
    pub sampling: SamplingParams,
    /// Label of the frontend endpoint, for metrics (`completions`, `chat`, `grpc`).
    pub endpoint: &'static str,
    /// The session key the sticky `manual` policy routes by (HTTP header `X-SMG-Routing-Key`,
    /// gRPC metadata `x-smg-routing-key`); `None`: placed like any request.
    pub routing_key: Option<String>,
    /// The client's latency targets (headers `X-SLO-TTFT-Ms`, `X-SLO-TPOT-Ms`); `None`: the
    /// config's (`router.slo`).
    pub slo: Slo,
}

/// A request's latency targets, ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Slo {
    pub ttft_ms: Option<u64>,
    pub tpot_ms: Option<u64>,
}

/// How often a request waiting for its latency targets (`router.slo.queue_ms`) checks again.
const SLO_RECHECK: std::time::Duration = std::time::Duration::from_millis(10);

/// The headers (and gRPC metadata keys) a client sets its latency targets with.
pub const SLO_TTFT_HEADER: &str = "x-slo-ttft-ms";
pub const SLO_TPOT_HEADER: &str = "x-slo-tpot-ms";

impl Slo {
    /// The targets from header values (`None`: header absent): whole milliseconds, 1 to
    /// [`pdnode_core::request::SLO_MAX_MS`].
    pub fn from_values(ttft: Option<&[u8]>, tpot: Option<&[u8]>) -> Result<Self, RouterError> {
        let one = |name: &str, v: Option<&[u8]>| -> Result<Option<u64>, RouterError> {
            let Some(v) = v else {
                return Ok(None);
            };
            let max = pdnode_core::request::SLO_MAX_MS;
            match std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
            {
                Some(ms) if (1..=max).contains(&ms) => Ok(Some(ms)),
                _ => Err(RouterError::InvalidRequest {
                    message: format!("{name} must be a whole number of milliseconds, 1 to {max}"),
                }),
            }
        };
        Ok(Self {
            ttft_ms: one(SLO_TTFT_HEADER, ttft)?,
            tpot_ms: one(SLO_TPOT_HEADER, tpot)?,
        })
    }
}

/// The header (and gRPC metadata key) a client names its session with, sglang-router's name.
pub const ROUTING_KEY_HEADER: &str = "x-smg-routing-key";

/// Longest routing key accepted, bytes (clients choose keys; the `manual` policy keeps them).
pub const ROUTING_KEY_MAX: usize = 256;

/// The routing key from a header or metadata value: UTF-8, 1 to [`ROUTING_KEY_MAX`] bytes.
pub fn routing_key(value: Option<&[u8]>) -> Result<Option<String>, RouterError> {
    let Some(v) = value else {
        return Ok(None);
    };
    match std::str::from_utf8(v) {
        Ok(k) if !k.is_empty() && k.len() <= ROUTING_KEY_MAX => Ok(Some(k.to_owned())),
        _ => Err(RouterError::InvalidRequest {
            message: format!("{ROUTING_KEY_HEADER} must be 1 to {ROUTING_KEY_MAX} bytes of UTF-8"),
        }),
    }
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
}

/// What a flow reports, in order: `Tokens`* then exactly one of `Done` or `Error`.
#[derive(Debug, Clone, PartialEq)]
pub enum GenEvent {
    Tokens {
        token_ids: Vec<u32>,
        /// The text these tokens complete (may be empty; cut at a stop string).
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    Done {
        finish: FinishReason,
        usage: Usage,
    },
    Error(RouterError),
}

/// A started request.
pub struct Generation {
    pub request_id: RequestId,
    pub events: mpsc::Receiver<GenEvent>,
}

/// `Stats` calls of one [`Router::refresh_stats`] in flight at once.
const STATS_CONCURRENCY: usize = 64;

pub struct Router {
    pub(crate) deps: RouterDeps,
    pub(crate) state: Mutex<RouterState>,
    pub(crate) metrics: Arc<Metrics>,
    /// One liveness watch per node some request is waiting on.
    pub(crate) watches: node_watch::NodeWatches,
    inflight: Arc<AtomicU32>,
    /// Requests waiting at admission (`router.slo.queue_ms`), at most `max_inflight_requests`.
    slo_waiting: AtomicU32,
    draining: AtomicBool,
    /// This router's streams by decode node, for `router.rebalance`.
    pub(crate) streams: rebalance::Streams,
}

/// A place among the requests waiting at admission, given back when the wait ends.
struct WaitSlot<'a>(&'a Router);

impl<'a> WaitSlot<'a> {
    fn take(router: &'a Router) -> Option<Self> {
        let limit = router.deps.config.max_inflight_requests;
        router
            .slo_waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()?;
        router.publish_slo_waiting();
        Some(WaitSlot(router))
    }
}

impl Drop for WaitSlot<'_> {
    fn drop(&mut self) {
        self.0.slo_waiting.fetch_sub(1, Ordering::AcqRel);
        self.0.publish_slo_waiting();
    }
}

impl Router {
    /// Requests waiting at admission now (`router.slo.queue_ms`).
    pub fn slo_waiting(&self) -> u32 {
        self.slo_waiting.load(Ordering::Acquire)
    }

    fn publish_slo_waiting(&self) {
        let count = &self.slo_waiting;
        self.metrics
            .set_from(m::ROUTER_SLO_WAITING_REQUESTS, &[], || {
                f64::from(count.load(Ordering::Acquire))
            });
    }
}

/// Decrements the in-flight count when the flow ends, however it ends.
pub(crate) struct InflightGuard {
    count: Arc<AtomicU32>,
    metrics: Arc<Metrics>,
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::AcqRel);
        let count = &self.count;
        self.metrics.set_from(m::ROUTER_INFLIGHT_REQUESTS, &[], || {
            f64::from(count.load(Ordering::Acquire))
        });
    }
}

impl Router {
    pub fn new(deps: RouterDeps) -> Arc<Self> {
        let cfg = &deps.config;
        let prefill = build_policy(cfg.prefill_policy, cfg, cfg.seed);
        let decode = build_policy(
            cfg.decode_policy,
            cfg,
            if cfg.seed == 0 { 0 } else { cfg.seed ^ 0x5eed },
        );
        let warm_pairs = cfg.warm_pairs;
        let metrics = Arc::new(Metrics::new());
        describe(&metrics);
        Arc::new(Self {
            deps,
            state: Mutex::new(RouterState::new(prefill, decode).warming_pairs(warm_pairs)),
            metrics,
            watches: node_watch::NodeWatches::default(),
            inflight: Arc::new(AtomicU32::new(0)),
            slo_waiting: AtomicU32::new(0),
            draining: AtomicBool::new(false),
            streams: rebalance::Streams::default(),
        })
    }

    pub fn deps(&self) -> &RouterDeps {
        &self.deps
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn inflight(&self) -> u32 {
        self.inflight.load(Ordering::Acquire)
    }

    /// Decode-node liveness watches running now: one task per decode node that some request's
    /// prefill or stream is waiting on, however many requests wait on it; 0 once none does.
    pub fn decode_watches(&self) -> usize {
        self.watches.tasks(Role::Decode)
    }

    /// Prefill-node liveness watches running now: one task per prefill node some request's
    /// prefill is waiting on; 0 once none does.
    pub fn prefill_watches(&self) -> usize {
        self.watches.tasks(Role::Prefill)
    }

    /// Stops admitting requests (shutdown); those in flight go on.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// How many nodes can prefill and how many can decode a request of this router now: the
    /// candidates the flow pairs from. A colocated `all` node counts in both; an `all` node
    /// without `colocated` in neither (its engines are in process, behind its own router).
    /// With `router.local_prefill.prefill_busy_requests` set, decode nodes prefill any request
    /// when no prefill node is left, so they count in both too.
    pub fn usable_nodes(&self) -> (usize, usize) {
        let (prefills, decodes) = crate::membership::candidates(self.deps.membership.as_ref());
        let busy_here = self.deps.config.local_prefill.prefill_busy_requests > 0;
        let prefill_too = decodes
            .iter()
            .filter(|w| crate::membership::is_colocated(w) || busy_here)
            .count();
        (prefills.len() + prefill_too, decodes.len())
    }

    /// Checks the prompt against the context length and the vocabulary.
    pub fn check_prompt(&self, req: &GenRequest) -> Result<(), RouterError> {
        if req.prompt_token_ids.is_empty() {
            return Err(RouterError::param("prompt", "the prompt is empty"));
        }
        let vocab = self.deps.tokenizer.vocab_size();
        if let Some(bad) = req.prompt_token_ids.iter().find(|&&t| t >= vocab) {
            return Err(RouterError::param(
                "prompt",
                format!("token id {bad} is outside the vocabulary (size {vocab})"),
            ));
        }
        let ctx = self.deps.model.context_length;
        let total = req.prompt_token_ids.len() as u64 + u64::from(req.sampling.max_tokens);
        if req.prompt_token_ids.len() as u64 >= u64::from(ctx) || total > u64::from(ctx) {
            return Err(RouterError::ContextLength {
                prompt_tokens: req.prompt_token_ids.len(),
                max_tokens: req.sampling.max_tokens,
                context_length: ctx,
            });
        }
        Ok(())
    }

    /// Admits `req` and starts its flow. Fails at once when the request is invalid, the router is
    /// at `max_inflight_requests`, or no prefill or decode node exists.
    pub fn generate(self: &Arc<Self>, req: GenRequest) -> Result<Generation, RouterError> {
        self.generate_traced(req, Remote::default())
    }

    /// [`Router::generate`] for a request that came with its caller's trace context `remote`
    /// (W3C `traceparent` of the HTTP or gRPC request; none: a new trace). The request's span
    /// (`request`, fields `request_id` and `trace_id`, which every log line of its flow shows)
    /// is a child of the caller's; admission and the whole flow run inside it.
    pub fn generate_traced(
        self: &Arc<Self>,
        req: GenRequest,
        remote: Remote,
    ) -> Result<Generation, RouterError> {
        let request_id = RequestId::random();
        let span = tracing::info_span!(
            parent: None,
            "request",
            otel.kind = "server",
            request_id = %request_id,
            trace_id = tracing::field::Empty,
            endpoint = req.endpoint,
            prompt_tokens = req.prompt_token_ids.len(),
            completion_tokens = tracing::field::Empty,
            finish_reason = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        remote.adopt(&span);
        let admitted = span.in_scope(|| {
            let admission = tracing::info_span!(
                "admission",
                inflight = tracing::field::Empty,
                limit = self.deps.config.max_inflight_requests,
            );
            let r = admission.in_scope(|| self.admit(&req));
            match &r {
                Ok(_) => {
                    admission.record("inflight", self.inflight());
                }
                Err(e) => pdnode_telemetry::fail(&admission, e),
            }
            r
        });
        let guard = match admitted {
            Ok(g) => g,
            Err(e) => {
                let outcome = pdnode_core::error::Classify::kind(&e).as_str();
                span.record("outcome", outcome);
                pdnode_telemetry::fail(&span, &e);
                // Refused at admission (in-flight limit, SLO, no node, invalid): counted with
                // the requests that ended, under the same outcome names.
                self.metrics.inc(
                    m::ROUTER_REQUESTS_TOTAL,
                    &[("endpoint", req.endpoint), ("outcome", outcome)],
                    1.0,
                );
                return Err(e);
            }
        };
        let (tx, rx) = mpsc::channel(64);
        let this = self.clone();
        tokio::spawn(flow::run(this, req, request_id, tx, guard).instrument(span));
        Ok(Generation {
            request_id,
            events: rx,
        })
    }

    /// The admission checks of [`Router::generate`]; books the request as in flight.
    fn admit(&self, req: &GenRequest) -> Result<InflightGuard, RouterError> {
        if self.is_draining() {
            return Err(RouterError::Draining);
        }
        self.check_prompt(req)?;
        let (prefills, decodes) = self.usable_nodes();
        // A short prompt is prefilled on its decode node (`router.local_prefill`): no prefill
        // node needed.
        let max_here = self.deps.config.local_prefill.max_prompt_tokens as usize;
        if prefills == 0 && req.prompt_token_ids.len() > max_here {
            return Err(RouterError::NoNode {
                role: Role::Prefill,
            });
        }
        if decodes == 0 {
            return Err(RouterError::NoNode { role: Role::Decode });
        }
        self.check_slo(req)?;
        let limit = self.deps.config.max_inflight_requests;
        let admitted = self
            .inflight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            });
        if admitted.is_err() {
            return Err(RouterError::Overloaded { limit });
        }
        // Read under the metrics lock: the gauge ends at the count's last value (a value read
        // here before a concurrent request's end could otherwise be written after it, and stay).
        let count = &self.inflight;
        self.metrics.set_from(m::ROUTER_INFLIGHT_REQUESTS, &[], || {
            f64::from(count.load(Ordering::Acquire))
        });
        Ok(InflightGuard {
            count: self.inflight.clone(),
            metrics: self.metrics.clone(),
        })
    }

    /// SLO admission (docs/runtime-semantics.md, "SLO admission"): refuses a request whose
    /// time to first token, as the router predicts it on the best prefill candidate, or whose
    /// time per output token, as every decode candidate's streams ran lately, is above its
    /// target. Admits whatever the router has not measured.
    fn check_slo(&self, req: &GenRequest) -> Result<(), RouterError> {
        self.check_targets(req.prompt_token_ids.len(), req.slo)
    }

    /// A request's targets: its own, else the config's (`None`: no target).
    fn targets(&self, slo: Slo) -> (Option<u64>, Option<u64>) {
        let cfg = &self.deps.config.slo;
        let pick = |asked: Option<u64>, default: u64| asked.or((default > 0).then_some(default));
        (
            pick(slo.ttft_ms, cfg.ttft_ms),
            pick(slo.tpot_ms, cfg.tpot_ms),
        )
    }

    /// [`Router::generate_traced`], after waiting (at most `router.slo.queue_ms`) while the
    /// request would miss a latency target now: a request predicted over its TTFT target
    /// because of the prompts ahead of it is admitted once they are gone, if what is left of its
    /// target still holds (the wait counts against it: its target shrinks by the time waited).
    /// Each waiting request checks again every 10 ms, in no order; at the end of the wait it is
    /// refused as without one (429). At most `max_inflight_requests` requests wait at once; one
    /// more is refused at once, as without a queue. `queue_ms` 0: no wait.
    pub async fn generate_queued(
        self: &Arc<Self>,
        mut req: GenRequest,
        remote: Remote,
    ) -> Result<Generation, RouterError> {
        let queue = std::time::Duration::from_millis(self.deps.config.slo.queue_ms);
        let (ttft, tpot) = self.targets(req.slo);
        if !queue.is_zero() && (ttft.is_some() || tpot.is_some()) {
            let start = std::time::Instant::now();
            let left = |waited: u64| ttft.map(|t| t.saturating_sub(waited).max(1));
            let mut slot: Option<WaitSlot<'_>> = None;
            loop {
                let waited = start.elapsed();
                let ms = waited.as_millis() as u64;
                let now = Slo {
                    ttft_ms: left(ms),
                    tpot_ms: tpot,
                };
                let over = self.check_targets(req.prompt_token_ids.len(), now).is_err();
                let spent = ttft.is_some_and(|t| ms >= t);
                if !over || waited >= queue || spent || self.is_draining() {
                    break;
                }
                if slot.is_none() {
                    match WaitSlot::take(self) {
                        Some(s) => slot = Some(s),
                        // The queue is full: refused now, as without one.
                        None => break,
                    }
                }
                tokio::time::sleep(SLO_RECHECK).await;
            }
            drop(slot);
            let ms = start.elapsed().as_millis() as u64;
            if ms > 0 {
                req.slo.ttft_ms = left(ms);
            }
        }
        self.generate_traced(req, remote)
    }

    /// The SLO check of a prompt of `prompt_len` tokens against targets `slo` (or the
    /// config's).
    fn check_targets(&self, prompt_len: usize, slo: Slo) -> Result<(), RouterError> {
        let (ttft, tpot) = self.targets(slo);
        if ttft.is_none() && tpot.is_none() {
            return Ok(());
        }
        let (prefills, decodes) = crate::membership::candidates(self.deps.membership.as_ref());
        let now = std::time::Instant::now();
        let st = self.state.lock();
        if let Some(target) = ttft {
            // Colocated workers prefill for themselves.
            let best = prefills
                .iter()
                .chain(
                    decodes
                        .iter()
                        .filter(|w| crate::membership::is_colocated(w)),
                )
                .filter_map(|p| st.cost.predict_prefill_us(p, prompt_len, now))
                .min();
            if let Some(us) = best {
                let (predicted, target_us) = (us / 1000, target * 1000);
                if us > target_us {
                    return Err(RouterError::SloUnmet {
                        what: "time to first token",
                        predicted_ms: predicted,
                        target_ms: target,
                        retry_after_s: (us - target_us).div_ceil(1_000_000).max(1),
                    });
                }
            }
        }
        if let Some(target) = tpot {
            let mut measured = decodes.iter().map(|d| st.cost.tpot(d, now));
            // Refused only when every decode candidate measured above the target lately.
            let all: Option<Vec<f64>> = measured.by_ref().collect();
            if let Some(best) = all.and_then(|v| v.into_iter().reduce(f64::min))
                && best * 1e3 > target as f64
            {
                return Err(RouterError::SloUnmet {
                    what: "time per output token",
                    predicted_ms: (best * 1e3).round() as u64,
                    target_ms: target,
                    retry_after_s: 1,
                });
            }
        }
        Ok(())
    }

    /// Asks every node for its stats (each call bounded by `timeout`, all side by side) and
    /// updates the policies' view and the per-node gauges.
    pub async fn refresh_stats(&self, timeout: Duration) {
        use futures::StreamExt;
        let mut present: Vec<NodeId> = Vec::new();
        let mut all = Vec::new();
        for role in [Role::Prefill, Role::Decode] {
            let workers = self.deps.membership.workers(role);
            self.metrics.set(
                m::ROUTER_NODES,
                &[("role", role.as_str())],
                workers.len() as f64,
            );
            present.extend(workers.iter().map(|w| w.id().clone()));
            all.extend(workers);
            let footprint = self.state.lock().footprint(role);
            if let Some(f) = footprint {
                let l = [("role", role.as_str())];
                self.metrics
                    .set(m::ROUTER_PREFIX_TREE_TOKENS, &l, f.tokens as f64);
                self.metrics
                    .set(m::ROUTER_PREFIX_TREE_NODES, &l, f.nodes as f64);
            }
        }
        // Asked side by side (at most STATS_CONCURRENCY at once): a node that does not answer
        // costs one `timeout`, not one per node behind it.
        let answers: Vec<_> = futures::stream::iter(all)
            .map(|w| async move {
                let r = tokio::time::timeout(timeout, w.client.stats()).await;
                (w, r)
            })
            .buffer_unordered(STATS_CONCURRENCY)
            .collect()
            .await;
        let mut rows = Vec::new();
        let mut down: Vec<NodeId> = Vec::new();
        for (w, r) in answers {
            match r {
                Ok(Ok(s)) => rows.push((w.id().clone(), s)),
                // Unreachable, its engine stalled (UNAVAILABLE), or no answer in time: new
                // picks avoid it for a while.
                Ok(Err(e)) if matches!(e.kind, ErrorKind::Unavailable | ErrorKind::Timeout) => {
                    tracing::debug!(node = %w.id(), error = %e, "stats: node unavailable");
                    down.push(w.id().clone());
                }
                Err(_) => down.push(w.id().clone()),
                Ok(Err(_)) => {}
            }
        }
        for name in [
            m::ENGINE_QUEUE_DEPTH,
            m::ENGINE_RUNNING_REQUESTS,
            m::KV_BLOCKS_IN_USE,
            m::KV_BLOCKS_TOTAL,
        ] {
            self.metrics.clear_gauge(name);
        }
        crate::metrics::clear_accounting(&self.metrics);
        let mut st = self.state.lock();
        st.retain_stats(&present);
        let until = std::time::Instant::now() + SUSPECT_FOR;
        for id in &down {
            st.suspect(id, until);
        }
        for (id, s) in rows {
            let node = id.as_str();
            let l = [("node", node)];
            self.metrics
                .set(m::ENGINE_QUEUE_DEPTH, &l, f64::from(s.queued_requests));
            self.metrics.set(
                m::ENGINE_RUNNING_REQUESTS,
                &l,
                f64::from(s.running_requests),
            );
            self.metrics.set(
                m::KV_BLOCKS_IN_USE,
                &l,
                s.kv_blocks_total.saturating_sub(s.kv_blocks_free) as f64,
            );
            self.metrics
                .set(m::KV_BLOCKS_TOTAL, &l, s.kv_blocks_total as f64);
            if let Some(a) = &s.accounting {
                crate::metrics::export_accounting(&self.metrics, node, a);
            }
            st.set_stats(id, s);
        }
    }
}

fn describe(mx: &Metrics) {
    for (n, h) in [
        (
            m::ROUTER_REQUESTS_TOTAL,
            "Requests finished, by endpoint and outcome.",
        ),
        (m::ROUTER_TTFT_SECONDS, "Time to first token."),
        (
            m::ROUTER_TPOT_SECONDS,
            "Time per output token after the first.",
        ),
        (m::ROUTER_E2E_SECONDS, "End-to-end request latency."),
        (
            m::ROUTER_INFLIGHT_REQUESTS,
            "Requests admitted and not finished.",
        ),
        (
            m::ROUTER_SLO_WAITING_REQUESTS,
            "Requests waiting at admission for their latency target to hold.",
        ),
        (
            m::ROUTER_PROMPT_TOKENS_TOTAL,
            "Prompt tokens of admitted requests.",
        ),
        (
            m::ROUTER_OUTPUT_TOKENS_TOTAL,
            "Output tokens streamed to clients.",
        ),
        (m::ROUTER_NODES, "Nodes in the membership view, by role."),
        (
            m::ROUTER_PREFIX_TREE_TOKENS,
            "Prompt tokens in the cache_aware policy's prefix tree, by role (bounded per worker by max_tree_size at each eviction).",
        ),
        (
            m::ROUTER_PREFIX_TREE_NODES,
            "Nodes of the cache_aware policy's prefix tree, by role.",
        ),
        (
            m::ROUTER_PAIR_WARMUPS_TOTAL,
            "Prefill/decode pair warm-ups (router.warm_pairs), by outcome.",
        ),
        (
            m::ROUTER_LOCAL_PREFILLS_TOTAL,
            "Requests prefilled on their decode node with no hand-off (router.local_prefill), by reason.",
        ),
        (
            m::ROUTER_MIGRATIONS_TOTAL,
            "Streams a draining decode node asked to move, by outcome (ok, failed, refused, nowhere).",
        ),
        (
            m::ENGINE_QUEUE_DEPTH,
            "Requests waiting in a node's queue (node stats).",
        ),
        (
            m::ENGINE_RUNNING_REQUESTS,
            "Requests running on a node (node stats).",
        ),
        (
            m::KV_BLOCKS_IN_USE,
            "KV blocks not free on a node: owned + cached (node stats).",
        ),
        (
            m::KV_BLOCKS_TOTAL,
            "KV blocks in a node's pool (node stats).",
        ),
        (
            m::TRANSFER_BYTES_TOTAL,
            "KV bytes handed off, as prefill nodes report them.",
        ),
        (
            m::TRANSFER_SECONDS,
            "KV hand-off time, as prefill nodes report it.",
        ),
        (
            m::TRANSFER_HANDOFFS_TOTAL,
            "Prefill calls (forward pass and KV hand-off) ended, by prefill node and outcome.",
        ),
    ] {
        mx.describe(n, h);
    }
    crate::metrics::describe_accounting(mx);
    mx.set(m::ROUTER_INFLIGHT_REQUESTS, &[], 0.0);
    mx.set(m::ROUTER_SLO_WAITING_REQUESTS, &[], 0.0);
}
