//! The in-process registry: etcd's semantics (revisions, leases that expire on tokio time,
//! create-if-absent, watch from a revision) in a mutex. Used by the all-in-one node and tests.

use crate::store::{CreateOutcome, LeaseId, RawEvent, RawKind, RawList, Store, WatchStream};
use crate::{
    MembershipWatch, Registration, Registry, RegistryError, RegistryOptions, Snapshot,
    list_cluster, registration, timed, watch,
};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use pdnode_core::{NodeCard, NodeId, Role};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;
use tokio::sync::broadcast;
use tokio::time::Instant;

/// Events kept for watches that start from an older revision.
const HISTORY: usize = 10_000;
/// How often expired leases are reaped.
const REAP_EVERY: Duration = Duration::from_millis(50);

/// The in-process [`Registry`]. Cheap to clone: clones share one store.
#[derive(Clone)]
pub struct MemoryRegistry {
    store: Arc<MemoryStore>,
    opts: RegistryOptions,
}

impl std::fmt::Debug for MemoryRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegistry")
            .field("opts", &self.opts)
            .finish()
    }
}

impl MemoryRegistry {
    pub fn new(opts: RegistryOptions) -> Self {
        Self {
            store: Arc::new(MemoryStore::default()),
            opts,
        }
    }

    /// Simulates a registry outage (`false`): every call fails with `Unavailable` and open
    /// watches break; leases keep expiring meanwhile, as they would behind a partition.
    pub fn set_available(&self, available: bool) {
        let mut g = self.store.lock();
        g.available = available;
        if !available {
            let _ = g.events.send(Msg::Broken);
        }
    }
}

impl Registry for MemoryRegistry {
    fn register(&self, card: NodeCard) -> BoxFuture<'_, Result<Registration, RegistryError>> {
        async move {
            self.store.start_reaper();
            registration::register(self.store.clone(), self.opts, card).await
        }
        .boxed()
    }

    fn list(&self, cluster: &str) -> BoxFuture<'_, Result<Snapshot, RegistryError>> {
        let cluster = cluster.to_string();
        async move { list_cluster(&*self.store, &cluster).await }.boxed()
    }

    fn watch(&self, cluster: &str) -> BoxFuture<'_, Result<MembershipWatch, RegistryError>> {
        let cluster = cluster.to_string();
        async move { watch::start(self.store.clone(), self.opts, &cluster).await }.boxed()
    }

    fn deregister(
        &self,
        cluster: &str,
        role: Role,
        id: &NodeId,
    ) -> BoxFuture<'_, Result<bool, RegistryError>> {
        let key = pdnode_core::card::node_key(cluster, role, id);
        timed("delete", self.opts.call_timeout, self.store.delete(key)).boxed()
    }
}

#[derive(Debug, Clone)]
enum Msg {
    Event(RawEvent),
    Broken,
}

struct Entry {
    value: Vec<u8>,
    lease: LeaseId,
}

struct LeaseState {
    ttl: Duration,
    expires: Instant,
    keys: BTreeSet<String>,
}

struct Inner {
    kvs: BTreeMap<String, Entry>,
    leases: HashMap<LeaseId, LeaseState>,
    revision: i64,
    next_lease: LeaseId,
    history: VecDeque<RawEvent>,
    events: broadcast::Sender<Msg>,
    available: bool,
    reaper_started: bool,
}

impl Default for Inner {
    fn default() -> Self {
        Self {
            kvs: BTreeMap::new(),
            leases: HashMap::new(),
            revision: 1,
            next_lease: 0x1000,
            history: VecDeque::new(),
            events: broadcast::channel(4096).0,
            available: true,
            reaper_started: false,
        }
    }
}

impl Inner {
    fn emit(&mut self, kind: RawKind, key: String, value: Vec<u8>) {
        self.revision += 1;
        let ev = RawEvent {
            kind,
            key,
            value,
            revision: self.revision,
        };
        if self.history.len() == HISTORY {
            self.history.pop_front();
        }
        self.history.push_back(ev.clone());
        let _ = self.events.send(Msg::Event(ev));
    }

    fn remove_key(&mut self, key: &str) -> bool {
        match self.kvs.remove(key) {
            Some(e) => {
                if let Some(l) = self.leases.get_mut(&e.lease) {
                    l.keys.remove(key);
                }
                self.emit(RawKind::Delete, key.to_string(), Vec::new());
                true
            }
            None => false,
        }
    }

    fn drop_lease(&mut self, lease: LeaseId) -> bool {
        match self.leases.remove(&lease) {
            Some(l) => {
                for k in l.keys {
                    if self.kvs.get(&k).is_some_and(|e| e.lease == lease) {
                        self.kvs.remove(&k);
                        self.emit(RawKind::Delete, k, Vec::new());
                    }
                }
                true
            }
            None => false,
        }
    }

