//! The EngineActor's decisions, without a runtime.

use super::messages::EngineHealth;
use pdnode_engine::engine::EngineError;

/// Consecutive failed load reads after which the engine counts as unhealthy.
pub const UNHEALTHY_AFTER: u32 = 3;

#[derive(Debug, Default, Clone, PartialEq)]
pub struct EngineActorState {
    pub admitting: bool,
    pub consecutive_errors: u32,
    pub last_error: Option<EngineError>,
}

impl EngineActorState {
    pub fn new() -> Self {
        Self {
            admitting: true,
            ..Self::default()
        }
    }

    pub fn on_load(&mut self, r: &Result<(), EngineError>) {
        match r {
            Ok(()) => {
                self.consecutive_errors = 0;
                self.last_error = None;
            }
            Err(e) => {
                self.consecutive_errors = self.consecutive_errors.saturating_add(1);
                self.last_error = Some(e.clone());
            }
        }
    }

    pub fn health(&self, backend: &str) -> EngineHealth {
        if !self.admitting {
            return EngineHealth {
                serving: false,
                detail: "draining: not admitting new requests".into(),
            };
        }
        if self.consecutive_errors >= UNHEALTHY_AFTER {
            return EngineHealth {
                serving: false,
                detail: format!(
                    "engine ({backend}) did not answer {} load reads: {}",
                    self.consecutive_errors,
                    self.last_error
                        .as_ref()
                        .map(ToString::to_string)
                        .unwrap_or_default()
                ),
            };
        }
        EngineHealth {
            serving: true,
            detail: format!("engine ({backend}) serving"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unhealthy_after_repeated_errors_and_while_draining() {
        let mut s = EngineActorState::new();
        assert!(s.health("mock").serving);
        for _ in 0..UNHEALTHY_AFTER {
            s.on_load(&Err(EngineError::Timeout {
                op: "stats",
                after: std::time::Duration::from_secs(1),
            }));
        }
        let h = s.health("mock");
        assert!(!h.serving && h.detail.contains("timed out"), "{h:?}");
        s.on_load(&Ok(()));
        assert!(s.health("mock").serving);
        s.admitting = false;
        assert!(!s.health("mock").serving);
    }
}
