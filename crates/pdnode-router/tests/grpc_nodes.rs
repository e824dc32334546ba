//! The router over real gRPC: `CardMembership` -> `GrpcNodeClient` -> a `pdnode.v1.Node` server
//! on 127.0.0.1 (a thin adapter over `FakeNode`). Checks the wire conversions end to end: the KV
//! target decode mints reaches prefill intact, tokens stream back, aborts arrive.

// Wire messages are built with `..Default::default()` even when every field is set today, so
// fields added to pdnode.v1 (additive within v1) do not break this code.
#![allow(clippy::needless_update)]

use crate::common;

use futures::StreamExt;
use pdnode_core::card::NodeAddresses;
use pdnode_core::{NodeId, RequestId, Role};
use pdnode_proto::convert::{finish_reason_to_wire, status_of};
use pdnode_proto::v1;
use pdnode_proto::v1::node_server::{Node, NodeServer};
use pdnode_router::grpc_client::CardMembership;
use pdnode_router::testing::{FakeCall, FakeNode, FakeTokenizer, fake_card};
use pdnode_router::{
    DecodeCall, KvTarget, ModelInfo, NodeClient, PrefillCall, ReserveKv, Router, RouterDeps,
};
use serde_json::{Value, json};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// Serves `pdnode.v1.Node` over a FakeNode; remembers the KV targets prefill received.
struct Adapter {
    fake: Arc<FakeNode>,
    targets_seen: parking_lot::Mutex<Vec<v1::KvTarget>>,
    /// `prefill_node_id` of each ReserveKv.
    paired_with: parking_lot::Mutex<Vec<String>>,
}

type DecodeOut = Pin<Box<dyn futures::Stream<Item = Result<v1::DecodeResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Node for Adapter {
    async fn reserve_kv(
        &self,
        r: Request<v1::ReserveKvRequest>,
    ) -> Result<Response<v1::ReserveKvResponse>, Status> {
        let r = r.into_inner();
        self.paired_with.lock().push(r.prefill_node_id.clone());
        let t = self
            .fake
            .reserve_kv(ReserveKv {
                request_id: RequestId(r.request_id),
                prefill_node: NodeId::new(r.prefill_node_id.clone()),
                prompt_token_ids: r.prompt_token_ids,
                max_tokens: r.max_tokens,
            })
            .await
            .map_err(|e| status_of(&e))?;
        Ok(Response::new(v1::ReserveKvResponse {
            target: Some(v1::KvTarget {
                block_ids: vec![7, 8, 9],
                lease_deadline_ms: 123,
                ..v1::KvTarget::from(&t)
            }),
        }))
    }

    async fn prefill(
        &self,
        r: Request<v1::PrefillRequest>,
    ) -> Result<Response<v1::PrefillResponse>, Status> {
        let r = r.into_inner();
        let target = r
            .kv_target
            .ok_or_else(|| Status::invalid_argument("no kv_target"))?;
        self.targets_seen.lock().push(target.clone());
        let o = self
            .fake
            .prefill(PrefillCall {
                request_id: RequestId(r.request_id),
                prompt_token_ids: r.prompt_token_ids,
                sampling: r.sampling.map(Into::into).unwrap_or_default(),
                target: KvTarget::try_from(target)
                    .map_err(|e| Status::invalid_argument(e.to_string()))?,
            })
            .await
            .map_err(|e| status_of(&e))?;
        Ok(Response::new(v1::PrefillResponse {
            request_id: r.request_id,
            first_token_id: o.first_token_id,
            first_logprob: o.first_logprob.as_ref().map(Into::into),
            timings: Some(v1::PrefillTimings {
                transfer_bytes: o.transfer_bytes,
                transfer_us: o.transfer_us,
                ..Default::default()
            }),
            finish_reason: finish_reason_to_wire(o.finish),
            ..Default::default()
        }))
    }

    type DecodeStream = DecodeOut;

    async fn decode(&self, r: Request<v1::DecodeRequest>) -> Result<Response<DecodeOut>, Status> {
        let r = r.into_inner();
        let s = self
            .fake
            .decode(DecodeCall {
                request_id: RequestId(r.request_id),
                secret: r.secret,
                first_token_id: r.first_token_id,
                first_logprob: r.first_logprob.map(Into::into),
                sampling: r.sampling.map(Into::into).unwrap_or_default(),
                prompt_token_ids: r.prompt_token_ids,
                sampler: r.sampler.map(Into::into),
            })
            .await
            .map_err(|e| status_of(&e))?;
        let out = s.map(|c| match c {
            Ok(c) => Ok(v1::DecodeResponse {
                token_ids: c.token_ids,
                logprobs: c.logprobs.iter().map(Into::into).collect(),
                finish_reason: finish_reason_to_wire(c.finish),
                ..Default::default()
            }),
            Err(e) => Err(status_of(&e)),
        });
        Ok(Response::new(Box::pin(out)))
    }

    async fn kv_done(
        &self,
        _r: Request<v1::KvDoneRequest>,
    ) -> Result<Response<v1::KvDoneResponse>, Status> {
        Ok(Response::new(v1::KvDoneResponse {}))
    }

    async fn drain(
        &self,
        _r: Request<v1::DrainRequest>,
    ) -> Result<Response<v1::DrainResponse>, Status> {
        Err(Status::unimplemented("the test adapter does not drain"))
    }

    async fn migrate(
        &self,
        _r: Request<v1::MigrateRequest>,
    ) -> Result<Response<v1::MigrateResponse>, Status> {
        Err(Status::unimplemented("the test adapter moves no decodes"))
    }

    async fn abort(
        &self,
        r: Request<v1::AbortRequest>,
    ) -> Result<Response<v1::AbortResponse>, Status> {
        let r = r.into_inner();
        let found = self
            .fake
            .abort(RequestId(r.request_id), r.capability, r.reason)
            .await
            .map_err(|e| status_of(&e))?;
        Ok(Response::new(v1::AbortResponse {
            found,
            ..Default::default()
        }))
    }

    async fn stats(
        &self,
        _r: Request<v1::StatsRequest>,
    ) -> Result<Response<v1::StatsResponse>, Status> {
        let s = self.fake.stats().await.map_err(|e| status_of(&e))?;
        Ok(Response::new(v1::StatsResponse {
            kv_blocks_free: s.kv_blocks_free,
            kv_blocks_total: s.kv_blocks_total,
            running_requests: s.running_requests,
            queued_requests: s.queued_requests,
            ..Default::default()
        }))
    }

    async fn health(
        &self,
        _r: Request<v1::HealthRequest>,
    ) -> Result<Response<v1::HealthResponse>, Status> {
        Ok(Response::new(v1::HealthResponse::default()))
    }
}

