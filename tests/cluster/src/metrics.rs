//! `/metrics` (Prometheus text) of the router and the nodes, read with deadlines.

use std::collections::HashMap;
use std::time::Duration;

/// Every scrape and probe ends within this.
const SCRAPE_DEADLINE: Duration = Duration::from_secs(2);

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .tcp_nodelay(true)
        .timeout(SCRAPE_DEADLINE)
        .connect_timeout(SCRAPE_DEADLINE)
        .build()
        .unwrap_or_else(|_| reqwest::Client::new())
}

/// One scrape: series (name with labels, as written) -> value.
#[derive(Debug, Clone, Default)]
pub struct Scrape(HashMap<String, f64>);

impl Scrape {
    pub fn parse(text: &str) -> Self {
        let mut m = HashMap::new();
        for l in text.lines() {
            if l.starts_with('#') {
                continue;
            }
            // The value follows the last space (labels may hold spaces inside quotes).
            if let Some((series, value)) = l.trim().rsplit_once(' ')
                && let Ok(v) = value.parse::<f64>()
            {
                m.insert(series.to_string(), v);
            }
        }
        Self(m)
    }

    pub fn get(&self, series: &str) -> Option<f64> {
        self.0.get(series).copied()
    }
}

pub async fn scrape(url: &str) -> Option<Scrape> {
    let r = client().get(url).send().await.ok()?;
    if !r.status().is_success() {
        return None;
    }
    Some(Scrape::parse(&r.text().await.ok()?))
}

/// What a prefill or decode node holds, from its own `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Held {
    pub running: u64,
    pub queued: u64,
    /// KV blocks owned by a request, and by a transfer lease (cached blocks are not counted:
    /// they are evictable capacity, docs/runtime-semantics.md section 6).
    pub kv_request: u64,
    pub kv_lease: u64,
    pub staging_spans: u64,
}

impl Held {
    pub fn of(m: &Scrape, node: &str) -> Option<Self> {
        let g = |name: &str, labels: &str| -> Option<u64> {
            m.get(&format!("{name}{{node=\"{node}\"{labels}}}"))
                .map(|v| v.max(0.0) as u64)
        };
        Some(Self {
            running: g("pdnode_engine_running_requests", "")?,
            queued: g("pdnode_engine_queue_depth", "")?,
            kv_request: g("pdnode_kv_owned_blocks", ",owner=\"request\"")?,
            kv_lease: g("pdnode_kv_owned_blocks", ",owner=\"transfer_lease\"")?,
            staging_spans: g("pdnode_staging_owned_spans", "")?,
        })
    }

    pub fn kv_blocks(&self) -> u64 {
        self.kv_request + self.kv_lease
    }

    pub fn idle(&self) -> bool {
        *self == Self::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_series_with_labels_and_reads_what_a_node_holds() {
        let text = "# HELP x y\n\
            pdnode_engine_running_requests{node=\"d0\"} 3\n\
            pdnode_engine_queue_depth{node=\"d0\"} 0\n\
            pdnode_kv_owned_blocks{node=\"d0\",owner=\"request\"} 5\n\
            pdnode_kv_owned_blocks{node=\"d0\",owner=\"transfer_lease\"} 2\n\
            pdnode_staging_owned_spans{node=\"d0\"} 1\n\
            garbage line\n";
        let m = Scrape::parse(text);
        let h = Held::of(&m, "d0").expect("all series present");
        assert_eq!(
            h,
            Held {
                running: 3,
                queued: 0,
                kv_request: 5,
                kv_lease: 2,
                staging_spans: 1
            }
        );
        assert!(!h.idle());
        assert!(Held::of(&m, "other").is_none(), "absent series are not 0");
    }
}
