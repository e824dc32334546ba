//! The fault cases: a fresh cluster each, load at concurrency 64, one fault, then the checks
//! (`drive`).

use crate::cluster::{EngineKind, Extra};
use crate::net;
use std::time::Duration;

pub const CONCURRENCY: usize = 64;
/// A completed request that waited longer than this for its next byte after the fault counts
/// as affected by it.
pub const STALL: Duration = Duration::from_secs(1);
/// The goal for the end of the last affected request after the fault.
pub const GOAL: Duration = Duration::from_secs(2);
/// The lease TTL of the multi-host files (`registry.lease_ttl_s`): a node joining (or coming
/// back) must be in the router's view and take traffic within this.
pub const LEASE_TTL: Duration = Duration::from_secs(10);
/// `transfer.lease_ms` of the `router-restart` case: the longest a node may hold what a dead
/// router's requests left (a reservation whose `Decode` never came).
pub const SHORT_TRANSFER_LEASE: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Prefill0,
    Decode0,
    Decode1,
}

impl Target {
    pub fn host(self) -> net::Host {
        match self {
            Target::Prefill0 => net::PREFILL[0],
            Target::Decode0 => net::DECODE[0],
            Target::Decode1 => net::DECODE[1],
        }
    }
}

/// What a [`Fault::DuringLinkDown`] does to its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sig {
    Kill,
    Stop,
}

#[derive(Debug, Clone, Copy)]
pub enum Fault {
    None,
    Kill(Target),
    /// SIGSTOP, hold, SIGCONT.
    Stop(Target, Duration),
    /// A direct link down (on its `b` end), hold, up.
    LinkDown(net::Link, Duration),
    /// etcd SIGSTOPped, hold, SIGCONT.
    EtcdStop(Duration),
    /// A direct link down; once the pushes over it stall (`after`), the target signalled
    /// (`Sig::Kill`, or `Sig::Stop`: SIGCONTed when the link is up again); the link up again
    /// after `hold`.
    DuringLinkDown {
        link: net::Link,
        target: Target,
        sig: Sig,
        after: Duration,
        hold: Duration,
    },
    /// SIGTERM: a graceful drain; the process must exit 0 within its drain timeout.
    Drain(Target),
    /// The router SIGKILLed; once every node dropped what the dead router's requests held
    /// (blocks within the transfer lease, staging spans one lease later: a prefill node may
    /// still be pushing until then; and slack), started again on the same host.
    RouterRestart {
        lease: Duration,
    },
    /// A third prefill host ([`net::SPARE_PREFILL`]) started under load.
    PrefillJoin,
    /// etcd SIGKILLed for `down`; `join_after` into the outage a third prefill host starts
    /// (started again each time it exits, as systemd's `Restart=on-failure` would: a node
    /// exits 1 when the registry is unreachable at start); then etcd starts again on its data
    /// directory.
    EtcdOutageJoin {
        down: Duration,
        join_after: Duration,
    },
}

/// When the fault is injected.
#[derive(Debug, Clone, Copy)]
pub enum Trigger {
    After(Duration),
    /// Once the node runs (or queues) at least this many requests.
    Busy(Target, u64),
    /// Once the node queues at least this many requests (its running batch is full).
    Queued(Target, u64),
}

/// What the clients must see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Every request completes.
    AllComplete,
    /// Some requests fail with a clear error (the fault hit them), none hang.
    SomeFail,
    /// Every request ends with tokens or a clear error, none hangs: a fault whose requests
    /// are retried when nothing was streamed yet and fail clearly otherwise, and which may
    /// catch a stream or not.
    EveryEnds,
    /// The router itself goes away: requests it held when it died, and those sent while it was
    /// down, may end cut or refused (no process is left to send an error); every other request
    /// completes, and some complete after its restart (the clients reconnected).
    CompleteOutsideOutage,
}

pub struct Case {
    pub name: &'static str,
    pub what: &'static str,
    pub extra: Extra,
    pub max_tokens: u32,
    pub prompt_len: usize,
    pub trigger: Trigger,
    pub fault: Fault,
    /// Load after the fault is over.
    pub tail: Duration,
    pub expect: Expect,
}

