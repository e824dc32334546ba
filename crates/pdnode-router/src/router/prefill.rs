//! Steps 2a and 2b of a request's flow (`flow.rs`): D reserves the prompt's KV, P prefills it
//! and hands the KV off while the router watches both nodes. Each step's failure goes through
//! the attempt's [`Flow`] (what to abort, whether to retry) and comes back as the attempt's
//! [`End`].

use super::attempt::{Event, Flow};
use super::booking::{Booking, CostTicket};
use super::calls::{StepErr, reserve_kv, step};
use super::flow::{End, Pair, Progress, count_handoff, node_lost};
use super::node_watch::NodeWatch;
use super::warm::WARM_UP_ENDPOINT;
use super::{GenEvent, GenRequest};
use crate::error::{RouterError, Step};
use crate::node::{PrefillCall, PrefillOutcome, ReserveKv};
use pdnode_core::error::Classify;
use pdnode_core::metrics as m;
use pdnode_core::{ErrorKind, KvTarget, Role};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tracing::Instrument;
use tracing::field::Empty;

/// How a watched prefill ended.
enum PrefillEnd {
    Done(Result<PrefillOutcome, StepErr>),
    /// The decode node went away first; why.
    DecodeLost(String),
    /// The prefill node went away (its watch said so) before it answered; why.
    PrefillLost(String),
}

/// D reserves the prompt's KV (bounded by `prefill_timeout` and the request's `deadline`); the
/// target, its capability set on the pair for every later Abort.
pub(super) async fn reserve(
    pair: &Pair<'_>,
    flow: &mut Flow,
    req: &GenRequest,
    tx: &mpsc::Sender<GenEvent>,
    deadline: Instant,
    prefill_timeout: Duration,
) -> Result<KvTarget, End> {
    let (p, d, req_id) = (pair.p, pair.d, pair.id);
    let tokens = &req.prompt_token_ids;
    let reserve = ReserveKv {
        request_id: req_id,
        prefill_node: p.id().clone(),
        prompt_token_ids: tokens.clone(),
        max_tokens: req.sampling.max_tokens,
    };
    let reserve_span = tracing::info_span!("reserve_kv", otel.kind = "client", node = %d.id());
    // Not cut short when the client leaves (`calls::reserve_kv`).
    let reserved = reserve_kv(d, reserve, prefill_timeout, deadline, reserve_span.clone()).await;
    let target = match reserved {
        Ok(t) => t,
        Err(StepErr::ClientGone) => return Err(pair.gone(flow).await),
        Err(StepErr::Failed(e)) => {
            pdnode_telemetry::fail(&reserve_span, &e);
            return Err(pair
                .fail(flow, Event::ReserveFailed(e.kind()), "reserve_kv failed", e)
                .await);
        }
    };
    let _ = pair.capability.set(target.secret.clone());
    flow.on(Event::Reserved);
    if tx.is_closed() {
        return Err(pair.gone(flow).await);
    }
    Ok(target)
}

