//! The node plane over mutual TLS, in process on 127.0.0.1, with certificates made by the code
//! behind `pdnode certs init`: a colocated role-"all" node (mock engine) serves
//! `pdnode.v1.Node` with `security.tls_*`; then
//! - a plaintext client, a TLS client without a certificate and one whose certificate comes
//!   from another CA are refused at the handshake (the same calls with the cluster's router
//!   certificate pass: the refusals are the certificate's doing);
//! - a prefill node's certificate may call Stats and Health but not Prefill, Decode, ReserveKv
//!   or Abort (PERMISSION_DENIED naming the role);
//! - a router over the registry's view with its certificate serves requests end to end, and a
//!   router refuses a server whose certificate names another node than the card.

use pdnode_core::config::{Backend, Config, ModelFormat, RegistryKind, TransferKind};
use pdnode_core::{NodeCard, NodeId, Role, SamplingParams};
use pdnode_node::{Node, assemble::assemble, pd};
use pdnode_nodeapi::certs::{self, CertNode, CertsInit};
use pdnode_nodeapi::tls::{NodeIdentity, NodeTls, TlsError};
use pdnode_proto::v1;
use pdnode_registry::{LiveMembership, MemoryRegistry, Registry, RegistryOptions};
use pdnode_router::grpc_client::{CardMembership, ChannelOptions};
use pdnode_router::{GenEvent, GenRequest, Router, RouterDeps};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

const CLUSTER: &str = "sec";

fn make_certs(dir: &Path, nodes: &[&str]) {
    certs::init(&CertsInit {
        dir: dir.to_path_buf(),
        cluster: CLUSTER.into(),
        nodes: nodes
            .iter()
            .map(|n| n.parse::<CertNode>().unwrap())
            .collect(),
        force: false,
        days: 2,
    })
    .unwrap();
}

fn path(dir: &Path, f: &str) -> String {
    dir.join(f).display().to_string()
}

fn node_config(dir: &Path) -> Config {
    let mut c = Config::default();
    c.engine.backend = Backend::Mock;
    c.engine.mock.prefill_us_per_token = 1;
    c.engine.mock.decode_us_per_token = 100;
    c.engine.mock.output_len = 6;
    c.engine.num_kv_blocks = 64;
    c.engine.block_size = 4;
    c.model.format = ModelFormat::Dummy;
    c.model.preset = "smollm2-135m".into();
    c.registry.kind = RegistryKind::Memory;
    c.transfer.kind = TransferKind::InProcess;
    c.transfer.lease_ms = 5_000;
    c.node.role = Role::All;
    c.engine.colocated = true;
    c.node.cluster = CLUSTER.into();
    c.node.id = "colo-0".into();
    c.node.listen = "127.0.0.1:0".into();
    c.router.http_listen = "127.0.0.1:0".into();
    c.security.tls_ca = path(dir, "ca.pem");
    c.security.tls_cert = path(dir, "colo-0.pem");
    c.security.tls_key = path(dir, "colo-0.key");
    c
}

/// `name`'s TLS material (issued in `dir` for `role`).
fn tls_of(dir: &Path, name: &str, role: Role) -> NodeTls {
    NodeTls::load(
        &path(dir, "ca.pem"),
        &path(dir, &format!("{name}.pem")),
        &path(dir, &format!("{name}.key")),
        &NodeIdentity::new(CLUSTER, role, NodeId::new(name)),
    )
    .unwrap()
}

/// A raw `pdnode.v1.Node` client of the node `colo-0` at `addr`, as `tls` over mutual TLS.
async fn client_as(tls: &NodeTls, addr: &str) -> v1::node_client::NodeClient<Channel> {
    let (cfg, verifier) =
        tls.client_tls(NodeIdentity::new(CLUSTER, Role::All, NodeId::new("colo-0")));
    let ch = Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config_with_verifier(cfg, verifier)
        .unwrap()
        .connect()
        .await
        .unwrap();
    v1::node_client::NodeClient::new(ch)
}

