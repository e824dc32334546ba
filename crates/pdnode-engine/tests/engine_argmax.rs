//! The engine step asks the backend for the arg-max only of plain greedy rows
//! (`Backend::forward_select` with `LogitsWant::Argmax`) and for full rows otherwise: the tokens
//! and logprobs it streams equal a reference decode that samples every full row on the host
//! (`Backend::forward` + `SequenceSampler::sample`), for greedy requests alone and for a batch
//! mixing greedy, sampled, logprobs and penalized requests. A recording wrapper checks which rows
//! took which path (so the test cannot pass with every row full). With a backend that samples on
//! the device (`Backend::samples_on_device`; here the CPU backend's host twin of `sample_rows`),
//! sampled requests without penalties or logprobs take `LogitsWant::Sample` and stream the tokens
//! of `sampling::sample_row` with the uniforms their samplers draw.

use pdnode_core::request::{GenerateRequest, TokenLogprob};
use pdnode_core::{BlockId, KvLayout, RequestId, SamplingParams};
use pdnode_engine::backend::cpu::{CpuBackend, CpuBackendConfig};
use pdnode_engine::backend::{
    Backend, BackendError, ForwardBatch, Logits, LogitsWant, SeqStep, StepLogits,
};
use pdnode_engine::engine::{EngineEvent, EngineHandle, EngineLoopConfig, RequestStream, spawn};
use pdnode_engine::loader::load_path;
use pdnode_engine::sampling::{SequenceSampler, sample_row};
use pdnode_engine::scheduler::Mode;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(120);
const BLOCK: u32 = 4;
const BLOCKS: u32 = 128;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama_gqa")
}

fn cpu() -> CpuBackend {
    let cfg = CpuBackendConfig {
        block_size: BLOCK,
        num_blocks: BLOCKS,
        threads: 1,
    };
    CpuBackend::from_loaded(load_path(&fixture()).unwrap(), cfg).unwrap()
}

/// Counts the rows each path served.
#[derive(Default)]
struct Counts {
    argmax: AtomicUsize,
    full: AtomicUsize,
    sample: AtomicUsize,
}

struct Recording {
    inner: CpuBackend,
    counts: Arc<Counts>,
    device_sampling: bool,
}

impl Backend for Recording {
    fn name(&self) -> String {
        "recording-cpu".into()
    }
    fn kv_layout(&self) -> &KvLayout {
        self.inner.kv_layout()
    }
    fn num_kv_blocks(&self) -> usize {
        self.inner.num_kv_blocks()
    }
    fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<Logits, BackendError> {
        self.inner.forward(batch)
    }
    fn forward_select(
        &mut self,
        batch: &ForwardBatch<'_>,
        want: &[LogitsWant],
        out: &mut StepLogits,
    ) -> Result<(), BackendError> {
        for w in want {
            match w {
                LogitsWant::Argmax => self.counts.argmax.fetch_add(1, Ordering::Relaxed),
                LogitsWant::Full => self.counts.full.fetch_add(1, Ordering::Relaxed),
                LogitsWant::Sample(_) => self.counts.sample.fetch_add(1, Ordering::Relaxed),
            };
        }
        self.inner.forward_select(batch, want, out)
    }
    fn samples_on_device(&self) -> bool {
        self.device_sampling
    }
    fn read_kv(
        &self,
        layers: Range<u32>,
        blocks: &[BlockId],
        out: &mut [u8],
    ) -> Result<(), BackendError> {
        self.inner.read_kv(layers, blocks, out)
    }
    fn write_kv(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        data: &[u8],
    ) -> Result<(), BackendError> {
        self.inner.write_kv(layers, blocks, data)
    }
}

fn engine(max_batch_tokens: usize) -> (EngineHandle, Arc<Counts>, usize) {
    engine_with(max_batch_tokens, false)
}

fn engine_with(
    max_batch_tokens: usize,
    device_sampling: bool,
) -> (EngineHandle, Arc<Counts>, usize) {
    let inner = cpu();
    let vocab = load_path(&fixture()).unwrap().spec.vocab_size;
    let counts = Arc::new(Counts::default());
    let b = Recording {
        inner,
        counts: counts.clone(),
        device_sampling,
    };
    let lc = EngineLoopConfig {
        mode: Mode::Colocated,
        max_batch_tokens,
        max_running_requests: 8,
        max_queued_requests: 100,
        context_length: 256,
        prefix_cache: true,
        lease: Duration::from_secs(5),
        vocab_size: vocab,
        eos_token_ids: vec![],
        max_output_tokens: None,
        idle_wait: Duration::from_millis(5),
        call_timeout: Duration::from_secs(30),
    };
    (spawn(Box::new(b), lc, None).unwrap(), counts, vocab)
}

