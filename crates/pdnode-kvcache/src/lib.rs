//! pdnode-kvcache: Paged KV cache bookkeeping: block pool, block tables, ownership by lease, radix prefix cache.
