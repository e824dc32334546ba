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

/// A node without an engine (a memory registry), from `c`.
async fn start_engineless(c: &Config) -> Node {
    let reg = Arc::new(MemoryRegistry::new(RegistryOptions::default()));
    Node::start(
        c,
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
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_and_http_health_stats_and_unimplemented_methods() {
    let mut c = Config::default();
    c.node.role = Role::All;
    c.node.id = "srv-0".into();
    c.node.http_listen = "127.0.0.1:0".into();
    let node = start_engineless(&c).await;
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

/// A router whose host stops answering (frozen: its sockets stay open, nothing moves) is hung
/// up on by the node's HTTP/2 keepalive (`router.node_keepalive_*`) within interval + timeout,
/// which ends the calls and streams it had open there. Here a loopback proxy between the
/// caller and the node freezes after a call; the node closes its side soon after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_stops_answering_is_hung_up_on_by_the_keepalive() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut c = Config::default();
    c.node.role = Role::All;
    c.node.id = "ka-0".into();
    c.router.node_keepalive_interval_ms = 100;
    c.router.node_keepalive_timeout_ms = 300;
    let node = start_engineless(&c).await;
    // caller <-> proxy <-> node; once frozen the proxy moves no byte either way but still
    // reads the node's side, to see it close
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = l.local_addr().unwrap();
    let upstream = node.grpc_addr();
    let (frozen_tx, frozen) = tokio::sync::watch::channel(false);
    let (closed_tx, closed) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let (down, _) = l.accept().await.unwrap();
        let up = tokio::net::TcpStream::connect(upstream).await.unwrap();
        let (mut dr, mut dw) = down.into_split();
        let (mut ur, mut uw) = up.into_split();
        let f = frozen.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 16 * 1024];
            while let Ok(n) = dr.read(&mut buf).await {
                if n == 0 || *f.borrow() || uw.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            let _keep = (dr, uw);
            std::future::pending::<()>().await;
        });
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match ur.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) if !*frozen.borrow() => {
                    if dw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                Ok(_) => {} // frozen: the node's pings go nowhere
            }
        }
        let _ = closed_tx.send(());
        let _keep = dw;
        std::future::pending::<()>().await;
    });
    let mut client = v1::node_client::NodeClient::connect(format!("http://{proxy}"))
        .await
        .unwrap();
    client.health(v1::HealthRequest {}).await.unwrap();
    frozen_tx.send_replace(true);
    tokio::time::timeout(Duration::from_secs(5), closed)
        .await
        .expect("the node kept the connection of a caller that stopped answering")
        .unwrap();
}
