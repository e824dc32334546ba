//! Node liveness watches: while a request waits on a node (its decode node during prefill and
//! during the stream, its prefill node during prefill), is that node still there?
//!
//! One watch per node (role and process start), shared by every request waiting on that node,
//! instead of one probe loop per request: however many requests wait on a node, it gets one
//! membership check every [`MEMBERSHIP_CHECK`] and at most one `Stats` liveness probe every
//! [`PROBE_EVERY`]. A node's `Stats` answers `UNAVAILABLE` once its engine stopped reporting
//! (pdnode-node), so a wedged engine behind a live process is found too.
//!
//! - [`DecodeWatches::subscribe`] joins D's watch, starting its task on the first subscriber.
//!   The returned [`DecodeWatch`] resolves [`DecodeWatch::lost`] once D is judged gone; dropping
//!   it leaves the watch, and the last one to leave stops the task.
//! - D is gone when it restarted (the membership lists its id with another process start),
//!   when a probe finds it unreachable (`Unavailable`), or after [`PROBE_MISSES`] probes in a
//!   row got no answer. Any other answer, even an error, came from a live process. A node that
//!   left the membership (its key is gone: its lease lapsed while etcd was unreachable, or it
//!   deregistered to drain) is probed at once and then every [`PROBE_EVERY`]: it keeps its
//!   requests while it answers, and is gone at its first failed or unanswered probe.
//! - A probe is sent only once some subscriber has waited [`PROBE_EVERY`] (short prefills send
//!   none, however many overlap), then one every [`PROBE_EVERY`], each bounded by the same time.
//! - A verdict ends the watch: every subscriber of that moment sees it, and a request that
//!   picks D afterwards starts a fresh watch (a fresh judgement) as it did before the sharing.
//!
//! [`WatchState`] holds the decisions, synchronous and unit-tested; the task does the I/O.

use crate::error::NodeError;
use crate::membership::{Membership, Worker};
use futures::future::BoxFuture;
use parking_lot::Mutex;
use pdnode_core::{ErrorKind, NodeId, Role};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::AbortHandle;
use tokio::time::{Instant, MissedTickBehavior};

/// How often a watched decode node is checked against the membership.
pub(crate) const MEMBERSHIP_CHECK: Duration = Duration::from_millis(200);
/// From this long into the longest running watched prefill, and then as often, the decode node
/// is probed with `Stats` (each probe bounded by the same time).
pub(crate) const PROBE_EVERY: Duration = Duration::from_secs(1);
/// Probes timing out in a row that count as the decode node being gone.
pub(crate) const PROBE_MISSES: u32 = 3;

const LEFT_MEMBERSHIP: &str = "it left the membership (lease ended, restarted or removed)";

/// What one liveness probe got.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ProbeAnswer {
    /// Stats came back.
    Alive,
    /// An error other than unreachable or timed out (refused, overloaded, ...): a live process.
    Answered(NodeError),
    /// Unreachable: connection refused or reset, engine stopped.
    Unreachable(NodeError),
    /// No answer within [`PROBE_EVERY`].
    NoAnswer,
}

impl ProbeAnswer {
    fn of(
        r: Result<Result<crate::node::NodeStats, NodeError>, tokio::time::error::Elapsed>,
    ) -> Self {
        match r {
            Ok(Ok(_)) => Self::Alive,
            Ok(Err(e)) if e.kind == ErrorKind::Unavailable => Self::Unreachable(e),
            Ok(Err(e)) if e.kind == ErrorKind::Timeout => Self::NoAnswer,
            Ok(Err(e)) => Self::Answered(e),
            Err(_) => Self::NoAnswer,
        }
    }
}

/// The decision state of one node's watch. No I/O.
#[derive(Debug, Default)]
pub(crate) struct WatchState {
    /// Subscriber id -> when it started watching.
    watchers: HashMap<u64, Instant>,
    /// Probes in a row that got no answer.
    misses: u32,
    /// When the last probe started.
    last_probe: Option<Instant>,
    /// The node left the membership (its key is gone: lease lapsed, etcd unreachable or
    /// restarted, or it deregistered) but has not been judged gone: probes decide.
    left: bool,
}

/// What a membership check decides about a watched node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    Keep,
    /// It left the membership: probe it now.
    ProbeNow,
    /// Gone, and why.
    Gone(String),
}

