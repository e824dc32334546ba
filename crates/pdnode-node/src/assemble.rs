//! What `pdnode start` runs for each role: the engine(s), the data path, the KV transport and
//! the router frontends, as [`NodeDeps`] for [`crate::Node::start`].
//!
//! | role | engine | data path | KV transport | router frontends |
//! |---|---|---|---|---|
//! | prefill | prefill-only | `PdNode` on node gRPC | UCX | - |
//! | decode | decode-only | `PdNode` on node gRPC | UCX | - |
//! | all | prefill-only + decode-only | in process | in process | membership = the two engines |
//! | all, `engine.colocated` | colocated | `ColocatedNode`, also on node gRPC | none | membership = itself |
//! | router | - | - | - | membership = registry watch, node gRPC clients (mTLS with `security.tls_*`) |

use crate::engine::adapter::EngineHandleService;
use crate::node::{NodeDeps, NodeOptions, node_id};
use crate::pd;
use crate::{EngineService, NodeError};
use pdnode_core::Role;
use pdnode_core::config::Config;
use pdnode_nodeapi::tls::NodeTls;
use pdnode_registry::{LiveMembership, Registry};
use pdnode_router::grpc_client::{CardMembership, ChannelOptions};
use std::sync::Arc;

/// Builds the node's dependencies for its role. Loads the model (blocking work runs on a blocking
/// thread). Pins the process first (`engine.cpu_affinity`), so the engine's threads start
/// pinned and the memory they touch first (KV pool, host staging) lands on their NUMA node.
pub async fn assemble(cfg: &Config, registry: Arc<dyn Registry>) -> Result<NodeDeps, NodeError> {
    assemble_connecting(cfg, async move { Ok(registry) }).await
}

/// As [`assemble`], with the registry still connecting: `registry` is awaited while the engine
/// builds (a node started during a registry outage loads its model meanwhile).
pub async fn assemble_connecting(
    cfg: &Config,
    registry: impl std::future::Future<Output = Result<Arc<dyn Registry>, NodeError>>,
) -> Result<NodeDeps, NodeError> {
    crate::affinity::apply(cfg)?;
    let id = node_id(cfg);
    let role = cfg.node.role;
    let engine_err = |e: pd::BuildError| NodeError::Engine(e.to_string());
    match role {
        Role::Prefill | Role::Decode => {
            let c = cfg.clone();
            let nid = id.clone();
            let build = tokio::task::spawn_blocking(move || pd::pd_node(&c, &nid, role));
            // The registry connects (or is waited for) while the engine builds.
            let registry = registry.await?;
            let s = build
                .await
                .map_err(|e| NodeError::Engine(format!("engine start panicked: {e}")))?
                .map_err(engine_err)?;
            let engine: Arc<dyn EngineService> = Arc::new(
                EngineHandleService::new(
                    s.built.handle.clone(),
                    s.built.model_id.clone(),
                    cfg.engine.max_running_requests,
                )
                .with_staging(s.node.clone()),
            );
            {
                // KV goes only to registered decode nodes, at the UCX workers their cards name:
                // a prefill node's hand-offs, a decode node's migration pushes.
                let view = LiveMembership::start(&*registry, &cfg.node.cluster).await?;
                s.node
                    .set_registered_peers(pd::RegisteredPeers::follow(view));
            }
            let ucx = pd::ucx_address_hex(&s.transport);
            tracing::info!(backend = %s.built.handle.info().backend_name, blocks = s.built.handle.info().num_kv_blocks, "engine ready");
            Ok(NodeDeps {
                registry,
                engine: Some(engine),
                options: NodeOptions::from_config(cfg, &s.built.handle.info().backend_name),
                pd: Some(s.node),
                ucx_worker: Some(ucx),
                router: None,
            })
        }
        Role::All if cfg.engine.colocated => {
            let c = cfg.clone();
            let nid = id.clone();
            let build = tokio::task::spawn_blocking(move || pd::colocated(&c, &nid));
            // The registry connects (or is waited for) while the engine builds.
            let registry = registry.await?;
            let col = build
                .await
                .map_err(|e| NodeError::Engine(format!("engine start panicked: {e}")))?
                .map_err(engine_err)?;
            let engine: Arc<dyn EngineService> = Arc::new(EngineHandleService::new(
                col.built.handle.clone(),
                col.built.model_id.clone(),
                cfg.engine.max_running_requests,
            ));
            tracing::info!(
                backend = %col.built.handle.info().backend_name,
                blocks = col.built.handle.info().num_kv_blocks,
                "colocated engine ready (prefill and decode in one batch); node gRPC serves it too"
            );
            Ok(NodeDeps {
                registry,
                engine: Some(engine),
                options: NodeOptions::from_config(cfg, &col.built.handle.info().backend_name),
                pd: Some(col.node),
                ucx_worker: None,
                router: Some(col.deps),
            })
        }
        Role::All => {
            let c = cfg.clone();
            let nid = id.clone();
            let build = tokio::task::spawn_blocking(move || pd::all_in_one(&c, &nid));
            // The registry connects (or is waited for) while the engine builds.
            let registry = registry.await?;
            let aio = build
                .await
                .map_err(|e| NodeError::Engine(format!("engine start panicked: {e}")))?
                .map_err(engine_err)?;
            let engine: Arc<dyn EngineService> = Arc::new(EngineHandleService::new(
                aio.decode.engine().clone(),
                aio.deps.model.served_name.clone(),
                cfg.engine.max_running_requests,
            ));
            tracing::info!(
                prefill = %aio.prefill.id(),
                decode = %aio.decode.id(),
                backend = %aio.decode.engine().info().backend_name,
                "all-in-one: prefill and decode engines ready, KV moves in process"
            );
            Ok(NodeDeps {
                registry,
                engine: Some(engine),
                options: NodeOptions::from_config(cfg, &aio.decode.engine().info().backend_name),
                pd: None,
                ucx_worker: None,
                router: Some(aio.deps),
            })
        }
        Role::Router => {
            let c = cfg.clone();
            let build = tokio::task::spawn_blocking(move || pd::router_tokenizer(&c));
            // The registry connects (or is waited for) while the engine builds.
            let registry = registry.await?;
            let rm = build
                .await
                .map_err(|e| NodeError::Engine(format!("tokenizer load panicked: {e}")))?
                .map_err(engine_err)?;
            let tls = NodeTls::from_config(cfg)?;
            let live = Arc::new(LiveMembership::start(&*registry, &cfg.node.cluster).await?);
            // A role whose cards all vanish keeps them one lease TTL: long enough for nodes
            // whose leases lapsed in a registry outage to register again (within a keepalive
            // period), short enough that a dead last node is reported gone soon after its key.
            let membership = CardMembership::new(move |r| live.serving(r))
                .with_channel_options(ChannelOptions::from(&cfg.router).with_tls(tls))
                .with_lapsed_grace(std::time::Duration::from_secs(cfg.registry.lease_ttl_s));
            let deps = rm
                .into_deps(cfg, Arc::new(membership))
                .map_err(engine_err)?;
            Ok(NodeDeps {
                registry,
                engine: None,
                options: NodeOptions::default(),
                pd: None,
                ucx_worker: None,
                router: Some(deps),
            })
        }
    }
}
