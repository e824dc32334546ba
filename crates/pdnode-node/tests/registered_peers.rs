//! A prefill node makes UCX endpoints only to registered decode nodes, at the worker address
//! their cards publish (`pd::RegisteredPeers`, fed by the registry in `pdnode start`): a KV
//! target naming another node or another worker is refused (`Retryable`) before any endpoint
//! exists. CPU backend over UCX on loopback.

use crate::common;

use common::{colocated_tokens, cpu_prompt, cpu_ucx_config, pd_pair};
use futures::StreamExt;
use pdnode_core::{ErrorKind, NodeId, RequestId, SamplingParams};
use pdnode_node::pd::RegisteredPeers;
use pdnode_router::{DecodeCall, NodeClient, PrefillCall, ReserveKv};
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