/// A TLS client that trusts the cluster CA (by the server's IP SAN) and presents `identity`
/// (none: no client certificate).
async fn stats_with(
    ca_pem: &[u8],
    identity: Option<Identity>,
    addr: &str,
) -> Result<v1::StatsResponse, String> {
    let mut cfg = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca_pem));
    if let Some(id) = identity {
        cfg = cfg.identity(id);
    }
    let ep = Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .tls_config(cfg)
        .unwrap();
    let ch = ep.connect().await.map_err(|e| format!("connect: {e:?}"))?;
    v1::node_client::NodeClient::new(ch)
        .stats(v1::StatsRequest {})
        .await
        .map(|r| r.into_inner())
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
}

fn request() -> GenRequest {
    GenRequest {
        prompt_token_ids: (0..17).map(|i| (i * 5 + 1) % 200).collect(),
        sampling: SamplingParams {
            max_tokens: 4,
            ..SamplingParams::default()
        },
        endpoint: "completions",
        routing_key: None,
        slo: Default::default(),
    }
}

async fn tokens_of(router: &Arc<Router>) -> Result<usize, String> {
    let mut g = router.generate(request()).map_err(|e| e.to_string())?;
    let mut n = 0;
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(15), g.events.recv())
            .await
            .expect("an event within 15 s")
            .expect("Done or Error");
        match ev {
            GenEvent::Tokens { token_ids, .. } => n += token_ids.len(),
            GenEvent::Done { .. } => return Ok(n),
            GenEvent::Error(e) => return Err(e.to_string()),
        }
    }
}

