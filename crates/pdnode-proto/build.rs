//! Compiles `proto/pdnode/v1/*.proto` with protox (pure Rust; no system `protoc`) and generates
//! prost messages plus tonic clients and servers. The encoded file descriptor sets are written to
//! `OUT_DIR/pdnode_v1_descriptor.bin` (every proto) and `OUT_DIR/pdnode_v1_client_descriptor.bin`
//! (the client API and its imports only: what the router's client port reflects).

use prost::Message;
use std::path::PathBuf;

const PROTOS: &[&str] = &[
    "pdnode/v1/common.proto",
    "pdnode/v1/inference.proto",
    "pdnode/v1/node.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto_root = manifest.join("../../proto");
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);

    println!("cargo:rerun-if-changed={}", proto_root.display());
    for p in PROTOS {
        println!("cargo:rerun-if-changed={}", proto_root.join(p).display());
    }

    // The client-facing port must not describe the node data-path API.
    let client = protox::compile(["pdnode/v1/inference.proto"], [&proto_root])?;
    if client
        .file
        .iter()
        .any(|f| f.name() == "pdnode/v1/node.proto")
    {
        return Err("the client descriptor set must not include node.proto".into());
    }
    std::fs::write(
        out_dir.join("pdnode_v1_client_descriptor.bin"),
        client.encode_to_vec(),
    )?;
    let fds = protox::compile(PROTOS, [&proto_root])?;
    std::fs::write(
        out_dir.join("pdnode_v1_descriptor.bin"),
        fds.encode_to_vec(),
    )?;

    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
