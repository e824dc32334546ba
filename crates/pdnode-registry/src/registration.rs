//! A node's registration: lease, keepalive, re-registration, card updates, revoke.

use crate::store::{CreateOutcome, LeaseId, Store};
use crate::{Registry, RegistryError, RegistryOptions, timed};
use pdnode_core::NodeCard;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};

/// Where a registration stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistrationStatus {
    /// The card is published under this lease.
    Registered { lease: i64 },
    /// The registry could not be reached or the lease was lost; retrying with backoff. The node
    /// keeps serving meanwhile.
    Reconnecting { attempt: u32, error: String },
    /// While re-registering, another live process held the key; retrying with backoff.
    Conflict { holder: String },
    /// The lease was revoked (shutdown) or the registration ended.
    Revoked,
}

type StopReply = oneshot::Sender<Result<(), RegistryError>>;

/// The handle of one published card. Dropping it revokes the lease in the background (best
/// effort, needs the runtime to keep running); [`Registration::shutdown`] revokes and waits.
#[derive(Debug)]
pub struct Registration {
    key: String,
    card_tx: watch::Sender<NodeCard>,
    status_rx: watch::Receiver<RegistrationStatus>,
    stop_tx: mpsc::Sender<StopReply>,
    failures: Arc<AtomicU64>,
    call_timeout: Duration,
    _cancel: DropGuard,
}

/// Reads a registration's failed keepalives (`pdnode_registry_keepalive_failures_total`).
#[derive(Debug, Clone)]
pub struct KeepaliveFailures(Arc<AtomicU64>);