async fn serve_node(fake: Arc<FakeNode>, stop: CancellationToken) -> (String, Arc<Adapter>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let adapter = Arc::new(Adapter {
        fake,
        targets_seen: parking_lot::Mutex::new(Vec::new()),
        paired_with: parking_lot::Mutex::new(Vec::new()),
    });
    let svc = NodeServer::from_arc(adapter.clone());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(l),
                stop.cancelled_owned(),
            )
            .await
            .unwrap();
    });
    (addr, adapter)
}

#[tokio::test]
async fn router_drives_nodes_over_grpc() {
    let stop = CancellationToken::new();
    let p = FakeNode::new("p0");
    let d = FakeNode::new("d0");
    let (p_addr, p_adapter) = serve_node(p.clone(), stop.clone()).await;
    let (d_addr, d_adapter) = serve_node(d.clone(), stop.clone()).await;
    let card = |id: &str, role: Role, addr: &str| {
        let mut c = fake_card(id, role);
        c.addresses = NodeAddresses {
            grpc: addr.to_string(),
            ..Default::default()
        };
        c
    };
    let cards = [
        card("p0", Role::Prefill, &p_addr),
        card("d0", Role::Decode, &d_addr),
    ];
    let membership =
        CardMembership::new(move |role| cards.iter().filter(|c| c.role == role).cloned().collect());
    let router = Router::new(RouterDeps {
        config: common::config(),
        api_keys: Vec::new(),
        insecure_node_plane: false,
        membership: Arc::new(membership),
        tokenizer: Arc::new(FakeTokenizer),
        chat: Arc::new(FakeTokenizer),
        model: ModelInfo {
            served_name: "fake-model".into(),
            context_length: 256,
            simulated: Some("mock".into()),
        },
    });
    let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", http.local_addr().unwrap());
    let server = tokio::spawn(pdnode_router::server::serve(
        router.clone(),
        http,
        None,
        stop.clone(),
    ));

    let c = reqwest::Client::new();
    let b: Value = c
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": "Say hi", "max_tokens": 100}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(b["choices"][0]["text"], "Hello from the fake node.", "{b}");
    assert_eq!(b["usage"]["completion_tokens"], 25);
    // The target decode minted reached prefill unchanged through the router.
    let seen = p_adapter.targets_seen.lock().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].block_ids, vec![7, 8, 9]);
    assert_eq!(seen[0].decode_node_id, "d0");
    assert_eq!(*d_adapter.paired_with.lock(), vec!["p0".to_string()]);
    assert_eq!(seen[0].secret[..8], seen[0].request_id.to_le_bytes());
    assert_eq!(seen[0].lease_deadline_ms, 123);

    // /v1/models names the simulated engine.
    let m: Value = c
        .get(format!("{url}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(m["data"][0]["simulated_engine"], "mock");

    // A disconnect mid-stream aborts on both nodes over gRPC.
    d.set(|b| b.token_interval = Duration::from_secs(20));
    let r = c
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": "x", "max_tokens": 50, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut body = r.bytes_stream();
    body.next().await.unwrap().unwrap();
    drop(body);
    let aborted = |calls: &[FakeCall]| calls.iter().any(|c| matches!(c, FakeCall::Abort(_)));
    assert!(
        d.wait_for(Duration::from_secs(5), aborted).await,
        "{:?}",
        d.calls()
    );
    assert!(
        p.wait_for(Duration::from_secs(5), aborted).await,
        "{:?}",
        p.calls()
    );

    stop.cancel();
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// The decode node's server goes away while prefill runs (its registry card not yet expired):
/// the router's liveness probe fails over gRPC, the prefill call is dropped and aborted on P
/// (every block free) and the caller gets the error within seconds, not at the end of prefill.
#[tokio::test]
async fn decode_server_gone_during_prefill_aborts_the_prefill_over_grpc() {
    let p_stop = CancellationToken::new();
    let d_stop = CancellationToken::new();
    let p = FakeNode::new("p0");
    let d = FakeNode::new("d0");
    p.set(|b| b.prefill_delay = Duration::from_secs(60));
    let (p_addr, _) = serve_node(p.clone(), p_stop.clone()).await;
    let (d_addr, _) = serve_node(d.clone(), d_stop.clone()).await;
    let card = |id: &str, role: Role, addr: &str| {
        let mut c = fake_card(id, role);
        c.addresses.grpc = addr.to_string();
        c
    };
    let cards = [
        card("p0", Role::Prefill, &p_addr),
        card("d0", Role::Decode, &d_addr),
    ];
    let membership =
        CardMembership::new(move |role| cards.iter().filter(|c| c.role == role).cloned().collect());
    let mut config = common::config();
    config.prefill_timeout_s = 120;
    config.request_timeout_s = 120;
    let router = Router::new(RouterDeps {
        config,
        api_keys: Vec::new(),
        insecure_node_plane: false,
        membership: Arc::new(membership),
        tokenizer: Arc::new(FakeTokenizer),
        chat: Arc::new(FakeTokenizer),
        model: ModelInfo {
            served_name: "fake-model".into(),
            context_length: 256,
            simulated: None,
        },
    });
    let mut g = router
        .generate(pdnode_router::GenRequest {
            prompt_token_ids: vec![b'x'.into(); 20],
            sampling: pdnode_core::SamplingParams {
                max_tokens: 8,
                ..Default::default()
            },
            endpoint: "grpc",
            routing_key: None,
            slo: Default::default(),
        })
        .unwrap();
    let prefilling = |calls: &[FakeCall]| calls.iter().any(|c| matches!(c, FakeCall::Prefill(_)));
    assert!(p.wait_for(Duration::from_secs(5), prefilling).await);
    assert_eq!(p.kv_blocks_held(), 2);
    let gone_at = Instant::now();
    d_stop.cancel();

    let ev = tokio::time::timeout(Duration::from_secs(10), g.events.recv())
        .await
        .expect("an answer long before the 60 s prefill ends")
        .expect("an event");
    let took = gone_at.elapsed();
    let pdnode_router::GenEvent::Error(e) = ev else {
        panic!("expected an error, got {ev:?}")
    };
    assert!(
        matches!(&e, pdnode_router::RouterError::DecodeLost { .. }),
        "{e:?}"
    );
    println!("decode server stopped -> error in {took:?}: {e}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    // The Abort went to P over gRPC before the error was reported.
    assert_eq!(p.aborts().len(), 1, "{:?}", p.calls());
    assert_eq!(p.kv_blocks_held(), 0);
    p_stop.cancel();
}

/// A loopback TCP proxy that can freeze: both directions stop moving bytes while every socket
/// stays open, as with a node whose process is stopped (SIGSTOP) on a live host.
struct FreezeProxy {
    addr: String,
    frozen: tokio::sync::watch::Sender<bool>,
    tasks: tokio::task::JoinSet<()>,
}

impl FreezeProxy {
    async fn start(upstream: String) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let (frozen, rx) = tokio::sync::watch::channel(false);
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((down, _)) = l.accept().await {
                let Ok(up) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                let (dr, dw) = down.into_split();
                let (ur, uw) = up.into_split();
                conns.spawn(pipe(dr, uw, rx.clone()));
                conns.spawn(pipe(ur, dw, rx.clone()));
            }
        });
        Self {
            addr,
            frozen,
            tasks,
        }
    }

    fn freeze(&self) {
        self.frozen.send_replace(true);
    }
}

