//! The KV layout a node's pool uses. Prefill and decode compare layouts before a hand-off; a
//! mismatch fails fast and names the field that differs.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Element type of KV cache entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    Bf16,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        })
    }
}

/// What a KV cache entry holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvKind {
    /// A K plane then a V plane of `kv_heads_per_rank` heads of `head_dim` (Llama family).
    #[default]
    KeyValue,
    /// One plane: multi-head latent attention's latent (`head_dim` values, one "head"), the same
    /// on every tensor-parallel rank (DeepSeek).
    Latent,
}

impl KvKind {
    /// Planes per layer of a block: 2 (K, V) or 1 (the latent).
    pub fn planes(self) -> usize {
        match self {
            KvKind::KeyValue => 2,
            KvKind::Latent => 1,
        }
    }
}

impl fmt::Display for KvKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvKind::KeyValue => "key_value",
            KvKind::Latent => "latent",
        })
    }
}

/// Shape of one node's paged KV pool, per tensor-parallel rank.
///
/// A block holds `block_size` token positions of one layer's cache for the KV heads of one
/// rank: `planes * block_size * kv_heads_per_rank * head_dim * dtype.size_bytes()` bytes per
/// layer, `planes` being 2 (K then V) or 1 (a latent, [`KvKind::Latent`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvLayout {
    pub dtype: DType,
    pub num_layers: u32,
    pub block_size: u32,
    pub kv_heads_per_rank: u32,
    pub head_dim: u32,
    pub tp_size: u32,
    /// Fingerprint of the model weights and architecture (see the engine's loader): two nodes
    /// may exchange KV only when they run the same model.
    pub model_fingerprint: String,
    /// K and V, or a latent.
    #[serde(default)]
    pub kind: KvKind,
}

/// The first field in which two layouts differ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutMismatch {
    pub field: &'static str,
    pub ours: String,
    pub theirs: String,
}

impl fmt::Display for LayoutMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "KV layout mismatch in `{}`: ours {}, theirs {}",
            self.field, self.ours, self.theirs
        )
    }
}

impl KvLayout {
    /// Bytes of one layer of one block (K and V together, or the latent) on one rank.
    pub fn block_layer_bytes(&self) -> usize {
        self.kind.planes()
            * self.block_size as usize
            * self.kv_heads_per_rank as usize
            * self.head_dim as usize
            * self.dtype.size_bytes()
    }

    /// Bytes of one block over all layers on one rank.
    pub fn block_bytes(&self) -> usize {
        self.block_layer_bytes() * self.num_layers as usize
    }

    /// Blocks needed to hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size as usize)
    }

    /// Compares two layouts field by field; `Err` names the first field that differs. A latent
    /// ([`KvKind::Latent`]) is the same on every tensor-parallel rank, so two latent layouts may
    /// differ in `tp_size` (each decode rank gets a whole copy: `KvTarget::source_ranks`); key
    /// and value heads are split over the ranks, so their `tp_size` must match.
    pub fn check_compatible(&self, theirs: &KvLayout) -> Result<(), LayoutMismatch> {
        macro_rules! cmp {
            ($f:ident) => {
                if self.$f != theirs.$f {
                    return Err(LayoutMismatch {
                        field: stringify!($f),
                        ours: self.$f.to_string(),
                        theirs: theirs.$f.to_string(),
                    });
                }
            };
        }
        cmp!(model_fingerprint);
        cmp!(kind);
        cmp!(dtype);
        cmp!(num_layers);
        cmp!(block_size);
        cmp!(kv_heads_per_rank);
        cmp!(head_dim);
        if self.kind != KvKind::Latent {
            cmp!(tp_size);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama8b() -> KvLayout {
        KvLayout {
            dtype: DType::Bf16,
            num_layers: 32,
            block_size: 16,
            kv_heads_per_rank: 8,
            head_dim: 128,
            tp_size: 1,
            model_fingerprint: "abc".into(),
            kind: KvKind::KeyValue,
        }
    }

    #[test]
    fn a_latent_block_is_one_plane_and_never_matches_key_value() {
        // DeepSeek-V2-Lite: 27 layers, a 512 + 64 latent per token.
        let mla = KvLayout {
            kind: KvKind::Latent,
            kv_heads_per_rank: 1,
            head_dim: 576,
            num_layers: 27,
            ..llama8b()
        };
        assert_eq!(mla.block_layer_bytes(), 16 * 576 * 2);
        assert_eq!(mla.block_bytes(), 27 * 16 * 576 * 2);
        let kv = KvLayout {
            kind: KvKind::KeyValue,
            ..mla.clone()
        };
        assert_eq!(kv.block_layer_bytes(), 2 * mla.block_layer_bytes());
        let err = mla.check_compatible(&kv).unwrap_err();
        assert_eq!(err.field, "kind");
        assert!(err.to_string().contains("ours latent, theirs key_value"));
        // A layout from a peer that predates the field reads as K and V.
        let old: KvLayout = serde_json::from_str(
            r#"{"dtype":"bf16","num_layers":1,"block_size":16,"kv_heads_per_rank":8,"head_dim":128,"tp_size":1,"model_fingerprint":"x"}"#,
        )
        .unwrap();
        assert_eq!(old.kind, KvKind::KeyValue);
    }

    #[test]
    fn a_latent_goes_between_tp_degrees_and_key_value_heads_do_not() {
        let mla = |tp| KvLayout {
            kind: KvKind::Latent,
            kv_heads_per_rank: 1,
            head_dim: 576,
            tp_size: tp,
            ..llama8b()
        };
        for (p, d) in [(1, 2), (2, 1), (4, 8), (2, 2)] {
            mla(p).check_compatible(&mla(d)).unwrap();
        }
        // every other field still has to match
        let other = KvLayout {
            block_size: 32,
            ..mla(2)
        };
        assert_eq!(
            mla(1).check_compatible(&other).unwrap_err().field,
            "block_size"
        );
        let kv = |tp| KvLayout {
            tp_size: tp,
            ..llama8b()
        };
        let err = kv(2).check_compatible(&kv(1)).unwrap_err();
        assert_eq!(
            (err.field, err.ours.as_str(), err.theirs.as_str()),
            ("tp_size", "2", "1")
        );
        kv(2).check_compatible(&kv(2)).unwrap();
    }

    #[test]
    fn llama8b_block_is_64_kib_per_layer() {
        assert_eq!(llama8b().block_layer_bytes(), 64 * 1024);
        assert_eq!(llama8b().blocks_for(17), 2);
    }

    #[test]
    fn mismatch_names_the_field() {
        let a = llama8b();
        let mut b = llama8b();
        b.block_size = 32;
        let err = a.check_compatible(&b).unwrap_err();
        assert_eq!(err.field, "block_size");
        assert!(err.to_string().contains("ours 16, theirs 32"));
        assert!(a.check_compatible(&a.clone()).is_ok());
    }
}
