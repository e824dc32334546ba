//! The etcd registry (etcd-client): leases, create-if-absent transactions, prefix get, watch
//! from a revision. Every call runs under the configured timeout; a transport failure drops the
//! cached client so the next call reconnects. TLS and etcd auth: [`EtcdSecurity`].

use crate::etcd_security::EtcdSecurity;
use crate::store::{CreateOutcome, LeaseId, RawEvent, RawKind, RawList, Store, WatchStream};
use crate::{
    MembershipWatch, Registration, Registry, RegistryError, RegistryOptions, Snapshot,
    list_cluster, registration, timed, watch,
};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp,
    WatchOptions,
};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use pdnode_core::config::RegistryConfig;
use pdnode_core::{NodeCard, NodeId, Role};
use std::sync::Arc;
use tokio::sync::Mutex;

/// The etcd [`Registry`].
#[derive(Clone)]
pub struct EtcdRegistry {
    store: Arc<EtcdStore>,
    opts: RegistryOptions,
}

impl std::fmt::Debug for EtcdRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdRegistry")
            .field("endpoints", &self.store.endpoints)
            .field("security", &self.store.security)
            .field("opts", &self.opts)
            .finish()
    }
}

impl EtcdRegistry {
    /// Connects to the endpoints (plaintext, no credentials; within the call timeout) and
    /// checks etcd answers.
    pub async fn connect(
        endpoints: &[String],
        opts: RegistryOptions,
    ) -> Result<Self, RegistryError> {
        Self::connect_with(endpoints, opts, EtcdSecurity::none()).await
    }

    /// The etcd registry `registry.*` describe: endpoints, timing, TLS and credentials (their
    /// files read now: an error names the key).
    pub async fn from_config(c: &RegistryConfig) -> Result<Self, RegistryError> {
        let security = EtcdSecurity::from_config(c)?;
        Self::connect_with(&c.endpoints, RegistryOptions::from_config(c), security).await
    }

    /// [`Self::connect`] with TLS and credentials. A wrong user or password fails here
    /// ([`RegistryError::AuthFailed`]).
    pub async fn connect_with(
        endpoints: &[String],
        opts: RegistryOptions,
        security: EtcdSecurity,
    ) -> Result<Self, RegistryError> {
        if endpoints.is_empty() {
            return Err(RegistryError::Unavailable {
                endpoints: "(none)".into(),
                reason: "no etcd endpoints configured".into(),
            });
        }
        let store = Arc::new(EtcdStore {
            endpoints: endpoints.to_vec(),
            opts,
            security,
            client: Mutex::new(None),
        });
        // Fail fast with a clear error when etcd is not there.
        timed("connect", opts.call_timeout, store.client()).await?;
        Ok(Self { store, opts })
    }

    pub fn endpoints(&self) -> &[String] {
        &self.store.endpoints
    }
}

impl Registry for EtcdRegistry {
    fn register(&self, card: NodeCard) -> BoxFuture<'_, Result<Registration, RegistryError>> {
        registration::register(self.store.clone(), self.opts, card).boxed()
    }

    fn list(&self, cluster: &str) -> BoxFuture<'_, Result<Snapshot, RegistryError>> {
        let cluster = cluster.to_string();
        timed("list", self.opts.call_timeout, async move {
            list_cluster(&*self.store, &cluster).await
        })
        .boxed()
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

pub(crate) struct EtcdStore {
    endpoints: Vec<String>,
    opts: RegistryOptions,
    security: EtcdSecurity,
    client: Mutex<Option<Client>>,
}

impl EtcdStore {
    async fn client(&self) -> Result<Client, RegistryError> {
        let mut g = self.client.lock().await;
        if let Some(c) = g.as_ref() {
            return Ok(c.clone());
        }
        let t = self.opts.call_timeout;
        let co = ConnectOptions::new()
            .with_connect_timeout(t)
            .with_timeout(t)
            // Detects a dead connection (and so a dead watch) within about a keepalive period.
            .with_keep_alive(self.opts.keepalive_interval(), t)
            .with_keep_alive_while_idle(true)
            // A member cut off from its cluster's quorum still answers pings but sends a watch
            // no events and serves stale reads: with "has leader" on every call it cancels the
            // watch (the watch loop then reconnects and reports the view stale) and refuses the
            // calls, as for an unreachable etcd.
            .with_require_leader(true);
        let co = self.security.apply(co);
        // With credentials, `connect` authenticates: a wrong password fails here.
        let mut c = Client::connect(&self.endpoints, Some(co))
            .await
            .map_err(|e| self.connect_failed(&e))?;
        // `connect` is lazy about the transport; make sure etcd answers.
        c.status().await.map_err(|e| self.connect_failed(&e))?;
        *g = Some(c.clone());
        Ok(c)
    }