fn sets(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// 20 ms a decode step, 100 tokens: 2 s streams, so a fault lands mid-decode.
fn long_decode() -> Extra {
    Extra {
        decode: sets(&[
            "engine.mock.decode_us_per_token=20000",
            "engine.mock.output_len=100",
        ]),
        ..Extra::default()
    }
}

/// 200 us a prompt token, 64 tokens a step: a queue of prefills to hit; short decodes.
fn slow_prefill() -> Extra {
    Extra {
        prefill: sets(&[
            "engine.mock.prefill_us_per_token=200",
            "engine.max_batch_tokens=64",
        ]),
        decode: sets(&[
            "engine.mock.decode_us_per_token=1000",
            "engine.mock.output_len=4",
        ]),
        ..Extra::default()
    }
}

/// Two prompts at a time on each prefill node, 300 us a prompt token, one prompt a step: the
/// prefill queues fill under 64 clients.
fn queued_prefill() -> Extra {
    Extra {
        prefill: sets(&[
            "engine.mock.prefill_us_per_token=300",
            "engine.max_batch_tokens=64",
            "engine.max_running_requests=2",
        ]),
        decode: sets(&[
            "engine.mock.decode_us_per_token=1000",
            "engine.mock.output_len=4",
        ]),
        ..Extra::default()
    }
}

/// Four streams at a time on each decode node (2 s each): the decode queues fill.
fn queued_decode() -> Extra {
    Extra {
        decode: sets(&[
            "engine.mock.decode_us_per_token=20000",
            "engine.mock.output_len=100",
            "engine.max_running_requests=4",
        ]),
        ..Extra::default()
    }
}

/// Decode nodes that drain by migrating their streams, 20 ms a decode step, 100-token streams.
fn migrating_decode() -> Extra {
    Extra {
        decode: sets(&[
            "node.drain=\"migrate\"",
            "engine.mock.decode_us_per_token=20000",
            "engine.mock.output_len=100",
        ]),
        ..Extra::default()
    }
}

/// The transfer lease of every node cut to [`SHORT_TRANSFER_LEASE`], so what a dead router's
/// requests left must be gone within seconds.
fn short_lease() -> Extra {
    let lease = format!("transfer.lease_ms={}", SHORT_TRANSFER_LEASE.as_millis());
    Extra {
        prefill: vec![lease.clone()],
        decode: vec![lease],
        ..Extra::default()
    }
}

/// The `--quick` matrix (mock engines).
pub fn quick() -> Vec<Case> {
    let s = Duration::from_secs;
    vec![
        Case {
            name: "baseline",
            what: "no fault",
            extra: Extra::default(),
            max_tokens: 32,
            prompt_len: 64,
            trigger: Trigger::After(s(1)),
            fault: Fault::None,
            tail: s(2),
            expect: Expect::AllComplete,
        },
        Case {
            name: "decode-kill",
            what: "decode0 SIGKILLed while decoding",
            extra: long_decode(),
            max_tokens: 100,
            prompt_len: 64,
            trigger: Trigger::Busy(Target::Decode0, 8),
            fault: Fault::Kill(Target::Decode0),
            tail: s(3),
            expect: Expect::SomeFail,
        },
        Case {
            name: "decode-stop",
            what: "decode0 SIGSTOPped 5 s while decoding",
            extra: long_decode(),
            max_tokens: 100,
            prompt_len: 64,
            trigger: Trigger::Busy(Target::Decode0, 8),
            fault: Fault::Stop(Target::Decode0, s(5)),
            tail: s(2),
            expect: Expect::SomeFail,
        },
        Case {
            name: "prefill-stop",
            what: "prefill0 SIGSTOPped 5 s while prefilling",
            extra: slow_prefill(),
            max_tokens: 4,
            prompt_len: 60,
            trigger: Trigger::Busy(Target::Prefill0, 2),
            fault: Fault::Stop(Target::Prefill0, s(5)),
            tail: s(2),
            expect: Expect::AllComplete,
        },
        Case {
            name: "prefill-kill",
            what: "prefill0 SIGKILLed while prefilling",
            extra: slow_prefill(),
            max_tokens: 4,
            prompt_len: 60,
            trigger: Trigger::Busy(Target::Prefill0, 2),
            fault: Fault::Kill(Target::Prefill0),
            tail: s(3),
            expect: Expect::AllComplete,
        },
        Case {
            name: "link-down",
            what: "prefill0 <-> decode0 link down 10 s",
            extra: Extra::default(),
            max_tokens: 32,
            prompt_len: 64,
            trigger: Trigger::After(s(2)),
            fault: Fault::LinkDown(net::KV_LINK, s(10)),
            tail: s(3),
            expect: Expect::AllComplete,
        },
        Case {
            name: "router-cut",
            what: "router <-> decode1 link down 10 s while decoding",
            extra: long_decode(),
            max_tokens: 100,
            prompt_len: 64,
            trigger: Trigger::Busy(Target::Decode1, 8),
            fault: Fault::LinkDown(net::ROUTER_LINK, s(10)),
            tail: s(3),
            expect: Expect::SomeFail,
        },
        Case {
            // The pushes in flight stall behind the cut link, then their writer dies: the
            // decode node's spans have no writer left and no record will come (fenced to their
            // deadline); every request is retried on prefill1.
            name: "prefill-kill-pushing",
            what: "prefill0 SIGKILLed while its KV pushes to decode0 stall (link down)",
            extra: Extra::default(),
            max_tokens: 32,
            prompt_len: 64,
            trigger: Trigger::After(s(2)),
            fault: Fault::DuringLinkDown {
                link: net::KV_LINK,
                target: Target::Prefill0,
                sig: Sig::Kill,
                after: Duration::from_millis(500),
                hold: s(3),
            },
            tail: s(3),
            expect: Expect::AllComplete,
        },
        Case {
            // The other end of the same cut: the prefill node's pushes to decode0 stall behind
            // the link, then their reader dies. The pushes fail (the endpoint fails, or the push
            // deadline passes) and the prefill node lives on; requests whose KV was meant for
            // decode0 are retried on decode1 or fail clearly, as do decode0's streams.
            name: "decode-kill-pushing",
            what: "decode0 SIGKILLed while prefill0's KV pushes to it stall (link down)",
            extra: Extra::default(),
            max_tokens: 32,
            prompt_len: 64,
            trigger: Trigger::After(s(2)),
            fault: Fault::DuringLinkDown {
                link: net::KV_LINK,
                target: Target::Decode0,
                sig: Sig::Kill,
                after: Duration::from_millis(500),
                hold: s(3),
            },
            tail: s(3),
            expect: Expect::SomeFail,
        },
        Case {
            // decode0 holds reservations for prefills still running when it dies: those are
            // retried on decode1 (nothing was streamed); a stream it was serving fails clearly.
            name: "decode-kill-reserved",
            what: "decode0 SIGKILLed while prefills for it run (between ReserveKv and Decode)",
            extra: slow_prefill(),
            max_tokens: 4,
            prompt_len: 60,
            trigger: Trigger::Busy(Target::Prefill0, 2),
            fault: Fault::Kill(Target::Decode0),
            tail: s(3),
            expect: Expect::EveryEnds,
        },
        Case {
            name: "etcd-stop",
            what: "etcd SIGSTOPped 4 s (within the 10 s lease TTL)",
            extra: Extra::default(),
            max_tokens: 32,
            prompt_len: 64,
            trigger: Trigger::After(s(1)),
            fault: Fault::EtcdStop(s(4)),
            tail: s(3),
            expect: Expect::AllComplete,
        },
        Case {
            // etcd, back after more than a TTL without keepalives, may expire every lease
            // before the nodes' next keepalive lands: the router keeps a role's last cards
            // for a grace while none is listed, and a watched node that still answers keeps
            // its requests.
            name: "etcd-stop-long",
            what: "etcd SIGSTOPped 15 s (past the 10 s lease TTL)",
            extra: Extra::default(),
            max_tokens: 32,
            prompt_len: 64,
            trigger: Trigger::After(s(1)),
            fault: Fault::EtcdStop(s(15)),
            tail: s(3),
            expect: Expect::AllComplete,
        },
        Case {
            name: "prefill-kill-queued",
            what: "prefill0 SIGKILLed with 4+ prompts queued (2 running at most)",
            extra: queued_prefill(),
            max_tokens: 4,
            prompt_len: 60,
            trigger: Trigger::Queued(Target::Prefill0, 4),
            fault: Fault::Kill(Target::Prefill0),
            tail: s(3),
            expect: Expect::AllComplete,
        },
        Case {
            name: "prefill-stop-queued",
            what: "prefill0 SIGSTOPped 5 s with 4+ prompts queued (2 running at most)",
            extra: queued_prefill(),
            max_tokens: 4,
            prompt_len: 60,
            trigger: Trigger::Queued(Target::Prefill0, 4),
            fault: Fault::Stop(Target::Prefill0, s(5)),
            tail: s(2),
            expect: Expect::AllComplete,
        },
        Case {
            // The queued requests' KV is on decode0 already (reserved and handed off): they
            // end with a clear error or are retried; the running streams fail clearly.
            name: "decode-kill-queued",
            what: "decode0 SIGKILLed with 4+ streams queued (4 running at most)",
            extra: queued_decode(),
            max_tokens: 100,
            prompt_len: 64,
            trigger: Trigger::Queued(Target::Decode0, 4),
            fault: Fault::Kill(Target::Decode0),
            tail: s(3),
            expect: Expect::SomeFail,
        },
        Case {
            name: "prefill-drain",
            what: "prefill0 sent SIGTERM (graceful drain) with 2+ prefills on it",
            extra: slow_prefill(),
            max_tokens: 4,
            prompt_len: 60,
            trigger: Trigger::Busy(Target::Prefill0, 2),
            fault: Fault::Drain(Target::Prefill0),
            tail: s(2),
            expect: Expect::AllComplete,
        },
        Case {
            // node.drain = "migrate": decode0's running streams move to decode1 (parked, KV
            // pushed over UCX, continued by the router); every request completes.
            name: "decode-drain-migrate",
            what: "decode0 sent SIGTERM (drain by migration) with 8+ streams on it",
            extra: migrating_decode(),
            max_tokens: 100,
            prompt_len: 64,
            trigger: Trigger::Busy(Target::Decode0, 8),
            fault: Fault::Drain(Target::Decode0),
            tail: s(2),
            expect: Expect::AllComplete,
        },
        Case {
            name: "prefill-join",
            what: "a third prefill host started under load",
            extra: Extra::default(),
            max_tokens: 32,
            prompt_len: 64,
            trigger: Trigger::After(s(2)),
            fault: Fault::PrefillJoin,
            tail: s(2),
            expect: Expect::AllComplete,
        },
        Case {
            name: "router-restart",
            what: "the router SIGKILLed under load, started again once the nodes dropped its requests",
            extra: short_lease(),
            max_tokens: 100,
            prompt_len: 64,
            trigger: Trigger::After(s(2)),
            fault: Fault::RouterRestart {
                lease: SHORT_TRANSFER_LEASE,
            },
            tail: s(3),
            expect: Expect::CompleteOutsideOutage,
        },
        Case {
            // --quick holds the outage 15 s (past the 10 s lease TTL); the 60 s is the
            // same path, longer.
            name: "etcd-outage-join",
            what: "etcd SIGKILLed 15 s, a third prefill host started 2 s into it, etcd restarted on its data",
            extra: Extra::default(),
            max_tokens: 32,
            prompt_len: 64,
            trigger: Trigger::After(s(1)),
            fault: Fault::EtcdOutageJoin {
                down: s(15),
                join_after: s(2),
            },
            tail: s(2),
            expect: Expect::AllComplete,
        },
    ]
}

/// The demo model the `--full` matrix serves (scripts/setup.sh fetches it).
pub const DEMO_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The `--full` matrix: the `--quick` cases on the CPU engine with the demo model, greedy. The
/// mock engine's timings (`engine.mock.*`) go; the real limits a case sets (running requests,
/// step budget, transfer lease) stay. Streams are shorter (16 tokens, 48 where a case needs
/// streams running when the fault lands: four CPU engines share two cores), and etcd's outage
/// with a joining host lasts the 60 s.
pub fn full(model: &std::path::Path) -> Vec<Case> {
    quick()
        .into_iter()
        .chain(beyond_quick())
        .map(|mut c| {
            for sets in [&mut c.extra.prefill, &mut c.extra.decode] {
                sets.retain(|s| !s.starts_with("engine.mock."));
            }
            c.extra.engine = EngineKind::Cpu(model.to_path_buf());
            c.max_tokens = match c.max_tokens {
                100 => 48,
                n => n.min(16),
            };
            // A CPU prefill waits in its queue for seconds: a 5 s transfer lease would expire
            // reservations before their prefill ran. The router's restart case gets 20 s.
            if let Fault::RouterRestart { .. } = c.fault {
                let lease = Duration::from_secs(20);
                let set = format!("transfer.lease_ms={}", lease.as_millis());
                for sets in [&mut c.extra.prefill, &mut c.extra.decode] {
                    sets.retain(|s| !s.starts_with("transfer.lease_ms="));
                    sets.push(set.clone());
                }
                c.fault = Fault::RouterRestart { lease };
            }
            // Four streams at most on each decode node: 48-token streams would queue the 64
            // clients past the 60 s request deadline on one CPU thread.
            if c.name == "decode-kill-queued" || c.name == "decode-stop-queued" {
                c.max_tokens = 16;
            }
            if let Fault::EtcdOutageJoin { join_after, .. } = c.fault {
                c.fault = Fault::EtcdOutageJoin {
                    down: Duration::from_secs(60),
                    join_after,
                };
                c.what = "etcd SIGKILLed 60 s, a third prefill host started 2 s into it, etcd restarted on its data";
            }
            c
        })
        .collect()
}

/// Cases of the full matrix that `--quick` runs only by name (`--case`): they pass, but CI's
/// quick matrix must stay within 5 minutes and these take 35-45 s each on mock engines.
pub fn beyond_quick() -> Vec<Case> {
    let s = Duration::from_secs;
    vec![
        Case {
            // prefill0 frozen while its pushes stall behind the cut link: the router finds it
            // frozen (keepalive) and redoes its prompts on prefill1 (every request completes);
            // once thawed, its late pushes meet fenced or released spans.
            name: "prefill-stop-pushing",
            what: "prefill0 SIGSTOPped while its KV pushes to decode0 stall (link down), SIGCONT at link up",
            extra: Extra::default(),
            max_tokens: 32,
            prompt_len: 64,
            trigger: Trigger::After(s(2)),
            fault: Fault::DuringLinkDown {
                link: net::KV_LINK,
                target: Target::Prefill0,
                sig: Sig::Stop,
                after: Duration::from_millis(500),
                hold: s(3),
            },
            tail: s(3),
            expect: Expect::AllComplete,
        },
        Case {
            // The queued streams' KV is on decode0 already: frozen 5 s, it resumes them (or
            // the router gives up on the frozen node and fails them clearly).
            name: "decode-stop-queued",
            what: "decode0 SIGSTOPped 5 s with 4+ streams queued (4 running at most)",
            extra: queued_decode(),
            max_tokens: 100,
            prompt_len: 64,
            trigger: Trigger::Queued(Target::Decode0, 4),
            fault: Fault::Stop(Target::Decode0, s(5)),
            tail: s(3),
            expect: Expect::SomeFail,
        },
        Case {
            // The plain drain beside `decode-drain-migrate` (docs/benchmarks.md): decode0 waits
            // for its streams to finish before it leaves.
            name: "decode-drain-wait",
            what: "decode0 sent SIGTERM (drain by waiting) with 8+ streams on it",
            extra: Extra {
                decode: sets(&[
                    "engine.mock.decode_us_per_token=20000",
                    "engine.mock.output_len=100",
                ]),
                ..Extra::default()
            },
            max_tokens: 100,
            prompt_len: 64,
            trigger: Trigger::Busy(Target::Decode0, 8),
            fault: Fault::Drain(Target::Decode0),
            tail: s(2),
            expect: Expect::AllComplete,
        },
        Case {
            // decode0 frozen while prefill0's pushes to it stall: the router finds decode0
            // frozen; its streams fail clearly, the prompts meant for it go to decode1. The
            // router's aborts cannot reach the frozen node: prefill0's abandoned fence records
            // (sent once decode0 answers) free those reservations' spans at their lease end.
            name: "decode-stop-pushing",
            what: "decode0 SIGSTOPped while prefill0's KV pushes to it stall (link down), SIGCONT at link up",
            extra: Extra::default(),
            max_tokens: 32,
            prompt_len: 64,
            trigger: Trigger::After(s(2)),
            fault: Fault::DuringLinkDown {
                link: net::KV_LINK,
                target: Target::Decode0,
                sig: Sig::Stop,
                after: Duration::from_millis(500),
                hold: s(3),
            },
            tail: s(3),
            expect: Expect::SomeFail,
        },
    ]
}

/// Cases run only by name (`--case`): known to fail today, kept out of the CI matrix and listed
/// with their figures in docs/benchmarks.md ("Faults").
pub fn known_failing() -> Vec<Case> {
    Vec::new()
}