/// P prefills the prompt and pushes its KV to `target`, the router watching P and D meanwhile
/// (a colocated worker or D prefilling itself is not watched: it answers its own call). P's
/// booking and cost ticket end with the call. Returns what P answered and D's watch, which goes
/// on for the stream.
#[allow(clippy::too_many_arguments)]
pub(super) async fn prefill(
    pair: &Pair<'_>,
    flow: &mut Flow,
    req: &GenRequest,
    target: KvTarget,
    (deadline, prefill_timeout): (Instant, Duration),
    (mut ticket, p_booking): (CostTicket<'_>, Booking<'_>),
    progress: &mut Progress,
    tx: &mpsc::Sender<GenEvent>,
) -> Result<(PrefillOutcome, Option<NodeWatch>), End> {
    let router = pair.router;
    let cfg = &router.deps.config;
    let (p, d, req_id) = (pair.p, pair.d, pair.id);
    let tokens = &req.prompt_token_ids;
    let call = PrefillCall {
        request_id: req_id,
        prompt_token_ids: tokens.clone(),
        sampling: req.sampling.clone(),
        target,
    };
    let prefill_span = tracing::info_span!(
        "prefill",
        otel.kind = "client",
        node = %p.id(),
        transfer_bytes = Empty,
        transfer_us = Empty,
        cached_tokens = Empty,
    );
    ticket.prefill_starts();
    let prefill = step(
        tx,
        prefill_timeout,
        deadline,
        (Step::Prefill, p.id(), req_id),
        p.client.prefill(call),
    )
    .instrument(prefill_span.clone());
    // Both nodes watched while P computes. A colocated worker or a decode node prefilling
    // itself (P == D) is not: it answers its own call, and its channel's keepalive covers a
    // frozen process.
    let membership = &router.deps.membership;
    let watched = p.id() != d.id();
    let mut d_watch = watched.then(|| router.watches.subscribe(d, Role::Decode, membership));
    let mut p_watch = watched.then(|| router.watches.subscribe(p, Role::Prefill, membership));
    let ended = tokio::select! {
        r = prefill => PrefillEnd::Done(r),
        why = node_lost(&mut d_watch) => PrefillEnd::DecodeLost(why),
        why = node_lost(&mut p_watch) => PrefillEnd::PrefillLost(why),
    };
    // Leave P's watch now (the last request to leave stops it); D's goes on for the stream.
    drop(p_watch);
    let outcome = match ended {
        PrefillEnd::Done(Ok(o)) => o,
        PrefillEnd::Done(Err(StepErr::ClientGone)) => return Err(pair.gone(flow).await),
        PrefillEnd::Done(Err(StepErr::Failed(e))) => {
            pdnode_telemetry::fail(&prefill_span, &e);
            count_handoff(pair, e.kind().as_str());
            return Err(pair
                .fail(flow, Event::PrefillFailed(e.kind()), "prefill failed", e)
                .await);
        }
        PrefillEnd::PrefillLost(reason) => {
            let e = RouterError::Node {
                step: Step::Prefill,
                node: p.id().clone(),
                request: req_id,
                source: crate::error::NodeError::new(
                    ErrorKind::Unavailable,
                    format!("prefill node lost: {reason}"),
                ),
            };
            pdnode_telemetry::fail(&prefill_span, &e);
            count_handoff(pair, e.kind().as_str());
            return Err(pair
                .fail(flow, Event::PrefillFailed(e.kind()), "prefill node lost", e)
                .await);
        }
        PrefillEnd::DecodeLost(reason) => {
            // The prefill call is dropped already; Abort frees what it holds on P.
            let e = RouterError::DecodeLost {
                node: d.id().clone(),
                request: req_id,
                reason,
            };
            pdnode_telemetry::fail(&prefill_span, &e);
            count_handoff(pair, e.kind().as_str());
            return Err(pair
                .fail(
                    flow,
                    Event::DecodeLost,
                    "decode node lost during prefill",
                    e,
                )
                .await);
        }
    };
    drop(p_booking);
    // The warm-up's few tokens fill a whole KV block: not a sample of bytes per token.
    if req.endpoint != WARM_UP_ENDPOINT {
        ticket.done(d, outcome.transfer_bytes, outcome.transfer_us);
    }
    count_handoff(pair, "ok");
    if cfg.warm_pairs && p.id() != d.id() {
        router.state.lock().warm.set_warm(p, d);
    }
    let mx = &router.metrics;
    let node = p.id().as_str();
    mx.inc(
        m::TRANSFER_BYTES_TOTAL,
        &[("direction", "sent"), ("node", node)],
        outcome.transfer_bytes as f64,
    );
    mx.observe(
        m::TRANSFER_SECONDS,
        &[("node", node)],
        outcome.transfer_us as f64 / 1e6,
    );
    progress.cached = outcome.cached_tokens;
    prefill_span.record("transfer_bytes", outcome.transfer_bytes);
    prefill_span.record("transfer_us", outcome.transfer_us);
    prefill_span.record("cached_tokens", outcome.cached_tokens);
    drop(prefill_span);
    Ok((outcome, d_watch))
}
