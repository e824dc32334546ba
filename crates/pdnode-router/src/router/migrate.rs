//! Moving a running stream to another decode node, the router's part (docs/runtime-semantics.md,
//! "Live decode migration"): the stream loop in `flow.rs` calls [`park`] when its decode node
//! asks for a move (draining) or the rebalancer does, and [`migrate_to`] once the parked
//! stream's last tokens went to the client.

use super::attempt::{Event, Flow};
use super::calls::{StepErr, abort_as, bounded, reserve_kv, step};
use super::flow::{End, Pair, Progress};
use super::{GenEvent, GenRequest, Router, SUSPECT_FOR};
use crate::error::Step;
use crate::membership::Worker;
use crate::membership::{candidates, is_colocated};
use crate::node::{DecodeCall, MigrateCall, MigrateOutcome, ReserveKv};
use pdnode_core::error::Classify;
use pdnode_core::metrics as m;
use pdnode_core::{ErrorKind, Role};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// What woke a stream's loop: the stream (or its node's watch), or a rebalancing ask.
pub(super) enum Got<T> {
    Next(T),
    Move,
}

/// The decode candidates now (a migration's destinations).
pub(super) fn decodes_now(router: &Router) -> Vec<Worker> {
    candidates(router.deps.membership.as_ref()).1
}

/// A decode node asked to move this stream: picks another decode node (the decode policy,
/// this one left out) and parks the request here. `None`: nowhere to go, or the park was
/// refused (the request ends or is not decoding now); the stream goes on where it is.
pub(super) async fn park(
    hop: &Pair<'_>,
    req: &GenRequest,
    decodes: &[Worker],
    progress: &Progress,
    deadline: Instant,
    to: Option<Worker>,
) -> Option<(Worker, MigrateOutcome)> {
    let router = hop.router;
    let from = hop.d.id().clone();
    let to = to.filter(|w| w.id() != &from).or_else(|| {
        let picked = router.state.lock().pick_for(
            Role::Decode,
            decodes,
            None,
            &req.prompt_token_ids,
            req.routing_key.as_deref(),
            std::slice::from_ref(&from),
            Instant::now(),
        );
        picked.map(|i| decodes[i].clone())
    });
    let Some(to) = to else {
        tracing::warn!(request = %hop.id, node = %from, "asked to move a stream, but no other decode node is there");
        router
            .metrics
            .inc(m::ROUTER_MIGRATIONS_TOTAL, &[("outcome", "nowhere")], 1.0);
        return None;
    };
    if is_colocated(&to) {
        return None;
    }
    let limit = Duration::from_secs(router.deps.config.token_timeout_s);
    let call = MigrateCall {
        request_id: hop.id,
        capability: hop.capability.get().cloned().unwrap_or_default(),
        target: None,
    };
    let parked = bounded(
        limit,
        deadline,
        (Step::Migrate, &from, hop.id),
        hop.d.client.migrate(call),
    )
    .await;
    // The node counts its own prompt and output: after an earlier move its prompt holds the
    // output before that move. What the router checks and uses is the request's: its prompt,
    // then every output token so far.
    let prompt = &req.prompt_token_ids;
    match parked {
        Ok(mut o)
            if o.token_ids.len() > prompt.len()
                && o.token_ids[..prompt.len()] == prompt[..]
                && (o.token_ids.len() - prompt.len()) as u32 >= progress.tokens =>
        {
            o.generated = (o.token_ids.len() - prompt.len()) as u32;
            Some((to, o))
        }
        Ok(o) => {
            // Not the request this router streams: leave it (the stream ends, and fails).
            tracing::warn!(request = %hop.id, node = %from, tokens = o.token_ids.len(),
                generated = o.generated, "a park answered tokens that do not match the request");
            None
        }
        Err(e) => {
            let e = match e {
                StepErr::Failed(e) => e.to_string(),
                StepErr::ClientGone => "the client left".into(),
            };
            tracing::info!(request = %hop.id, node = %from, error = %e, "not moved: the park was refused");
            router
                .metrics
                .inc(m::ROUTER_MIGRATIONS_TOTAL, &[("outcome", "refused")], 1.0);
            None
        }
    }
}