/// What the membership says of a watched node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Seen {
    /// Listed, same process.
    Member,
    /// Listed under the same id with another process start: the watched process is gone.
    Restarted,
    /// Not listed.
    Absent,
}

impl WatchState {
    pub(crate) fn add(&mut self, id: u64, since: Instant) {
        self.watchers.insert(id, since);
    }

    /// Removes a subscriber; whether it was one.
    pub(crate) fn remove(&mut self, id: u64) -> bool {
        self.watchers.remove(&id).is_some()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.watchers.is_empty()
    }

    /// Books what the membership says at `now`: the node is gone (restarted), it just left
    /// the membership and a probe starts now (the caller has none in flight) to decide (a node
    /// that answers keeps its requests: its key may be gone only because its lease lapsed while
    /// etcd was unreachable), or nothing to do.
    pub(crate) fn seen(&mut self, seen: Seen, now: Instant) -> Verdict {
        match seen {
            Seen::Member => {
                self.left = false;
                Verdict::Keep
            }
            Seen::Restarted => Verdict::Gone(format!("{LEFT_MEMBERSHIP}: it restarted")),
            Seen::Absent if self.left => Verdict::Keep,
            Seen::Absent => {
                self.left = true;
                self.last_probe = Some(now);
                Verdict::ProbeNow
            }
        }
    }

    /// Whether a probe starts at `now` (the caller has none in flight): some subscriber has
    /// watched for [`PROBE_EVERY`] (or the node left the membership) and the last probe started
    /// at least that long ago. Books the probe when it does.
    pub(crate) fn start_probe(&mut self, now: Instant) -> bool {
        let Some(oldest) = self.watchers.values().min() else {
            return false;
        };
        let watched_long = self.left || now.saturating_duration_since(*oldest) >= PROBE_EVERY;
        let period_over = self
            .last_probe
            .is_none_or(|t| now.saturating_duration_since(t) >= PROBE_EVERY);
        let start = watched_long && period_over;
        if start {
            self.last_probe = Some(now);
        }
        start
    }

    /// Books a probe's answer; `Some(why)` when the node is gone.
    pub(crate) fn probe_answered(&mut self, a: ProbeAnswer) -> Option<String> {
        match a {
            ProbeAnswer::Alive | ProbeAnswer::Answered(_) => {
                self.misses = 0;
                None
            }
            // Out of the membership and not answering: gone, no more chances.
            ProbeAnswer::Unreachable(e) if self.left => Some(format!(
                "{LEFT_MEMBERSHIP}, and its liveness probe failed: {e}"
            )),
            ProbeAnswer::NoAnswer if self.left => Some(format!(
                "{LEFT_MEMBERSHIP}, and its liveness probe got no answer within {} ms",
                PROBE_EVERY.as_millis()
            )),
            ProbeAnswer::Unreachable(e) => Some(format!("its liveness probe failed: {e}")),
            ProbeAnswer::NoAnswer => {
                self.misses += 1;
                (self.misses >= PROBE_MISSES).then(|| {
                    format!(
                        "{} liveness probes in a row got no answer within {} ms",
                        self.misses,
                        PROBE_EVERY.as_millis()
                    )
                })
            }
        }
    }
}

/// A node process in a role: id and start time (a restart under the same id is another node).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct WatchKey {
    node: NodeId,
    started_at_ms: u64,
    role: Role,
}

impl WatchKey {
    fn of(w: &Worker, role: Role) -> Self {
        Self {
            node: w.id().clone(),
            started_at_ms: w.card.started_at_ms,
            role,
        }
    }
}

/// Index of a role's task counter.
fn slot(role: Role) -> usize {
    usize::from(role == Role::Decode)
}

/// A watched node: its decisions, the channel its verdict goes out on and its task.
struct Entry {
    /// Tells this watch from a later one of the same node.
    generation: u64,
    watch: WatchState,
    lost: watch::Sender<Option<Arc<str>>>,
    task: AbortHandle,
}

#[derive(Default)]
struct Shared {
    nodes: Mutex<HashMap<WatchKey, Entry>>,
    next_id: AtomicU64,
    /// Watch tasks alive (spawned and not yet ended or dropped), of prefill and decode nodes.
    tasks: [AtomicUsize; 2],
}

impl Shared {
    /// Runs `f` on the node's watch if it is still the watch `generation`.
    fn with<T>(
        &self,
        key: &WatchKey,
        generation: u64,
        f: impl FnOnce(&mut WatchState) -> T,
    ) -> Option<T> {
        let mut nodes = self.nodes.lock();
        match nodes.get_mut(key) {
            Some(e) if e.generation == generation => Some(f(&mut e.watch)),
            _ => None,
        }
    }

