//! pdnode-testkit: Test harness helpers: a real etcd server on a free loopback port, process guards, fixture paths, waits with deadlines.
