//! pdnode-registry: where nodes find each other.
//!
//! A node publishes its [`NodeCard`] under `pdnode/v1/{cluster}/nodes/{role}/{node_id}` (see
//! [`pdnode_core::card::node_key`]) as JSON, attached to a lease. Routers list and watch the
//! cluster prefix and keep a [`MembershipView`].
//!
//! - [`Registry`]: the narrow trait; [`EtcdRegistry`] (etcd-client) and [`MemoryRegistry`] (its
//!   in-process twin, same semantics including lease expiry on tokio time).
//! - [`Registration`]: the handle [`Registry::register`] returns. A background task keeps the
//!   lease alive (every TTL/3), re-registers after failures (under a new lease when the old one
//!   expired), puts updated cards, and revokes the lease on [`Registration::shutdown`] or drop.
//! - [`MembershipWatch`]: events from [`Registry::watch`]: a [`MembershipEvent::Snapshot`] first
//!   and after every resync, then puts and deletes; [`MembershipEvent::Stale`] when the watch
//!   broke and is being re-established.
//! - [`MembershipView`]: plain state fed by those events; [`LiveMembership`] keeps one up to
//!   date in a background task (what a router reads: `serving(role)`).
//!
//! A second registration of a key that a live lease holds fails with
//! [`RegistryError::AlreadyRegistered`] (an etcd transaction: put only if `create_revision == 0`).

mod error;
mod etcd;
mod etcd_security;
mod live;
mod memory;
mod registration;
mod store;
mod view;
mod watch;

pub use error::RegistryError;
pub use etcd::EtcdRegistry;
pub use etcd_security::EtcdSecurity;
pub use live::LiveMembership;
pub use memory::MemoryRegistry;
pub use registration::{
    KeepaliveFailures, Registration, RegistrationStatus, register_waiting_out_stale,
};
pub use view::MembershipView;
pub use watch::MembershipWatch;

use futures::future::BoxFuture;
use pdnode_core::config::{RegistryConfig, RegistryKind};
use pdnode_core::{NodeCard, NodeId, Role};
use std::sync::Arc;
use std::time::Duration;

/// Timing of leases and calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegistryOptions {
    /// The card's lease; a dead node disappears within this time.
    pub lease_ttl: Duration,
    /// Deadline of every registry call.
    pub call_timeout: Duration,
    /// Longest wait between two retries after a failure.
    pub max_backoff: Duration,
}

impl RegistryOptions {
    pub fn from_config(c: &RegistryConfig) -> Self {
        Self {
            lease_ttl: Duration::from_secs(c.lease_ttl_s.max(1)),
            call_timeout: Duration::from_millis(c.timeout_ms.max(1)),
            max_backoff: Duration::from_secs(2),
        }
    }

    /// Keepalive period: a third of the TTL, so two keepalives may fail before the lease expires.
    pub fn keepalive_interval(&self) -> Duration {
        (self.lease_ttl / 3).max(Duration::from_millis(100))
    }

    pub(crate) fn ttl_secs(&self) -> u64 {
        self.lease_ttl.as_secs().max(1)
    }
}

impl Default for RegistryOptions {
    fn default() -> Self {
        Self::from_config(&RegistryConfig::default())
    }
}

/// The cards of one cluster at one registry revision.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Snapshot {
    pub cards: Vec<NodeCard>,
    pub revision: i64,
}

/// One change of a cluster's membership.
#[derive(Debug, Clone, PartialEq)]
pub enum MembershipEvent {
    /// The full membership: the first event of a watch and the first after each resync. Replaces
    /// whatever the view held.
    Snapshot(Snapshot),
    /// A node appeared or its card changed.
    Put { card: Box<NodeCard>, revision: i64 },
    /// A node's key was deleted (graceful shutdown, or its lease expired).
    Delete {
        role: Role,
        id: NodeId,
        revision: i64,
    },
    /// The watch broke (registry unreachable); it is being re-established. The view keeps its
    /// last state and marks itself stale until the next snapshot.
    Stale { reason: String },
}

/// The narrow registry trait.
pub trait Registry: Send + Sync + 'static {
    /// Publishes `card` under a new lease. Fails with [`RegistryError::AlreadyRegistered`] when
    /// a live lease holds the key, and with `Unavailable`/`Timeout` when the registry cannot be
    /// reached. After success the returned handle keeps the registration alive.
    fn register(&self, card: NodeCard) -> BoxFuture<'_, Result<Registration, RegistryError>>;
    /// The cards of a cluster now. Values that do not parse are skipped with a warning.
    fn list(&self, cluster: &str) -> BoxFuture<'_, Result<Snapshot, RegistryError>>;
    /// Watches a cluster: a snapshot first, then changes; re-lists and re-watches by itself
    /// when the watch breaks. Fails only if the first listing fails.
    fn watch(&self, cluster: &str) -> BoxFuture<'_, Result<MembershipWatch, RegistryError>>;
    /// Deletes a node's key (an operator's clean-up; a running node's registration puts it back
    /// at its next re-registration). Returns whether the key existed.
    fn deregister(
        &self,
        cluster: &str,
        role: Role,
        id: &NodeId,
    ) -> BoxFuture<'_, Result<bool, RegistryError>>;
}

