//! Workloads: what prompts to send and how long each answer should be.

use crate::error::BenchError;
use crate::text::{keyed_words, words};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One request to send.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSpec {
    pub prompt: String,
    /// Prompt length in words (about one token each); the server's usage replaces it when given.
    pub input_tokens: u32,
    /// `max_tokens` to ask for.
    pub output_tokens: u32,
    /// When to send it, ms after the start of the run (trace replay); `None`: as soon as the
    /// concurrency limit (or the Poisson rate) allows.
    pub arrival_ms: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Workload {
    /// Every request: `input_len` prompt tokens, `output_len` output tokens.
    Fixed { input_len: u32, output_len: u32 },
    /// Lengths uniform in `[len * range_ratio, len]`.
    Random {
        input_len: u32,
        output_len: u32,
        range_ratio: f64,
    },
    /// Long prompts with short answers beside short chats with long answers: the prefill/decode
    /// interference that disaggregation removes.
    Mixed {
        long_input_len: u32,
        long_output_len: u32,
        short_input_len: u32,
        short_output_len: u32,
        /// Fraction of requests that are long.
        long_fraction: f64,
    },
    /// `num_prefixes` groups; each request is its group's `prefix_len` shared words plus
    /// `suffix_len` own words (for cache-aware routing).
    SharedPrefix {
        num_prefixes: u32,
        prefix_len: u32,
        suffix_len: u32,
        output_len: u32,
    },
    /// Replay of a Mooncake-format JSONL trace (`timestamp` ms, `input_length`, `output_length`,
    /// `hash_ids`): requests are sent at their timestamps times `time_scale`; equal hash ids give
    /// equal `block_tokens`-word blocks of text.
    Trace {
        path: PathBuf,
        block_tokens: u32,
        time_scale: f64,
    },
}

/// One line of a Mooncake trace.
#[derive(Debug, Clone, Deserialize)]
struct TraceLine {
    timestamp: f64,
    input_length: u32,
    output_length: u32,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

impl Workload {
    pub fn name(&self) -> &'static str {
        match self {
            Workload::Fixed { .. } => "fixed",
            Workload::Random { .. } => "random",
            Workload::Mixed { .. } => "mixed",
            Workload::SharedPrefix { .. } => "shared-prefix",
            Workload::Trace { .. } => "trace",
        }
    }

    /// Checks the parameters.
    pub fn validate(&self) -> Result<(), BenchError> {
        let bad = |option: &'static str, reason: &str| {
            Err(BenchError::InvalidOption {
                option,
                reason: reason.to_string(),
            })
        };
        match self {
            Workload::Fixed { output_len, .. } if *output_len == 0 => {
                bad("--output-len", "must be at least 1")
            }
            Workload::Random {
                output_len,
                range_ratio,
                ..
            } => {
                if *output_len == 0 {
                    bad("--output-len", "must be at least 1")
                } else if !(0.0..=1.0).contains(range_ratio) {
                    bad("--random-range-ratio", "must be in [0, 1]")
                } else {
                    Ok(())
                }
            }
            Workload::Mixed {
                long_output_len,
                short_output_len,
                long_fraction,
                ..
            } => {
                if *long_output_len == 0 || *short_output_len == 0 {
                    bad("--output-len", "output lengths must be at least 1")
                } else if !(0.0..=1.0).contains(long_fraction) {
                    bad("--long-fraction", "must be in [0, 1]")
                } else {
                    Ok(())
                }
            }
            Workload::SharedPrefix {
                num_prefixes,
                output_len,
                ..
            } => {
                if *num_prefixes == 0 {
                    bad("--num-prefixes", "must be at least 1")
                } else if *output_len == 0 {
                    bad("--output-len", "must be at least 1")
                } else {
                    Ok(())
                }
            }
            Workload::Trace {
                block_tokens,
                time_scale,
                ..
            } => {
                if *block_tokens == 0 {
                    bad("--trace-block-tokens", "must be at least 1")
                } else if !(time_scale.is_finite() && *time_scale >= 0.0) {
                    bad("--trace-time-scale", "must be a finite number >= 0")
                } else {
                    Ok(())
                }
            }
            _ => Ok(()),
        }
    }

    /// The requests of one run: `n` of them (a trace: its first `n` lines; `n = 0`: all).
    /// Deterministic for a given seed.
    pub fn generate(&self, n: usize, seed: u64) -> Result<Vec<RequestSpec>, BenchError> {
        self.validate()?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let spec = |prompt: String, input: u32, output: u32| RequestSpec {
            prompt,
            input_tokens: input,
            output_tokens: output,
            arrival_ms: None,
        };
        Ok(match self {
            Workload::Fixed {
                input_len,
                output_len,
            } => (0..n)
                .map(|_| {
                    spec(
                        words(&mut rng, *input_len as usize),
                        *input_len,
                        *output_len,
                    )
                })
                .collect(),
            Workload::Random {
                input_len,
                output_len,
                range_ratio,
            } => (0..n)
                .map(|_| {
                    let i = uniform(&mut rng, *input_len, *range_ratio);
                    let o = uniform(&mut rng, *output_len, *range_ratio).max(1);
                    spec(words(&mut rng, i as usize), i, o)
                })
                .collect(),
            Workload::Mixed {
                long_input_len,
                long_output_len,
                short_input_len,
                short_output_len,
                long_fraction,
            } => (0..n)
                .map(|_| {
                    let (i, o) = if rng.random_bool(*long_fraction) {
                        (*long_input_len, *long_output_len)
                    } else {
                        (*short_input_len, *short_output_len)
                    };
                    spec(words(&mut rng, i as usize), i, o)
                })
                .collect(),
            Workload::SharedPrefix {
                num_prefixes,
                prefix_len,
                suffix_len,
                output_len,
            } => (0..n)
                .map(|_| {
                    let group = rng.random_range(0..*num_prefixes);
                    let mut p = keyed_words(u64::from(group), *prefix_len as usize);
                    let suffix = words(&mut rng, *suffix_len as usize);
                    if !p.is_empty() && !suffix.is_empty() {
                        p.push(' ');
                    }
                    p.push_str(&suffix);
                    spec(p, prefix_len + suffix_len, *output_len)
                })
                .collect(),
            Workload::Trace {
                path,
                block_tokens,
                time_scale,
            } => read_trace(path, n, *block_tokens, *time_scale)?,
        })
    }
}

