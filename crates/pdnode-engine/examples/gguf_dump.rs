//! Prints a GGUF file's metadata, tensor types and the ModelSpec derived from it:
//! `cargo run -p pdnode-engine --example gguf_dump -- models/SmolLM2-135M-Instruct.Q4_1.gguf`

use pdnode_engine::loader::{gguf::GgufFile, gguf_model::spec_from_gguf};
use std::collections::BTreeMap;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path: PathBuf = std::env::args_os()
        .nth(1)
        .ok_or("usage: gguf_dump FILE.gguf")?
        .into();
    let f = GgufFile::open(&path)?;
    println!(
        "GGUF v{}, {} tensors, alignment {}",
        f.version,
        f.tensors.len(),
        f.alignment
    );
    for k in &f.metadata_order {
        if let Some(v) = f.get(k) {
            println!("{k} = {}", v.summary());
        }
    }
    let mut types = BTreeMap::new();
    for t in &f.tensors {
        *types.entry(format!("{:?}", t.ggml_type)).or_insert(0usize) += 1;
    }
    println!("tensor types: {types:?}");
    println!("{:#?}", spec_from_gguf(&f)?);
    Ok(())
}
