//! The storage primitives both registries provide (etcd and in-memory). The registration loop
//! (lease, keepalive, re-register) and the watch loop (list, watch, resync) are written once on
//! top of them.

use crate::RegistryError;
use futures::future::BoxFuture;
use futures::stream::BoxStream;

/// A lease id (etcd's i64).
pub(crate) type LeaseId = i64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RawKind {
    Put,
    Delete,
}

/// One change of one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RawEvent {
    pub kind: RawKind,
    pub key: String,
    /// Empty for deletes.
    pub value: Vec<u8>,
    pub revision: i64,
}

/// Keys and values under a prefix, at a revision.
#[derive(Debug, Clone, Default)]
pub(crate) struct RawList {
    pub kvs: Vec<(String, Vec<u8>)>,
    pub revision: i64,
}

/// What the registration of a key ran into when the key exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CreateOutcome {
    Created,
    /// The key exists under another lease; `holder` describes who holds it.
    Exists {
        holder: String,
    },
}

pub(crate) type WatchStream = BoxStream<'static, Result<Vec<RawEvent>, RegistryError>>;

pub(crate) trait Store: Send + Sync + 'static {
    fn grant(&self, ttl_s: u64) -> BoxFuture<'_, Result<LeaseId, RegistryError>>;
    /// Refreshes the lease; `LeaseNotFound` when it expired or was revoked.
    fn keepalive(&self, lease: LeaseId) -> BoxFuture<'_, Result<(), RegistryError>>;
    fn revoke(&self, lease: LeaseId) -> BoxFuture<'_, Result<(), RegistryError>>;
    /// Puts `key` under `lease` only if it does not exist, or if it exists under `takeover`
    /// (our own earlier lease).
    fn create(
        &self,
        key: String,
        value: Vec<u8>,
        lease: LeaseId,
        takeover: Option<LeaseId>,
    ) -> BoxFuture<'_, Result<CreateOutcome, RegistryError>>;
    /// Overwrites `key` under `lease`; `LeaseNotFound` when the lease is gone.
    fn put(
        &self,
        key: String,
        value: Vec<u8>,
        lease: LeaseId,
    ) -> BoxFuture<'_, Result<(), RegistryError>>;
    fn delete(&self, key: String) -> BoxFuture<'_, Result<bool, RegistryError>>;
    fn list(&self, prefix: String) -> BoxFuture<'_, Result<RawList, RegistryError>>;
    /// Changes under `prefix` from `from_revision` (inclusive). The stream ends or yields an
    /// error when the watch breaks; `Compacted` when `from_revision` is no longer available.
    fn watch(
        &self,
        prefix: String,
        from_revision: i64,
    ) -> BoxFuture<'_, Result<WatchStream, RegistryError>>;
}
