//! pdnode-registry: Node registry: the Registry trait with etcd and in-memory implementations; node cards under leases, watches.
