//! DeepSeek's latent KV through the prefill/decode hand-off (CPU backend, UCX on loopback).

use crate::common;

use common::{
    arena_free, assert_node_clean as assert_clean, colocated_tokens, cpu_ucx_config, pd_pair,
    pd_request,
};

/// DeepSeek's latent KV (one plane per layer, `KvKind::Latent`) through the same hand-off: the
/// CPU backend over a tiny DeepSeek-V2 and -V3 checkpoint, prefill and decode nodes over UCX on
/// loopback, layer groups of 1 and of the default size. The PD tokens are the colocated engine's
/// and transformers' greedy tokens (the fixture's reference), the bytes moved are the latents'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deepseek_latent_kv_hand_off_matches_colocated_and_transformers() {
    for name in ["deepseek_v2", "deepseek_v3"] {
        let dir = format!(
            "{}/../pdnode-engine/tests/fixtures/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        let reference: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(format!("{dir}/reference.json")).unwrap(),
        )
        .unwrap();
        let ids: Vec<u32> = reference["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let greedy: Vec<u32> = reference["greedy_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let mut cfg = cpu_ucx_config();
        cfg.model.path = dir.clone();
        let want = colocated_tokens(&cfg, &ids, 8).await;
        assert_eq!(want, greedy[..8], "{name}: colocated vs transformers");
        let Some((p, d)) = pd_pair(&cfg) else { return };
        let layout = d.built.handle.info().kv_layout.clone();
        assert_eq!(layout.kind, pdnode_core::KvKind::Latent, "{name}");
        assert_eq!((layout.kv_heads_per_rank, layout.head_dim), (1, 32 + 8));
        for (i, group) in [1u32, 4].into_iter().enumerate() {
            p.node.set_push_layer_group(group);
            let (got, out) = pd_request(&p, &d, 200 + i as u64, &ids, 8).await;
            assert_eq!(
                got, want,
                "{name}: PD (layer groups of {group}) vs colocated"
            );
            let blocks = ids.len().div_ceil(layout.block_size as usize) as u64;
            assert_eq!(
                out.transfer_bytes,
                layout.num_layers as u64 * blocks * layout.block_layer_bytes() as u64,
                "{name}: the latents of every prompt block"
            );
        }
        assert!(arena_free(&p) && arena_free(&d));
        assert_clean(&p.node).await;
        assert_clean(&d.node).await;
    }
}