/// Builds the registry the configuration names. `memory` gives a fresh in-process registry;
/// `etcd` connects with the TLS and credentials of `registry.etcd_*` (every role that talks to
/// etcd, nodes and routers, comes through here).
/// Connects to the configured registry, trying once a second for up to
/// `registry.start_wait_s` (0: once); the last error when no try succeeded.
pub async fn connect_waiting(c: &RegistryConfig) -> Result<Arc<dyn Registry>, RegistryError> {
    retry_for(
        Duration::from_secs(c.start_wait_s),
        Duration::from_secs(1),
        || from_config(c),
    )
    .await
}

/// Runs `attempt` until it succeeds, pausing `every` after a failed try (logged) while a next
/// try would still start within `wait` of the first; then the last error.
pub async fn retry_for<T, E, F, Fut>(
    wait: Duration,
    every: Duration,
    mut attempt: F,
) -> Result<T, E>
where
    E: std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let until = tokio::time::Instant::now() + wait;
    let mut tries = 0u32;
    loop {
        tries += 1;
        match attempt().await {
            Ok(v) => {
                if tries > 1 {
                    tracing::info!(tries, "registry reachable");
                }
                return Ok(v);
            }
            Err(e) if tokio::time::Instant::now() + every <= until => {
                tracing::warn!(error = %e, tries, "registry unreachable; trying again (registry.start_wait_s)");
                tokio::time::sleep(every).await;
            }
            Err(e) => return Err(e),
        }
    }
}

pub async fn from_config(c: &RegistryConfig) -> Result<Arc<dyn Registry>, RegistryError> {
    Ok(match c.kind {
        RegistryKind::Memory => Arc::new(MemoryRegistry::new(RegistryOptions::from_config(c))),
        RegistryKind::Etcd => Arc::new(EtcdRegistry::from_config(c).await?),
    })
}

/// Decodes listed key/values into cards, skipping (and logging) what does not parse.
pub(crate) fn decode_cards(kvs: Vec<(String, Vec<u8>)>) -> Vec<NodeCard> {
    kvs.into_iter()
        .filter_map(|(k, v)| match decode_card(&k, &v) {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!(error = %e, "skipping a registry entry");
                None
            }
        })
        .collect()
}

pub(crate) fn decode_card(key: &str, value: &[u8]) -> Result<NodeCard, RegistryError> {
    let card = NodeCard::from_json(value).map_err(|e| RegistryError::BadCard {
        key: key.to_string(),
        reason: e.to_string(),
    })?;
    if card.key() != key {
        return Err(RegistryError::BadCard {
            key: key.to_string(),
            reason: format!("the card's own key is {}", card.key()),
        });
    }
    Ok(card)
}

pub(crate) async fn list_cluster(
    store: &dyn store::Store,
    cluster: &str,
) -> Result<Snapshot, RegistryError> {
    let raw = store
        .list(pdnode_core::card::cluster_prefix(cluster))
        .await?;
    Ok(Snapshot {
        cards: decode_cards(raw.kvs),
        revision: raw.revision,
    })
}

/// Runs `fut` under the call timeout.
pub(crate) async fn timed<T>(
    op: &'static str,
    timeout: Duration,
    fut: impl std::future::Future<Output = Result<T, RegistryError>>,
) -> Result<T, RegistryError> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(RegistryError::Timeout {
            op,
            timeout_ms: timeout.as_millis() as u64,
        }),
    }
}

#[cfg(test)]
mod retry_tests {
    use super::retry_for;
    use std::time::Duration;

    #[tokio::test]
    async fn retries_until_an_attempt_succeeds() {
        let mut n = 0;
        let r: Result<u32, String> =
            retry_for(Duration::from_secs(30), Duration::from_millis(1), || {
                n += 1;
                let v = n;
                async move {
                    if v < 3 {
                        Err(format!("try {v}"))
                    } else {
                        Ok(v)
                    }
                }
            })
            .await;
        assert_eq!(r, Ok(3));
    }

    #[tokio::test]
    async fn no_wait_is_one_attempt_and_its_error() {
        let mut n = 0;
        let r: Result<(), String> = retry_for(Duration::ZERO, Duration::from_millis(1), || {
            n += 1;
            async { Err("down".to_string()) }
        })
        .await;
        assert_eq!((r, n), (Err("down".to_string()), 1));
    }

    #[tokio::test]
    async fn gives_up_with_the_last_error_once_the_wait_is_spent() {
        let mut n = 0;
        let r: Result<(), String> =
            retry_for(Duration::from_millis(50), Duration::from_millis(10), || {
                n += 1;
                let v = n;
                async move { Err(format!("try {v}")) }
            })
            .await;
        assert!(n >= 2, "tried {n} times");
        assert_eq!(r, Err(format!("try {n}")));
    }
}
