//! pdnode-proto: Generated gRPC code for pdnode.v1 (client API and node-to-node API), and conversions to pdnode-core types.
