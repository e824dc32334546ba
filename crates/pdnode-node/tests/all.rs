//! Every integration test of `pdnode-node`, one module per file, in one test binary: one build and
//! one link instead of one per file (the cold build on CI's two cores). Run one file's tests
//! with its module path: `cargo test -p pdnode-node --test all abort_capability::`.

mod common;

#[path = "abort_capability.rs"]
mod abort_capability;
#[path = "all_cards.rs"]
mod all_cards;
#[path = "colocated.rs"]
mod colocated;
#[path = "fuzz_node_wire.rs"]
mod fuzz_node_wire;
#[path = "migration.rs"]
mod migration;
#[path = "mock_engine.rs"]
mod mock_engine;
#[path = "mtls.rs"]
mod mtls;
#[path = "pd_data_path.rs"]
mod pd_data_path;
#[path = "pd_fencing.rs"]
mod pd_fencing;
#[path = "pd_latent_kv.rs"]
mod pd_latent_kv;
#[path = "pd_leases.rs"]
mod pd_leases;
#[path = "pd_router_semantics.rs"]
mod pd_router_semantics;
#[path = "prefill_here.rs"]
mod prefill_here;
#[path = "registered_peers.rs"]
mod registered_peers;
#[path = "servers.rs"]
mod servers;
#[path = "supervision.rs"]
mod supervision;
