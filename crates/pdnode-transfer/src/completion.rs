//! A one-shot completion shared between the thread that finishes an operation and the caller
//! that waits for it, blocking (with a deadline) or async (with a deadline).

use crate::TransferError;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

struct Inner {
    result: Mutex<Option<Result<(), TransferError>>>,
    cv: Condvar,
    notify: tokio::sync::Notify,
}

/// The waiting side.
#[derive(Clone)]
pub struct Completion {
    inner: Arc<Inner>,
    what: &'static str,
}

/// The finishing side. Dropping it unfinished completes with [`TransferError::Closed`].
pub struct Completer {
    inner: Option<Arc<Inner>>,
    transport: &'static str,
}

impl Completion {
    /// A pending completion and its completer. `what` names the operation in timeout errors.
    pub fn pending(what: &'static str, transport: &'static str) -> (Completion, Completer) {
        let inner = Arc::new(Inner {
            result: Mutex::new(None),
            cv: Condvar::new(),
            notify: tokio::sync::Notify::new(),
        });
        (
            Completion {
                inner: inner.clone(),
                what,
            },
            Completer {
                inner: Some(inner),
                transport,
            },
        )
    }

    /// An already finished completion.
    pub fn ready(what: &'static str, result: Result<(), TransferError>) -> Completion {
        let (c, done) = Completion::pending(what, "ready");
        done.complete(result);
        c
    }

    /// The result, if finished.
    pub fn try_result(&self) -> Option<Result<(), TransferError>> {
        self.inner
            .result
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Blocks until finished or `deadline`.
    pub fn wait(&self, deadline: Instant) -> Result<(), TransferError> {
        let mut g = self.inner.result.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = g.as_ref() {
                return r.clone();
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(TransferError::Timeout {
                    what: self.what.into(),
                });
            }
            g = self
                .inner
                .cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Waits asynchronously until finished or `deadline`.
    pub async fn wait_async(&self, deadline: Instant) -> Result<(), TransferError> {
        loop {
            let notified = self.inner.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(r) = self.try_result() {
                return r;
            }
            if tokio::time::timeout_at(deadline.into(), notified)
                .await
                .is_err()
            {
                return self.try_result().unwrap_or(Err(TransferError::Timeout {
                    what: self.what.into(),
                }));
            }
        }
    }
}

impl Completer {
    /// Finishes the operation (the first result wins).
    pub fn complete(mut self, result: Result<(), TransferError>) {
        if let Some(inner) = self.inner.take() {
            finish(&inner, result);
        }
    }
}

fn finish(inner: &Inner, result: Result<(), TransferError>) {
    {
        let mut g = inner.result.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(result);
        }
    }
    inner.cv.notify_all();
    inner.notify.notify_waiters();
}

impl Drop for Completer {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            finish(
                &inner,
                Err(TransferError::Closed {
                    transport: self.transport,
                }),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn wait_returns_the_result_or_times_out() {
        let (c, done) = Completion::pending("put", "test");
        let t = Instant::now() + Duration::from_millis(20);
        assert!(matches!(c.wait(t), Err(TransferError::Timeout { .. })));
        let h = std::thread::spawn(move || done.complete(Ok(())));
        c.wait(Instant::now() + Duration::from_secs(10)).unwrap();
        h.join().unwrap();
    }

    #[test]
    fn dropped_completer_is_a_closed_error() {
        let (c, done) = Completion::pending("flush", "test");
        drop(done);
        assert!(matches!(
            c.wait(Instant::now() + Duration::from_secs(1)),
            Err(TransferError::Closed { .. })
        ));
    }

    #[tokio::test]
    async fn async_wait_sees_completion_from_another_thread() {
        let (c, done) = Completion::pending("put", "test");
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            done.complete(Ok(()));
        });
        c.wait_async(Instant::now() + Duration::from_secs(10))
            .await
            .unwrap();
        let (c2, _keep) = Completion::pending("put", "test");
        assert!(
            c2.wait_async(Instant::now() + Duration::from_millis(10))
                .await
                .is_err()
        );
    }
}
