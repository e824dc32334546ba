mod common;

use common::assert_accounting;
use pdnode_core::error::Classify;
use pdnode_core::{BlockId, ErrorKind, RequestId, TransferId};
use pdnode_kvcache::{KvCache, KvError, Owner};
use std::time::{Duration, Instant};

fn req(n: u64) -> Owner {
    Owner::Request(RequestId(n))
}

#[test]
fn allocate_and_free_return_every_block() {
    let mut kv = KvCache::new(8, 4, false);
    let t = kv.allocate(req(1), &[], 3).unwrap().to_vec();
    assert_eq!(t, vec![BlockId(0), BlockId(1), BlockId(2)]);
    kv.grow(req(1), 2).unwrap();
    assert_eq!(kv.table(req(1)).unwrap().len(), 5);
    assert_eq!(kv.available(), 3);
    assert_accounting(&kv);
    assert_eq!(kv.free(req(1)).unwrap(), 5);
    assert_eq!(kv.available(), 8);
    assert_accounting(&kv);
}

#[test]
fn errors_are_typed_and_change_nothing() {
    let mut kv = KvCache::new(4, 4, true);
    kv.allocate(req(1), &[], 3).unwrap();
    let e = kv.allocate(req(2), &[], 2).unwrap_err();
    assert_eq!(
        e,
        KvError::OutOfBlocks {
            needed: 2,
            available: 1
        }
    );
    assert_eq!(e.kind(), ErrorKind::Overloaded);
    assert!(matches!(
        kv.allocate(req(3), &[], 5),
        Err(KvError::TooLarge {
            needed: 5,
            total: 4
        })
    ));
    assert!(matches!(
        kv.allocate(req(1), &[], 1),
        Err(KvError::OwnerExists { .. })
    ));
    assert!(matches!(
        kv.allocate(Owner::PrefixCache, &[], 1),
        Err(KvError::InvalidOwner { .. })
    ));
    // A block that is not cached cannot be shared.
    assert!(matches!(
        kv.allocate(req(4), &[BlockId(3)], 0),
        Err(KvError::NotCached { block: BlockId(3) })
    ));
    assert!(matches!(
        kv.owner_of(BlockId(99)),
        Err(KvError::UnknownBlock { .. })
    ));
    kv.free(req(1)).unwrap();
    // Double free is an error, not a panic, and does not corrupt the pool.
    assert!(matches!(kv.free(req(1)), Err(KvError::UnknownOwner { .. })));
    assert!(matches!(
        kv.release_lease(TransferId(9)),
        Err(KvError::UnknownLease { .. })
    ));
    assert_eq!(kv.available(), 4);
    assert_accounting(&kv);
}

fn toks(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + salt).collect()
}

#[test]
fn prefix_hit_shares_full_blocks_and_survives_the_first_owner() {
    let mut kv = KvCache::new(16, 4, true);
    let prompt = toks(10, 1); // 2 full blocks + 2 tokens
    kv.allocate(req(1), &[], 3).unwrap();
    assert_eq!(kv.cache_full_blocks(req(1), &prompt).unwrap(), 2);
    assert_accounting(&kv);

    // A second request with the same first 9 tokens shares both full blocks.
    let mut p2 = prompt[..9].to_vec();
    p2.push(999);
    let hit = kv.match_prefix(&p2, p2.len() - 1);
    assert_eq!(hit, kv.table(req(1)).unwrap()[..2].to_vec());
    kv.allocate(req(2), &hit, 1).unwrap();
    assert_eq!(kv.stats().cached, 2);
    assert_accounting(&kv);

    kv.free(req(1)).unwrap();
    assert_accounting(&kv);
    // Still shared by request 2: not reclaimable.
    assert_eq!(kv.stats().cached_unreferenced, 0);
    kv.free(req(2)).unwrap();
    assert_eq!(kv.stats().cached_unreferenced, 2);
    assert_eq!(kv.available(), 16);
    // Now a third request hits the cache with no one else holding it.
    let hit = kv.match_prefix(&prompt, prompt.len() - 1);
    assert_eq!(hit.len(), 2);
    assert_accounting(&kv);
}

#[test]
fn match_is_exact_on_tokens_and_limited_by_max_tokens() {
    let mut kv = KvCache::new(16, 4, true);
    let p = toks(8, 3);
    kv.allocate(req(1), &[], 2).unwrap();
    kv.cache_full_blocks(req(1), &p).unwrap();
    let mut other = p.clone();
    other[1] += 1;
    assert!(kv.match_prefix(&other, 8).is_empty());
    assert_eq!(
        kv.match_prefix(&p, 7).len(),
        1,
        "never match the last token"
    );
    assert_eq!(kv.match_prefix(&p, 8).len(), 2);
    let mut diverge = p.clone();
    diverge[6] = 12345;
    assert_eq!(kv.match_prefix(&diverge, 8).len(), 1);
    kv.free(req(1)).unwrap();
    assert_accounting(&kv);
}

