//! One request's prefill/decode flow (docs/protocol.md). [`super::attempt::Flow`] decides, per
//! attempt, what every way a step ends means (what to abort on which node, retry or not); this
//! file performs the calls (each bounded: `calls.rs`) and those decisions:
//!
//! 1. Pick decode node D (decode policy) and prefill node P (prefill policy); book both. Nodes
//!    that lately failed as unreachable are left out while others exist.
//! 2. `D.ReserveKv` -> KV target; `P.Prefill(target)` -> first token, KV handed off. Each call
//!    is bounded by `prefill_timeout_s` (and the request's `request_timeout_s`).
//! 3. A failure before the first token went out is retried once, under a fresh request id, on
//!    another pair (another P after a prefill failure, another D after a failed reservation or a
//!    lost D). Invalid-request verdicts of a node are not retried.
//!    While P computes, the router watches P and D; during the stream, D (one watch per node,
//!    shared by all requests waiting on it: [`super::node_watch`]). A node leaving the
//!    membership or failing a liveness probe (`Stats`; a node whose engine stalled answers it
//!    `UNAVAILABLE`) counts as lost: P lost is a failed prefill (retried), D lost during prefill
//!    drops the prefill call (retried on another D), D lost during the stream ends it.
//!    A frozen node (stopped process, hung host) is found by the channel's HTTP/2 keepalive
//!    (`router.node_keepalive_*`): the connection closes and every call on it fails at once.
//! 4. `D.Decode` streams the rest; each gap between messages is bounded by `token_timeout_s`.
//!    A broken or stalled stream aborts D and ends the client's stream with an error.
//! 5. The client going away (the event receiver dropped), or not taking an event within
//!    `client_send_timeout_s`, aborts the request on both nodes.
//! 6. A stop string matched by the router's detokenizer ends the request and aborts D.
//!
//! A node that looks gone (`Unavailable`, `Timeout`) gets its `Abort` without the router waiting
//! for the answer, so the client's answer or the retry never waits on a frozen node.

use super::attempt::{Event, Flow, Then};
use super::booking::{Booking, CostTicket};
use super::calls::{StepErr, abort_as, send, send_limit, step};
use super::migrate::{Got, decodes_now, migrate_to, park};
use super::node_watch::NodeWatch;
use super::warm::WARM_UP_ENDPOINT;
use super::{GenEvent, GenRequest, InflightGuard, Router, Usage};
use crate::error::{RouterError, Step};
use crate::membership::Worker;
use crate::membership::{candidates, is_colocated};
use crate::node::{DecodeCall, MigrateOutcome};
use crate::tokenize::Detokenizer;
use futures::StreamExt;
use pdnode_core::error::Classify;
use pdnode_core::metrics as m;
use pdnode_core::{ErrorKind, FinishReason, NodeId, RequestId, Role};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tracing::Instrument;
use tracing::field::Empty;

pub(super) enum Exit {
    Done(FinishReason),
    ClientGone,
}

/// Counts what the client got.
pub(super) struct Progress {
    pub(super) first_at: Option<Instant>,
    pub(super) tokens: u32,
    pub(super) cached: u32,
}

pub(super) async fn run(
    router: Arc<Router>,
    req: GenRequest,
    id: RequestId,
    tx: mpsc::Sender<GenEvent>,
    _guard: InflightGuard,
) {
    let start = Instant::now();
    let mx = router.metrics.clone();
    mx.inc(
        m::ROUTER_PROMPT_TOKENS_TOTAL,
        &[],
        req.prompt_token_ids.len() as f64,
    );
    let mut progress = Progress {
        first_at: None,
        tokens: 0,
        cached: 0,
    };
    let result = drive(&router, &req, id, &tx, start, &mut progress).await;
    let outcome = match &result {
        Ok(Exit::Done(_)) => "ok",
        Ok(Exit::ClientGone) => ErrorKind::Cancelled.as_str(),
        Err(e) => e.kind().as_str(),
    };
    // The request's span (Router::generate_traced): how it ended.
    let span = tracing::Span::current();
    span.record("outcome", outcome);
    span.record("completion_tokens", progress.tokens);
    match &result {
        Ok(Exit::Done(f)) => {
            span.record("finish_reason", f.as_str());
        }
        Ok(Exit::ClientGone) => {}
        Err(e) => pdnode_telemetry::fail(&span, e),
    }
    match result {
        Ok(Exit::Done(finish)) => {
            let usage = Usage {
                prompt_tokens: req.prompt_token_ids.len() as u32,
                completion_tokens: progress.tokens,
                cached_tokens: progress.cached,
            };
            let _ = send(&tx, GenEvent::Done { finish, usage }, send_limit(&router)).await;
            let e2e = start.elapsed();
            mx.observe(m::ROUTER_E2E_SECONDS, &[], e2e.as_secs_f64());
            if let (Some(first), true) = (progress.first_at, progress.tokens > 1) {
                let per = first.elapsed().as_secs_f64() / f64::from(progress.tokens - 1);
                mx.observe(m::ROUTER_TPOT_SECONDS, &[], per);
            }
        }
        Ok(Exit::ClientGone) => {
            tracing::info!(request = %id, "client went away; request aborted on its nodes");
        }
        Err(e) => {
            tracing::warn!(request = %id, error = %e, "request failed");
            let _ = send(&tx, GenEvent::Error(e), send_limit(&router)).await;
        }
    }
    mx.inc(
        m::ROUTER_OUTPUT_TOKENS_TOTAL,
        &[],
        f64::from(progress.tokens),
    );
    mx.inc(
        m::ROUTER_REQUESTS_TOTAL,
        &[("endpoint", req.endpoint), ("outcome", outcome)],
        1.0,
    );
}

