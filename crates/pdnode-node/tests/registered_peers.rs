//! A prefill node makes UCX endpoints only to registered decode nodes, at the worker address
//! their cards publish (`pd::RegisteredPeers`, fed by the registry in `pdnode start`): a KV
//! target naming another node or another worker is refused (`Retryable`) before any endpoint
//! exists. CPU backend over UCX on loopback.

use crate::common;

use common::{colocated_tokens, cpu_prompt, cpu_ucx_config, pd_pair};
use futures::StreamExt;
use pdnode_core::{ErrorKind, NodeId, RequestId, SamplingParams};
use pdnode_node::pd::RegisteredPeers;
use pdnode_router::{DecodeCall, MigrateCall, NodeClient, PrefillCall, ReserveKv};
use pdnode_transfer::KvTransport;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_node_pushes_only_to_registered_decode_workers() {
    let cfg = cpu_ucx_config();
    let ids = cpu_prompt(3);
    let want = colocated_tokens(&cfg, &ids, 5).await;
    let Some((p, d)) = pd_pair(&cfg) else { return };
    let worker = d.transport.local_address();
    let reserve = |id: u64| {
        d.node.reserve_kv(ReserveKv {
            request_id: RequestId(id),
            prefill_node: NodeId::new("p"),
            prompt_token_ids: ids.clone(),
            max_tokens: 5,
        })
    };
    let call = |id: u64, t: &pdnode_router::KvTarget| PrefillCall {
        request_id: RequestId(id),
        prompt_token_ids: ids.clone(),
        sampling: SamplingParams::greedy(5),
        target: t.clone(),
    };

    // Not registered; registered at another worker; the worker registered by another node.
    let refused = [
        RegisteredPeers::fixed([]),
        RegisteredPeers::fixed([(NodeId::new("d"), vec![1, 2, 3])]),
        RegisteredPeers::fixed([(NodeId::new("other"), worker.clone())]),
    ];
    for (i, peers) in refused.into_iter().enumerate() {
        let id = 10 + i as u64;
        p.node.set_registered_peers(peers);
        let t = reserve(id).await.unwrap();
        let e = p.node.prefill(call(id, &t)).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::Retryable, "{e}");
        assert_eq!(p.transport.endpoints_created(), 0, "no endpoint made");
        assert!(
            d.node
                .abort(RequestId(id), t.secret.clone(), "refused".into())
                .await
                .unwrap()
        );
    }

    // Registered at its worker: the hand-off goes through.
    p.node
        .set_registered_peers(RegisteredPeers::fixed([(NodeId::new("d"), worker)]));
    let t = reserve(20).await.unwrap();
    let out = p.node.prefill(call(20, &t)).await.unwrap();
    assert_eq!(p.transport.endpoints_created(), 1);
    let mut s = d
        .node
        .decode(DecodeCall {
            request_id: RequestId(20),
            secret: t.secret.clone(),
            first_token_id: out.first_token_id,
            first_logprob: None,
            sampling: SamplingParams::greedy(5),
            prompt_token_ids: ids.clone(),
            sampler: out.sampler,
        })
        .await
        .unwrap();
    let mut got = vec![out.first_token_id];
    while let Some(c) = s.next().await {
        let c = c.unwrap();
        got.extend(c.token_ids);
        if c.finish.is_some() {
            break;
        }
    }
    assert_eq!(got, want);
}

/// A decode node's migration push goes by the same rule: a `Migrate` whose target names a node
/// that is not a registered decode node is refused (`Retryable`) before any UCX endpoint is
/// made, and the request stays parked, so an `Abort` with its capability still frees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_node_migrates_only_to_registered_decode_workers() {
    let cfg = cpu_ucx_config();
    let ids = cpu_prompt(5);
    let Some((p, d)) = pd_pair(&cfg) else { return };
    let id = RequestId(30);
    let (t, _, mut stream) = common::pd_start(&p, &d, id, &ids, SamplingParams::greedy(40)).await;
    assert!(!stream.next().await.unwrap().unwrap().token_ids.is_empty());
    let parked = d
        .node
        .migrate(MigrateCall {
            request_id: id,
            capability: t.secret.clone(),
            target: None,
        })
        .await
        .unwrap();
    assert!(parked.token_ids.len() > ids.len());
    // A target on "d2", a node this decode node does not know, at p's UCX worker.
    d.node.set_registered_peers(RegisteredPeers::fixed([]));
    let mut elsewhere = t.clone();
    elsewhere.decode_node = NodeId::new("d2");
    elsewhere.worker_address = p.transport.local_address();
    let before = d.transport.endpoints_created();
    let e = d
        .node
        .migrate(MigrateCall {
            request_id: id,
            capability: t.secret.clone(),
            target: Some(elsewhere),
        })
        .await
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Retryable, "{e}");
    assert!(
        e.to_string().contains("not a registered decode node"),
        "{e}"
    );
    assert_eq!(d.transport.endpoints_created(), before, "no endpoint made");
    // still parked: the abort with its capability finds and frees it
    assert!(
        d.node
            .abort(id, t.secret.clone(), "refused".into())
            .await
            .unwrap()
    );
    common::assert_clean(&d.built.handle).await;
}

/// The hand-off keys of the config reach the node `pdnode start` builds (`pd::pd_node`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handoff_keys_reach_the_node() {
    let mut cfg = cpu_ucx_config();
    cfg.engine.kv_push_layer_group = 3;
    cfg.transfer.verify = false;
    cfg.transfer.host_staging_bytes = 12345;
    cfg.transfer.stall_ms = 250;
    cfg.transfer.stall_min_rate_mibps = 7;
    let Some((p, d)) = pd_pair(&cfg) else { return };
    for n in [&p, &d] {
        assert_eq!(
            n.node.handoff_settings(),
            pdnode_node::pd::HandoffSettings {
                push_layer_group: 3,
                verify: false,
                host_staging_bytes: 12345,
                stall_ms: 250,
                stall_bytes_per_s: 7 << 20,
            }
        );
    }
}

/// `transfer.ucx_lib` is the library the node loads: a path that holds none is a start error
/// naming it (not a fall-back to the system's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_ucx_lib_is_the_library_loaded() {
    let mut cfg = cpu_ucx_config();
    cfg.node.role = pdnode_core::Role::Decode;
    cfg.transfer.ucx_lib = "/nonexistent/pdnode-test/libucp.so.0".into();
    let e = match tokio::task::block_in_place(|| {
        pdnode_node::pd::pd_node(&cfg, &NodeId::new("d"), pdnode_core::Role::Decode)
    }) {
        Ok(_) => panic!("a node started without its UCX library"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("/nonexistent/pdnode-test/libucp.so.0"), "{e}");
}