type Out = Vec<(u32, Option<TokenLogprob>)>;

async fn collect(mut s: RequestStream) -> Out {
    let fut = async {
        let mut out = Vec::new();
        while let Some(ev) = s.next().await {
            match ev {
                EngineEvent::Token { token, logprob, .. } => out.push((token, logprob)),
                EngineEvent::Finished { .. } => return out,
                other => panic!("unexpected {other:?}"),
            }
        }
        panic!("stream ended without Finished");
    };
    tokio::time::timeout(DEADLINE, fut).await.expect("deadline")
}

/// The reference: one request alone on a fresh CPU backend, every step's full row sampled on
/// the host by the request's own sampler (same seed).
fn reference(req: &GenerateRequest, vocab: usize) -> Out {
    reference_with(req, vocab, false)
}

/// As [`reference`]; with `device`, rows a device may sample are picked by `sample_row` with the
/// uniform `SequenceSampler::device_draw` draws.
fn reference_with(req: &GenerateRequest, vocab: usize, device: bool) -> Out {
    let mut be = cpu();
    let mut sampler = SequenceSampler::new(&req.sampling, vocab, &req.prompt_token_ids).unwrap();
    let table: Vec<BlockId> = (0..BLOCKS).map(BlockId).collect();
    let mut out: Out = Vec::new();
    let mut toks = req.prompt_token_ids.clone();
    let mut pos = 0;
    for _ in 0..req.sampling.max_tokens {
        let b = ForwardBatch {
            seqs: vec![SeqStep {
                tokens: &toks,
                start_pos: pos,
                block_table: &table,
                want_logits: true,
            }],
        };
        let l = be.forward(&b).unwrap();
        // (`device_draw` advances the stream: only when the engine would call it)
        let draw = if device { sampler.device_draw() } else { None };
        let o = match draw {
            Some(d) => sampler.accept_sampled(sample_row(l.row(0), &d)).unwrap(),
            None => sampler.sample(l.row(0)).unwrap(),
        };
        pos += toks.len();
        toks = vec![o.token];
        out.push((o.token, o.logprob));
    }
    out
}

fn same(got: &Out, want: &Out, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: token count");
    for (i, ((gt, gl), (wt, wl))) in got.iter().zip(want).enumerate() {
        assert_eq!(gt, wt, "{what}: token {i}");
        match (gl, wl) {
            (None, None) => {}
            (Some(g), Some(w)) => {
                assert_eq!(g.token_id, w.token_id, "{what}: logprob id {i}");
                assert!((g.logprob - w.logprob).abs() < 1e-4, "{what}: logprob {i}");
                let gi: Vec<u32> = g.top.iter().map(|t| t.0).collect();
                let wi: Vec<u32> = w.top.iter().map(|t| t.0).collect();
                assert_eq!(gi, wi, "{what}: top ids {i}");
            }
            _ => panic!("{what}: logprob presence differs at {i}: {gl:?} vs {wl:?}"),
        }
    }
}

