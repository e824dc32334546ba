//! The node's servers in-process: pdnode.v1.Node Health/Stats, grpc.health.v1, HTTP /health,
//! and UNIMPLEMENTED (with a reason) for the data-path methods on a node without an engine.

use pdnode_core::Role;
use pdnode_core::config::Config;
use pdnode_node::{Node, NodeDeps, NodeOptions};
use pdnode_proto::v1;
use pdnode_registry::{MemoryRegistry, RegistryOptions};
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_and_http_health_stats_and_unimplemented_methods() {
    let mut c = Config::default();
    c.node.role = Role::All;
    c.node.id = "srv-0".into();
    c.node.http_listen = "127.0.0.1:0".into();
    let reg = Arc::new(MemoryRegistry::new(RegistryOptions::default()));
    let node = Node::start(
        &c,
        NodeDeps {
            pd: None,
            ucx_worker: None,
            router: None,
            registry: reg,
            engine: None,
            options: NodeOptions::default(),
        },
    )
    .await
    .unwrap();
    let url = format!("http://{}", node.grpc_addr());

    let mut client = v1::node_client::NodeClient::connect(url.clone())
        .await
        .unwrap();
    let h = client
        .health(v1::HealthRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(h.status, v1::ServingStatus::Serving as i32, "{h:?}");
    assert_eq!(h.node_id, "srv-0");
    // A role-"all" node that is not colocated serves no data path on its node API: it says
    // (and registers) what it serves, a router.
    assert_eq!(h.role, v1::Role::Router as i32);
    let s = client
        .stats(v1::StatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.node_id, "srv-0");
    let e = client
        .prefill(v1::PrefillRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unimplemented);
    assert!(e.message().contains("not served by this node"), "{e}");

    let channel = tonic::transport::Channel::from_shared(url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut std_health = tonic_health::pb::health_client::HealthClient::new(channel);
    let mut serving = false;
    for _ in 0..40 {
        let r = std_health
            .check(tonic_health::pb::HealthCheckRequest {
                service: "pdnode.v1.Node".into(),
            })
            .await;
        if r.is_ok_and(|r| r.into_inner().status == 1) {
            serving = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(serving, "grpc.health.v1 never reported SERVING");

    let http = node.http_addr().expect("http listener");
    let body = tokio::task::spawn_blocking(move || http_get(http, "/health"))
        .await
        .unwrap();
    assert!(body.contains(" 200 "), "{body}");
    assert!(body.contains("\"node_id\":\"srv-0\""), "{body}");
    // Loopback node API: not flagged as insecure.
    assert!(body.contains("\"insecure_node_plane\":false"), "{body}");

    let grpc = node.grpc_addr();
    let report = node.shutdown().await;
    assert!(report.deregistered);
    assert!(
        std::net::TcpStream::connect(grpc).is_err(),
        "the gRPC listener is closed after shutdown"
    );
}
