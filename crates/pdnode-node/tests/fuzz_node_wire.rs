//! Fuzz-style property test (proptest, stable Rust) of the node data-path API as its gRPC
//! server answers it (`pd::wire`: the same conversion and handlers `pdnode.v1.Node` serves):
//! random sequences of ReserveKv, Prefill (with real KV targets edited field by field, or
//! random ones), Decode (right or wrong secrets, any first token) and Abort, with any ids,
//! lengths, token ids and sampling values, against the all-in-one PD node (mock engine, KV in
//! process). Every call answers (a response or a status) within its deadline, never a panic,
//! and afterwards the nodes still serve a normal request and hold no KV.

use crate::common;

use futures::StreamExt;
use pdnode_core::config::Config;
use pdnode_core::{NodeId, RequestId, SamplingParams};
use pdnode_node::pd::{self, wire};
use pdnode_proto::v1;
use pdnode_router::{GenEvent, GenRequest, NodeClient, Router};
use pdnode_testkit::fuzz::Fuzz;
use pdnode_testkit::fuzz_regressions;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use std::collections::HashMap;
use std::time::Duration;

fn mock_config() -> Config {
    common::mock_config(50, 6, 1_000)
}

/// Token ids: mostly inside a small vocabulary, sometimes anything.
fn token_ids() -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(
        prop_oneof![8 => 0u32..300, 1 => any::<u32>(), 1 => Just(u32::MAX)],
        0..48,
    )
}

fn sampling() -> impl Strategy<Value = Option<v1::SamplingParams>> {
    let f = prop_oneof![
        Just(None),
        prop::sample::select(vec![
            0.0f32,
            0.5,
            1.0,
            2.0,
            -1.0,
            f32::NAN,
            f32::INFINITY,
            1e30
        ])
        .prop_map(Some),
    ];
    let params = (
        f.clone(),
        f.clone(),
        any::<u32>(),
        f,
        prop::option::of(any::<u64>()),
        prop::option::of(prop_oneof![1u32..12, any::<u32>()]),
        prop::collection::vec(any::<String>(), 0..2),
        prop::option::of(prop_oneof![0u32..5, any::<u32>()]),
    )
        .prop_map(
            |(temperature, top_p, top_k, rep, seed, max_tokens, stop, logprobs)| {
                v1::SamplingParams {
                    temperature,
                    top_p,
                    top_k: top_k % 64,
                    repetition_penalty: rep,
                    seed,
                    max_tokens,
                    stop,
                    logprobs,
                    ..Default::default()
                }
            },
        );
    prop_oneof![3 => Just(None), 1 => params.prop_map(Some)]
}

/// How a Prefill's KV target is made from the reservation the op names (if any).
#[derive(Debug, Clone)]
enum TargetEdit {
    Keep,
    None,
    RequestId(u64),
    Blocks(Vec<u32>),
    /// layers, block size, heads, head dim, TP, dtype, kind (any value, known or not).
    Layout(u32, u32, u32, u32, u32, i32, i32),
    Secret(Vec<u8>),
    StagingOffset(u64),
    Generation(u64, bool, bool),
    Random(Vec<u8>),
}

fn target_edit() -> impl Strategy<Value = TargetEdit> {
    prop_oneof![
        4 => Just(TargetEdit::Keep),
        1 => Just(TargetEdit::None),
        1 => any::<u64>().prop_map(TargetEdit::RequestId),
        2 => prop::collection::vec(prop_oneof![0u32..70, any::<u32>()], 0..20)
            .prop_map(TargetEdit::Blocks),
        1 => (0u32..70, 0u32..9, 0u32..4, 0u32..5, 0u32..3, -1i32..5, -1i32..3)
            .prop_map(|(a, b, c, d, e, f, k)| TargetEdit::Layout(a, b, c, d, e, f, k)),
        1 => prop::collection::vec(any::<u8>(), 0..20).prop_map(TargetEdit::Secret),
        1 => any::<u64>().prop_map(TargetEdit::StagingOffset),
        1 => (any::<u64>(), any::<bool>(), any::<bool>())
            .prop_map(|(g, f, v)| TargetEdit::Generation(g, f, v)),
        1 => prop::collection::vec(any::<u8>(), 0..64).prop_map(TargetEdit::Random),
    ]
}