/// Whether a decode node other than `d` and not yet excluded is there to retry on.
fn other_decode(decodes: &[Worker], d: &Worker, excluded: &[NodeId]) -> bool {
    decodes
        .iter()
        .any(|w| w.id() != d.id() && !excluded.contains(w.id()))
}

/// Resolves only when the watched node is gone; says why. Never without a watch.
pub(super) async fn node_lost(watch: &mut Option<NodeWatch>) -> String {
    match watch {
        Some(w) => w.lost().await,
        None => std::future::pending().await,
    }
}

/// How many attempts (pairs) a request gets: the first and one retry.
const ATTEMPTS: u32 = 2;

/// How one attempt ended.
pub(super) enum End {
    Exit(Exit),
    Fail(RouterError),
    /// Retry on another pair, leaving out this attempt's prefill and/or decode node.
    Retry {
        new_prefill: bool,
        new_decode: bool,
        err: RouterError,
    },
}

/// One attempt's pair and request id: carries out what [`Flow`] decides.
pub(super) struct Pair<'a> {
    pub(super) router: &'a Router,
    pub(super) p: &'a Worker,
    pub(super) d: &'a Worker,
    pub(super) id: RequestId,
    /// D prefills the request itself (`router.local_prefill`): P is D, no hand-off.
    pub(super) here: bool,
    /// D's booking, moved with the stream when it migrates.
    pub(super) d_booking: Option<&'a Booking<'a>>,
    /// The KV capability D's `ReserveKv` answered (the target's secret): every Abort of this
    /// attempt presents it. Unset until the reservation answered.
    pub(super) capability: OnceLock<Vec<u8>>,
}

impl Pair<'_> {
    /// Books `ev` and sends the aborts it calls for; returns what comes next.
    async fn act(&self, flow: &mut Flow, ev: Event, reason: &'static str) -> Then {
        let a = flow.on(ev);
        let cap = self.capability.get().cloned().unwrap_or_default();
        futures::join!(
            abort_as(self.router, self.p, self.id, cap.clone(), reason, a.prefill),
            abort_as(self.router, self.d, self.id, cap, reason, a.decode)
        );
        a.then
    }

    /// The attempt failed with `err` (event `ev`).
    pub(super) async fn fail(
        &self,
        flow: &mut Flow,
        ev: Event,
        reason: &'static str,
        err: RouterError,
    ) -> End {
        match self.act(flow, ev, reason).await {
            Then::Retry {
                new_prefill,
                new_decode,
            } => End::Retry {
                new_prefill,
                new_decode,
                err,
            },
            Then::ClientGone => End::Exit(Exit::ClientGone),
            Then::Go | Then::Fail | Then::Done => End::Fail(err),
        }
    }

    /// The client left (or stopped reading).
    pub(super) async fn gone(&self, flow: &mut Flow) -> End {
        self.act(flow, Event::ClientGone, "client disconnected")
            .await;
        End::Exit(Exit::ClientGone)
    }
}

