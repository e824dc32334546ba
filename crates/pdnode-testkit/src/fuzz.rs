//! Bounded fuzz targets on proptest (stable Rust) that keep what they find.
//!
//! A target ([`Fuzz`]) runs until its case count or its time budget is reached, whichever comes
//! first, in chunks of [`CHUNK`] cases (the budget is checked between chunks). Every failure is
//! appended to the target's regression file (`tests/regressions/<target>.txt` of its crate, see
//! [`fuzz_regressions!`](crate::fuzz_regressions)), and every run replays the seeds in that file
//! before it generates new cases: a crash found once is checked on every later run once the
//! file is committed (CI prints the seed line to add when it finds one).
//!
//! The budget comes from the environment, for longer local runs (docs/testing.md):
//! - neither variable set (CI): the target's own case count, at most [`DEFAULT_TIME`];
//! - `PDNODE_FUZZ_CASES=N`: `N` cases per target (no time limit unless also set);
//! - `PDNODE_FUZZ_SECS=S`: `S` seconds per target (no case limit unless also set).

use proptest::strategy::Strategy;
use proptest::test_runner::{
    Config, FailurePersistence, FileFailurePersistence, PersistedSeed, TestCaseResult, TestError,
    TestRunner,
};
use std::any::Any;
use std::time::{Duration, Instant};

/// Cases per chunk: the time budget is looked at every this many cases.
pub const CHUNK: u32 = 32;

/// A target's time budget when the environment sets none.
pub const DEFAULT_TIME: Duration = Duration::from_secs(30);

/// The environment variable with the cases per target.
pub const CASES_VAR: &str = "PDNODE_FUZZ_CASES";
/// The environment variable with the seconds per target.
pub const SECS_VAR: &str = "PDNODE_FUZZ_SECS";

/// The regression file of fuzz target `$target` in the calling crate:
/// `<crate>/tests/regressions/<target>.txt`.
#[macro_export]
macro_rules! fuzz_regressions {
    ($target:literal) => {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/regressions/",
            $target,
            ".txt"
        )
    };
}

/// A fuzz budget value that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?}: expected a positive whole number")]
pub struct BudgetError {
    pub var: &'static str,
    pub value: String,
}

/// How long a target runs: at most `cases` cases and at most `time`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub cases: u32,
    pub time: Duration,
}

impl Budget {
    /// The budget of a target whose own case count is `cases`, given the values of
    /// [`CASES_VAR`] and [`SECS_VAR`] (`None`: unset).
    pub fn from_vars(
        cases: u32,
        env_cases: Option<&str>,
        env_secs: Option<&str>,
    ) -> Result<Self, BudgetError> {
        let parse = |var: &'static str, v: &str| {
            v.trim()
                .parse::<u64>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| BudgetError {
                    var,
                    value: v.to_string(),
                })
        };
        let env_cases = env_cases.map(|v| parse(CASES_VAR, v)).transpose()?;
        let env_secs = env_secs.map(|v| parse(SECS_VAR, v)).transpose()?;
        Ok(match (env_cases, env_secs) {
            (None, None) => Budget {
                cases,
                time: DEFAULT_TIME,
            },
            (c, s) => Budget {
                cases: c.map_or(u32::MAX, |c| u32::try_from(c).unwrap_or(u32::MAX)),
                time: s.map_or(Duration::MAX, Duration::from_secs),
            },
        })
    }

    /// The budget from the process environment.
    pub fn from_env(cases: u32) -> Result<Self, BudgetError> {
        let var = |name| std::env::var(name).ok();
        Self::from_vars(cases, var(CASES_VAR).as_deref(), var(SECS_VAR).as_deref())
    }
}

/// What a run did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ran {
    /// New cases run (replayed regressions not counted).
    pub cases: u32,
    pub elapsed: Duration,
    /// Whether the time budget ended the run before the case count.
    pub out_of_time: bool,
}

/// One fuzz target: its regression file and its budget.
#[derive(Debug, Clone)]
pub struct Fuzz {
    regressions: &'static str,
    budget: Budget,
}

impl Fuzz {
    /// A target of `cases` cases (what CI runs) keeping its failures in `regressions`
    /// ([`fuzz_regressions!`](crate::fuzz_regressions)); the environment may change the budget.
    /// Panics on a budget variable that does not parse (a test's setup error).
    pub fn new(regressions: &'static str, cases: u32) -> Self {
        let budget = Budget::from_env(cases).unwrap_or_else(|e| panic!("{e}"));
        Self::with_budget(regressions, budget)
    }

    /// A target with a fixed budget (no environment).
    pub fn with_budget(regressions: &'static str, budget: Budget) -> Self {
        Self {
            regressions,
            budget,
        }
    }

    pub fn budget(&self) -> Budget {
        self.budget
    }

