//! Waiting on conditions with a deadline, never fixed sleeps.

use crate::TestkitError;
use std::future::Future;
use std::time::{Duration, Instant};

const POLL: Duration = Duration::from_millis(25);

/// Polls `cond` every 25 ms until it returns true or `deadline` passes; `what` names the
/// condition in the error.
pub fn wait_for(
    what: &str,
    deadline: Duration,
    mut cond: impl FnMut() -> bool,
) -> Result<(), TestkitError> {
    let start = Instant::now();
    loop {
        if cond() {
            return Ok(());
        }
        if start.elapsed() >= deadline {
            return Err(TestkitError::Timeout {
                what: what.to_string(),
                waited: deadline,
            });
        }
        std::thread::sleep(POLL);
    }
}

/// Async twin of [`wait_for`]: polls an async condition every 25 ms (tokio time) until it
/// returns true or `deadline` passes.
pub async fn wait_for_async<F, Fut>(
    what: &str,
    deadline: Duration,
    mut cond: F,
) -> Result<(), TestkitError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = tokio::time::Instant::now();
    loop {
        if cond().await {
            return Ok(());
        }
        if start.elapsed() >= deadline {
            return Err(TestkitError::Timeout {
                what: what.to_string(),
                waited: deadline,
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_for_times_out_and_succeeds() {
        let e = wait_for("never", Duration::from_millis(60), || false).unwrap_err();
        assert!(matches!(e, TestkitError::Timeout { .. }));
        let mut n = 0;
        wait_for("third poll", Duration::from_secs(5), || {
            n += 1;
            n >= 3
        })
        .unwrap();
        assert_eq!(n, 3);
    }
}