    fn expire(&mut self, now: Instant) {
        let dead: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, l)| l.expires <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in dead {
            self.drop_lease(id);
        }
    }

    fn set(&mut self, key: String, value: Vec<u8>, lease: LeaseId) {
        if let Some(old) = self.kvs.get(&key)
            && old.lease != lease
            && let Some(l) = self.leases.get_mut(&old.lease)
        {
            l.keys.remove(&key);
        }
        if let Some(l) = self.leases.get_mut(&lease) {
            l.keys.insert(key.clone());
        }
        self.kvs.insert(
            key.clone(),
            Entry {
                value: value.clone(),
                lease,
            },
        );
        self.emit(RawKind::Put, key, value);
    }
}

#[derive(Default)]
pub(crate) struct MemoryStore {
    inner: Mutex<Inner>,
}

impl MemoryStore {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent data (every mutation is one step).
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Locks, checks availability and reaps expired leases.
    fn op(&self) -> Result<MutexGuard<'_, Inner>, RegistryError> {
        let mut g = self.lock();
        if !g.available {
            return Err(RegistryError::Unavailable {
                endpoints: "memory".into(),
                reason: "simulated outage".into(),
            });
        }
        g.expire(Instant::now());
        Ok(g)
    }

    fn start_reaper(self: &Arc<Self>) {
        let mut g = self.lock();
        if g.reaper_started {
            return;
        }
        g.reaper_started = true;
        drop(g);
        let weak: Weak<Self> = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(REAP_EVERY).await;
                let Some(s) = weak.upgrade() else { return };
                s.lock().expire(Instant::now());
            }
        });
    }
}

impl Store for MemoryStore {
    fn grant(&self, ttl_s: u64) -> BoxFuture<'_, Result<LeaseId, RegistryError>> {
        async move {
            let mut g = self.op()?;
            let id = g.next_lease;
            g.next_lease += 1;
            let ttl = Duration::from_secs(ttl_s);
            g.leases.insert(
                id,
                LeaseState {
                    ttl,
                    expires: Instant::now() + ttl,
                    keys: BTreeSet::new(),
                },
            );
            Ok(id)
        }
        .boxed()
    }

    fn keepalive(&self, lease: LeaseId) -> BoxFuture<'_, Result<(), RegistryError>> {
        async move {
            let mut g = self.op()?;
            match g.leases.get_mut(&lease) {
                Some(l) => {
                    l.expires = Instant::now() + l.ttl;
                    Ok(())
                }
                None => Err(RegistryError::LeaseNotFound { lease }),
            }
        }
        .boxed()
    }

    fn revoke(&self, lease: LeaseId) -> BoxFuture<'_, Result<(), RegistryError>> {
        async move {
            let mut g = self.op()?;
            if g.drop_lease(lease) {
                Ok(())
            } else {
                Err(RegistryError::LeaseNotFound { lease })
            }
        }
        .boxed()
    }

    fn create(
        &self,
        key: String,
        value: Vec<u8>,
        lease: LeaseId,
        takeover: Option<LeaseId>,
    ) -> BoxFuture<'_, Result<CreateOutcome, RegistryError>> {
        async move {
            let mut g = self.op()?;
            if !g.leases.contains_key(&lease) {
                return Err(RegistryError::LeaseNotFound { lease });
            }
            if let Some(e) = g.kvs.get(&key)
                && Some(e.lease) != takeover
            {
                return Ok(CreateOutcome::Exists {
                    holder: holder_of(&e.value, e.lease),
                });
            }
            g.set(key, value, lease);
            Ok(CreateOutcome::Created)
        }
        .boxed()
    }

    fn put(
        &self,
        key: String,
        value: Vec<u8>,
        lease: LeaseId,
    ) -> BoxFuture<'_, Result<(), RegistryError>> {
        async move {
            let mut g = self.op()?;
            if !g.leases.contains_key(&lease) {
                return Err(RegistryError::LeaseNotFound { lease });
            }
            g.set(key, value, lease);
            Ok(())
        }
        .boxed()
    }

    fn delete(&self, key: String) -> BoxFuture<'_, Result<bool, RegistryError>> {
        async move { Ok(self.op()?.remove_key(&key)) }.boxed()
    }

    fn list(&self, prefix: String) -> BoxFuture<'_, Result<RawList, RegistryError>> {
        async move {
            let g = self.op()?;
            Ok(RawList {
                kvs: g
                    .kvs
                    .range(prefix.clone()..)
                    .take_while(|(k, _)| k.starts_with(&prefix))
                    .map(|(k, e)| (k.clone(), e.value.clone()))
                    .collect(),
                revision: g.revision,
            })
        }
        .boxed()
    }

    fn watch(
        &self,
        prefix: String,
        from_revision: i64,
    ) -> BoxFuture<'_, Result<WatchStream, RegistryError>> {
        async move {
            let g = self.op()?;
            let oldest = g.history.front().map_or(g.revision + 1, |e| e.revision);
            if from_revision < oldest && g.history.len() == HISTORY {
                return Err(RegistryError::Compacted {
                    revision: from_revision,
                });
            }
            let backlog: Vec<RawEvent> = g
                .history
                .iter()
                .filter(|e| e.revision >= from_revision && e.key.starts_with(&prefix))
                .cloned()
                .collect();
            let rx = g.events.subscribe();
            drop(g);
            let first = futures::stream::iter(if backlog.is_empty() {
                None
            } else {
                Some(Ok(backlog))
            });
            let live = futures::stream::unfold(Some(rx), move |rx| {
                let prefix = prefix.clone();
                async move {
                    let mut rx = rx?;
                    loop {
                        match rx.recv().await {
                            Ok(Msg::Event(e)) if e.revision >= from_revision => {
                                if e.key.starts_with(&prefix) {
                                    return Some((Ok(vec![e]), Some(rx)));
                                }
                            }
                            Ok(Msg::Event(_)) => {}
                            Ok(Msg::Broken) => {
                                return Some((
                                    Err(RegistryError::Unavailable {
                                        endpoints: "memory".into(),
                                        reason: "simulated outage".into(),
                                    }),
                                    None,
                                ));
                            }
                            Err(broadcast::error::RecvError::Lagged(n)) => {
                                return Some((
                                    Err(RegistryError::Backend {
                                        op: "watch",
                                        reason: format!("watcher lagged {n} events behind"),
                                    }),
                                    None,
                                ));
                            }
                            Err(broadcast::error::RecvError::Closed) => return None,
                        }
                    }
                }
            });
            Ok(first.chain(live).boxed())
        }
        .boxed()
    }
}