/// The request is parked on `hop`'s decode node and every token it made went to the client:
/// `to` reserves every computed position, `hop`'s node pushes the KV there, and `to` streams
/// the rest. Any failure aborts both and ends the request (its tokens went out: no retry).
pub(super) async fn migrate_to(
    hop: &Pair<'_>,
    flow: &mut Flow,
    req: &GenRequest,
    tx: &mpsc::Sender<GenEvent>,
    to: &Worker,
    parked: &MigrateOutcome,
    deadline: Instant,
) -> Result<(crate::node::DecodeStream, Vec<u8>), End> {
    let router = hop.router;
    let cfg = &router.deps.config;
    let id = hop.id;
    let n = parked.token_ids.len();
    let prompt = parked.token_ids[..n - 1].to_vec();
    let first = parked.token_ids[n - 1];
    // The new node counts the token it starts from as its first output.
    let mut sampling = req.sampling.clone();
    sampling.max_tokens = sampling.max_tokens.saturating_sub(parked.generated) + 1;
    let reserve = ReserveKv {
        request_id: id,
        prefill_node: hop.d.id().clone(),
        prompt_token_ids: prompt.clone(),
        max_tokens: sampling.max_tokens,
    };
    let prefill_limit = Duration::from_secs(cfg.prefill_timeout_s);
    // A reservation answered past the bound is aborted when it lands (`calls::reserve_kv`).
    let span = tracing::info_span!("reserve_kv", otel.kind = "client", node = %to.id());
    let target = match reserve_kv(to, reserve, prefill_limit, deadline, span).await {
        Ok(t) => t,
        Err(e) => return Err(fail_move(hop, flow, e, Some(to)).await),
    };
    let cap = target.secret.clone();
    let gone = |cap: Vec<u8>| async move {
        abort_as(
            router,
            to,
            id,
            cap,
            "migration failed",
            super::attempt::Abort::Wait,
        )
        .await;
    };
    let call = MigrateCall {
        request_id: id,
        capability: hop.capability.get().cloned().unwrap_or_default(),
        target: Some(target),
    };
    if let Err(e) = bounded(
        prefill_limit,
        deadline,
        (Step::Migrate, hop.d.id(), id),
        hop.d.client.migrate(call),
    )
    .await
    {
        gone(cap).await;
        return Err(fail_move(hop, flow, e, None).await);
    }
    let call = DecodeCall {
        request_id: id,
        secret: cap.clone(),
        first_token_id: first,
        first_logprob: None,
        sampling,
        prompt_token_ids: prompt,
        sampler: parked.sampler,
    };
    match step(
        tx,
        Duration::from_secs(cfg.token_timeout_s),
        deadline,
        (Step::Decode, to.id(), id),
        to.client.decode(call),
    )
    .await
    {
        Ok(s) => Ok((s, cap)),
        Err(e) => {
            gone(cap).await;
            Err(fail_move(hop, flow, e, Some(to)).await)
        }
    }
}

/// A migration step failed: the request ends (aborted on the node it was parked on). `at_new`:
/// the step was the new node's (its reservation or its decode); the parked node is then not
/// blamed, and the new node is suspected when it did not answer (`Unavailable`, `Timeout`).
async fn fail_move(hop: &Pair<'_>, flow: &mut Flow, e: StepErr, at_new: Option<&Worker>) -> End {
    match e {
        StepErr::ClientGone => hop.gone(flow).await,
        StepErr::Failed(e) => {
            let event = match at_new {
                None => Event::DecodeFailed(e.kind()),
                Some(to) => {
                    if matches!(e.kind(), ErrorKind::Unavailable | ErrorKind::Timeout) {
                        hop.router
                            .state
                            .lock()
                            .suspect(to.id(), Instant::now() + SUSPECT_FOR);
                    }
                    Event::MoveFailed
                }
            };
            hop.fail(flow, event, "migration failed", e).await
        }
    }
}