    /// A failed connect: refused credentials, refused TLS options, or etcd not answering.
    fn connect_failed(&self, e: &etcd_client::Error) -> RegistryError {
        if let Some(err) = self.refused("connect", e) {
            return err;
        }
        if let etcd_client::Error::InvalidArgs(reason) = e {
            return RegistryError::BadConfig {
                key: "registry.endpoints",
                reason: reason.clone(),
            };
        }
        self.unavailable(e)
    }

    /// etcd refusing who the client is: [`RegistryError::AuthFailed`] for a wrong user or
    /// password, [`RegistryError::NotAuthorized`] for a call without credentials or beyond the
    /// user's roles. etcd says which only in the status message (its `rpctypes` errors).
    fn refused(&self, op: &'static str, e: &etcd_client::Error) -> Option<RegistryError> {
        let etcd_client::Error::GRpcStatus(s) = e else {
            return None;
        };
        let m = s.message();
        if m.contains("authentication failed") {
            return Some(RegistryError::AuthFailed {
                endpoints: self.endpoints.join(","),
                user: self.security.user().to_string(),
                reason: m.to_string(),
            });
        }
        let denied = s.code() == tonic::Code::PermissionDenied
            || s.code() == tonic::Code::Unauthenticated
            || m.contains("permission denied")
            || m.contains("user name is empty")
            || m.contains("invalid auth token");
        denied.then(|| RegistryError::NotAuthorized {
            op,
            user: self.security.user().to_string(),
            reason: m.to_string(),
        })
    }

    fn unavailable(&self, e: &etcd_client::Error) -> RegistryError {
        RegistryError::Unavailable {
            endpoints: self.endpoints.join(","),
            reason: e.to_string(),
        }
    }

    /// Maps an etcd error; forgets the client on transport-level failures.
    async fn fail(&self, op: &'static str, lease: LeaseId, e: etcd_client::Error) -> RegistryError {
        let msg = e.to_string();
        if msg.contains("lease not found") {
            return RegistryError::LeaseNotFound { lease };
        }
        if let Some(err) = self.refused(op, &e) {
            return err;
        }
        let transport = match &e {
            etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
            etcd_client::Error::GRpcStatus(s) => matches!(
                s.code(),
                tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::DeadlineExceeded
            ),
            _ => false,
        };
        if transport {
            *self.client.lock().await = None;
            self.unavailable(&e)
        } else {
            RegistryError::Backend { op, reason: msg }
        }
    }
}