impl KeepaliveFailures {
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl Registration {
    /// The registry key of the card.
    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn status(&self) -> RegistrationStatus {
        self.status_rx.borrow().clone()
    }

    /// A receiver of status changes.
    pub fn subscribe(&self) -> watch::Receiver<RegistrationStatus> {
        self.status_rx.clone()
    }

    /// Keepalive or re-registration attempts that failed so far
    /// (`pdnode_registry_keepalive_failures_total`).
    pub fn keepalive_failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// A reader of [`Registration::keepalive_failures`] that outlives the registration (for a
    /// metrics endpoint).
    pub fn keepalive_failures_reader(&self) -> KeepaliveFailures {
        KeepaliveFailures(self.failures.clone())
    }

    /// The card as last set.
    pub fn card(&self) -> NodeCard {
        self.card_tx.borrow().clone()
    }

    /// Publishes a new version of the card (e.g. its load). Returns at once; the background task
    /// puts it (and puts it again after a re-registration). The key must not change.
    pub fn update(&self, card: NodeCard) -> Result<(), RegistryError> {
        if card.key() != self.key {
            return Err(RegistryError::BadCard {
                key: self.key.clone(),
                reason: format!("an update may not move the card to {}", card.key()),
            });
        }
        self.card_tx.send(card).map_err(|_| RegistryError::Closed {
            key: self.key.clone(),
        })
    }

    /// Revokes the lease (the key disappears at once) and stops the background task.
    pub async fn shutdown(self) -> Result<(), RegistryError> {
        let (tx, rx) = oneshot::channel();
        if self.stop_tx.send(tx).await.is_err() {
            return Err(RegistryError::Closed { key: self.key });
        }
        match tokio::time::timeout(self.call_timeout * 2, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(RegistryError::Closed { key: self.key }),
            Err(_) => Err(RegistryError::Timeout {
                op: "revoke",
                timeout_ms: (self.call_timeout * 2).as_millis() as u64,
            }),
        }
    }
}

/// Registers, and when the key is held by another lease, retries for up to `wait` before
/// failing with [`RegistryError::AlreadyRegistered`]. A crashed predecessor with the same id
/// holds its key until its lease expires (at most one TTL); a live duplicate holds it forever.
pub async fn register_waiting_out_stale(
    registry: &dyn Registry,
    card: NodeCard,
    wait: Duration,
) -> Result<Registration, RegistryError> {
    let deadline = Instant::now() + wait;
    loop {
        match registry.register(card.clone()).await {
            Err(RegistryError::AlreadyRegistered { .. }) if Instant::now() < deadline => {
                tracing::info!(key = %card.key(), "node key is held by another lease; waiting for it to expire");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            r => return r,
        }
    }
}

/// First registration: grant, create-if-absent; then the background task takes over.
pub(crate) async fn register(
    store: Arc<dyn Store>,
    opts: RegistryOptions,
    card: NodeCard,
) -> Result<Registration, RegistryError> {
    let key = card.key();
    let t = opts.call_timeout;
    let lease = timed("lease_grant", t, store.grant(opts.ttl_secs())).await?;
    let outcome = timed(
        "create",
        t,
        store.create(key.clone(), card.to_json().into_bytes(), lease, None),
    )
    .await;
    match outcome {
        Ok(CreateOutcome::Created) => {}
        Ok(CreateOutcome::Exists { holder }) => {
            let _ = timed("lease_revoke", t, store.revoke(lease)).await;
            return Err(RegistryError::AlreadyRegistered {
                key,
                id: card.id.to_string(),
                cluster: card.cluster.clone(),
                holder,
            });
        }
        Err(e) => {
            let _ = timed("lease_revoke", t, store.revoke(lease)).await;
            return Err(e);
        }
    }
    tracing::info!(%key, lease = format_args!("{lease:x}"), ttl_s = opts.ttl_secs(), "registered");
    let (card_tx, card_rx) = watch::channel(card);
    let (status_tx, status_rx) = watch::channel(RegistrationStatus::Registered { lease });
    let (stop_tx, stop_rx) = mpsc::channel(1);
    let cancel = CancellationToken::new();
    let failures = Arc::new(AtomicU64::new(0));
    let task = Task {
        store,
        opts,
        key: key.clone(),
        card_rx,
        status_tx,
        stop_rx,
        cancel: cancel.clone(),
        failures: failures.clone(),
        lease,
        healthy: true,
        dirty: false,
        attempt: 0,
    };
    tokio::spawn(task.run());
    Ok(Registration {
        key,
        card_tx,
        status_rx,
        stop_tx,
        failures,
        call_timeout: t,
        _cancel: cancel.drop_guard(),
    })
}

struct Task {
    store: Arc<dyn Store>,
    opts: RegistryOptions,
    key: String,
    card_rx: watch::Receiver<NodeCard>,
    status_tx: watch::Sender<RegistrationStatus>,
    stop_rx: mpsc::Receiver<StopReply>,
    cancel: CancellationToken,
    failures: Arc<AtomicU64>,
    lease: LeaseId,
    /// The current lease is believed alive (keepalive answered, or unknown because unreachable).
    healthy: bool,
    /// The card changed and the change is not yet published.
    dirty: bool,
    /// Consecutive failed attempts.
    attempt: u32,
}

impl Task {
    async fn run(mut self) {
        let mut next = Instant::now() + self.opts.keepalive_interval();
        loop {
            tokio::select! {
                biased;
                _ = self.cancel.cancelled() => {
                    let _ = self.revoke().await;
                    return;
                }
                reply = self.stop_rx.recv() => {
                    let r = self.revoke().await;
                    if let Some(reply) = reply {
                        let _ = reply.send(r);
                    }
                    return;
                }
                changed = self.card_rx.changed() => {
                    if changed.is_err() {
                        let _ = self.revoke().await;
                        return;
                    }
                    self.dirty = true;
                    if self.healthy && self.attempt == 0 {
                        self.put_card().await;
                    }
                }
                _ = tokio::time::sleep_until(next) => {
                    next = if self.healthy {
                        self.keepalive().await
                    } else {
                        self.reregister().await
                    };
                }
            }
        }
    }

    fn backoff(&self) -> Duration {
        let base = Duration::from_millis(100);
        let b = base.saturating_mul(1u32 << self.attempt.min(10));
        b.min(self.opts.max_backoff)
            .min(self.opts.keepalive_interval())
    }

    fn failed(&mut self, e: &RegistryError) -> Instant {
        self.failures.fetch_add(1, Ordering::Relaxed);
        self.attempt = self.attempt.saturating_add(1);
        tracing::warn!(
            key = %self.key,
            attempt = self.attempt,
            error = %e,
            metric = pdnode_core::metrics::REGISTRY_KEEPALIVE_FAILURES_TOTAL,
            "registry keepalive failed; retrying"
        );
        self.status_tx
            .send_replace(RegistrationStatus::Reconnecting {
                attempt: self.attempt,
                error: e.to_string(),
            });
        Instant::now() + self.backoff()
    }

    fn recovered(&mut self) -> Instant {
        if self.attempt > 0 {
            tracing::info!(key = %self.key, lease = format_args!("{:x}", self.lease), "registry reachable again; registration restored");
        }
        self.attempt = 0;
        self.status_tx
            .send_replace(RegistrationStatus::Registered { lease: self.lease });
        Instant::now() + self.opts.keepalive_interval()
    }

    async fn keepalive(&mut self) -> Instant {
        let t = self.opts.call_timeout;
        match timed("lease_keepalive", t, self.store.keepalive(self.lease)).await {
            Ok(()) => {
                // After an outage, put the card again: the key may have been deleted meanwhile.
                if self.attempt > 0 || self.dirty {
                    self.dirty = true;
                    if let Err(e) = self.try_put().await {
                        return self.after_put_error(e);
                    }
                }
                self.recovered()
            }
            Err(RegistryError::LeaseNotFound { .. }) => {
                tracing::warn!(key = %self.key, lease = format_args!("{:x}", self.lease), "lease expired; registering again under a new lease");
                self.healthy = false;
                Instant::now()
            }
            Err(e) => self.failed(&e),
        }
    }

    fn after_put_error(&mut self, e: RegistryError) -> Instant {
        if matches!(e, RegistryError::LeaseNotFound { .. }) {
            self.healthy = false;
            Instant::now()
        } else {
            self.failed(&e)
        }
    }

    async fn try_put(&mut self) -> Result<(), RegistryError> {
        let value = self.card_rx.borrow_and_update().to_json().into_bytes();
        timed(
            "put",
            self.opts.call_timeout,
            self.store.put(self.key.clone(), value, self.lease),
        )
        .await?;
        self.dirty = false;
        Ok(())
    }

    async fn put_card(&mut self) {
        if let Err(e) = self.try_put().await {
            match e {
                RegistryError::LeaseNotFound { .. } => self.healthy = false,
                e => {
                    tracing::warn!(key = %self.key, error = %e, "card update not published yet; retrying at the next keepalive")
                }
            }
        }
    }

    async fn reregister(&mut self) -> Instant {
        let t = self.opts.call_timeout;
        let lease = match timed("lease_grant", t, self.store.grant(self.opts.ttl_secs())).await {
            Ok(l) => l,
            Err(e) => return self.failed(&e),
        };
        let value = self.card_rx.borrow_and_update().to_json().into_bytes();
        let r = timed(
            "create",
            t,
            self.store
                .create(self.key.clone(), value, lease, Some(self.lease)),
        )
        .await;
        match r {
            Ok(CreateOutcome::Created) => {
                tracing::info!(key = %self.key, old = format_args!("{:x}", self.lease), new = format_args!("{lease:x}"), "registered again under a new lease");
                self.lease = lease;
                self.healthy = true;
                self.dirty = false;
                self.attempt = 1; // makes recovered() log
                self.recovered()
            }
            Ok(CreateOutcome::Exists { holder }) => {
                let _ = timed("lease_revoke", t, self.store.revoke(lease)).await;
                tracing::error!(key = %self.key, %holder, "cannot register again: another live node holds this id; retrying");
                self.failures.fetch_add(1, Ordering::Relaxed);
                self.attempt = self.attempt.saturating_add(1);
                self.status_tx
                    .send_replace(RegistrationStatus::Conflict { holder });
                Instant::now() + self.backoff()
            }
            Err(e) => {
                let _ = timed("lease_revoke", t, self.store.revoke(lease)).await;
                self.failed(&e)
            }
        }
    }

    async fn revoke(&mut self) -> Result<(), RegistryError> {
        let r = timed(
            "lease_revoke",
            self.opts.call_timeout,
            self.store.revoke(self.lease),
        )
        .await;
        let r = match r {
            // Already gone is as good as revoked.
            Err(RegistryError::LeaseNotFound { .. }) => Ok(()),
            r => r,
        };
        match &r {
            Ok(()) => tracing::info!(key = %self.key, "lease revoked; node deregistered"),
            Err(e) => {
                tracing::warn!(key = %self.key, error = %e, "lease revoke failed; the key expires with its TTL")
            }
        }
        self.status_tx.send_replace(RegistrationStatus::Revoked);
        r
    }
}