#[test]
fn lru_eviction_reclaims_unreferenced_cached_blocks_oldest_first() {
    let mut kv = KvCache::new(4, 2, true);
    let a = toks(4, 100);
    let b = toks(4, 200);
    kv.allocate(req(1), &[], 2).unwrap();
    kv.cache_full_blocks(req(1), &a).unwrap();
    kv.free(req(1)).unwrap();
    kv.allocate(req(2), &[], 2).unwrap();
    kv.cache_full_blocks(req(2), &b).unwrap();
    kv.free(req(2)).unwrap();
    assert_eq!(kv.stats().free, 0);
    assert_eq!(kv.available(), 4);
    // Touch `a` so that `b` is the least recently used.
    assert_eq!(kv.match_prefix(&a, 4).len(), 2);
    let hit = kv.match_prefix(&a, 4);
    kv.allocate(req(3), &hit, 0).unwrap();
    kv.free(req(3)).unwrap();
    // Needing one block evicts the leaf of `b` first.
    kv.allocate(req(4), &[], 1).unwrap();
    assert_eq!(kv.match_prefix(&b, 4).len(), 1);
    assert_eq!(kv.match_prefix(&a, 4).len(), 2);
    assert_accounting(&kv);
    // Needing everything evicts the rest, leaves first.
    kv.grow(req(4), 3).unwrap();
    assert!(kv.match_prefix(&a, 4).is_empty());
    assert_eq!(kv.stats().cached, 0);
    kv.free(req(4)).unwrap();
    assert_accounting(&kv);
}

#[test]
fn shared_blocks_are_never_evicted() {
    let mut kv = KvCache::new(4, 2, true);
    let a = toks(4, 1);
    kv.allocate(req(1), &[], 2).unwrap();
    kv.cache_full_blocks(req(1), &a).unwrap();
    kv.grow(req(1), 1).unwrap();
    assert!(matches!(
        kv.allocate(req(2), &[], 2),
        Err(KvError::OutOfBlocks { .. })
    ));
    kv.free(req(1)).unwrap();
    kv.allocate(req(2), &[], 4).unwrap();
    kv.free(req(2)).unwrap();
    assert_accounting(&kv);
}

#[test]
fn duplicate_blocks_are_deduplicated_into_shares() {
    let mut kv = KvCache::new(8, 2, true);
    let a = toks(4, 5);
    kv.allocate(req(1), &[], 2).unwrap();
    kv.allocate(req(2), &[], 3).unwrap();
    assert_eq!(kv.cache_full_blocks(req(1), &a).unwrap(), 2);
    let t1 = kv.table(req(1)).unwrap().to_vec();
    assert_eq!(kv.cache_full_blocks(req(2), &a).unwrap(), 2);
    // Request 2 now shares request 1's cached blocks; its own copies went back to the pool.
    assert_eq!(kv.table(req(2)).unwrap()[..2], t1[..]);
    assert_eq!(kv.stats().request_owned, 1);
    assert_eq!(kv.stats().free, 5);
    assert_accounting(&kv);
    kv.free(req(2)).unwrap();
    kv.free(req(1)).unwrap();
    assert_eq!(kv.stats().free, 6);
    assert_eq!(kv.stats().cached_unreferenced, 2);
    assert_accounting(&kv);
}

