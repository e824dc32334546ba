//! pdnode-router: Router: membership view, prefill/decode policies, request orchestration, OpenAI HTTP and gRPC frontends.