fn prompt(i: u32, vocab: u32) -> Vec<u32> {
    (0..(6 + i * 3))
        .map(|k| (k * 37 + i * 11 + 1) % vocab)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_requests_take_the_argmax_path_with_the_same_tokens() {
    let (e, counts, vocab) = engine(64);
    let reqs: Vec<GenerateRequest> = (1..=3u32)
        .map(|i| GenerateRequest {
            id: RequestId(i as u64),
            prompt_token_ids: prompt(i, vocab as u32),
            sampling: SamplingParams::greedy(7),
        })
        .collect();
    let streams: Vec<_> = reqs
        .iter()
        .map(|r| e.add_request(r.clone()).unwrap())
        .collect();
    for (r, s) in reqs.iter().zip(streams) {
        let got = collect(s).await;
        same(&got, &reference(r, vocab), &format!("greedy {}", r.id));
        assert!(got.iter().all(|(_, l)| l.is_none()));
    }
    assert_eq!(counts.full.load(Ordering::Relaxed), 0, "no full row asked");
    assert_eq!(counts.argmax.load(Ordering::Relaxed), 3 * 7);
    assert!(e.shutdown(DEADLINE).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_batch_of_greedy_sampled_logprobs_and_penalties_matches_host_sampling() {
    let (e, counts, vocab) = engine(24);
    let v = vocab as u32;
    let n = 6u32;
    let params = [
        SamplingParams::greedy(n),
        SamplingParams {
            temperature: 0.9,
            top_k: 20,
            seed: Some(7),
            max_tokens: n,
            ..SamplingParams::default()
        },
        SamplingParams {
            logprobs: Some(2),
            ..SamplingParams::greedy(n)
        },
        SamplingParams {
            repetition_penalty: 1.3,
            ..SamplingParams::greedy(n)
        },
        SamplingParams {
            temperature: 0.7,
            top_p: 0.8,
            seed: Some(11),
            logprobs: Some(1),
            max_tokens: n,
            ..SamplingParams::default()
        },
        SamplingParams::greedy(n),
    ];
    let reqs: Vec<GenerateRequest> = params
        .iter()
        .enumerate()
        .map(|(i, p)| GenerateRequest {
            id: RequestId(i as u64 + 1),
            prompt_token_ids: prompt(i as u32 + 1, v),
            sampling: p.clone(),
        })
        .collect();
    let streams: Vec<_> = reqs
        .iter()
        .map(|r| e.add_request(r.clone()).unwrap())
        .collect();
    for (r, s) in reqs.iter().zip(streams) {
        let got = collect(s).await;
        same(&got, &reference(r, vocab), &format!("request {}", r.id));
    }
    // two plain greedy requests took the arg-max path; the four others full rows
    assert_eq!(counts.argmax.load(Ordering::Relaxed), 2 * n as usize);
    assert_eq!(counts.full.load(Ordering::Relaxed), 4 * n as usize);
    assert_eq!(
        counts.sample.load(Ordering::Relaxed),
        0,
        "no device sampling here"
    );
    e.check_accounting().await.unwrap().unwrap();
    assert!(e.shutdown(DEADLINE).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_device_sampling_plain_sampled_rows_take_the_sample_path() {
    let (e, counts, vocab) = engine_with(24, true);
    let v = vocab as u32;
    let n = 6u32;
    let sampled =
        |temperature: f32, top_k: u32, top_p: f32, min_p: f32, seed: u64| SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed: Some(seed),
            max_tokens: n,
            ..SamplingParams::default()
        };
    let params = [
        SamplingParams::greedy(n),
        sampled(0.9, 20, 1.0, 0.0, 7),
        sampled(1.0, 0, 1.0, 0.0, 8),
        sampled(0.7, 0, 0.8, 0.05, 9),
        SamplingParams {
            logprobs: Some(1),
            ..sampled(0.7, 0, 0.8, 0.0, 11)
        },
        SamplingParams {
            presence_penalty: 0.5,
            ..sampled(1.2, 5, 1.0, 0.0, 12)
        },
    ];
    let reqs: Vec<GenerateRequest> = params
        .iter()
        .enumerate()
        .map(|(i, p)| GenerateRequest {
            id: RequestId(i as u64 + 1),
            prompt_token_ids: prompt(i as u32 + 1, v),
            sampling: p.clone(),
        })
        .collect();
    let streams: Vec<_> = reqs
        .iter()
        .map(|r| e.add_request(r.clone()).unwrap())
        .collect();
    for (r, s) in reqs.iter().zip(streams) {
        let got = collect(s).await;
        same(
            &got,
            &reference_with(r, vocab, true),
            &format!("request {}", r.id),
        );
    }
    // greedy: arg-max; three plain sampled: device sampling; logprobs and penalties: full rows
    assert_eq!(counts.argmax.load(Ordering::Relaxed), n as usize);
    assert_eq!(counts.sample.load(Ordering::Relaxed), 3 * n as usize);
    assert_eq!(counts.full.load(Ordering::Relaxed), 2 * n as usize);
    e.check_accounting().await.unwrap().unwrap();
    assert!(e.shutdown(DEADLINE).await);
}
