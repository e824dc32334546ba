//! Every duration key of the configuration with its bounds: a value outside them is an error,
//! never a deadline that overflows (`Instant + Duration`).

use super::super::schema::*;

/// A duration's unit, as errors name it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Unit {
    pub(super) name: &'static str,
}

const SECONDS: Unit = Unit { name: "seconds" };
const MILLIS: Unit = Unit { name: "ms" };
const MICROS: Unit = Unit { name: "us" };

/// The longest duration any key may set: a day. Past any sane timeout, and small enough that
/// deadlines built from a few of them (`Instant::now() + a + b`) never overflow.
const DAY_S: u64 = 86_400;

pub(super) struct DurationKey {
    pub(super) key: &'static str,
    pub(super) value: u64,
    pub(super) unit: Unit,
    pub(super) min: u64,
    pub(super) max: u64,
}

/// Every duration in the configuration, with its bounds (in its own unit). A key whose name says
/// it is a duration (`_s`, `_ms`, `_us`, `_secs`, `_us_per_token`) must be listed here; the
/// config tests check that each one refuses an out-of-range value.
pub(super) fn durations(c: &Config) -> Vec<DurationKey> {
    let d = |key, value, unit: Unit, min, max| DurationKey {
        key,
        value,
        unit,
        min,
        max,
    };
    let (r, sg) = (&c.router, &c.router.sglang);
    vec![
        d(
            "node.drain_timeout_s",
            c.node.drain_timeout_s,
            SECONDS,
            0,
            DAY_S,
        ),
        d(
            "node.engine_stall_ms",
            c.node.engine_stall_ms,
            MILLIS,
            0,
            3_600_000,
        ),
        d("router.slo.queue_ms", r.slo.queue_ms, MILLIS, 0, 3_600_000),
        d(
            "router.rebalance.interval_ms",
            r.rebalance.interval_ms,
            MILLIS,
            100,
            3_600_000,
        ),
        d(
            "registry.lease_ttl_s",
            c.registry.lease_ttl_s,
            SECONDS,
            2,
            3_600,
        ),
        d(
            "registry.start_wait_s",
            c.registry.start_wait_s,
            SECONDS,
            0,
            DAY_S,
        ),
        d(
            "registry.timeout_ms",
            c.registry.timeout_ms,
            MILLIS,
            1,
            3_600_000,
        ),
        // Slept per forward step, times the step's tokens: 10 s a token is plenty to simulate.
        d(
            "engine.mock.prefill_us_per_token",
            c.engine.mock.prefill_us_per_token,
            MICROS,
            0,
            10_000_000,
        ),
        d(
            "engine.mock.decode_us_per_token",
            c.engine.mock.decode_us_per_token,
            MICROS,
            0,
            10_000_000,
        ),
        d(
            "telemetry.batch_delay_ms",
            c.telemetry.batch_delay_ms,
            MILLIS,
            1,
            3_600_000,
        ),
        d(
            "transfer.lease_ms",
            c.transfer.lease_ms,
            MILLIS,
            100,
            3_600_000,
        ),
        d(
            "transfer.stall_ms",
            c.transfer.stall_ms,
            MILLIS,
            10,
            3_600_000,
        ),
        // A routing key must expire within a year (the `manual` policy's idle limit).
        d(
            "router.manual.max_idle_secs",
            r.manual.max_idle_secs,
            SECONDS,
            1,
            365 * DAY_S,
        ),
        d(
            "router.request_timeout_s",
            r.request_timeout_s,
            SECONDS,
            1,
            DAY_S,
        ),
        d(
            "router.prefill_timeout_s",
            r.prefill_timeout_s,
            SECONDS,
            1,
            DAY_S,
        ),
        d(
            "router.token_timeout_s",
            r.token_timeout_s,
            SECONDS,
            1,
            DAY_S,
        ),
        d(
            "router.client_send_timeout_s",
            r.client_send_timeout_s,
            SECONDS,
            1,
            DAY_S,
        ),
        d(
            "router.node_keepalive_interval_ms",
            r.node_keepalive_interval_ms,
            MILLIS,
            10,
            3_600_000,
        ),
        d(
            "router.node_keepalive_timeout_ms",
            r.node_keepalive_timeout_ms,
            MILLIS,
            10,
            3_600_000,
        ),
        d(
            "router.cache_aware.eviction_interval_secs",
            r.cache_aware.eviction_interval_secs,
            SECONDS,
            1,
            DAY_S,
        ),
        d(
            "router.power_of_two.load_refresh_ms",
            r.power_of_two.load_refresh_ms,
            MILLIS,
            50,
            3_600_000,
        ),
        d(
            "router.bucket.rebalance_interval_secs",
            r.bucket.rebalance_interval_secs,
            SECONDS,
            1,
            DAY_S,
        ),
        d(
            "router.sglang.health_check_interval_s",
            sg.health_check_interval_s,
            SECONDS,
            1,
            DAY_S,
        ),
        d(
            "router.sglang.health_check_timeout_s",
            sg.health_check_timeout_s,
            SECONDS,
            1,
            3_600,
        ),
        d(
            "router.sglang.breaker_timeout_s",
            sg.breaker_timeout_s,
            SECONDS,
            1,
            DAY_S,
        ),
    ]
}