#[derive(Debug, Clone)]
enum Op {
    Reserve {
        id: u64,
        prompt: Vec<u32>,
        prompt_len: u32,
        max_tokens: u32,
    },
    Prefill {
        /// `None`: the request last reserved (as the router follows ReserveKv with Prefill).
        id: Option<u64>,
        /// `None`: the prompt of the reservation with this id (as the router sends).
        prompt: Option<Vec<u32>>,
        sampling: Option<v1::SamplingParams>,
        edit: TargetEdit,
    },
    Decode {
        /// `None`: the request last reserved.
        id: Option<u64>,
        right_secret: bool,
        first_token_id: u32,
        sampling: Option<v1::SamplingParams>,
        /// `None`: the reservation's prompt.
        prompt: Option<Vec<u32>>,
    },
    Abort {
        id: u64,
        /// `None`: the KV capability of the reservation with this id (empty without one).
        capability: Option<Vec<u8>>,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let id = 0u64..4;
    prop_oneof![
        3 => (id.clone(),
              prop_oneof![3 => prop::collection::vec(0u32..300, 1..40), 1 => token_ids()],
              prop_oneof![3 => Just(0u32), 1 => 0u32..60, 1 => any::<u32>()],
              prop_oneof![3 => 1u32..20, 1 => any::<u32>()])
            .prop_map(|(id, prompt, prompt_len, max_tokens)| Op::Reserve {
                id, prompt, prompt_len, max_tokens,
            }),
        3 => (prop_oneof![3 => Just(None), 1 => id.clone().prop_map(Some)],
              prop_oneof![3 => Just(None), 1 => token_ids().prop_map(Some)], sampling(), target_edit())
            .prop_map(|(id, prompt, sampling, edit)| Op::Prefill { id, prompt, sampling, edit }),
        2 => (prop_oneof![3 => Just(None), 1 => id.clone().prop_map(Some)],
              prop_oneof![3 => Just(true), 1 => Just(false)],
              prop_oneof![0u32..300, any::<u32>()], sampling(),
              prop_oneof![3 => Just(None), 1 => token_ids().prop_map(Some)])
            .prop_map(|(id, right_secret, first_token_id, sampling, prompt)| Op::Decode {
                id, right_secret, first_token_id, sampling, prompt,
            }),
        1 => (id, prop_oneof![2 => Just(None),
                              1 => prop::collection::vec(any::<u8>(), 0..20).prop_map(Some)])
            .prop_map(|(id, capability)| Op::Abort { id, capability }),
    ]
}

fn edited(t: Option<&v1::KvTarget>, e: &TargetEdit) -> Option<v1::KvTarget> {
    use prost::Message;
    let mut t = t.cloned().unwrap_or_default();
    match e {
        TargetEdit::Keep => {}
        TargetEdit::None => return None,
        TargetEdit::RequestId(r) => t.request_id = *r,
        TargetEdit::Blocks(b) => t.block_ids = b.clone(),
        TargetEdit::Layout(l, bs, h, d, tp, dt, kind) => {
            t.layout = Some(v1::KvLayout {
                dtype: *dt,
                num_layers: *l,
                block_size: *bs,
                kv_heads_per_rank: *h,
                head_dim: *d,
                tp_size: *tp,
                model_fingerprint: t
                    .layout
                    .as_ref()
                    .map_or(String::new(), |x| x.model_fingerprint.clone()),
                kind: *kind,
            })
        }
        TargetEdit::Secret(s) => t.secret = s.clone(),
        TargetEdit::StagingOffset(o) => t.staging_offset = *o,
        TargetEdit::Generation(g, f, v) => {
            t.staging_generation = *g;
            t.fence_record = *f;
            t.verify = *v;
        }
        TargetEdit::Random(bytes) => return v1::KvTarget::decode(bytes.as_slice()).ok(),
    }
    Some(t)
}

const CALL: Duration = Duration::from_secs(10);

/// Calls that succeeded, by kind: the sequences must reach the happy path too.
#[derive(Debug, Default)]
struct Served {
    reserved: u32,
    prefilled: u32,
    decoded_tokens: u32,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_node_calls_get_answers_and_the_node_keeps_serving() {
    let cfg = mock_config();
    let aio = tokio::task::block_in_place(|| pd::all_in_one(&cfg, &NodeId::new("fz"))).unwrap();
    let (p, d) = (aio.prefill.clone(), aio.decode.clone());
    let rt = tokio::runtime::Handle::current();
    let fuzz = Fuzz::new(fuzz_regressions!("node_wire_calls"), 512);
    let served = std::sync::Mutex::new(Served::default());
    let result = tokio::task::block_in_place(|| {
        fuzz.run(&prop::collection::vec(op(), 1..7), |ops| {
            rt.block_on(async {
                let mut targets: HashMap<u64, (v1::KvTarget, Vec<u32>)> = HashMap::new();
                let mut last = 0;
                for op in &ops {
                    if let Op::Reserve { id, .. } = op {
                        last = *id;
                    }
                    run_op(&*p, &*d, op, last, &mut targets, &served).await?;
                }
                // With each reservation's capability (a wrong one is refused).
                for id in 0..4 {
                    let cap = targets.get(&id).map(|t| t.0.secret.clone());
                    let cap = cap.unwrap_or_default();
                    let _ = p
                        .abort(RequestId(id), cap.clone(), "fuzz case over".into())
                        .await;
                    let _ = d.abort(RequestId(id), cap, "fuzz case over".into()).await;
                }
                Ok(())
            })
        })
    });
    let ran = result.unwrap();
    let served = served.into_inner().unwrap();
    eprintln!("{served:?}");
    // The happy path is reached too: 20, 5 and 5 of CI's 512 cases at least.
    let n = ran.cases;
    assert!(
        served.reserved * 25 > n && served.prefilled * 100 > n && served.decoded_tokens * 100 > n,
        "{served:?} in {n} cases"
    );

    // The nodes still serve, and hold nothing once the leases of unclaimed work expired.
    let router = Router::new(aio.deps.clone());
    let mut g = router
        .generate(GenRequest {
            prompt_token_ids: (0..23).map(|i| (i * 7 + 3) % 200).collect(),
            sampling: SamplingParams::greedy(4),
            endpoint: "test",
            routing_key: None,
            slo: Default::default(),
        })
        .unwrap();
    let mut n = 0;
    loop {
        match tokio::time::timeout(CALL, g.events.recv()).await.unwrap() {
            Some(GenEvent::Tokens { token_ids, .. }) => n += token_ids.len(),
            Some(GenEvent::Done { .. }) => break,
            other => panic!("after the fuzzing: {other:?}"),
        }
    }
    assert_eq!(n, 4);
    for node in [&aio.prefill, &aio.decode] {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let s = node.engine().stats().await.unwrap();
            if s.in_flight() == 0 {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "still held: {s:?}");
            node.sweep();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        node.engine().check_accounting().await.unwrap().unwrap();
    }
}

async fn run_op(
    p: &dyn NodeClient,
    d: &dyn NodeClient,
    op: &Op,
    last: u64,
    targets: &mut HashMap<u64, (v1::KvTarget, Vec<u32>)>,
    served: &std::sync::Mutex<Served>,
) -> Result<(), TestCaseError> {
    let late = |what: &str| TestCaseError::fail(format!("{what} did not answer within {CALL:?}"));
    match op {
        Op::Reserve {
            id,
            prompt,
            prompt_len,
            max_tokens,
        } => {
            let r = v1::ReserveKvRequest {
                request_id: *id,
                prompt_len: *prompt_len,
                max_tokens: *max_tokens,
                prompt_token_ids: prompt.clone(),
                ..Default::default()
            };
            let out = tokio::time::timeout(CALL, wire::reserve_kv(d, r))
                .await
                .map_err(|_| late("ReserveKv"))?;
            if let Ok(resp) = out
                && let Some(t) = resp.target
            {
                served.lock().unwrap().reserved += 1;
                targets.insert(*id, (t, prompt.clone()));
            }
        }
        Op::Prefill {
            id,
            prompt,
            sampling,
            edit,
        } => {
            let id = &id.unwrap_or(last);
            let reserved = targets.get(id);
            let r = v1::PrefillRequest {
                request_id: *id,
                prompt_token_ids: prompt
                    .clone()
                    .or_else(|| reserved.map(|r| r.1.clone()))
                    .unwrap_or_default(),
                sampling: sampling.clone(),
                kv_target: edited(reserved.map(|r| &r.0), edit),
            };
            let out = tokio::time::timeout(CALL, wire::prefill(p, r))
                .await
                .map_err(|_| late("Prefill"))?;
            if out.is_ok() {
                served.lock().unwrap().prefilled += 1;
            }
        }
        Op::Decode {
            id,
            right_secret,
            first_token_id,
            sampling,
            prompt,
        } => {
            let id = &id.unwrap_or(last);
            let reserved = targets.get(id);
            let secret = match (right_secret, reserved) {
                (true, Some(r)) => r.0.secret.clone(),
                _ => vec![7; 16],
            };
            let prompt = prompt
                .clone()
                .or_else(|| reserved.map(|r| r.1.clone()))
                .unwrap_or_default();
            let r = v1::DecodeRequest {
                request_id: *id,
                secret,
                first_token_id: *first_token_id,
                sampling: sampling.clone(),
                prompt_token_ids: prompt,
                ..Default::default()
            };
            let opened = tokio::time::timeout(CALL, wire::decode(d, r))
                .await
                .map_err(|_| late("Decode"))?;
            if let Ok(mut s) = opened {
                // The stream ends (finish or error) within the deadline.
                loop {
                    let item = tokio::time::timeout(CALL, s.next())
                        .await
                        .map_err(|_| late("the decode stream"))?;
                    match item {
                        None => break,
                        Some(Ok(m)) => {
                            served.lock().unwrap().decoded_tokens += m.token_ids.len() as u32;
                            if m.finish_reason != 0 {
                                break;
                            }
                        }
                        Some(Err(_)) => {}
                    }
                }
            }
        }
        Op::Abort { id, capability } => {
            let capability = capability
                .clone()
                .or_else(|| targets.get(id).map(|r| r.0.secret.clone()))
                .unwrap_or_default();
            for n in [p, d] {
                let r = v1::AbortRequest {
                    request_id: *id,
                    reason: "fuzz".into(),
                    capability: capability.clone(),
                };
                let _ = tokio::time::timeout(CALL, wire::abort(n, r))
                    .await
                    .map_err(|_| late("Abort"))?;
            }
        }
    }
    Ok(())
}
