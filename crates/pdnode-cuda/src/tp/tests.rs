use super::*;
use pdnode_engine::spec::Arch;

fn spec(kv_heads: usize) -> ModelSpec {
    ModelSpec {
        arch: Arch::Llama,
        hidden_size: 64,
        intermediate_size: 128,
        num_layers: 1,
        num_heads: 4,
        num_kv_heads: kv_heads,
        head_dim: 16,
        vocab_size: 10,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        max_position_embeddings: 128,
        tie_word_embeddings: true,
        qkv_bias: false,
        qk_norm: false,
        sliding_window: None,
        mla: None,
        moe: None,
        bos_token_id: None,
        eos_token_ids: vec![],
    }
}

fn opts(tp: u32) -> CudaOptions {
    CudaOptions {
        gpus: (0..tp).collect(),
        tensor_parallel: tp,
        mem_fraction: 0.5,
        num_kv_blocks: 4,
        block_size: 16,
        max_batch_tokens: 16,
        max_seqs: 2,
        prefill_gemm_min_tokens: 64,
        linear: super::super::ops::LinearImpl::Auto,
        attention: super::super::ops::AttnVariant::Auto.into(),
        prefill_attention: Default::default(),
        cuda_graphs: false,
        gpu_sampling: true,
        pdl: false,
        fusion: crate::ops::Fusion::default(),
        warm_up_context: 0,
    }
}

// Sliding-window attention runs on the CUDA kernels (the window reaches every attention kernel,
// per layer): a windowed model is no longer refused. It passes every check made before a device
// is touched, one GPU and tensor-parallel alike, so the GPU-list check after them is the one that
// fails here, on a host with or without a GPU.
#[test]
fn a_sliding_window_model_is_not_refused() {
    let mut s = spec(2);
    s.sliding_window = Some(pdnode_engine::spec::SlidingWindow {
        size: 8,
        layers: vec![true; s.num_layers],
    });
    let one = CudaOptions {
        gpus: vec![0, 1],
        ..opts(1)
    };
    let tp = CudaOptions {
        gpus: vec![0, 1, 2, 3],
        ..opts(2)
    };
    for (what, r) in [
        (
            "one GPU",
            CudaBackend::new_dummy(&s, 1, &one, "t".into()).err(),
        ),
        (
            "TP 2",
            CudaTpBackend::new_dummy(&s, 1, None, &tp, "t".into()).err(),
        ),
    ] {
        match r {
            Some(CudaError::Unsupported { reason }) => assert!(
                reason.contains("one node per") && !reason.contains("window"),
                "{what}: {reason}"
            ),
            Some(other) => panic!("{what}: unexpected error {other:?}"),
            None => panic!("{what}: the GPU list must still be refused"),
        }
    }
}

// Shape checks come before any device or library is touched: the same typed error on a
// build host without a GPU and on the GPU host.
#[test]
fn kv_heads_not_divisible_by_tp_is_a_typed_error() {
    let e = CudaTpBackend::new_dummy(&spec(1), 1, None, &opts(2), "t".into())
        .err()
        .expect("1 KV head over 2 ranks must be refused");
    match &e {
        CudaError::Unsupported { reason } => {
            assert!(reason.contains("num_kv_heads = 1"), "{reason}")
        }
        other => panic!("unexpected error {other:?}"),
    }
    let e = CudaTpBackend::new_dummy(&spec(2), 1, None, &opts(3), "t".into())
        .err()
        .expect("tp = 3 must be refused");
    assert!(matches!(e, CudaError::Unsupported { .. }), "{e:?}");
}

// The GPU list is checked before any device or library is touched too: never a silent
// subset of the listed GPUs, never two ranks on one GPU.
#[test]
fn a_gpu_list_that_is_not_one_gpu_per_rank_is_a_typed_error() {
    for gpus in [vec![0, 1, 2, 3], vec![0], vec![], vec![1, 1]] {
        let o = CudaOptions {
            gpus: gpus.clone(),
            ..opts(2)
        };
        match CudaTpBackend::new_dummy(&spec(2), 1, None, &o, "t".into()) {
            Err(CudaError::Unsupported { reason }) => {
                assert!(
                    reason.contains("one node per") || reason.contains("twice"),
                    "{reason}"
                )
            }
            Err(other) => panic!("{gpus:?}: unexpected error {other:?}"),
            Ok(_) => panic!("{gpus:?} must be refused at tensor_parallel 2"),
        }
    }
    let o = CudaOptions {
        gpus: vec![0, 1],
        ..opts(1)
    };
    match CudaBackend::new_dummy(&spec(2), 1, &o, "t".into()) {
        Err(CudaError::Unsupported { reason }) => {
            assert!(reason.contains("one node per"), "{reason}")
        }
        Err(other) => panic!("unexpected error {other:?}"),
        Ok(_) => panic!("two GPUs listed for one rank must be refused"),
    }
}

#[test]
fn plain_cuda_backend_refuses_tp_above_one() {
    let e = CudaBackend::new_dummy(&spec(2), 1, &opts(2), "t".into())
        .err()
        .expect("CudaBackend is one GPU");
    match e {
        CudaError::Unsupported { reason } => assert!(reason.contains("CudaTpBackend")),
        other => panic!("unexpected error {other:?}"),
    }
}
