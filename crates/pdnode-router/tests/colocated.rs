//! Colocated workers (role `all`): the router pairs each with itself (D == P), never with a
//! prefill-only or decode-only node, and a failed colocated prefill moves the whole request on.

use crate::common;

use pdnode_core::{ErrorKind, Role, SamplingParams};
use pdnode_router::testing::{FakeCall, FakeNode, FakeTokenizer};
use pdnode_router::{
    GenEvent, GenRequest, ModelInfo, NodeError, Router, RouterDeps, StaticMembership,
};
use std::sync::Arc;
use std::time::Duration;

fn router(workers: Vec<pdnode_router::Worker>) -> Arc<Router> {
    Router::new(RouterDeps {
        config: common::config(),
        api_keys: Vec::new(),
        insecure_node_plane: false,
        membership: Arc::new(StaticMembership::new(workers)),
        tokenizer: Arc::new(FakeTokenizer),
        chat: Arc::new(FakeTokenizer),
        model: ModelInfo {
            served_name: "fake-model".into(),
            context_length: 256,
            simulated: None,
        },
    })
}

/// Runs one request to its end; `Ok(text)` or the error's kind.
async fn run(r: &Arc<Router>, prompt: &str) -> Result<String, ErrorKind> {
    let mut g = r
        .generate(GenRequest {
            prompt_token_ids: prompt.bytes().map(u32::from).collect(),
            sampling: SamplingParams {
                max_tokens: 100,
                ..SamplingParams::default()
            },
            endpoint: "completions",
            routing_key: None,
            slo: Default::default(),
        })
        .map_err(|e| pdnode_core::error::Classify::kind(&e))?;
    let mut text = String::new();
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(10), g.events.recv())
            .await
            .expect("an event within 10 s");
        match ev {
            Some(GenEvent::Tokens { text: t, .. }) => text.push_str(&t),
            Some(GenEvent::Done { .. }) => return Ok(text),
            Some(GenEvent::Error(e)) => return Err(pdnode_core::error::Classify::kind(&e)),
            None => panic!("stream ended without Done or Error"),
        }
    }
}

fn ids(n: &FakeNode, f: impl Fn(&FakeCall) -> Option<pdnode_core::RequestId>) -> Vec<u64> {
    let mut v: Vec<u64> = n.calls().iter().filter_map(&f).map(|r| r.0).collect();
    v.sort_unstable();
    v
}

#[tokio::test]
async fn colocated_workers_prefill_and_decode_their_own_requests() {
    let p = FakeNode::new("p0");
    let d = FakeNode::new("d0");
    let c0 = FakeNode::new("c0");
    let c1 = FakeNode::new("c1");
    let r = router(vec![
        p.worker(Role::Prefill),
        d.worker(Role::Decode),
        c0.worker(Role::All),
        c1.worker(Role::All),
    ]);
    for i in 0..9 {
        let out = run(&r, &format!("req {i}")).await;
        assert_eq!(out.as_deref(), Ok("Hello from the fake node."));
    }
    let reserve = |c: &FakeCall| match c {
        FakeCall::ReserveKv(id) => Some(*id),
        _ => None,
    };
    let prefill = |c: &FakeCall| match c {
        FakeCall::Prefill(id) => Some(*id),
        _ => None,
    };
    let decode = |c: &FakeCall| match c {
        FakeCall::Decode(id) => Some(*id),
        _ => None,
    };
    // Round robin over the three decode candidates (d0, c0, c1): three requests each.
    for c in [&c0, &c1] {
        let rs = ids(c, reserve);
        assert_eq!(rs.len(), 3, "{:?}", c.calls());
        assert_eq!(
            ids(c, prefill),
            rs,
            "a colocated node prefills what it reserved"
        );
        assert_eq!(ids(c, decode), rs, "and decodes it");
    }
    // The PD pair served the rest, with each other only.
    let rs = ids(&d, reserve);
    assert_eq!(rs.len(), 3);
    assert_eq!(ids(&p, prefill), rs);
    assert_eq!(ids(&d, decode), rs);
    assert!(ids(&p, reserve).is_empty() && ids(&d, prefill).is_empty());
    // Only the PD pair's prefills hand KV off, and only they are counted as hand-offs.
    let handoffs = |node: &str| {
        r.metrics().value(
            pdnode_core::metrics::TRANSFER_HANDOFFS_TOTAL,
            &[("node", node), ("outcome", "ok")],
        )
    };
    assert_eq!(handoffs("p0"), Some(3.0));
    assert_eq!((handoffs("c0"), handoffs("c1")), (None, None));
}