/// Copies `r` to `w` until either closes; once frozen, holds both open and moves nothing.
async fn pipe(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = tokio::select! {
            _ = frozen.wait_for(|f| *f) => break,
            n = r.read(&mut buf) => match n {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
        };
        if *frozen.borrow() || w.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    // Frozen: keep the sockets, move nothing.
    let _keep = (r, w);
    std::future::pending::<()>().await;
}

/// A decode node that freezes mid-stream (the connection stays up, nothing answers): the
/// channel's HTTP/2 keepalive (`router.node_keepalive_*`) closes the connection and the stream
/// ends with an error within interval + timeout, long before `token_timeout_s`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_decode_node_is_found_by_the_channel_keepalive() {
    use pdnode_core::error::Classify as _;
    let stop = CancellationToken::new();
    let p = FakeNode::new("p0");
    let d = FakeNode::new("d0");
    let output: Vec<u32> = (0..200).map(|i| u32::from(b'a') + i % 26).collect();
    for n in [&p, &d] {
        n.set(|b| b.output = output.clone());
    }
    d.set(|b| b.token_interval = Duration::from_millis(20));
    let (p_addr, _) = serve_node(p.clone(), stop.clone()).await;
    let (d_addr, _) = serve_node(d.clone(), stop.clone()).await;
    let proxy = FreezeProxy::start(d_addr).await;
    let card = |id: &str, role: Role, addr: &str| {
        let mut c = fake_card(id, role);
        c.addresses.grpc = addr.to_string();
        c
    };
    let cards = [
        card("p0", Role::Prefill, &p_addr),
        card("d0", Role::Decode, &proxy.addr),
    ];
    let mut config = common::config();
    config.token_timeout_s = 60;
    config.request_timeout_s = 120;
    config.node_keepalive_interval_ms = 200;
    config.node_keepalive_timeout_ms = 300;
    let membership =
        CardMembership::new(move |role| cards.iter().filter(|c| c.role == role).cloned().collect())
            .with_channel_options((&config).into());
    let router = Router::new(RouterDeps {
        config,
        api_keys: Vec::new(),
        insecure_node_plane: false,
        membership: Arc::new(membership),
        tokenizer: Arc::new(FakeTokenizer),
        chat: Arc::new(FakeTokenizer),
        model: ModelInfo {
            served_name: "fake-model".into(),
            context_length: 256,
            simulated: None,
        },
    });
    let mut g = router
        .generate(pdnode_router::GenRequest {
            prompt_token_ids: vec![b'x'.into(); 20],
            sampling: pdnode_core::SamplingParams {
                max_tokens: 200,
                ..Default::default()
            },
            endpoint: "grpc",
            routing_key: None,
            slo: Default::default(),
        })
        .unwrap();
    // A few tokens stream, then the node freezes.
    for _ in 0..5 {
        let ev = tokio::time::timeout(Duration::from_secs(10), g.events.recv())
            .await
            .expect("tokens")
            .expect("an event");
        assert!(
            matches!(ev, pdnode_router::GenEvent::Tokens { .. }),
            "{ev:?}"
        );
    }
    proxy.freeze();
    let frozen = Instant::now();
    let end = loop {
        let ev = tokio::time::timeout(Duration::from_secs(10), g.events.recv())
            .await
            .expect("the stream ends long before token_timeout_s")
            .expect("an event");
        if !matches!(ev, pdnode_router::GenEvent::Tokens { .. }) {
            break ev;
        }
    };
    let took = frozen.elapsed();
    println!("decode frozen -> {end:?} after {took:?}");
    assert!(
        matches!(&end, pdnode_router::GenEvent::Error(e) if e.kind() == pdnode_core::ErrorKind::Unavailable),
        "{end:?}"
    );
    // Keepalive 200 ms + 300 ms; generous for a loaded machine, far below 60 s.
    assert!(took < Duration::from_secs(3), "took {took:?}");
    stop.cancel();
    drop(proxy.tasks);
}