    /// Ends the watch `generation` with a verdict every subscriber sees.
    fn conclude(&self, key: &WatchKey, generation: u64, why: String) {
        let mut nodes = self.nodes.lock();
        if nodes.get(key).is_some_and(|e| e.generation == generation)
            && let Some(e) = nodes.remove(key)
        {
            e.lost.send_replace(Some(why.into()));
        }
    }
}

/// Counts a watch task from its spawn to its end, however it ends (even dropped unpolled).
struct TaskAlive(Arc<Shared>, usize);

impl TaskAlive {
    fn new(s: &Arc<Shared>, role: Role) -> Self {
        s.tasks[slot(role)].fetch_add(1, Ordering::AcqRel);
        Self(s.clone(), slot(role))
    }
}

impl Drop for TaskAlive {
    fn drop(&mut self) {
        self.0.tasks[self.1].fetch_sub(1, Ordering::AcqRel);
    }
}

/// The router's node watches, one per node (and role) being waited on.
#[derive(Default)]
pub(crate) struct NodeWatches {
    shared: Arc<Shared>,
}

impl NodeWatches {
    /// Joins the watch of node `d` in `role`, starting it if nobody watches it yet. Must be
    /// called inside a tokio runtime.
    pub(crate) fn subscribe(
        &self,
        d: &Worker,
        role: Role,
        membership: &Arc<dyn Membership>,
    ) -> NodeWatch {
        let s = &self.shared;
        let id = s.next_id.fetch_add(1, Ordering::Relaxed);
        let key = WatchKey::of(d, role);
        let now = Instant::now();
        let mut nodes = s.nodes.lock();
        if let Some(e) = nodes.get_mut(&key) {
            e.watch.add(id, now);
            return NodeWatch {
                shared: s.clone(),
                key,
                generation: e.generation,
                id,
                lost: e.lost.subscribe(),
            };
        }
        let generation = id;
        let (tx, rx) = watch::channel(None);
        let mut w = WatchState::default();
        w.add(id, now);
        // The entry goes in under the same lock, before the task can look for it.
        let alive = TaskAlive::new(s, role);
        let task = tokio::spawn(run_watch(
            alive,
            key.clone(),
            generation,
            d.clone(),
            membership.clone(),
        ));
        nodes.insert(
            key.clone(),
            Entry {
                generation,
                watch: w,
                lost: tx,
                task: task.abort_handle(),
            },
        );
        NodeWatch {
            shared: s.clone(),
            key,
            generation,
            id,
            lost: rx,
        }
    }

    /// Watch tasks alive now of nodes in `role`: one per node some request is waiting on.
    pub(crate) fn tasks(&self, role: Role) -> usize {
        self.shared.tasks[slot(role)].load(Ordering::Acquire)
    }
}

/// One request's subscription to a node's watch; dropping it leaves the watch.
pub(crate) struct NodeWatch {
    shared: Arc<Shared>,
    key: WatchKey,
    generation: u64,
    id: u64,
    lost: watch::Receiver<Option<Arc<str>>>,
}

impl NodeWatch {
    /// Resolves only when the node is judged gone; says why.
    pub(crate) async fn lost(&mut self) -> String {
        let why = match self.lost.wait_for(Option::is_some).await {
            Ok(why) => Some(why.as_deref().unwrap_or_default().to_string()),
            Err(_) => None,
        };
        match why {
            Some(why) => why,
            // The watch went away without a verdict (its task cannot end so while subscribed,
            // short of a panic): no news of the node; the caller's own deadlines still hold.
            None => std::future::pending().await,
        }
    }
}

impl Drop for NodeWatch {
    fn drop(&mut self) {
        let mut nodes = self.shared.nodes.lock();
        let last = match nodes.get_mut(&self.key) {
            Some(e) if e.generation == self.generation => {
                e.watch.remove(self.id);
                e.watch.is_empty()
            }
            _ => false,
        };
        if last && let Some(e) = nodes.remove(&self.key) {
            e.task.abort();
        }
    }
}