#[tokio::test]
async fn a_failed_colocated_prefill_retries_on_another_colocated_node() {
    let c0 = FakeNode::new("c0");
    let c1 = FakeNode::new("c1");
    c0.set(|b| b.fail_prefill = Some(NodeError::new(ErrorKind::Unavailable, "engine down")));
    let r = router(vec![c0.worker(Role::All), c1.worker(Role::All)]);
    assert_eq!(
        run(&r, "hi").await.as_deref(),
        Ok("Hello from the fake node.")
    );
    // c0 reserved, failed prefill and was aborted; c1 served the retry from start to end.
    let calls0 = c0.calls();
    assert!(
        calls0.iter().any(|c| matches!(c, FakeCall::Prefill(_))),
        "{calls0:?}"
    );
    assert!(
        calls0.iter().any(|c| matches!(c, FakeCall::Abort(_))),
        "{calls0:?}"
    );
    assert!(
        !calls0.iter().any(|c| matches!(c, FakeCall::Decode(_))),
        "{calls0:?}"
    );
    let n = |f: fn(&FakeCall) -> bool| c1.count(f);
    assert_eq!(n(|c| matches!(c, FakeCall::ReserveKv(_))), 1);
    assert_eq!(n(|c| matches!(c, FakeCall::Prefill(_))), 1);
    assert_eq!(n(|c| matches!(c, FakeCall::Decode(_))), 1);
}

/// A role-`all` node whose card is not `colocated` (router + prefill-only + decode-only engines
/// in one process, KV moved in process) does not serve its phases on its node API: another router
/// never pairs it with itself, nor uses it as a prefill or decode node.
#[tokio::test]
async fn an_all_node_that_is_not_colocated_is_never_used() {
    let p = FakeNode::new("p0");
    let d = FakeNode::new("d0");
    let a = FakeNode::new("a0");
    let c = FakeNode::new("c0");
    let mut in_process = a.worker(Role::All);
    in_process.card.colocated = false;
    let colocated = c.worker(Role::All);
    assert!(colocated.card.colocated);
    let r = router(vec![
        p.worker(Role::Prefill),
        d.worker(Role::Decode),
        in_process.clone(),
        colocated,
    ]);
    // p0 and c0 can prefill, d0 and c0 can decode (what /health and admission count).
    assert_eq!(r.usable_nodes(), (2, 2));
    for i in 0..6 {
        let out = run(&r, &format!("req {i}")).await;
        assert_eq!(out.as_deref(), Ok("Hello from the fake node."));
    }
    assert!(a.calls().is_empty(), "{:?}", a.calls());
    let n = |node: &FakeNode, f: fn(&FakeCall) -> bool| node.count(f);
    let reserve: fn(&FakeCall) -> bool = |x| matches!(x, FakeCall::ReserveKv(_));
    let prefill: fn(&FakeCall) -> bool = |x| matches!(x, FakeCall::Prefill(_));
    // Round robin over the two decode candidates, d0 and c0: c0 served its three requests whole,
    // the PD pair the other three.
    assert_eq!((n(&c, reserve), n(&c, prefill)), (3, 3));
    assert_eq!((n(&d, reserve), n(&p, prefill)), (3, 3));

    // Alone, it is no node at all: refused at admission, without a call to it.
    let r = router(vec![in_process]);
    assert_eq!(r.usable_nodes(), (0, 0));
    assert_eq!(run(&r, "x").await, Err(ErrorKind::Unavailable));
    assert!(a.calls().is_empty(), "{:?}", a.calls());
}
