//! Conditional disaggregation (`router.local_prefill`; docs/runtime-semantics.md, "Prefill on
//! the decode node"): after the decode node D is picked, the router decides whether D prefills
//! the request itself, with no prefill node and no KV hand-off:
//!
//! - `short`: the prompt has at most `max_prompt_tokens` tokens (its prefill costs D's batch
//!   less than a hand-off costs the request);
//! - `busy`: every prefill node the request may still go to has at least
//!   `prefill_busy_requests` requests in flight (its last stats and this router's bookings), and
//!   D has none queued. With no prefill node left at all this holds too: D serves the request
//!   rather than the router refusing it.
//!
//! A colocated worker prefills its own requests anyway; SGLang workers are refused this in
//! config. The request then runs on D alone: `ReserveKv` naming D as its own prefill node (no
//! blocks reserved, a fresh capability), `Prefill` and `Decode` on D (protocol.md, "Prefill on
//! the decode node").

use super::state::RouterState;
use crate::membership::Worker;
use crate::membership::is_colocated;
use pdnode_core::config::LocalPrefillConfig;
use pdnode_core::{NodeId, Role};

/// Why a request is prefilled on its decode node (the metric's `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Here {
    Short,
    Busy,
}

impl Here {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Here::Short => "short",
            Here::Busy => "busy",
        }
    }
}

/// Whether decode node `d` prefills a request of `prompt_len` tokens itself, and why; `None`:
/// a prefill node does. `prefills` less `excluded` are the prefill nodes it may still go to.
pub(crate) fn decide(
    cfg: &LocalPrefillConfig,
    st: &RouterState,
    prompt_len: usize,
    d: &Worker,
    prefills: &[Worker],
    excluded: &[NodeId],
) -> Option<Here> {
    if d.card.role != Role::Decode || is_colocated(d) {
        return None;
    }
    if cfg.max_prompt_tokens > 0 && prompt_len <= cfg.max_prompt_tokens as usize {
        return Some(Here::Short);
    }
    if cfg.prefill_busy_requests == 0 || st.load_of(d.id()).queued > 0 {
        return None;
    }
    let busy = u64::from(cfg.prefill_busy_requests);
    prefills
        .iter()
        .filter(|w| !excluded.contains(w.id()))
        .all(|w| st.load_of(w.id()).load() >= busy)
        .then_some(Here::Busy)
}
