//! The router's calls to nodes and to the client, each bounded: a node call by its step limit
//! and the request's deadline (and the client leaving), an event handed to the client by
//! `router.client_send_timeout_s`, an `Abort` by [`ABORT_TIMEOUT`], waited for or detached.

use super::attempt::Abort;
use super::{GenEvent, Router, SUSPECT_FOR};
use crate::error::{RouterError, Step};
use crate::membership::Worker;
use pdnode_core::{NodeId, RequestId};
use std::future::Future;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Longest wait for a node to acknowledge an Abort.
const ABORT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a `ReserveKv` answer is still waited for after its step's bound, to abort what it
/// reserved with its capability; past it the reservation's lease frees it.
const LATE_RESERVATION_WAIT: Duration = Duration::from_secs(60);

/// How a bounded step ended other than with its value.
pub(super) enum StepErr {
    ClientGone,
    Failed(RouterError),
}

/// Awaits `fut` bounded by `limit` and the request deadline, or notices the client left.
pub(super) async fn step<T, E>(
    tx: &mpsc::Sender<GenEvent>,
    limit: Duration,
    deadline: Instant,
    what: (Step, &NodeId, RequestId),
    fut: impl Future<Output = Result<T, E>>,
) -> Result<T, StepErr>
where
    E: Into<crate::error::NodeError>,
{
    tokio::select! {
        biased;
        _ = tx.closed() => Err(StepErr::ClientGone),
        r = bounded(limit, deadline, what, fut) => r,
    }
}

/// Awaits `fut` bounded by `limit` and the request deadline, whether the client is there or
/// not.
pub(super) async fn bounded<T, E>(
    limit: Duration,
    deadline: Instant,
    what: (Step, &NodeId, RequestId),
    fut: impl Future<Output = Result<T, E>>,
) -> Result<T, StepErr>
where
    E: Into<crate::error::NodeError>,
{
    let left = deadline.saturating_duration_since(Instant::now());
    let limit = limit.min(left);
    let (step, node, request) = what;
    match tokio::time::timeout(limit, fut).await {
        Err(_) => Err(StepErr::Failed(RouterError::Timeout {
            step,
            node: node.clone(),
            request,
            after_ms: limit.as_millis() as u64,
        })),
        Ok(Err(e)) => Err(StepErr::Failed(RouterError::Node {
            step,
            node: node.clone(),
            request,
            source: e.into(),
        })),
        Ok(Ok(v)) => Ok(v),
    }
}

/// The client's deadline to take one event (`router.client_send_timeout_s`).
pub(super) fn send_limit(router: &Router) -> Duration {
    Duration::from_secs(router.deps.config.client_send_timeout_s)
}

/// Hands `ev` to the client within `limit`; false when it is gone or did not take the event in
/// time (it stopped reading: treated as gone, so its request is aborted and its slot freed).
pub(super) async fn send(tx: &mpsc::Sender<GenEvent>, ev: GenEvent, limit: Duration) -> bool {
    match tx.send_timeout(ev, limit).await {
        Ok(()) => true,
        Err(mpsc::error::SendTimeoutError::Closed(_)) => false,
        Err(mpsc::error::SendTimeoutError::Timeout(_)) => {
            tracing::warn!(
                after_ms = limit.as_millis() as u64,
                "the client stopped reading; treating it as gone"
            );
            false
        }
    }
}

/// Aborts `id` on `w` with the request's KV capability (empty before `ReserveKv` answered: the
/// decode node then cancels only a reservation still being made).
pub(super) async fn abort(w: &Worker, id: RequestId, capability: Vec<u8>, reason: &str) {
    let call = w.client.abort(id, capability, reason.to_string());
    match tokio::time::timeout(ABORT_TIMEOUT, call).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::warn!(request = %id, node = %w.id(), error = %e, "abort failed"),
        Err(_) => tracing::warn!(request = %id, node = %w.id(), "abort timed out"),
    }
}

/// Aborts on a node that may be gone, without waiting for the answer.
pub(super) fn abort_detached(w: &Worker, id: RequestId, capability: Vec<u8>, reason: &'static str) {
    let w = w.clone();
    tokio::spawn(async move { abort(&w, id, capability, reason).await });
}

/// Aborts `id` on `w` the way `how` says.
pub(super) async fn abort_as(
    router: &Router,
    w: &Worker,
    id: RequestId,
    capability: Vec<u8>,
    reason: &'static str,
    how: Abort,
) {
    match how {
        Abort::No => {}
        Abort::Wait => abort(w, id, capability, reason).await,
        Abort::Detach => abort_detached(w, id, capability, reason),
        Abort::DetachSuspect => {
            router
                .state
                .lock()
                .suspect(w.id(), Instant::now() + SUSPECT_FOR);
            abort_detached(w, id, capability, reason);
        }
    }
}

/// `ReserveKv` on `d`, bounded like any step (not cut short when the client leaves: the answer
/// carries the KV capability every `Abort` of the reservation presents, so the caller waits for
/// it and aborts with it). The call runs as its own task: past its bound the caller moves on,
/// and an answer still on its way is aborted with its capability when it lands
/// ([`abort_late_reservation`]), so a reservation made too late is never left to its lease.
pub(super) async fn reserve_kv(
    d: &Worker,
    reserve: crate::node::ReserveKv,
    limit: Duration,
    deadline: Instant,
    span: tracing::Span,
) -> Result<crate::node::KvTarget, StepErr> {
    use tracing::Instrument;
    let id = reserve.request_id;
    let mut call = {
        let d = d.clone();
        tokio::spawn(async move { d.client.reserve_kv(reserve).await }.instrument(span.clone()))
    };
    let reserved = bounded(limit, deadline, (Step::ReserveKv, d.id(), id), async {
        (&mut call).await.unwrap_or_else(|e| {
            Err(crate::error::NodeError::new(
                pdnode_core::ErrorKind::Internal,
                format!("the ReserveKv call's task ended: {e}"),
            ))
        })
    })
    .instrument(span)
    .await;
    if matches!(reserved, Err(StepErr::Failed(RouterError::Timeout { .. }))) {
        abort_late_reservation(d, id, call);
    }
    reserved
}

/// A `ReserveKv` call past its step's bound: the request went on without it, but the decode
/// node may have made the reservation (its answer on the way), and an `Abort` without the
/// capability the answer carries is refused. Waits for the answer (at most
/// [`LATE_RESERVATION_WAIT`]) and aborts what it reserved, with its capability.
fn abort_late_reservation(
    d: &Worker,
    id: RequestId,
    call: tokio::task::JoinHandle<Result<crate::node::KvTarget, crate::error::NodeError>>,
) {
    let d = d.clone();
    tokio::spawn(async move {
        if let Ok(Ok(Ok(t))) = tokio::time::timeout(LATE_RESERVATION_WAIT, call).await {
            tracing::debug!(request = %id, node = %d.id(),
                "a reservation answered past its bound: aborting it with its capability");
            abort(&d, id, t.secret, "reservation answered past its bound").await;
        }
    });
}
