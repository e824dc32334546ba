//! One run: send a workload's requests to one endpoint under a concurrency limit, optionally
//! paced by a Poisson process or by trace timestamps.

use crate::client::{Client, RequestResult};
use crate::workload::RequestSpec;
use indicatif::ProgressBar;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// How requests are released.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pacing {
    /// Most requests in flight at once.
    pub concurrency: usize,
    /// Poisson arrivals at this many requests per second; `None`: as fast as `concurrency`
    /// allows. Ignored for requests that carry their own arrival time (traces).
    pub request_rate: Option<f64>,
    /// Seed of the arrival process.
    pub seed: u64,
}

/// Send offsets (seconds after start) for `n` Poisson arrivals at `rate` per second.
pub fn poisson_offsets(n: usize, rate: f64, seed: u64) -> Vec<f64> {
    use rand::Rng;
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            // Exponential inter-arrival: -ln(U) / rate, U in (0, 1].
            let u: f64 = 1.0 - rng.random::<f64>();
            t += -u.ln() / rate;
            t
        })
        .collect()
}

/// Results in the order of `specs`, and the wall time from the first send to the last answer.
pub async fn run(
    client: &Client,
    specs: &[RequestSpec],
    pacing: Pacing,
    progress: &ProgressBar,
) -> (Vec<RequestResult>, f64) {
    let limit = Arc::new(Semaphore::new(pacing.concurrency.max(1)));
    let offsets: Vec<Option<f64>> = match pacing.request_rate {
        Some(rate) if rate > 0.0 && rate.is_finite() => {
            let p = poisson_offsets(specs.len(), rate, pacing.seed);
            specs
                .iter()
                .zip(p)
                .map(|(s, p)| Some(s.arrival_ms.map_or(p, |ms| ms / 1000.0)))
                .collect()
        }
        _ => specs
            .iter()
            .map(|s| s.arrival_ms.map(|ms| ms / 1000.0))
            .collect(),
    };
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, (spec, offset)) in specs.iter().zip(offsets).enumerate() {
        if let Some(off) = offset {
            tokio::time::sleep_until((start + Duration::from_secs_f64(off.max(0.0))).into()).await;
        }
        // The semaphore is never closed, so acquire only fails if it were; then run unlimited.
        let permit = limit.clone().acquire_owned().await.ok();
        let client = client.clone();
        let spec = spec.clone();
        let pb = progress.clone();
        tasks.spawn(async move {
            let r = client.send(&spec).await;
            drop(permit);
            pb.inc(1);
            (i, r, Instant::now())
        });
    }
    let mut results: Vec<Option<RequestResult>> = vec![None; specs.len()];
    let mut end = start;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((i, r, t)) => {
                end = end.max(t);
                results[i] = Some(r);
            }
            Err(e) => tracing::error!("bench task failed: {e}"),
        }
    }
    let results = results
        .into_iter()
        .map(|r| {
            r.unwrap_or_else(|| RequestResult {
                error: Some("internal".into()),
                error_detail: Some("the request task did not finish".into()),
                ttft_s: None,
                itl_s: Vec::new(),
                e2e_s: 0.0,
                input_tokens: 0,
                output_tokens: 0,
            })
        })
        .collect();
    (results, end.duration_since(start).as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_mean_rate() {
        let o = poisson_offsets(20_000, 50.0, 1);
        let rate = o.len() as f64 / o[o.len() - 1];
        assert!((rate - 50.0).abs() < 2.0, "{rate}");
        assert!(o.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(o, poisson_offsets(20_000, 50.0, 1));
    }
}
