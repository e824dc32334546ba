//! Restart bookkeeping: at most `max_restarts` restarts of one child within `window`, then the
//! supervisor gives up and stops the node.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Restart limits of the NodeSupervisor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartLimits {
    pub max_restarts: usize,
    pub window: Duration,
}

impl Default for RestartLimits {
    /// 5 restarts of one child within 60 s.
    fn default() -> Self {
        Self {
            max_restarts: 5,
            window: Duration::from_secs(60),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Restart,
    GiveUp { restarts: usize },
}

/// Per-child failure history.
#[derive(Debug, Default)]
pub struct RestartPolicy {
    limits: RestartLimits,
    history: HashMap<&'static str, VecDeque<Instant>>,
    totals: HashMap<&'static str, u64>,
}

impl RestartPolicy {
    pub fn new(limits: RestartLimits) -> Self {
        Self {
            limits,
            history: HashMap::new(),
            totals: HashMap::new(),
        }
    }

    pub fn limits(&self) -> RestartLimits {
        self.limits
    }

    /// Records a failure of `child` at `now` and decides.
    pub fn on_failure(&mut self, child: &'static str, now: Instant) -> Decision {
        let h = self.history.entry(child).or_default();
        while h
            .front()
            .is_some_and(|t| now.duration_since(*t) > self.limits.window)
        {
            h.pop_front();
        }
        if h.len() >= self.limits.max_restarts {
            return Decision::GiveUp { restarts: h.len() };
        }
        h.push_back(now);
        *self.totals.entry(child).or_default() += 1;
        Decision::Restart
    }

    /// Restarts so far per child (`pdnode_node_actor_restarts_total{actor}`).
    pub fn totals(&self) -> Vec<(String, u64)> {
        let mut v: Vec<_> = self
            .totals
            .iter()
            .map(|(k, n)| (k.to_string(), *n))
            .collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gives_up_after_the_limit_within_the_window_only() {
        let mut p = RestartPolicy::new(RestartLimits {
            max_restarts: 3,
            window: Duration::from_secs(10),
        });
        let t0 = Instant::now();
        for i in 0..3 {
            assert_eq!(
                p.on_failure("engine", t0 + Duration::from_secs(i)),
                Decision::Restart
            );
        }
        assert_eq!(
            p.on_failure("engine", t0 + Duration::from_secs(3)),
            Decision::GiveUp { restarts: 3 }
        );
        // Another child has its own budget.
        assert_eq!(p.on_failure("registrar", t0), Decision::Restart);
        // Old failures leave the window.
        assert_eq!(
            p.on_failure("engine", t0 + Duration::from_secs(12)),
            Decision::Restart
        );
        assert_eq!(
            p.totals(),
            vec![("engine".to_string(), 4), ("registrar".to_string(), 1)]
        );
    }
}