    /// Runs `test` over `strategy`: first the seeds of the regression file, then new cases
    /// until the budget is spent. A failure (after shrinking) is saved to the regression file
    /// and returned.
    pub fn run<S: Strategy>(
        &self,
        strategy: &S,
        test: impl Fn(S::Value) -> TestCaseResult,
    ) -> Result<Ran, TestError<S::Value>> {
        let start = Instant::now();
        // Derives each chunk's random stream (PROPTEST_RNG_SEED makes the whole run repeat).
        let mut seeds = TestRunner::new(Config {
            failure_persistence: None,
            ..Config::default()
        });
        let mut done = 0u32;
        let mut out_of_time = false;
        while done < self.budget.cases {
            if done > 0 && start.elapsed() >= self.budget.time {
                out_of_time = true;
                break;
            }
            let n = (self.budget.cases - done).min(CHUNK);
            let file = FileFailurePersistence::Direct(self.regressions);
            // The first chunk replays the file; every chunk saves what fails.
            let persistence: Box<dyn FailurePersistence> = if done == 0 {
                Box::new(file)
            } else {
                Box::new(SaveOnly(file))
            };
            let config = Config {
                cases: n,
                failure_persistence: Some(persistence),
                ..Config::default()
            };
            TestRunner::new_with_rng(config, seeds.new_rng()).run(strategy, &test)?;
            done += n;
        }
        let ran = Ran {
            cases: done,
            elapsed: start.elapsed(),
            out_of_time,
        };
        eprintln!(
            "fuzz: {} cases in {:.1} s{} (regressions: {})",
            ran.cases,
            ran.elapsed.as_secs_f64(),
            if out_of_time {
                ", stopped by the time budget"
            } else {
                ""
            },
            self.regressions
        );
        Ok(ran)
    }
}

/// Saves failures like the file it wraps, replays nothing (the first chunk did).
#[derive(Debug, Clone, PartialEq)]
struct SaveOnly(FileFailurePersistence);

impl FailurePersistence for SaveOnly {
    fn load_persisted_failures2(&self, _source_file: Option<&'static str>) -> Vec<PersistedSeed> {
        Vec::new()
    }

    fn save_persisted_failure2(
        &mut self,
        source_file: Option<&'static str>,
        seed: PersistedSeed,
        shrunken_value: &dyn std::fmt::Debug,
    ) {
        self.0
            .save_persisted_failure2(source_file, seed, shrunken_value);
    }

    fn box_clone(&self) -> Box<dyn FailurePersistence> {
        Box::new(self.clone())
    }

    fn eq(&self, other: &dyn FailurePersistence) -> bool {
        other
            .as_any()
            .downcast_ref::<Self>()
            .is_some_and(|o| o == self)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn budgets_from_the_environment() {
        let b = |c, s| Budget::from_vars(500, c, s);
        assert_eq!(
            b(None, None),
            Ok(Budget {
                cases: 500,
                time: DEFAULT_TIME
            })
        );
        assert_eq!(
            b(Some("100000"), None),
            Ok(Budget {
                cases: 100_000,
                time: Duration::MAX
            })
        );
        assert_eq!(
            b(None, Some("600")),
            Ok(Budget {
                cases: u32::MAX,
                time: Duration::from_secs(600)
            })
        );
        assert_eq!(
            b(Some(" 7 "), Some("9")),
            Ok(Budget {
                cases: 7,
                time: Duration::from_secs(9)
            })
        );
        assert_eq!(b(Some("99999999999"), None).map(|b| b.cases), Ok(u32::MAX));
        for bad in ["0", "-1", "ten", ""] {
            assert_eq!(
                b(Some(bad), None),
                Err(BudgetError {
                    var: CASES_VAR,
                    value: bad.into()
                })
            );
            assert!(b(None, Some(bad)).is_err());
        }
    }

    fn leaked_path(dir: &tempfile::TempDir) -> &'static str {
        let p = dir.path().join("regressions").join("t.txt");
        Box::leak(p.to_string_lossy().into_owned().into_boxed_str())
    }

    #[test]
    fn a_failure_is_saved_and_replayed_once_on_every_later_run() {
        let dir = tempfile::tempdir().unwrap();
        let path = leaked_path(&dir);
        let budget = Budget {
            cases: 2 * CHUNK,
            time: Duration::from_secs(60),
        };
        let fuzz = Fuzz::with_budget(path, budget);
        // Fails for values >= 1000: shrinks to exactly 1000, and is saved.
        let err = fuzz
            .run(&(1000u32..100_000), |v| {
                prop_assert!(v < 1000);
                Ok(())
            })
            .unwrap_err();
        assert!(matches!(err, TestError::Fail(_, 1000)), "{err:?}");
        let saved = std::fs::read_to_string(path).unwrap();
        assert_eq!(saved.lines().filter(|l| l.starts_with("cc ")).count(), 1);
        // Every later run runs the saved case once more than its new cases (in its first
        // chunk only), and counts only the new ones.
        for _ in 0..2 {
            let calls = AtomicU32::new(0);
            let ran = fuzz
                .run(&(0u32..100_000), |_| {
                    calls.fetch_add(1, Ordering::Relaxed);
                    Ok(())
                })
                .unwrap();
            assert_eq!(ran.cases, 2 * CHUNK);
            assert!(!ran.out_of_time);
            assert_eq!(calls.load(Ordering::Relaxed), 2 * CHUNK + 1);
        }
    }

    #[test]
    fn the_time_budget_ends_a_run_between_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let fuzz = Fuzz::with_budget(
            leaked_path(&dir),
            Budget {
                cases: u32::MAX,
                time: Duration::from_millis(200),
            },
        );
        let ran = fuzz
            .run(&any::<u8>(), |_| {
                std::thread::sleep(Duration::from_millis(1));
                Ok(())
            })
            .unwrap();
        assert!(ran.out_of_time);
        assert!(
            ran.cases >= CHUNK && ran.cases.is_multiple_of(CHUNK),
            "{ran:?}"
        );
        // At most one chunk (32 ms of sleeps, plus overhead) past the budget.
        assert!(ran.elapsed < Duration::from_secs(2), "{ran:?}");
        assert!(!std::path::Path::new(fuzz.regressions).exists());
    }
}
