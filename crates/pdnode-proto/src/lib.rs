//! pdnode-proto: the generated gRPC code for `pdnode.v1` and its conversions to pdnode-core types.
//!
//! - [`v1`]: prost messages, `inference_client`/`inference_server` (`pdnode.v1.Inference`, the
//!   client API) and `node_client`/`node_server` (`pdnode.v1.Node`, the node-to-node API).
//! - [`convert`]: `From`/`TryFrom` between these messages and pdnode-core types. Convert at the
//!   edge that serves or calls an RPC; actors and policies never see prost types.
//! - [`FILE_DESCRIPTOR_SET`]: the encoded descriptors of every proto;
//!   [`CLIENT_FILE_DESCRIPTOR_SET`]: those of the client API only (what the router's client port
//!   reflects: never `pdnode.v1.Node`).
//!
//! The protos live in `proto/pdnode/v1/` at the workspace root; code generation uses protox, so
//! no system `protoc` is needed.

pub mod convert;

/// Generated code of package `pdnode.v1`.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod v1 {
    tonic::include_proto!("pdnode.v1");
}

/// The encoded `FileDescriptorSet` of every `pdnode.v1` proto (with imports and source info), for
/// `tonic_reflection::server::Builder::register_encoded_file_descriptor_set`.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/pdnode_v1_descriptor.bin"));

/// The encoded `FileDescriptorSet` of the client API (`pdnode/v1/inference.proto` and its
/// imports): reflection on the client-facing port describes `pdnode.v1.Inference` and never the
/// node data-path API.
pub const CLIENT_FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/pdnode_v1_client_descriptor.bin"));

pub use convert::ConvertError;
