//! pdnode-transfer: KV hand-off: the KvTransport trait with UCX and in-process implementations, and the negotiation state machines.
