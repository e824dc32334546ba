//! Fuzz-style property tests (proptest, stable Rust) of the OpenAI HTTP surface: random JSON
//! bodies built from the parameters both endpoints know (and some they do not), with values of
//! every JSON type and edge numbers, and raw byte bodies, all through the real router (parsing,
//! validation, tokenization, the flow over fake nodes). Every body gets an answer: 200, or a
//! 4xx whose JSON names the error; never a 5xx, a dropped connection (a handler panic) or a hang.
//! Bounded: a few hundred cases per target, a few seconds in a debug build.

use crate::common;

use common::Harness;
use pdnode_testkit::fuzz::Fuzz;
use pdnode_testkit::fuzz_regressions;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde_json::{Map, Value, json};
use std::time::Duration;

/// Parameter names of `/v1/completions` and `/v1/chat/completions`, message fields, and a few
/// unknown ones.
const KEYS: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "best_of",
    "stop",
    "stop_token_ids",
    "seed",
    "stream",
    "stream_options",
    "include_usage",
    "logprobs",
    "top_logprobs",
    "echo",
    "suffix",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "user",
    "tools",
    "tool_choice",
    "response_format",
    "store",
    "metadata",
    "service_tier",
    "priority",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "add_special_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "min_tokens",
    "chat_template_kwargs",
    "role",
    "content",
    "type",
    "text",
    "bogus",
];

fn numbers() -> impl Strategy<Value = Value> {
    prop_oneof![
        prop::sample::select(vec![
            json!(-1),
            json!(0),
            json!(1),
            json!(2),
            json!(255),
            json!(256),
            json!(4096),
            json!(i32::MAX),
            json!(u32::MAX),
            json!(u64::from(u32::MAX) + 1),
            json!(i64::MIN),
            json!(i64::MAX),
            json!(u64::MAX),
            json!(1e300),
            json!(-1e300),
            json!(1e-300),
            json!(0.5),
            json!(-0.0),
            json!(2.000_001),
        ]),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
            .prop_map(Value::from),
    ]
}

fn strings() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            String::new(),
            "fake-model".to_string(),
            "user".into(),
            "assistant".into(),
            "system".into(),
            "text".into(),
            "none".into(),
            "json_object".into(),
            "Hello".into(),
            "\u{FFFD}\u{0}é漢".into(),
        ]),
        any::<String>(),
    ]
}

fn values() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        numbers(),
        strings().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(KEYS), inner), 0..6).prop_map(|kv| {
                Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            }),
        ]
    })
}

/// A plausible message list (so bodies get past the first checks often), or anything.
fn messages() -> impl Strategy<Value = Value> {
    let msg = (
        prop::sample::select(vec!["user", "system", "assistant", "developer", "tool"]),
        prop_oneof![
            strings().prop_map(Value::String),
            values(),
            Just(json!([{"type": "text", "text": "hi"}])),
        ],
    )
        .prop_map(|(role, content)| json!({"role": role, "content": content}));
    prop_oneof![
        3 => prop::collection::vec(msg, 0..4).prop_map(Value::Array),
        1 => values(),
    ]
}

/// A body: an object with some of the known parameters (a usable prompt or messages most of
/// the time), or any JSON value.
fn bodies() -> impl Strategy<Value = (bool, Value)> {
    // Typed values for the common parameters (so many bodies reach the flow), then any
    // parameter with any value.
    let sane = prop::collection::vec(
        prop_oneof![
            (0u32..40).prop_map(|n| ("max_tokens", json!(n))),
            (0.0f64..2.5).prop_map(|t| ("temperature", json!(t))),
            (0.0f64..1.2).prop_map(|p| ("top_p", json!(p))),
            (-2i64..100).prop_map(|k| ("top_k", json!(k))),
            any::<u64>().prop_map(|s| ("seed", json!(s))),
            any::<bool>().prop_map(|b| ("stream", json!(b))),
            prop::collection::vec(strings(), 0..3).prop_map(|v| ("stop", json!(v))),
            prop::collection::vec(0u32..300, 0..3).prop_map(|v| ("stop_token_ids", json!(v))),
            (0u32..6).prop_map(|n| ("logprobs", json!(n))),
            any::<bool>().prop_map(|b| ("ignore_eos", json!(b))),
            (-2.5f64..2.5).prop_map(|p| ("presence_penalty", json!(p))),
        ],
        0..5,
    );
    let params = (
        sane,
        prop::collection::vec((prop::sample::select(KEYS), values()), 0..2),
    )
        .prop_map(|(sane, wild)| {
            let mut all: Vec<(&str, Value)> = sane;
            all.extend(wild);
            all
        });
    let prompt = prop_oneof![
        strings().prop_map(Value::String),
        prop::collection::vec(0u32..300, 0..40).prop_map(|v| json!(v)),
        values(),
    ];
    let object = (any::<bool>(), params, prompt, messages(), any::<bool>()).prop_map(
        |(chat, params, prompt, msgs, small)| {
            let mut m = Map::new();
            m.insert("model".into(), json!("fake-model"));
            if chat {
                m.insert("messages".into(), msgs);
            } else {
                m.insert("prompt".into(), prompt);
            }
            if small {
                m.insert("max_tokens".into(), json!(4));
            }
            for (k, v) in params {
                m.insert(k.to_string(), v);
            }
            (chat, Value::Object(m))
        },
    );
    prop_oneof![4 => object, 1 => (any::<bool>(), values())]
}