impl Store for EtcdStore {
    fn grant(&self, ttl_s: u64) -> BoxFuture<'_, Result<LeaseId, RegistryError>> {
        async move {
            let mut c = self.client().await?;
            match c.lease_grant(ttl_s as i64, None).await {
                Ok(r) => Ok(r.id()),
                Err(e) => Err(self.fail("lease_grant", 0, e).await),
            }
        }
        .boxed()
    }

    fn keepalive(&self, lease: LeaseId) -> BoxFuture<'_, Result<(), RegistryError>> {
        async move {
            let mut c = self.client().await?;
            // One keepalive round trip: `lease_keep_alive` sends the first request and reads its
            // answer (an error when the lease is gone).
            match c.lease_keep_alive(lease).await {
                Ok(_) => Ok(()),
                Err(e) => Err(self.fail("lease_keepalive", lease, e).await),
            }
        }
        .boxed()
    }

    fn revoke(&self, lease: LeaseId) -> BoxFuture<'_, Result<(), RegistryError>> {
        async move {
            let mut c = self.client().await?;
            match c.lease_revoke(lease).await {
                Ok(_) => Ok(()),
                Err(e) => Err(self.fail("lease_revoke", lease, e).await),
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
            let mut c = self.client().await?;
            let put = || {
                TxnOp::put(
                    key.clone(),
                    value.clone(),
                    Some(PutOptions::new().with_lease(lease)),
                )
            };
            let txn = Txn::new()
                .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                .and_then([put()])
                .or_else([TxnOp::get(key.clone(), None)]);
            let r = match c.txn(txn).await {
                Ok(r) => r,
                Err(e) => return Err(self.fail("create", lease, e).await),
            };
            if r.succeeded() {
                return Ok(CreateOutcome::Created);
            }
            if let Some(old) = takeover {
                let txn = Txn::new()
                    .when([Compare::lease(key.clone(), CompareOp::Equal, old)])
                    .and_then([put()]);
                match c.txn(txn).await {
                    Ok(r) if r.succeeded() => return Ok(CreateOutcome::Created),
                    Ok(_) => {}
                    Err(e) => return Err(self.fail("create", lease, e).await),
                }
            }
            let holder = match c.get(key.clone(), None).await {
                Ok(g) => g
                    .kvs()
                    .first()
                    .map(|kv| holder_of(kv.value(), kv.lease()))
                    .unwrap_or_else(|| "a node that just left".into()),
                Err(_) => "another lease".into(),
            };
            Ok(CreateOutcome::Exists { holder })
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
            let mut c = self.client().await?;
            match c
                .put(key, value, Some(PutOptions::new().with_lease(lease)))
                .await
            {
                Ok(_) => Ok(()),
                Err(e) => Err(self.fail("put", lease, e).await),
            }
        }
        .boxed()
    }

    fn delete(&self, key: String) -> BoxFuture<'_, Result<bool, RegistryError>> {
        async move {
            let mut c = self.client().await?;
            match c.delete(key, None).await {
                Ok(r) => Ok(r.deleted() > 0),
                Err(e) => Err(self.fail("delete", 0, e).await),
            }
        }
        .boxed()
    }

    fn list(&self, prefix: String) -> BoxFuture<'_, Result<RawList, RegistryError>> {
        async move {
            let mut c = self.client().await?;
            let r = match c.get(prefix, Some(GetOptions::new().with_prefix())).await {
                Ok(r) => r,
                Err(e) => return Err(self.fail("list", 0, e).await),
            };
            let revision = r.header().map_or(0, |h| h.revision());
            let kvs = r
                .kvs()
                .iter()
                .filter_map(|kv| {
                    let k = kv.key_str().ok()?.to_string();
                    Some((k, kv.value().to_vec()))
                })
                .collect();
            Ok(RawList { kvs, revision })
        }
        .boxed()
    }

    fn watch(
        &self,
        prefix: String,
        from_revision: i64,
    ) -> BoxFuture<'_, Result<WatchStream, RegistryError>> {
        async move {
            let mut c = self.client().await?;
            let opts = WatchOptions::new()
                .with_prefix()
                .with_start_revision(from_revision);
            let stream = match c.watch(prefix, Some(opts)).await {
                Ok(s) => s,
                Err(e) => return Err(self.fail("watch", 0, e).await),
            };
            let s = futures::stream::unfold(Some(stream), |st| async move {
                let mut st = st?;
                match st.message().await {
                    Ok(Some(resp)) => {
                        if resp.canceled() {
                            let err = if resp.compact_revision() > 0 {
                                RegistryError::Compacted {
                                    revision: resp.compact_revision(),
                                }
                            } else {
                                RegistryError::Backend {
                                    op: "watch",
                                    reason: format!("cancelled by etcd: {}", resp.cancel_reason()),
                                }
                            };
                            return Some((Err(err), None));
                        }
                        let events = resp
                            .events()
                            .iter()
                            .filter_map(|ev| {
                                let kv = ev.kv()?;
                                Some(RawEvent {
                                    kind: match ev.event_type() {
                                        EventType::Put => RawKind::Put,
                                        EventType::Delete => RawKind::Delete,
                                    },
                                    key: kv.key_str().ok()?.to_string(),
                                    value: kv.value().to_vec(),
                                    revision: kv.mod_revision(),
                                })
                            })
                            .collect();
                        Some((Ok(events), Some(st)))
                    }
                    Ok(None) => None,
                    Err(e) => Some((
                        Err(RegistryError::Unavailable {
                            endpoints: String::new(),
                            reason: e.to_string(),
                        }),
                        None,
                    )),
                }
            });
            Ok(s.boxed())
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