async fn drive(
    router: &Arc<Router>,
    req: &GenRequest,
    id: RequestId,
    tx: &mpsc::Sender<GenEvent>,
    start: Instant,
    progress: &mut Progress,
) -> Result<Exit, RouterError> {
    let tokens = &req.prompt_token_ids;
    let key = req.routing_key.as_deref();
    let (prefills, decodes) = candidates(router.deps.membership.as_ref());
    let now = Instant::now();
    let mut flow = Flow::new(ATTEMPTS);
    let mut excluded: Vec<NodeId> = Vec::new();
    let mut excluded_d: Vec<NodeId> = Vec::new();
    let mut last_err: Option<RouterError> = None;
    let mut missing = Role::Prefill;
    let mut req_id = id;
    // The decode node and its booking; picked again only after it failed.
    let mut d_slot: Option<(Worker, Booking<'_>)> = None;
    for attempt in 0..ATTEMPTS {
        let choice = tracing::info_span!(
            "pair_choice",
            attempt,
            prefill_policy = ?router.deps.config.prefill_policy,
            decode_policy = ?router.deps.config.decode_policy,
            prefill_candidates = prefills.len() - excluded.len().min(prefills.len()),
            decode_candidates = decodes.len() - excluded_d.len().min(decodes.len()),
            prefill = Empty,
            decode = Empty,
        );
        if d_slot.is_none() {
            let picked = router.state.lock().pick_for(
                Role::Decode,
                &decodes,
                None,
                tokens,
                key,
                &excluded_d,
                now,
            );
            let Some(d_idx) = picked else {
                missing = Role::Decode;
                pdnode_telemetry::fail(&choice, &"no decode node to pick");
                break;
            };
            let w = decodes[d_idx].clone();
            let b = Booking::new(router, w.id());
            d_slot = Some((w, b));
        }
        let Some(d) = d_slot.as_ref().map(|(w, _)| w.clone()) else {
            break;
        };
        // A colocated worker prefills and decodes its own requests: P == D. So does a decode
        // node asked to prefill a request itself (`router.local_prefill`, `here.rs`).
        let here = super::here::decide(
            &router.deps.config.local_prefill,
            &router.state.lock(),
            tokens.len(),
            &d,
            &prefills,
            &excluded,
        );
        let p = if is_colocated(&d) || here.is_some() {
            d.clone()
        } else {
            let (picked, cold) = {
                let mut st = router.state.lock();
                let picked = st.pick_for(
                    Role::Prefill,
                    &prefills,
                    Some(&d),
                    tokens,
                    key,
                    &excluded,
                    now,
                );
                // A cold pair of D's, warmed now for the requests after this one.
                let cold = router
                    .deps
                    .config
                    .warm_pairs
                    .then(|| st.warm.next_cold(&prefills, &d, &excluded, now))
                    .flatten();
                (picked, cold)
            };
            if let Some(cold) = cold {
                super::warm::spawn(router.clone(), cold, d.clone());
            }
            let Some(p_idx) = picked else {
                missing = Role::Prefill;
                pdnode_telemetry::fail(&choice, &"no prefill node to pick");
                break;
            };
            prefills[p_idx].clone()
        };
        choice.record("prefill", p.id().as_str());
        choice.record("decode", d.id().as_str());
        drop(choice);
        if !flow.begin(p.id() == d.id()) {
            break;
        }
        if let Some(why) = here {
            router.metrics.inc(
                m::ROUTER_LOCAL_PREFILLS_TOTAL,
                &[("reason", why.as_str())],
                1.0,
            );
        }
        if attempt > 0 {
            req_id = RequestId::random();
            tracing::info!(request = %id, retry_id = %req_id, prefill = %p.id(), decode = %d.id(), "retrying on another node");
        }
        let pair = Pair {
            router,
            p: &p,
            d: &d,
            id: req_id,
            here: here.is_some(),
            d_booking: d_slot.as_ref().map(|(_, b)| b),
            capability: OnceLock::new(),
        };
        let attempt_span = tracing::info_span!(
            "attempt",
            attempt,
            request_id = %req_id,
            prefill = %p.id(),
            decode = %d.id(),
        );
        match run_attempt(&pair, &mut flow, req, tx, start, progress)
            .instrument(attempt_span.clone())
            .await
        {
            End::Exit(e) => return Ok(e),
            End::Fail(e) => return Err(e),
            End::Retry {
                new_prefill,
                new_decode,
                err,
            } => {
                pdnode_telemetry::fail(&attempt_span, &err);
                tracing::warn!(request = %req_id, prefill = %p.id(), decode = %d.id(), error = %err, "attempt failed");
                if new_prefill {
                    excluded.push(p.id().clone());
                }
                // A failed prefill may be its KV hand-off to D failing (D dead or cut off from
                // P): D's reservation is aborted anyway, so the retry takes another decode
                // node too when there is one.
                let avoid_d =
                    new_decode || (new_prefill && other_decode(&decodes, &d, &excluded_d));
                if avoid_d {
                    excluded_d.push(d.id().clone());
                    d_slot = None;
                }
                last_err = Some(err);
            }
        }
    }
    Err(last_err.unwrap_or(RouterError::NoNode { role: missing }))
}

/// One attempt on `pair`: reserve, prefill (the decode node watched), the first token, the
/// stream. Every exit goes through `flow`, which says what to abort and what comes next.
pub(super) async fn run_attempt(
    pair: &Pair<'_>,
    flow: &mut Flow,
    req: &GenRequest,
    tx: &mpsc::Sender<GenEvent>,
    start: Instant,
    progress: &mut Progress,
) -> End {
    let router = pair.router;
    let (p, d, req_id) = (pair.p, pair.d, pair.id);
    let cfg = &router.deps.config;
    let deadline = start + Duration::from_secs(cfg.request_timeout_s);
    let prefill_timeout = Duration::from_secs(cfg.prefill_timeout_s);
    let token_timeout = Duration::from_secs(cfg.token_timeout_s);
    let client_limit = send_limit(router);
    let tokens = &req.prompt_token_ids;
    let p_booking = Booking::new(router, p.id());
    // For the `cost` policy's estimates: this request's tokens count against P from its pick
    // (as its booking does) until its prefill call ends.
    let ticket = if pair.here {
        CostTicket::none(router)
    } else {
        CostTicket::new(router, p, tokens.len())
    };

    let target = match super::prefill::reserve(pair, flow, req, tx, deadline, prefill_timeout).await
    {
        Ok(t) => t,
        Err(end) => return end,
    };
    let secret = target.secret.clone();
    let (outcome, mut d_watch) = match super::prefill::prefill(
        pair,
        flow,
        req,
        target,
        (deadline, prefill_timeout),
        (ticket, p_booking),
        progress,
        tx,
    )
    .await
    {
        Ok(x) => x,
        Err(end) => return end,
    };
    let membership = &router.deps.membership;
    let mx = &router.metrics;

    // The first token.
    let mut detok = Detokenizer::new(router.deps.tokenizer.as_ref(), req.sampling.stop.clone());
    let text = match detok.push(&[outcome.first_token_id]) {
        Ok(t) => t,
        Err(e) => {
            flow.on(Event::Prefilled { finished: false });
            let e = detok_err(e);
            return pair
                .fail(
                    flow,
                    Event::DecodeFailed(e.kind()),
                    "output does not detokenize",
                    e,
                )
                .await;
        }
    };
    progress.tokens = 1;
    progress.first_at = Some(Instant::now());
    if req.endpoint != WARM_UP_ENDPOINT {
        mx.observe(m::ROUTER_TTFT_SECONDS, &[], start.elapsed().as_secs_f64());
    }
    let ev = GenEvent::Tokens {
        token_ids: vec![outcome.first_token_id],
        text,
        logprobs: outcome.first_logprob.clone().into_iter().collect(),
    };
    if !send(tx, ev, client_limit).await {
        return pair.gone(flow).await;
    }
    let early = if detok.stopped() {
        Some(FinishReason::Stop)
    } else if req.sampling.max_tokens <= 1 {
        Some(outcome.finish.unwrap_or(FinishReason::Length))
    } else {
        outcome.finish
    };
    if let Some(finish) = early {
        pair.act(
            flow,
            Event::Prefilled { finished: true },
            "finished at the first token",
        )
        .await;
        return finish_text(tx, &mut detok, finish, client_limit).await;
    }
    flow.on(Event::Prefilled { finished: false });

    let call = DecodeCall {
        request_id: req_id,
        secret,
        first_token_id: outcome.first_token_id,
        first_logprob: outcome.first_logprob,
        sampling: req.sampling.clone(),
        prompt_token_ids: tokens.clone(),
        sampler: outcome.sampler,
    };
    let decode_span = tracing::info_span!("decode", otel.kind = "client", node = %d.id());
    let opened = step(
        tx,
        token_timeout,
        deadline,
        (Step::Decode, d.id(), req_id),
        d.client.decode(call),
    )
    .instrument(decode_span.clone())
    .await;
    let mut stream = match opened {
        Ok(s) => s,
        Err(StepErr::ClientGone) => return pair.gone(flow).await,
        Err(StepErr::Failed(e)) => {
            pdnode_telemetry::fail(&decode_span, &e);
            return pair
                .fail(flow, Event::DecodeFailed(e.kind()), "decode failed", e)
                .await;
        }
    };
    // The tokens as they stream from D to the client.
    let stream_span = tracing::info_span!(
        parent: &decode_span,
        "stream",
        tokens = progress.tokens,
        finish_reason = Empty,
    );
    // A decode node draining by migration asks for its streams to move (`migrate` on a
    // chunk): the router parks the request there, forwards what the stream still carries, has
    // another decode node reserve every computed position, has the first push the KV there,
    // and goes on with the new node's stream (docs/runtime-semantics.md, "Live decode
    // migration").
    let mut cur_d = d.clone();
    let mut cur_cap = pair.capability.get().cloned().unwrap_or_default();
    let mut moving: Option<(Worker, MigrateOutcome)> = None;
    // `router.rebalance` may ask this stream to move (not a request D prefilled itself: D's
    // data path keeps it as a colocated engine would, and it does not move).
    let entry = (!pair.here && !is_colocated(d)).then(|| router.streams.register(req_id, d.id()));
    loop {
        let hop = Pair {
            router,
            p,
            d: &cur_d,
            id: req_id,
            here: pair.here,
            d_booking: None,
            capability: OnceLock::from(cur_cap.clone()),
        };
        let asked_to_move = async {
            match &entry {
                Some(e) => e.ask.notify.notified().await,
                None => std::future::pending().await,
            }
        };
        let got = tokio::select! {
            r = step(
                tx,
                token_timeout,
                deadline,
                (Step::Decode, cur_d.id(), req_id),
                async { Ok::<_, crate::error::NodeError>(stream.next().await) },
            )
            .instrument(stream_span.clone()) => Got::Next(r),
            why = node_lost(&mut d_watch) => Got::Next(Err(StepErr::Failed(decode_err(
                cur_d.id(),
                req_id,
                &format!("decode node lost: {why}"),
            )))),
            () = asked_to_move, if moving.is_none() => Got::Move,
        };
        if let Some(e) = &entry {
            e.set_moving(moving.is_some());
        }
        let next = match got {
            Got::Next(n) => n,
            Got::Move => {
                // An ask that came while the stream was moving may name where it is now.
                let to = entry
                    .as_ref()
                    .and_then(|e| e.ask.take())
                    .filter(|w| w.id() != cur_d.id());
                if let Some(to) = to {
                    // Not a candidate while its park is asked either: a second ask then would
                    // move it again right after this move.
                    if let Some(e) = &entry {
                        e.set_moving(true);
                    }
                    moving = park(&hop, req, &[], progress, deadline, Some(to)).await;
                    if let Some(e) = &entry {
                        e.set_moving(moving.is_some());
                    }
                }
                continue;
            }
        };
        let chunk = match next {
            Ok(Some(Ok(c))) => c,
            // The parked stream ended where the park said: on to the new node.
            Ok(None)
                if moving
                    .as_ref()
                    .is_some_and(|(_, o)| o.generated == progress.tokens) =>
            {
                let Some((to, parked)) = moving.take() else {
                    continue;
                };
                let hop_from = hop.d.id().clone();
                let t0 = Instant::now();
                match migrate_to(&hop, flow, req, tx, &to, &parked, deadline).await {
                    Ok((s, cap)) => {
                        tracing::info!(request = %req_id, from = %hop_from, to = %to.id(),
                            tokens = progress.tokens, ms = t0.elapsed().as_millis() as u64,
                            "stream moved to another decode node");
                        router
                            .metrics
                            .inc(m::ROUTER_MIGRATIONS_TOTAL, &[("outcome", "ok")], 1.0);
                        stream = s;
                        cur_cap = cap;
                        if let Some(e) = &entry {
                            e.moved_to(to.id());
                        }
                        if let Some(b) = pair.d_booking {
                            b.move_to(to.id());
                        }
                        d_watch = Some(router.watches.subscribe(&to, Role::Decode, membership));
                        cur_d = to;
                        continue;
                    }
                    Err(end) => {
                        router.metrics.inc(
                            m::ROUTER_MIGRATIONS_TOTAL,
                            &[("outcome", "failed")],
                            1.0,
                        );
                        return end;
                    }
                }
            }
            Err(StepErr::ClientGone) => {
                drop(stream);
                return hop.gone(flow).await;
            }
            failed => {
                drop(stream);
                let (e, reason) = match failed {
                    Err(StepErr::Failed(e)) => (e, "decode stalled"),
                    Ok(Some(Err(source))) => (
                        RouterError::Node {
                            step: Step::Decode,
                            node: cur_d.id().clone(),
                            request: req_id,
                            source,
                        },
                        "decode stream failed",
                    ),
                    _ => (
                        decode_err(
                            cur_d.id(),
                            req_id,
                            "the decode stream ended without a finish reason",
                        ),
                        "decode stream ended early",
                    ),
                };
                pdnode_telemetry::fail(&stream_span, &e);
                return hop
                    .fail(flow, Event::DecodeFailed(e.kind()), reason, e)
                    .await;
            }
        };
        if chunk.migrate {
            if moving.is_none()
                && let Some(m) =
                    park(&hop, req, &decodes_now(router), progress, deadline, None).await
            {
                moving = Some(m);
            }
            continue;
        }
        if chunk.finish == Some(FinishReason::Error) {
            let source = chunk.error.unwrap_or_else(|| {
                crate::error::NodeError::new(ErrorKind::Internal, "decode failed without detail")
            });
            let e = RouterError::Node {
                step: Step::Decode,
                node: cur_d.id().clone(),
                request: req_id,
                source,
            };
            pdnode_telemetry::fail(&stream_span, &e);
            // D answered: wait for its Abort whatever the error says.
            return hop
                .fail(
                    flow,
                    Event::DecodeFailed(ErrorKind::Internal),
                    "decode reported an error",
                    e,
                )
                .await;
        }
        if !chunk.token_ids.is_empty() {
            progress.tokens += chunk.token_ids.len() as u32;
            stream_span.record("tokens", progress.tokens);
            let text = match detok.push(&chunk.token_ids) {
                Ok(t) => t,
                Err(e) => {
                    drop(stream);
                    let e = detok_err(e);
                    return hop
                        .fail(
                            flow,
                            Event::DecodeFailed(e.kind()),
                            "output does not detokenize",
                            e,
                        )
                        .await;
                }
            };
            let ev = GenEvent::Tokens {
                token_ids: chunk.token_ids,
                text,
                logprobs: chunk.logprobs,
            };
            if !send(tx, ev, client_limit).await {
                drop(stream);
                return hop.gone(flow).await;
            }
            if detok.stopped() {
                drop(stream);
                hop.act(flow, Event::StopMatched, "stop string matched")
                    .await;
                return End::Exit(Exit::Done(FinishReason::Stop));
            }
        }
        if let Some(finish) = chunk.finish {
            if let Some(first) = progress.first_at {
                let now = Instant::now();
                router.state.lock().cost.observe_stream(
                    &cur_d,
                    progress.tokens,
                    now.duration_since(first),
                    now,
                );
            }
            stream_span.record("finish_reason", finish.as_str());
            flow.on(Event::Finished);
            return finish_text(tx, &mut detok, finish, client_limit).await;
        }
    }
}

fn detok_err(e: crate::tokenize::TokenizeError) -> RouterError {
    RouterError::Internal {
        message: format!("detokenizing output: {e}"),
    }
}

fn decode_err(node: &NodeId, request: RequestId, msg: &str) -> RouterError {
    RouterError::Node {
        step: Step::Decode,
        node: node.clone(),
        request,
        source: crate::error::NodeError::new(ErrorKind::Unavailable, msg),
    }
}

/// Flushes held-back text and reports the finish.
async fn finish_text(
    tx: &mpsc::Sender<GenEvent>,
    detok: &mut Detokenizer<'_>,
    finish: FinishReason,
    client_limit: Duration,
) -> End {
    let rest = detok.finish();
    if !rest.is_empty() {
        let ev = GenEvent::Tokens {
            token_ids: Vec::new(),
            text: rest,
            logprobs: Vec::new(),
        };
        if !send(tx, ev, client_limit).await {
            return End::Exit(Exit::ClientGone);
        }
    }
    End::Exit(Exit::Done(finish))
}

/// A prefill call (forward pass and KV hand-off) of `pair` ended with `outcome` (`ok`, or the
/// failure's error class), counted for its prefill node. A colocated worker, or a decode node
/// prefilling a request itself (P == D), hands nothing off: not counted.
pub(super) fn count_handoff(pair: &Pair<'_>, outcome: &str) {
    if pair.p.id() == pair.d.id() {
        return;
    }
    pair.router.metrics.inc(
        m::TRANSFER_HANDOFFS_TOTAL,
        &[("node", pair.p.id().as_str()), ("outcome", outcome)],
        1.0,
    );
}