fn uniform(rng: &mut impl Rng, len: u32, ratio: f64) -> u32 {
    let lo = ((f64::from(len) * ratio).floor() as u32).min(len);
    rng.random_range(lo..=len)
}

fn read_trace(
    path: &Path,
    n: usize,
    block_tokens: u32,
    time_scale: f64,
) -> Result<Vec<RequestSpec>, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|e| BenchError::Read {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let mut out = Vec::new();
    let mut t0 = None;
    for (i, line) in text.lines().enumerate() {
        if n > 0 && out.len() >= n {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| BenchError::Trace {
            path: path.to_path_buf(),
            line: i + 1,
            reason,
        };
        let l: TraceLine = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        if !(l.timestamp.is_finite() && l.timestamp >= 0.0) {
            return Err(bad(format!(
                "timestamp {} is not a time in ms",
                l.timestamp
            )));
        }
        if l.output_length == 0 {
            return Err(bad("output_length must be at least 1".into()));
        }
        let start = *t0.get_or_insert(l.timestamp);
        if l.timestamp < start {
            return Err(bad("timestamps must not decrease".into()));
        }
        out.push(RequestSpec {
            prompt: trace_prompt(&l, block_tokens, i as u64),
            input_tokens: l.input_length,
            output_tokens: l.output_length,
            arrival_ms: Some((l.timestamp - start) * time_scale),
        });
    }
    if out.is_empty() {
        return Err(BenchError::Trace {
            path: path.to_path_buf(),
            line: 0,
            reason: "no requests in the trace".into(),
        });
    }
    Ok(out)
}

/// Blocks of `block_tokens` words, one per hash id (equal ids, equal text); words past the hash
/// ids are unique to the line.
fn trace_prompt(l: &TraceLine, block_tokens: u32, line_no: u64) -> String {
    let mut left = l.input_length as usize;
    let mut parts = Vec::new();
    for &h in &l.hash_ids {
        if left == 0 {
            break;
        }
        let take = left.min(block_tokens as usize);
        parts.push(keyed_words(h, take));
        left -= take;
    }
    if left > 0 {
        parts.push(keyed_words((1 << 63) | line_no, left));
    }
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_and_random_lengths() {
        let w = Workload::Fixed {
            input_len: 10,
            output_len: 5,
        };
        let r = w.generate(3, 1).unwrap();
        assert_eq!(r.len(), 3);
        assert!(
            r.iter()
                .all(|s| s.prompt.split(' ').count() == 10 && s.output_tokens == 5)
        );
        assert_eq!(r, w.generate(3, 1).unwrap(), "deterministic per seed");

        let w = Workload::Random {
            input_len: 100,
            output_len: 50,
            range_ratio: 0.5,
        };
        for s in w.generate(200, 2).unwrap() {
            assert!((50..=100).contains(&s.input_tokens));
            assert!((25..=50).contains(&s.output_tokens));
            assert_eq!(s.prompt.split(' ').count() as u32, s.input_tokens);
        }
    }

    #[test]
    fn mixed_has_both_kinds() {
        let w = Workload::Mixed {
            long_input_len: 1000,
            long_output_len: 8,
            short_input_len: 20,
            short_output_len: 100,
            long_fraction: 0.3,
        };
        let r = w.generate(200, 3).unwrap();
        let long = r.iter().filter(|s| s.input_tokens == 1000).count();
        assert!((30..=90).contains(&long), "{long}");
    }

    #[test]
    fn shared_prefix_groups_share_text() {
        let w = Workload::SharedPrefix {
            num_prefixes: 2,
            prefix_len: 30,
            suffix_len: 5,
            output_len: 4,
        };
        let r = w.generate(20, 4).unwrap();
        let prefixes: std::collections::HashSet<String> = r
            .iter()
            .map(|s| s.prompt.split(' ').take(30).collect::<Vec<_>>().join(" "))
            .collect();
        assert_eq!(prefixes.len(), 2);
    }

    #[test]
    fn trace_replay_reads_mooncake_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        std::fs::write(
            &p,
            concat!(
                r#"{"timestamp": 1000, "input_length": 10, "output_length": 3, "hash_ids": [1, 2]}"#,
                "\n\n",
                r#"{"timestamp": 1500, "input_length": 12, "output_length": 4, "hash_ids": [1, 3, 9]}"#,
                "\n",
            ),
        )
        .unwrap();
        let w = Workload::Trace {
            path: p.clone(),
            block_tokens: 4,
            time_scale: 2.0,
        };
        let r = w.generate(0, 0).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].arrival_ms, Some(0.0));
        assert_eq!(r[1].arrival_ms, Some(1000.0));
        assert_eq!(r[0].prompt.split(' ').count(), 10);
        assert_eq!(r[1].prompt.split(' ').count(), 12);
        // Same first hash id, same first block.
        let first4 = |s: &str| s.split(' ').take(4).collect::<Vec<_>>().join(" ");
        assert_eq!(first4(&r[0].prompt), first4(&r[1].prompt));
        assert_eq!(w.generate(1, 0).unwrap().len(), 1);

        std::fs::write(&p, "{\"timestamp\": 1}\n").unwrap();
        assert!(matches!(
            w.generate(0, 0),
            Err(BenchError::Trace { line: 1, .. })
        ));
        std::fs::write(&p, "not json\n").unwrap();
        assert!(w.generate(0, 0).is_err());
    }

    #[test]
    fn bad_parameters_are_errors() {
        let w = Workload::Random {
            input_len: 1,
            output_len: 1,
            range_ratio: 2.0,
        };
        assert!(matches!(
            w.generate(1, 0),
            Err(BenchError::InvalidOption {
                option: "--random-range-ratio",
                ..
            })
        ));
    }
}