fn router_over(
    cfg: &Config,
    cards: impl Fn(Role) -> Vec<NodeCard> + Send + Sync + 'static,
    tls: NodeTls,
) -> Arc<Router> {
    let rm = pd::router_tokenizer(cfg).unwrap();
    Router::new(RouterDeps {
        config: cfg.router.clone(),
        api_keys: Vec::new(),
        insecure_node_plane: false,
        membership: Arc::new(
            CardMembership::new(cards)
                .with_channel_options(ChannelOptions::from(&cfg.router).with_tls(Some(tls))),
        ),
        tokenizer: rm.tokenizer,
        chat: rm.chat,
        model: rm.model,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_refuses_strangers_and_checks_roles() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    make_certs(
        d,
        &[
            "colo-0:all@127.0.0.1",
            "router-0:router",
            "prefill-0:prefill",
        ],
    );
    let other = dir.path().join("other");
    make_certs(&other, &["router-0:router"]);

    let reg: Arc<dyn Registry> = Arc::new(MemoryRegistry::new(RegistryOptions::default()));
    let c = node_config(d);
    let node = Node::start(&c, assemble(&c, reg.clone()).await.unwrap())
        .await
        .unwrap();
    let addr = node.grpc_addr().to_string();
    let ca_pem = std::fs::read(d.join("ca.pem")).unwrap();
    let identity = |dir: &Path, name: &str| {
        Identity::from_pem(
            std::fs::read(dir.join(format!("{name}.pem"))).unwrap(),
            std::fs::read(dir.join(format!("{name}.key"))).unwrap(),
        )
    };

    // The cluster's router certificate passes through a generic TLS client...
    let s = stats_with(&ca_pem, Some(identity(d, "router-0")), &addr)
        .await
        .unwrap();
    assert_eq!(s.node_id, "colo-0");
    // ... no certificate, another CA's certificate and plaintext do not.
    let e = stats_with(&ca_pem, None, &addr).await.unwrap_err();
    println!("no client certificate: {e}");
    let e = stats_with(&ca_pem, Some(identity(&other, "router-0")), &addr)
        .await
        .unwrap_err();
    println!("another CA's certificate: {e}");
    let plain = async {
        let mut c = v1::node_client::NodeClient::connect(format!("http://{addr}")).await?;
        c.stats(v1::StatsRequest {})
            .await
            .map_err(|s| -> Box<dyn std::error::Error> { format!("{s:?}").into() })
    };
    let e = tokio::time::timeout(Duration::from_secs(10), plain)
        .await
        .expect("the plaintext client got no answer within 10 s")
        .expect_err("a plaintext client was served");
    println!("plaintext: {e}");

    // A prefill node's certificate: load and liveness, nothing of the data path.
    let mut p = client_as(&tls_of(d, "prefill-0", Role::Prefill), &addr).await;
    assert_eq!(
        p.stats(v1::StatsRequest {})
            .await
            .unwrap()
            .into_inner()
            .node_id,
        "colo-0"
    );
    p.health(v1::HealthRequest {}).await.unwrap();
    fn denied<T>(r: Result<T, tonic::Status>) {
        let Err(s) = r else {
            panic!("a prefill certificate was let into the data path")
        };
        assert_eq!(s.code(), tonic::Code::PermissionDenied, "{s:?}");
        assert!(s.message().contains("role prefill"), "{s:?}");
    }
    denied(p.prefill(v1::PrefillRequest::default()).await);
    denied(p.decode(v1::DecodeRequest::default()).await);
    denied(p.reserve_kv(v1::ReserveKvRequest::default()).await);
    denied(p.abort(v1::AbortRequest::default()).await);
    // The router's certificate reaches the data path (an empty request is refused by the
    // handler, not by the role check).
    let mut r = client_as(&tls_of(d, "router-0", Role::Router), &addr).await;
    let e = r.abort(v1::AbortRequest::default()).await;
    assert!(
        e.as_ref()
            .map_or_else(|s| s.code() != tonic::Code::PermissionDenied, |_| true),
        "{e:?}"
    );

    // A router with its certificate over the registry's view: requests served end to end.
    let live = Arc::new(LiveMembership::start(&*reg, CLUSTER).await.unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    while live.serving(Role::All).is_empty() {
        assert!(Instant::now() < deadline, "the node never showed up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let router_tls = tls_of(d, "router-0", Role::Router);
    let l = live.clone();
    let router = router_over(&c, move |r| l.serving(r), router_tls.clone());
    for _ in 0..3 {
        assert_eq!(tokens_of(&router).await, Ok(4));
    }
    // A card that names another node at this address: the router refuses the server.
    let l = live.clone();
    let impostor = router_over(
        &c,
        move |r| {
            l.serving(r)
                .into_iter()
                .map(|mut card| {
                    card.id = NodeId::new("colo-1");
                    card
                })
                .collect()
        },
        router_tls,
    );
    let e = tokens_of(&impostor).await.unwrap_err();
    println!("server naming another node: {e}");

    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_refuses_tls_files_that_do_not_name_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    make_certs(d, &["colo-0:all", "prefill-0:prefill"]);
    let reg: Arc<dyn Registry> = Arc::new(MemoryRegistry::new(RegistryOptions::default()));
    // Another node's certificate and key.
    let mut c = node_config(d);
    c.security.tls_cert = path(d, "prefill-0.pem");
    c.security.tls_key = path(d, "prefill-0.key");
    let e = NodeTls::from_config(&c).unwrap_err();
    assert_eq!(e.key(), Some("security.tls_cert"), "{e}");
    assert!(
        matches!(&e, TlsError::WrongIdentity { issued_for, .. }
            if issued_for.role == Role::Prefill && issued_for.node_id.as_str() == "prefill-0"),
        "{e}"
    );
    // The right certificate with another node's key.
    let mut c = node_config(d);
    c.security.tls_key = path(d, "prefill-0.key");
    let e = NodeTls::from_config(&c).unwrap_err();
    assert_eq!(e.key(), Some("security.tls_key"), "{e}");
    // Node::start refuses too, before it registers.
    let deps = assemble(&node_config(d), reg.clone()).await.unwrap();
    assert!(Node::start(&c, deps).await.is_err());
    assert!(reg.list(CLUSTER).await.unwrap().cards.is_empty());
}
