//! Checks types cannot express. Every error names the key and the source that set it.

use super::load::{ConfigError, ConfigSource};
use super::pem::FileError;
use super::schema::*;
use super::schema_router::*;
use super::sglang::worker_url_host;
use crate::card::Role;
use std::collections::HashSet;

mod durations;
mod etcd;

use durations::durations;
use etcd::validate_etcd_security;

pub(crate) fn validate(c: &Config, origin: &dyn Fn(&str) -> ConfigSource) -> Vec<ConfigError> {
    let mut errs = Vec::new();
    // Files named by keys: checked here, reported after the rest (they need `origin` too).
    let mut files: Vec<(&'static str, FileError)> = Vec::new();
    let mut bad = |key: &str, reason: String| {
        errs.push(ConfigError::Invalid {
            source_name: origin(key),
            key: key.to_string(),
            reason,
        })
    };

    // node
    if !is_key_segment(&c.node.cluster) {
        bad(
            "node.cluster",
            format!("{:?}: expected 1-128 of [A-Za-z0-9._-]", c.node.cluster),
        );
    }
    if !c.node.id.is_empty() && !is_key_segment(&c.node.id) {
        bad(
            "node.id",
            format!("{:?}: expected 1-128 of [A-Za-z0-9._-]", c.node.id),
        );
    }
    for (key, v, may_be_empty) in [
        ("node.listen", &c.node.listen, false),
        ("node.advertise", &c.node.advertise, true),
        ("node.http_listen", &c.node.http_listen, true),
        ("router.http_listen", &c.router.http_listen, false),
        ("router.grpc_listen", &c.router.grpc_listen, true),
        (
            "router.sglang.prometheus_listen",
            &c.router.sglang.prometheus_listen,
            true,
        ),
    ] {
        if v.is_empty() && may_be_empty {
            continue;
        }
        if !is_host_port(v) {
            bad(
                key,
                format!("{v:?}: expected host:port, e.g. 127.0.0.1:8000"),
            );
        }
    }

    // registry
    match c.registry.kind {
        RegistryKind::Etcd => {
            if c.registry.endpoints.is_empty() {
                bad("registry.endpoints", "registry.kind = \"etcd\" needs at least one endpoint, e.g. [\"http://127.0.0.1:2379\"]".into());
            }
            for e in &c.registry.endpoints {
                if e.is_empty() || e.contains(char::is_whitespace) {
                    bad(
                        "registry.endpoints",
                        format!("{e:?} is not an endpoint URL"),
                    );
                }
            }
        }
        RegistryKind::Memory => {
            // A router in front of a static list of SGLang workers needs no registry.
            let static_sglang = c.node.role == Role::Router
                && c.router.sglang.enabled()
                && !c.router.sglang.discover;
            if c.router.sglang.discover {
                bad(
                    "router.sglang.discover",
                    "needs a shared registry: set registry.kind = \"etcd\"".into(),
                );
            }
            if c.node.role != Role::All && !static_sglang {
                bad(
                    "registry.kind",
                    format!(
                        "\"memory\" only works with node.role = \"all\" (role is \"{}\"): separate processes need \"etcd\"",
                        c.node.role
                    ),
                );
            }
            if !c.registry.endpoints.is_empty() {
                bad("registry.endpoints", "set, but registry.kind is \"memory\": set registry.kind = \"etcd\" or remove the endpoints".into());
            }
        }
    }
    let etcd_keys = [
        ("registry.etcd_tls_ca", &c.registry.etcd_tls_ca),
        ("registry.etcd_tls_cert", &c.registry.etcd_tls_cert),
        ("registry.etcd_tls_key", &c.registry.etcd_tls_key),
        ("registry.etcd_user", &c.registry.etcd_user),
        (
            "registry.etcd_password_file",
            &c.registry.etcd_password_file,
        ),
    ];
    if c.registry.kind == RegistryKind::Etcd {
        files.extend(validate_etcd_security(&c.registry, &mut bad));
    } else {
        for (key, v) in etcd_keys {
            if !v.is_empty() {
                bad(
                    key,
                    "set, but registry.kind is \"memory\": it would do nothing; remove it".into(),
                );
            }
        }
    }

    // model
    let serves_model = c.node.role != Role::Router;
    if serves_model {
        match c.model.format {
            ModelFormat::Dummy => {
                if c.model.preset.is_empty() {
                    bad(
                        "model.preset",
                        format!(
                            "model.format = \"dummy\" needs a shape preset: one of {}",
                            MODEL_PRESETS.join(", ")
                        ),
                    );
                } else if !MODEL_PRESETS
                    .iter()
                    .any(|p| p.eq_ignore_ascii_case(&c.model.preset))
                {
                    bad(
                        "model.preset",
                        format!(
                            "unknown preset {:?}: known presets are {}",
                            c.model.preset,
                            MODEL_PRESETS.join(", ")
                        ),
                    );
                }
            }
            ModelFormat::Hf | ModelFormat::Gguf => {
                if c.model.path.is_empty() {
                    bad(
                        "model.path",
                        "empty: expected an HF model directory or a .gguf file".into(),
                    );
                }
                if !c.model.preset.is_empty() {
                    bad(
                        "model.preset",
                        "only used with model.format = \"dummy\"".into(),
                    );
                }
            }
        }
    }

    // engine
    let e = &c.engine;
    let mut seen = HashSet::new();
    for g in &e.gpus {
        if !seen.insert(*g) {
            bad(
                "engine.gpus",
                format!("GPU {g} is listed twice in {:?}", e.gpus),
            );
        }
    }
    // A CUDA node binds exactly the GPUs it lists, rank `r` on `gpus[r]` (`auto` may resolve to
    // CUDA, so it follows the same rule): never a silent subset of the list.
    let binds_gpus = matches!(e.backend, Backend::Cuda | Backend::Auto);
    if e.tensor_parallel == 0 {
        bad("engine.tensor_parallel", "must be at least 1".into());
    } else if binds_gpus && !e.gpus.is_empty() && e.gpus.len() != e.tensor_parallel as usize {
        let tp = e.tensor_parallel as usize;
        let fix = if e.gpus.len().is_multiple_of(tp) {
            let groups: Vec<String> = e.gpus.chunks(tp).map(|g| format!("{g:?}")).collect();
            format!(
                "run one node per group instead, with engine.gpus = {}",
                groups.join(", ")
            )
        } else {
            format!("list exactly {tp} GPUs, and run one node per group for more")
        };
        bad(
            "engine.tensor_parallel",
            format!(
                "{tp} but engine.gpus lists {} GPUs {:?}: a node runs one tensor-parallel group, \
                 on exactly the GPUs it lists (rank r on the r-th); {fix}",
                e.gpus.len(),
                e.gpus,
            ),
        );
    } else if !e.gpus.is_empty() && !e.gpus.len().is_multiple_of(e.tensor_parallel as usize) {
        bad(
            "engine.tensor_parallel",
            format!(
                "{} does not divide the {} GPUs of engine.gpus {:?}",
                e.tensor_parallel,
                e.gpus.len(),
                e.gpus
            ),
        );
    } else if e.gpus.is_empty() && e.tensor_parallel > 1 && e.backend != Backend::Mock {
        bad(
            "engine.tensor_parallel",
            format!(
                "{} needs engine.gpus to list that many GPUs, one per rank",
                e.tensor_parallel
            ),
        );
    }
    if e.backend == Backend::Cpu && e.tensor_parallel > 1 {
        bad(
            "engine.tensor_parallel",
            "the cpu backend runs tensor_parallel = 1".into(),
        );
    }
    if e.backend == Backend::Cuda && e.gpus.is_empty() && serves_model {
        bad(
            "engine.gpus",
            "engine.backend = \"cuda\" needs the GPUs to bind, e.g. [0]".into(),
        );
    }
    if e.cpu_affinity == CpuAffinity::Auto && !binds_gpus {
        bad(
            "engine.cpu_affinity",
            format!(
                "\"auto\" pins to the NUMA node of the node's GPUs, and engine.backend = \"{}\" binds none: list the cores instead, or remove it",
                if e.backend == Backend::Cpu {
                    "cpu"
                } else {
                    "mock"
                }
            ),
        );
    }
    if let CpuAffinity::Cores(cores) = &e.cpu_affinity {
        let mut seen = HashSet::new();
        if let Some(c) = cores.iter().find(|c| !seen.insert(**c)) {
            bad(
                "engine.cpu_affinity",
                format!("core {c} is listed twice in {cores:?}"),
            );
        }
    }
    if !(e.mem_fraction > 0.0 && e.mem_fraction <= 1.0) {
        bad(
            "engine.mem_fraction",
            format!("{} is outside (0, 1]", e.mem_fraction),
        );
    }
    if e.block_size == 0 || e.block_size > 1024 || !e.block_size.is_power_of_two() {
        bad(
            "engine.block_size",
            format!("{}: expected a power of two in [1, 1024]", e.block_size),
        );
    }
    if e.context_length < 16 || e.context_length > 1 << 20 {
        bad(
            "engine.context_length",
            format!("{} is outside [16, 1048576]", e.context_length),
        );
    }
    if e.max_batch_tokens == 0 {
        bad("engine.max_batch_tokens", "must be at least 1".into());
    }
    if e.max_queued_requests == 0 {
        bad(
            "engine.max_queued_requests",
            "must be at least 1 (0 would refuse every request: each one waits before it runs)"
                .into(),
        );
    }
    if e.max_running_requests == 0 {
        bad("engine.max_running_requests", "must be at least 1".into());
    }
    if e.colocated && c.node.role != Role::All {
        bad(
            "engine.colocated",
            format!(
                "a colocated engine serves prefill and decode itself: it needs node.role = \"all\", not \"{}\"",
                c.node.role
            ),
        );
    }
    // the tensor-core GEMV takes at most 8 tokens (`GEMV_MAX_TOKENS` of the CUDA backend)
    for (key, v) in [
        (
            "engine.cuda.fuse_swiglu_max_tokens",
            e.cuda.fuse_swiglu_max_tokens,
        ),
        (
            "engine.cuda.fuse_norm_max_tokens",
            e.cuda.fuse_norm_max_tokens,
        ),
    ] {
        if v > 8 {
            bad(
                key,
                format!("{v}: the fused GEMV takes at most 8 tokens (0 switches the fusion off)"),
            );
        }
    }
    if e.cuda.warm_up_context > 1 << 20 {
        bad(
            "engine.cuda.warm_up_context",
            format!(
                "{}: expected at most 1048576 tokens (0: no warm-up)",
                e.cuda.warm_up_context
            ),
        );
    }
    if !(1..=64).contains(&e.cuda.attention_v4_waves) {
        bad(
            "engine.cuda.attention_v4_waves",
            format!("{}: expected 1 to 64 waves", e.cuda.attention_v4_waves),
        );
    }
    if !(128..=1 << 20).contains(&e.cuda.attention_v4_max_part) {
        bad(
            "engine.cuda.attention_v4_max_part",
            format!(
                "{}: expected 128 to 1048576 keys per partition",
                e.cuda.attention_v4_max_part
            ),
        );
    }
    if e.mock.vocab_size < 2 {
        bad("engine.mock.vocab_size", "must be at least 2".into());
    }
    if e.mock.output_len == 0 {
        bad("engine.mock.output_len", "must be at least 1".into());
    }

    // transfer
    let split = matches!(c.node.role, Role::Prefill | Role::Decode);
    if split && c.transfer.kind == TransferKind::InProcess {
        bad(
            "transfer.kind",
            format!(
                "\"in-process\" only works with node.role = \"all\"; a {} node needs \"ucx\"",
                c.node.role
            ),
        );
    }
    if c.transfer.stall_min_rate_mibps == 0 {
        bad("transfer.stall_min_rate_mibps", "must be at least 1".into());
    }

    // router
    let r = &c.router;
    if !(0.0..=1.0).contains(&r.cache_aware.cache_threshold) {
        bad(
            "router.cache_aware.cache_threshold",
            format!("{} is outside [0, 1]", r.cache_aware.cache_threshold),
        );
    }
    if r.cache_aware.balance_rel_threshold.is_nan() || r.cache_aware.balance_rel_threshold < 1.0 {
        bad(
            "router.cache_aware.balance_rel_threshold",
            format!("{} is below 1.0", r.cache_aware.balance_rel_threshold),
        );
    }
    if r.bucket.boundaries.windows(2).any(|w| w[0] >= w[1]) {
        bad(
            "router.bucket.boundaries",
            format!("{:?} is not strictly increasing", r.bucket.boundaries),
        );
    }
    // Every duration: a lower bound where zero (or less) breaks something, and an upper bound,
    // so that `Instant::now() + d` (and a deadline built from a few of them) never overflows.
    for d in durations(c) {
        if d.value < d.min || d.value > d.max {
            bad(
                d.key,
                format!(
                    "{} is outside [{}, {}] {}",
                    d.value, d.min, d.max, d.unit.name
                ),
            );
        }
    }
    if r.max_inflight_requests == 0 {
        bad("router.max_inflight_requests", "must be at least 1".into());
    }
    for (key, v) in [
        ("router.slo.ttft_ms", r.slo.ttft_ms),
        ("router.slo.tpot_ms", r.slo.tpot_ms),
    ] {
        if v > crate::request::SLO_MAX_MS {
            bad(
                key,
                format!(
                    "{v} ms is above {} ms (0: no target)",
                    crate::request::SLO_MAX_MS
                ),
            );
        }
    }
    if r.decode_policy == PolicyName::Cost {
        bad(
            "router.decode_policy",
            "`cost` picks the prefill node for a decode node already picked; set it as router.prefill_policy"
                .into(),
        );
    }
    if r.prefill_policy == PolicyName::Cost && r.sglang.enabled() {
        bad(
            "router.prefill_policy",
            "`cost` needs the KV hand-off figures pdnode nodes report; SGLang workers (router.sglang) do not"
                .into(),
        );
    }
    if c.node.drain == super::DrainMode::Migrate && c.node.role != Role::Decode {
        bad(
            "node.drain",
            format!(
                "\"migrate\" moves running decodes: a decode node's setting, not a {} node's",
                c.node.role
            ),
        );
    }
    let rb = &r.rebalance;
    if rb.min_gap == 1 {
        bad(
            "router.rebalance.min_gap",
            "1 would move a stream back and forth between two nodes one request apart; 0 (off) or at least 2".into(),
        );
    }
    if rb.min_gap > 0 && r.sglang.enabled() {
        bad(
            "router.rebalance",
            "moving streams is a pdnode decode node's call; SGLang workers (router.sglang) have none".into(),
        );
    }
    let lp = &r.local_prefill;
    if (lp.max_prompt_tokens > 0 || lp.prefill_busy_requests > 0) && r.sglang.enabled() {
        bad(
            "router.local_prefill",
            "a prefill on the decode node is a pdnode decode node's call; SGLang workers (router.sglang) have none"
                .into(),
        );
    }
    if (r.slo.ttft_ms > 0 || r.slo.tpot_ms > 0 || r.slo.queue_ms > 0) && r.sglang.enabled() {
        bad(
            "router.slo",
            "SLO admission predicts from pdnode nodes' loads and step times; SGLang workers (router.sglang) report none"
                .into(),
        );
    }
    let sg = &r.sglang;
    if sg.enabled() {
        if c.node.role != Role::Router {
            bad(
                "router.sglang",
                format!(
                    "SGLang workers are served by role = \"router\", not \"{}\"",
                    c.node.role
                ),
            );
        }
        if !sg.discover && (sg.prefill.is_empty() || sg.decode.is_empty()) {
            bad(
                "router.sglang",
                "list at least one [[router.sglang.prefill]] and one [[router.sglang.decode]] worker, or set router.sglang.discover = true"
                    .into(),
            );
        }
        let mut seen = HashSet::new();
        let urls = sg.prefill.iter().map(|w| ("router.sglang.prefill", &w.url));
        for (key, url) in urls.chain(sg.decode.iter().map(|w| ("router.sglang.decode", &w.url))) {
            if worker_url_host(url).is_none() {
                bad(key, format!("{url:?}: expected http://host:port"));
            } else if !seen.insert((key, url.trim_end_matches('/'))) {
                bad(key, format!("{url:?} is listed twice"));
            }
        }
    }
    for (key, v) in [
        (
            "router.sglang.health_failure_threshold",
            sg.health_failure_threshold,
        ),
        (
            "router.sglang.health_success_threshold",
            sg.health_success_threshold,
        ),
        (
            "router.sglang.breaker_failure_threshold",
            sg.breaker_failure_threshold,
        ),
    ] {
        if v == 0 {
            bad(key, "must be at least 1".into());
        }
    }
    if sg.max_retries > 100 {
        bad(
            "router.sglang.max_retries",
            format!("{} is above 100", sg.max_retries),
        );
    }
    if sg.max_payload_bytes < 1024 {
        bad(
            "router.sglang.max_payload_bytes",
            format!("{} is below 1024", sg.max_payload_bytes),
        );
    }

    // security
    let s = &c.security;
    // A router in front of SGLang workers serves no node API: nothing to secure or refuse.
    let sglang_router = c.node.role == Role::Router && c.router.sglang.enabled();
    let tls_keys = [
        ("security.tls_ca", &s.tls_ca),
        ("security.tls_cert", &s.tls_cert),
        ("security.tls_key", &s.tls_key),
    ];
    let tls_set = tls_keys.iter().filter(|(_, v)| !v.is_empty()).count();
    if tls_set != 0 && tls_set != tls_keys.len() {
        for (key, v) in tls_keys {
            if v.is_empty() {
                bad(
                    key,
                    "missing: the node plane's TLS needs security.tls_ca, security.tls_cert and security.tls_key together (or none of them)".into(),
                );
            }
        }
    }
    if s.node_tls() {
        if sglang_router {
            bad(
                "security.tls_cert",
                "a router in front of SGLang workers serves no node API and calls no pdnode node: the TLS keys would do nothing; remove them".into(),
            );
        }
        if let Err(e) = super::pem::read_pem_certs(&s.tls_ca) {
            files.push(("security.tls_ca", e));
        }
        if let Err(e) = super::pem::read_pem_certs(&s.tls_cert) {
            files.push(("security.tls_cert", e));
        }
        if let Err(e) = super::pem::read_pem_key(&s.tls_key) {
            files.push(("security.tls_key", e));
        }
        if c.node.id.is_empty() && !sglang_router {
            bad(
                "node.id",
                "empty, but security.tls_cert is set: the certificate names the node (spiffe://pdnode/{cluster}/{role}/{node.id}), so set node.id to the name it was issued for".into(),
            );
        }
        if s.allow_insecure {
            bad(
                "security.allow_insecure",
                "true, but the node plane is mutual TLS (security.tls_* are set): there is nothing insecure to allow; remove it".into(),
            );
        }
    }
    if !sglang_router && !c.node.listens_on_loopback() && !s.node_tls() && !s.allow_insecure {
        bad(
            "node.listen",
            format!(
                "{:?} is reachable from other hosts, and without security.tls_ca/tls_cert/tls_key the node API is plaintext and unauthenticated: anyone who reaches it can run, read or abort requests past the API keys. Set the TLS keys (`pdnode certs init` makes them), listen on loopback, or set security.allow_insecure = true to accept that",
                c.node.listen
            ),
        );
    }
    let kv_over_network =
        split && c.transfer.kind == TransferKind::Ucx && !c.transfer.ucx_loopback_only();
    if kv_over_network && !s.trusted_kv_network {
        bad(
            "transfer.ucx_net_devices",
            format!(
                "{:?} puts the KV plane (UCX) on a network, and UCX authenticates no one: any host that reaches these interfaces can write and read this process's memory, TLS or not (docs/runtime-semantics.md, \"Trust\"). Keep UCX on a network only the cluster's nodes reach (a dedicated fabric or VLAN, or firewall rules) and then set security.trusted_kv_network = true, or use \"lo\" on one host",
                c.transfer.ucx_net_devices
            ),
        );
    }
    if !kv_over_network && s.trusted_kv_network {
        bad(
            "security.trusted_kv_network",
            "true, but this node's KV plane does not reach a network (no UCX, or transfer.ucx_net_devices = \"lo\"): it would do nothing; remove it".into(),
        );
    }
    if s.api_keys.iter().any(|k| k.trim().is_empty()) {
        bad("security.api_keys", "an API key is empty".into());
    }

    if c.log.filter.trim().is_empty() {
        bad(
            "log.filter",
            "empty: expected e.g. \"info\" or \"pdnode=debug\"".into(),
        );
    }
    // telemetry
    let t = &c.telemetry;
    if !t.endpoint.is_empty() && !is_collector_url(&t.endpoint) {
        bad(
            "telemetry.endpoint",
            format!(
                "{:?}: expected an OTLP/gRPC collector URL, http://host:port (plaintext: point it at a collector on this host or network)",
                t.endpoint
            ),
        );
    }
    if !(0.0..=1.0).contains(&t.sampling_ratio) {
        bad(
            "telemetry.sampling_ratio",
            format!("{}: expected a fraction in [0, 1]", t.sampling_ratio),
        );
    }
    if !t.service_name.is_empty() && !is_key_segment(&t.service_name) {
        bad(
            "telemetry.service_name",
            format!("{:?}: expected 1-128 of [A-Za-z0-9._-]", t.service_name),
        );
    }
    errs.extend(files.into_iter().map(|(key, error)| ConfigError::BadFile {
        source_name: origin(key),
        key: key.to_string(),
        error,
    }));
    errs
}

/// `http://host:port`, an optional `/` after it: what the OTLP/gRPC exporter dials. Plaintext
/// only: the exporter is built without TLS roots (a collector agent beside the node forwards).
fn is_collector_url(u: &str) -> bool {
    let Some(rest) = u.strip_prefix("http://") else {
        return false;
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    !authority.contains(['/', '@'])
        && !authority.contains(char::is_whitespace)
        && is_host_port(authority)
}

fn is_key_segment(s: &str) -> bool {
    crate::ids::NodeId::new(s).is_valid()
}

fn is_host_port(s: &str) -> bool {
    match s.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && port.parse::<u16>().is_ok(),
        None => false,
    }
}
