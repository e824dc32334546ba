//! The model fingerprint carried in `KvLayout::model_fingerprint`: two nodes exchange KV only when
//! their fingerprints agree. It hashes the [`ModelSpec`], every tensor's name and shape, and a
//! sample of each tensor's values (up to 64 evenly spaced elements plus the first and last), so a
//! different checkpoint of the same architecture gets a different fingerprint while loading the
//! same model from the same file twice gives the same one. The same model loaded from different
//! formats (GGUF Q4_1 vs HF bf16) differs, as its KV would.

use super::DummySpec;
use crate::spec::ModelSpec;
use crate::weights::{MlaWeights, Tensor, Weights};

/// Two independent 64-bit FNV-1a streams make a 128-bit hash (not cryptographic; it guards
/// against mistakes, not adversaries).
struct Hasher {
    a: u64,
    b: u64,
}

impl Hasher {
    fn new() -> Self {
        Self {
            a: 0xcbf2_9ce4_8422_2325,
            b: 0x6c62_272e_07bb_0142,
        }
    }
    fn bytes(&mut self, data: &[u8]) {
        for &x in data {
            self.a = (self.a ^ x as u64).wrapping_mul(0x0000_0100_0000_01b3);
            self.b = (self.b ^ x as u64)
                .wrapping_mul(0x0000_0100_0000_01b3)
                .rotate_left(5);
        }
    }
    fn str(&mut self, s: &str) {
        self.bytes(&(s.len() as u64).to_le_bytes());
        self.bytes(s.as_bytes());
    }
    fn hex(&self) -> String {
        format!("{:016x}{:016x}", self.a, self.b)
    }
}

fn spec_bytes(h: &mut Hasher, spec: &ModelSpec) {
    // Debug formatting of the spec is stable within a build and covers every field.
    h.str(&format!("{spec:?}"));
}

fn tensor(h: &mut Hasher, name: &str, t: &Tensor) {
    h.str(name);
    for d in &t.shape {
        h.bytes(&(*d as u64).to_le_bytes());
    }
    let n = t.data.len();
    if n == 0 {
        return;
    }
    let step = (n / 64).max(1);
    for i in (0..n).step_by(step).chain([n - 1]) {
        h.bytes(&t.data[i].to_bits().to_le_bytes());
    }
}

/// Fingerprint of host weights.
pub fn of_weights(spec: &ModelSpec, w: &Weights) -> String {
    let mut h = Hasher::new();
    spec_bytes(&mut h, spec);
    tensor(&mut h, "embed", &w.embed);
    for (n, l) in w.layers.iter().enumerate() {
        let mut t = |name: &str, x: &Tensor| tensor(&mut h, &format!("layers.{n}.{name}"), x);
        t("attn_norm", &l.attn_norm);
        t("wq", &l.wq);
        t("wk", &l.wk);
        t("wv", &l.wv);
        for (name, x) in [
            ("bq", &l.bq),
            ("bk", &l.bk),
            ("bv", &l.bv),
            ("q_norm", &l.q_norm),
            ("k_norm", &l.k_norm),
        ] {
            if let Some(x) = x {
                t(name, x);
            }
        }
        t("wo", &l.wo);
        t("mlp_norm", &l.mlp_norm);
        t("w_gate", &l.w_gate);
        t("w_up", &l.w_up);
        t("w_down", &l.w_down);
    }
    tensor(&mut h, "final_norm", &w.final_norm);
    if let Some(x) = &w.lm_head {
        tensor(&mut h, "lm_head", x);
    }
    h.hex()
}

/// Fingerprint of dummy weights (a function of the spec and the generator parameters, so a CPU
/// node and a CUDA node with the same preset and seed agree without materializing anything).
pub fn of_mla_weights(spec: &ModelSpec, w: &MlaWeights) -> String {
    let mut h = Hasher::new();
    spec_bytes(&mut h, spec);
    for (name, t) in w.tensors() {
        tensor(&mut h, &name, t);
    }
    h.hex()
}

pub fn of_dummy(spec: &ModelSpec, d: DummySpec) -> String {
    let mut h = Hasher::new();
    spec_bytes(&mut h, spec);
    h.str("dummy-splitmix64-v1");
    h.bytes(&d.seed.to_le_bytes());
    h.bytes(&d.std.to_bits().to_le_bytes());
    h.hex()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loader::dummy;

    #[test]
    fn fingerprint_tracks_weights_and_spec() {
        let spec = ModelSpec {
            num_layers: 2,
            vocab_size: 64,
            ..dummy::preset("smollm2-135m").unwrap()
        };
        let d = DummySpec { seed: 1, std: 0.02 };
        let w = dummy::materialize(&spec, d);
        let f1 = of_weights(&spec, &w);
        assert_eq!(f1.len(), 32);
        assert_eq!(f1, of_weights(&spec, &w.clone()));
        let mut w2 = w.clone();
        w2.layers[1].w_up.data[0] += 1.0;
        assert_ne!(f1, of_weights(&spec, &w2));
        let spec2 = ModelSpec {
            rope_theta: 1.0,
            ..spec.clone()
        };
        assert_ne!(f1, of_weights(&spec2, &w));
        assert_ne!(
            of_dummy(&spec, d),
            of_dummy(&spec, DummySpec { seed: 2, ..d })
        );
    }
}
