//! The membership watch: list, watch from the listed revision, and resync (re-list) whenever
//! the watch breaks.

use crate::store::{RawEvent, RawKind, Store};
use crate::{
    MembershipEvent, RegistryError, RegistryOptions, Snapshot, decode_card, list_cluster, timed,
};
use futures::StreamExt;
use pdnode_core::card::{cluster_prefix, parse_node_key};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::{CancellationToken, DropGuard};

/// Events of one cluster's membership. Dropping it stops the background watch.
#[derive(Debug)]
pub struct MembershipWatch {
    rx: mpsc::Receiver<MembershipEvent>,
    _guard: DropGuard,
}

impl MembershipWatch {
    /// The next event; `None` once the watch ended.
    pub async fn next(&mut self) -> Option<MembershipEvent> {
        self.rx.recv().await
    }

    /// The next event if one is ready.
    pub fn try_next(&mut self) -> Option<MembershipEvent> {
        self.rx.try_recv().ok()
    }
}

pub(crate) async fn start(
    store: Arc<dyn Store>,
    opts: RegistryOptions,
    cluster: &str,
) -> Result<MembershipWatch, RegistryError> {
    let first = timed("list", opts.call_timeout, list_cluster(&*store, cluster)).await?;
    let (tx, rx) = mpsc::channel(4096);
    let rev = first.revision;
    // The channel is empty: this cannot fail.
    let _ = tx.try_send(MembershipEvent::Snapshot(first));
    let cancel = CancellationToken::new();
    let w = Watcher {
        store,
        opts,
        cluster: cluster.to_string(),
        tx,
        cancel: cancel.clone(),
    };
    tokio::spawn(w.run(rev));
    Ok(MembershipWatch {
        rx,
        _guard: cancel.drop_guard(),
    })
}

struct Watcher {
    store: Arc<dyn Store>,
    opts: RegistryOptions,
    cluster: String,
    tx: mpsc::Sender<MembershipEvent>,
    cancel: CancellationToken,
}

enum Flow {
    Continue,
    Stop,
}

impl Watcher {
    async fn run(self, mut rev: i64) {
        let prefix = cluster_prefix(&self.cluster);
        loop {
            let reason = tokio::select! {
                _ = self.cancel.cancelled() => return,
                r = self.watch_until_broken(&prefix, &mut rev) => match r {
                    Some(reason) => reason,
                    None => return,
                },
            };
            tracing::warn!(cluster = %self.cluster, %reason, "membership watch broke; resyncing");
            if self
                .tx
                .send(MembershipEvent::Stale {
                    reason: reason.clone(),
                })
                .await
                .is_err()
            {
                return;
            }
            match self.resync().await {
                Some(snap) => {
                    rev = snap.revision;
                    if self.tx.send(MembershipEvent::Snapshot(snap)).await.is_err() {
                        return;
                    }
                }
                None => return,
            }
        }
    }

    /// Watches from `rev + 1`; returns why the watch broke, or `None` to stop (receiver gone).
    async fn watch_until_broken(&self, prefix: &str, rev: &mut i64) -> Option<String> {
        let stream = timed(
            "watch",
            self.opts.call_timeout,
            self.store.watch(prefix.to_string(), *rev + 1),
        )
        .await;
        let mut stream = match stream {
            Ok(s) => s,
            Err(e) => return Some(e.to_string()),
        };
        loop {
            match stream.next().await {
                Some(Ok(events)) => {
                    for ev in events {
                        *rev = (*rev).max(ev.revision);
                        if let Flow::Stop = self.forward(ev).await {
                            return None;
                        }
                    }
                }
                Some(Err(e)) => return Some(e.to_string()),
                None => return Some("the watch stream ended".into()),
            }
        }
    }

    async fn forward(&self, ev: RawEvent) -> Flow {
        let out = match ev.kind {
            RawKind::Put => match decode_card(&ev.key, &ev.value) {
                Ok(card) => MembershipEvent::Put {
                    card: Box::new(card),
                    revision: ev.revision,
                },
                Err(e) => {
                    tracing::warn!(error = %e, "ignoring a registry put");
                    return Flow::Continue;
                }
            },
            RawKind::Delete => match parse_node_key(&ev.key) {
                Some((_, role, id)) => MembershipEvent::Delete {
                    role,
                    id,
                    revision: ev.revision,
                },
                None => return Flow::Continue,
            },
        };
        if self.tx.send(out).await.is_err() {
            Flow::Stop
        } else {
            Flow::Continue
        }
    }

    /// Re-lists with backoff until it works; `None` when cancelled.
    async fn resync(&self) -> Option<Snapshot> {
        let mut attempt = 0u32;
        loop {
            let wait = Duration::from_millis(100)
                .saturating_mul(1u32 << attempt.min(10))
                .min(self.opts.max_backoff);
            tokio::select! {
                _ = self.cancel.cancelled() => return None,
                _ = self.tx.closed() => return None,
                _ = tokio::time::sleep(wait) => {}
            }
            match timed(
                "list",
                self.opts.call_timeout,
                list_cluster(&*self.store, &self.cluster),
            )
            .await
            {
                Ok(s) => return Some(s),
                Err(e) => {
                    attempt = attempt.saturating_add(1);
                    tracing::debug!(error = %e, attempt, "resync failed; retrying");
                }
            }
        }
    }
}