/// What the membership view says of `d` (same id, same process start) in `role`.
fn seen(m: &dyn Membership, d: &Worker, role: Role) -> Seen {
    let workers = m.workers(role);
    let mut same_id = workers.iter().filter(|w| w.id() == d.id());
    match same_id.next() {
        None => Seen::Absent,
        Some(w) if w.card.started_at_ms == d.card.started_at_ms => Seen::Member,
        Some(_) => Seen::Restarted,
    }
}

fn probe(d: &Worker) -> BoxFuture<'static, ProbeAnswer> {
    let client = d.client.clone();
    Box::pin(
        async move { ProbeAnswer::of(tokio::time::timeout(PROBE_EVERY, client.stats()).await) },
    )
}

/// The in-flight probe's answer; pending while there is none.
async fn answer(p: &mut Option<BoxFuture<'static, ProbeAnswer>>) -> ProbeAnswer {
    match p {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

/// The watch of one decode node: a membership check every [`MEMBERSHIP_CHECK`] and the
/// probes [`WatchState`] asks for, running alongside. Ends with a verdict, or when its entry is
/// gone (the last subscriber left; that also aborts it).
async fn run_watch(
    alive: TaskAlive,
    key: WatchKey,
    generation: u64,
    d: Worker,
    membership: Arc<dyn Membership>,
) {
    let shared = alive.0.clone();
    let _alive = alive;
    let mut tick = tokio::time::interval_at(Instant::now() + MEMBERSHIP_CHECK, MEMBERSHIP_CHECK);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut in_flight: Option<BoxFuture<'static, ProbeAnswer>> = None;
    loop {
        let verdict = tokio::select! {
            _ = tick.tick() => {
                let now = Instant::now();
                let s = seen(membership.as_ref(), &d, key.role);
                match shared.with(&key, generation, |w| w.seen(s, now)) {
                    None => return,
                    Some(Verdict::Gone(why)) => Some(why),
                    Some(Verdict::ProbeNow) => {
                        tracing::info!(node = %d.id(), role = key.role.as_str(),
                            "node left the membership; probing it before giving its requests up");
                        in_flight = Some(probe(&d));
                        None
                    }
                    Some(Verdict::Keep) => None,
                }
            }
            a = answer(&mut in_flight) => {
                in_flight = None;
                if let ProbeAnswer::Answered(e) = &a {
                    tracing::debug!(node = %d.id(), error = %e, "liveness probe answered with an error");
                }
                match shared.with(&key, generation, |w| w.probe_answered(a)) {
                    Some(v) => v,
                    None => return,
                }
            }
        };
        if let Some(why) = verdict {
            tracing::info!(node = %d.id(), role = key.role.as_str(), reason = %why, "node lost");
            shared.conclude(&key, generation, why);
            return;
        }
        if in_flight.is_none() {
            match shared.with(&key, generation, |w| w.start_probe(Instant::now())) {
                None => return,
                Some(true) => in_flight = Some(probe(&d)),
                Some(false) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(kind: ErrorKind) -> NodeError {
        NodeError::new(kind, "x")
    }

    #[test]
    fn probes_start_once_a_watcher_waited_a_period_then_one_per_period() {
        let t0 = Instant::now();
        let mut w = WatchState::default();
        assert!(!w.start_probe(t0 + PROBE_EVERY), "nobody watches: no probe");
        w.add(1, t0);
        assert!(
            !w.start_probe(t0 + PROBE_EVERY / 2),
            "a short wait sends none"
        );
        // Many later watchers change nothing.
        for i in 2..50 {
            w.add(i, t0 + PROBE_EVERY / 2);
        }
        assert!(w.start_probe(t0 + PROBE_EVERY));
        assert!(!w.start_probe(t0 + PROBE_EVERY), "one per period");
        assert!(!w.start_probe(t0 + PROBE_EVERY * 3 / 2));
        assert!(w.start_probe(t0 + PROBE_EVERY * 2));
        // The old watcher leaves: the young ones have waited long enough by now.
        assert!(w.remove(1));
        assert!(!w.remove(1));
        assert!(w.start_probe(t0 + PROBE_EVERY * 3));
        for i in 2..50 {
            w.remove(i);
        }
        assert!(w.is_empty());
        assert!(!w.start_probe(t0 + PROBE_EVERY * 10));
    }

    #[test]
    fn young_watchers_alone_send_no_probe() {
        let t0 = Instant::now();
        let mut w = WatchState::default();
        // Overlapping short prefills: each leaves before it waited a period.
        for i in 0..20u64 {
            let at = t0 + Duration::from_millis(100 * i);
            w.add(i, at);
            if i >= 3 {
                w.remove(i - 3);
            }
            assert!(!w.start_probe(at), "at {i}");
        }
    }

    #[test]
    fn verdicts_follow_the_documented_rules() {
        let mut w = WatchState::default();
        assert_eq!(w.probe_answered(ProbeAnswer::NoAnswer), None);
        assert_eq!(w.probe_answered(ProbeAnswer::NoAnswer), None);
        // An answer, even an error, resets the count.
        assert_eq!(
            w.probe_answered(ProbeAnswer::Answered(err(ErrorKind::Overloaded))),
            None
        );
        assert_eq!(w.probe_answered(ProbeAnswer::NoAnswer), None);
        assert_eq!(w.probe_answered(ProbeAnswer::Alive), None);
        for _ in 1..PROBE_MISSES {
            assert_eq!(w.probe_answered(ProbeAnswer::NoAnswer), None);
        }
        let why = w.probe_answered(ProbeAnswer::NoAnswer).expect("gone");
        assert!(why.contains("3 liveness probes in a row"), "{why}");

        let mut w = WatchState::default();
        let why = w
            .probe_answered(ProbeAnswer::Unreachable(err(ErrorKind::Unavailable)))
            .expect("gone");
        assert!(why.contains("liveness probe failed"), "{why}");
    }

    #[test]
    fn answers_are_classified_by_kind() {
        use crate::node::NodeStats;
        let ok: Result<NodeStats, NodeError> = Ok(NodeStats::default());
        assert_eq!(ProbeAnswer::of(Ok(ok)), ProbeAnswer::Alive);
        assert!(matches!(
            ProbeAnswer::of(Ok(Err(err(ErrorKind::Unavailable)))),
            ProbeAnswer::Unreachable(_)
        ));
        assert_eq!(
            ProbeAnswer::of(Ok(Err(err(ErrorKind::Timeout)))),
            ProbeAnswer::NoAnswer
        );
        assert!(matches!(
            ProbeAnswer::of(Ok(Err(err(ErrorKind::Internal)))),
            ProbeAnswer::Answered(_)
        ));
    }

    #[test]
    fn a_node_out_of_the_membership_keeps_its_requests_while_it_answers() {
        let t0 = Instant::now();
        let mut w = WatchState::default();
        w.add(1, t0);
        assert_eq!(w.seen(Seen::Member, t0), Verdict::Keep);
        // It left: one probe at once (even though nobody waited a period yet).
        assert_eq!(w.seen(Seen::Absent, t0), Verdict::ProbeNow);
        assert_eq!(
            w.seen(Seen::Absent, t0),
            Verdict::Keep,
            "one probe, not one per check"
        );
        assert_eq!(w.probe_answered(ProbeAnswer::Alive), None);
        // Then one probe a period while it stays out.
        assert!(!w.start_probe(t0 + PROBE_EVERY / 2));
        assert!(w.start_probe(t0 + PROBE_EVERY));
        assert_eq!(
            w.probe_answered(ProbeAnswer::Answered(err(ErrorKind::Overloaded))),
            None
        );
        // Back in the membership: probes as before (none missed counts against it).
        assert_eq!(w.seen(Seen::Member, t0 + PROBE_EVERY), Verdict::Keep);
        assert_eq!(w.probe_answered(ProbeAnswer::NoAnswer), None);
        // Out again and silent once: gone at once, not after PROBE_MISSES.
        let mut out = WatchState::default();
        out.add(1, t0);
        assert_eq!(out.seen(Seen::Absent, t0), Verdict::ProbeNow);
        let why = out.probe_answered(ProbeAnswer::NoAnswer).unwrap();
        assert!(
            why.contains("left the membership") && why.contains("no answer"),
            "{why}"
        );
        let mut gone = WatchState::default();
        gone.add(1, t0);
        assert_eq!(gone.seen(Seen::Absent, t0), Verdict::ProbeNow);
        let why = gone
            .probe_answered(ProbeAnswer::Unreachable(err(ErrorKind::Unavailable)))
            .unwrap();
        assert!(why.contains("probe failed"), "{why}");
        // Restarted under the same id: gone without a probe.
        let mut r = WatchState::default();
        r.add(1, t0);
        assert!(matches!(
            r.seen(Seen::Restarted, t0),
            Verdict::Gone(why) if why.contains("restarted")
        ));
    }
}
