//! pdnode-node: Node runtime: supervision tree (ractor), engine/transfer/registrar actors, node gRPC server, graceful shutdown.