fn holder_of(value: &[u8], lease: LeaseId) -> String {
    match NodeCard::from_json(value) {
        Ok(c) => format!(
            "lease {lease:x}, grpc {}, started at {} ms",
            c.addresses.grpc, c.started_at_ms
        ),
        Err(_) => format!("lease {lease:x}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_lease_that_is_not_kept_alive_expires_with_its_keys() {
        let s = Arc::new(MemoryStore::default());
        s.start_reaper();
        let lease = s.grant(2).await.unwrap();
        let k = "pdnode/v1/c/nodes/decode/d0".to_string();
        assert_eq!(
            s.create(k.clone(), b"{}".to_vec(), lease, None)
                .await
                .unwrap(),
            CreateOutcome::Created
        );
        let other = s.grant(2).await.unwrap();
        assert!(matches!(
            s.create(k.clone(), b"{}".to_vec(), other, None)
                .await
                .unwrap(),
            CreateOutcome::Exists { .. }
        ));
        tokio::time::sleep(Duration::from_millis(1500)).await;
        s.keepalive(lease).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(s.list("pdnode/".into()).await.unwrap().kvs.len(), 1);
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert!(s.list("pdnode/".into()).await.unwrap().kvs.is_empty());
        assert_eq!(
            s.keepalive(lease).await,
            Err(RegistryError::LeaseNotFound { lease })
        );
        // Now the key is free for a new lease, and takeover works from our own old lease.
        let other = s.grant(2).await.unwrap();
        assert_eq!(
            s.create(k.clone(), b"{}".to_vec(), other, Some(lease))
                .await
                .unwrap(),
            CreateOutcome::Created
        );
        let third = s.grant(2).await.unwrap();
        assert_eq!(
            s.create(k, b"{}".to_vec(), third, Some(other))
                .await
                .unwrap(),
            CreateOutcome::Created
        );
    }

    #[tokio::test]
    async fn watch_replays_from_a_revision_and_breaks_on_outage() {
        let s = Arc::new(MemoryStore::default());
        let lease = s.grant(10).await.unwrap();
        let start = s.list("p/".into()).await.unwrap().revision;
        s.put("p/a".into(), b"1".to_vec(), lease).await.unwrap();
        s.put("q/x".into(), b"1".to_vec(), lease).await.unwrap();
        s.put("p/b".into(), b"2".to_vec(), lease).await.unwrap();
        let mut w = s.watch("p/".into(), start + 1).await.unwrap();
        let first = w.next().await.unwrap().unwrap();
        assert_eq!(
            first.iter().map(|e| e.key.as_str()).collect::<Vec<_>>(),
            ["p/a", "p/b"]
        );
        s.delete("p/a".into()).await.unwrap();
        let ev = w.next().await.unwrap().unwrap();
        assert_eq!((ev[0].kind, ev[0].key.as_str()), (RawKind::Delete, "p/a"));
        {
            let mut g = s.lock();
            g.available = false;
            let _ = g.events.send(Msg::Broken);
        }
        assert!(matches!(
            w.next().await,
            Some(Err(RegistryError::Unavailable { .. }))
        ));
        assert!(s.list("p/".into()).await.is_err());
    }
}