#[test]
fn leases_reserve_commit_release_and_expire() {
    let mut kv = KvCache::new(10, 4, true);
    let now = Instant::now();
    let l1 = TransferId(1);
    let l2 = TransferId(2);
    let blocks = kv
        .reserve(l1, 3, now + Duration::from_secs(5))
        .unwrap()
        .to_vec();
    assert_eq!(
        kv.owner_of(blocks[0]).unwrap(),
        Some(Owner::TransferLease(l1))
    );
    kv.reserve(l2, 2, now + Duration::from_secs(1)).unwrap();
    assert!(matches!(
        kv.reserve(l2, 1, now),
        Err(KvError::OwnerExists { .. })
    ));
    assert_eq!(kv.next_deadline(), Some(now + Duration::from_secs(1)));
    assert_accounting(&kv);

    assert!(kv.expire(now).is_empty());
    assert_eq!(kv.expire(now + Duration::from_secs(2)), vec![l2]);
    assert!(matches!(
        kv.commit_lease(l2, RequestId(2)),
        Err(KvError::UnknownLease { .. })
    ));
    assert_accounting(&kv);

    let t = kv.commit_lease(l1, RequestId(7)).unwrap().to_vec();
    assert_eq!(t, blocks);
    assert_eq!(
        kv.owner_of(blocks[0]).unwrap(),
        Some(Owner::Request(RequestId(7)))
    );
    assert!(kv.expire(now + Duration::from_secs(60)).is_empty());
    assert_accounting(&kv);

    // Prefill side: a request's table (with cached shares) goes under a lease and back to free.
    let p = toks(6, 9);
    kv.cache_full_blocks(req(7), &p).unwrap();
    kv.lease_request(RequestId(7), TransferId(3), now + Duration::from_secs(1))
        .unwrap();
    assert!(!kv.holds(req(7)));
    assert_accounting(&kv);
    kv.release_lease(TransferId(3)).unwrap();
    assert_eq!(kv.available(), 10);
    assert_eq!(kv.stats().cached, 1);
    assert_accounting(&kv);
}

#[test]
fn a_failed_reserve_leaves_no_lease_behind() {
    let mut kv = KvCache::new(2, 4, false);
    assert!(kv.reserve(TransferId(1), 3, Instant::now()).is_err());
    assert_eq!(kv.stats().leases, 0);
    assert!(kv.expire(Instant::now()).is_empty());
    assert_accounting(&kv);
}

/// The split `/metrics` exports: owned by requests / by leases, evictable cached, free. Sequences
/// that finished or were cut off leave their full blocks cached, which is not owned.
#[test]
fn owned_cached_free_split_tells_a_cache_from_a_leak() {
    let mut kv = KvCache::new(16, 4, true);
    let a = toks(10, 1); // 2 full blocks + 2 positions
    // Request 1: 3 private blocks, 2 of them published to the prefix cache.
    kv.allocate(req(1), &[], 3).unwrap();
    kv.cache_full_blocks(req(1), &a).unwrap();
    // Request 2 shares the 2 cached blocks and holds 1 private block.
    let hit = kv.match_prefix(&a, a.len());
    assert_eq!(hit.len(), 2);
    kv.allocate(req(2), &hit, 1).unwrap();
    // A decode reservation: 4 private blocks under a transfer lease.
    let deadline = Instant::now() + Duration::from_secs(60);
    kv.reserve(TransferId(9), 4, deadline).unwrap();
    let s = kv.stats();
    assert_eq!(
        s.owned_by_requests(),
        2 + 1 + 1,
        "shared cached blocks are owned"
    );
    assert_eq!(s.owned_by_leases(), 4);
    assert_eq!(s.cached_evictable(), 0, "shared blocks cannot be evicted");
    assert_eq!(s.free, 16 - 8);
    assert_eq!(s.owned(), s.in_use());
    assert_accounting(&kv);

    // Request 1 ends: its shared blocks stay owned by request 2.
    kv.free(req(1)).unwrap();
    let s = kv.stats();
    assert_eq!((s.owned_by_requests(), s.cached_evictable()), (3, 0));
    // Request 2 is cut off: the 2 cached blocks become evictable, nothing is owned by requests.
    kv.free(req(2)).unwrap();
    let s = kv.stats();
    assert_eq!(s.owned_by_requests(), 0);
    assert_eq!(s.cached_evictable(), 2);
    assert_eq!(s.owned_by_leases(), 4);
    // A lease that shares a cached block (prefill hand-off of a prefix hit) owns it too.
    let hit = kv.match_prefix(&a, a.len());
    kv.allocate(req(3), &hit, 1).unwrap();
    kv.lease_request(RequestId(3), TransferId(10), deadline)
        .unwrap();
    let s = kv.stats();
    assert_eq!(s.owned_by_requests(), 0);
    assert_eq!(s.owned_by_leases(), 4 + 2 + 1);
    assert_eq!(s.cached_evictable(), 0);
    assert_accounting(&kv);

    // Everything released: owned is 0 though the pool is not all free (the cache keeps 2).
    kv.release_lease(TransferId(9)).unwrap();
    kv.release_lease(TransferId(10)).unwrap();
    let s = kv.stats();
    assert_eq!(s.owned(), 0);
    assert_eq!(s.cached_evictable(), 2);
    assert_eq!(s.free, 14);
    assert_eq!(
        s.total - s.free,
        2,
        "what the old in-use gauge showed: owned + cached"
    );
    assert_accounting(&kv);
}
