//! The engine a config asks for: `mock` runs the engine loop behind the EngineService seam;
//! routers and not-yet-wired backends get none.

use pdnode_core::Role;
use pdnode_core::config::{Backend, Config, ModelFormat};
use pdnode_node::engine::adapter::engine_for;
use std::time::Duration;

fn cfg(role: Role, backend: Backend) -> Config {
    let mut c = Config::default();
    c.node.role = role;
    c.model.format = ModelFormat::Dummy;
    c.model.preset = "smollm2-135m".into();
    c.engine.backend = backend;
    c.engine.num_kv_blocks = 64;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mock_engine_reports_layout_and_load_and_stops() {
    let e = engine_for(&cfg(Role::Decode, Backend::Mock))
        .unwrap()
        .expect("a mock engine");
    let d = e.describe();
    assert_eq!(d.backend, "mock");
    assert_eq!(d.model_id, "smollm2-135m");
    assert!(d.kv_layout.is_some());
    let load = e.load().await.unwrap();
    assert_eq!(load.capacity.kv_blocks_total, 64);
    assert_eq!(load.capacity.kv_blocks_free, 64);
    let a = load.accounting.expect("the engine reports its accounting");
    assert_eq!(
        (a.kv_blocks_owned(), a.kv_blocks_cached, a.kv_blocks_free),
        (0, 0, 64)
    );
    assert_eq!(e.in_flight().await.unwrap(), 0);
    assert!(e.shutdown(Duration::from_secs(5)).await);
    assert!(e.load().await.is_err(), "a stopped engine does not answer");

    assert!(
        engine_for(&cfg(Role::Router, Backend::Mock))
            .unwrap()
            .is_none()
    );
    assert!(
        engine_for(&cfg(Role::Prefill, Backend::Cpu))
            .unwrap()
            .is_none()
    );
}