struct Client {
    rt: tokio::runtime::Runtime,
    h: Harness,
    http: reqwest::Client,
}

impl Client {
    fn start() -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let h = rt.block_on(Harness::start(1, 1));
        Self {
            rt,
            h,
            http: reqwest::Client::new(),
        }
    }

    /// POSTs `body`; the status and the whole answer, or why none came.
    fn post(&self, chat: bool, body: Vec<u8>) -> Result<(u16, String), String> {
        let path = if chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let url = format!("http://{}{path}", self.h.http);
        self.rt.block_on(async {
            let send = self
                .http
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send();
            tokio::time::timeout(Duration::from_secs(10), async {
                let resp = send.await.map_err(|e| format!("no answer: {e}"))?;
                let status = resp.status().as_u16();
                let text = resp.text().await.map_err(|e| format!("answer cut: {e}"))?;
                Ok::<_, String>((status, text))
            })
            .await
            .map_err(|_| "no answer within 10 s".to_string())?
        })
    }
}

/// The property: an answer, 200 or a 4xx with an OpenAI error object. Counts the 200s in
/// `served` (the generators must reach the flow, not only the parser).
fn check(
    c: &Client,
    chat: bool,
    body: Vec<u8>,
    served: &std::cell::Cell<u32>,
) -> Result<(), TestCaseError> {
    let shown = String::from_utf8_lossy(&body).into_owned();
    let (status, text) = c
        .post(chat, body)
        .map_err(|e| TestCaseError::fail(format!("{e} for {shown}")))?;
    prop_assert!(
        status == 200 || (400..500).contains(&status),
        "HTTP {status} for {shown}: {text}"
    );
    if status == 200 {
        served.set(served.get() + 1);
    } else {
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| TestCaseError::fail(format!("error body is not JSON ({e}): {text}")))?;
        prop_assert!(v["error"]["message"].is_string(), "{text} for {shown}");
    }
    Ok(())
}

#[test]
fn openai_json_bodies_get_an_answer_or_a_named_error() {
    let c = Client::start();
    let served = std::cell::Cell::new(0);
    let ran = Fuzz::new(fuzz_regressions!("openai_json_bodies"), 600)
        .run(&bodies(), |(chat, body)| {
            check(&c, chat, serde_json::to_vec(&body).unwrap(), &served)
        })
        .unwrap();
    eprintln!("served {} of {}", served.get(), ran.cases);
    // About one body in ten is valid: at least 20 of the 600 CI runs.
    assert!(
        served.get() * 30 >= ran.cases,
        "only {} bodies of {} were served",
        served.get(),
        ran.cases
    );
    c.rt.block_on(c.h.stop());
}

#[test]
fn openai_raw_bodies_get_an_answer_or_a_named_error() {
    let c = Client::start();
    let fuzz = Fuzz::new(fuzz_regressions!("openai_raw_bodies"), 300);
    let raw = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..200),
        // Almost JSON: a valid body cut or with a byte changed.
        (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(i, b)| {
            let mut v =
                br#"{"model":"fake-model","prompt":"hi","max_tokens":3,"stop":["x"]}"#.to_vec();
            let at = i.index(v.len());
            v[at] = b;
            v
        }),
        any::<prop::sample::Index>().prop_map(|i| {
            let v = br#"{"model":"fake-model","messages":[{"role":"user","content":"hi"}]}"#;
            v[..i.index(v.len())].to_vec()
        }),
    ];
    fuzz.run(&(any::<bool>(), raw), |(chat, body)| {
        check(&c, chat, body, &std::cell::Cell::new(0))
    })
    .unwrap();
    c.rt.block_on(c.h.stop());
}
