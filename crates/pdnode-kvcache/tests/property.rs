//! Random sequences of operations (seeded, so a failure replays) with the accounting invariant
//! checked after every single operation.

mod common;

use common::{Rng, assert_accounting};
use pdnode_core::{RequestId, TransferId};
use pdnode_kvcache::{KvCache, KvError, Owner};
use std::time::{Duration, Instant};

fn run(seed: u64, steps: usize, prefix: bool) {
    let mut rng = Rng(seed);
    let bs = 1 + rng.below(4);
    let total = 8 + rng.below(40) as u32;
    let mut kv = KvCache::new(total, bs as u32, prefix);
    let t0 = Instant::now();
    // (request, its tokens) for live requests; a few shared prompt stems so the cache hits.
    let stems: Vec<Vec<u32>> = (0..3)
        .map(|s| (0..24).map(|i| (s * 1000 + i) as u32).collect())
        .collect();
    let mut live: Vec<(u64, Vec<u32>)> = Vec::new();
    let mut leases: Vec<u64> = Vec::new();
    let mut next = 1u64;
    for step in 0..steps {
        let now = t0 + Duration::from_millis(step as u64);
        match rng.below(9) {
            0 | 1 => {
                let stem = &stems[rng.below(3)];
                let mut tokens = stem[..rng.below(stem.len()) + 1].to_vec();
                tokens.extend((0..rng.below(6)).map(|_| rng.below(50) as u32));
                let hit = kv.match_prefix(&tokens, tokens.len().saturating_sub(1));
                let need = kv.blocks_for(tokens.len()) - hit.len();
                let id = next;
                next += 1;
                match kv.allocate(Owner::Request(RequestId(id)), &hit, need) {
                    Ok(t) => {
                        assert_eq!(t.len(), kv.blocks_for(tokens.len()));
                        live.push((id, tokens));
                    }
                    Err(KvError::OutOfBlocks { .. } | KvError::TooLarge { .. }) => {}
                    Err(e) => panic!("seed {seed} step {step}: {e}"),
                }
            }
            2 if !live.is_empty() => {
                let i = rng.below(live.len());
                let (id, tokens) = &mut live[i];
                tokens.push(rng.below(50) as u32);
                let owner = Owner::Request(RequestId(*id));
                let have = kv.table(owner).map_or(0, |t| t.len());
                let want = kv.blocks_for(tokens.len());
                if want > have && kv.grow(owner, want - have).is_err() {
                    tokens.pop();
                }
            }
            3 if !live.is_empty() => {
                let i = rng.below(live.len());
                let (id, tokens) = &live[i];
                kv.cache_full_blocks(Owner::Request(RequestId(*id)), tokens)
                    .unwrap();
            }
            4 | 5 if !live.is_empty() => {
                let (id, tokens) = live.swap_remove(rng.below(live.len()));
                let owner = Owner::Request(RequestId(id));
                kv.cache_full_blocks(owner, &tokens).unwrap();
                kv.free(owner).unwrap();
                assert!(kv.free(owner).is_err(), "double free must be refused");
            }
            6 => {
                let id = next;
                next += 1;
                let n = rng.below(6);
                let deadline = now + Duration::from_millis(rng.below(20) as u64);
                if kv.reserve(TransferId(id), n, deadline).is_ok() {
                    leases.push(id);
                }
            }
            7 if !leases.is_empty() => {
                let id = leases.swap_remove(rng.below(leases.len()));
                let r = if rng.below(2) == 0 {
                    kv.commit_lease(TransferId(id), RequestId(id)).map(|_| ())
                } else {
                    kv.release_lease(TransferId(id)).map(|_| ())
                };
                match r {
                    Ok(()) => {
                        if kv.holds(Owner::Request(RequestId(id))) {
                            let n = kv.table(Owner::Request(RequestId(id))).unwrap().len();
                            live.push((id, (0..(n * bs) as u32).collect()));
                        }
                    }
                    Err(KvError::UnknownLease { .. }) => {} // expired meanwhile
                    Err(e) => panic!("seed {seed} step {step}: {e}"),
                }
            }
            8 if !live.is_empty() => {
                // Prefill side hand-off: a request's blocks go under a lease.
                let (id, tokens) = live.swap_remove(rng.below(live.len()));
                kv.cache_full_blocks(Owner::Request(RequestId(id)), &tokens)
                    .unwrap();
                kv.lease_request(
                    RequestId(id),
                    TransferId(id),
                    now + Duration::from_millis(5),
                )
                .unwrap();
                leases.push(id);
            }
            _ => {
                kv.expire(now);
            }
        }
        if let Err(e) = kv.check_accounting() {
            panic!("seed {seed} step {step}: {e}");
        }
    }
    for (id, _) in live {
        kv.free(Owner::Request(RequestId(id))).unwrap();
    }
    kv.expire(t0 + Duration::from_secs(3600));
    assert_eq!(kv.available(), total as usize, "seed {seed}: blocks leaked");
    assert_accounting(&kv);
}

#[test]
fn random_operations_keep_the_invariant_with_prefix_cache() {
    for seed in 0..60 {
        run(seed, 400, true);
    }
}

#[test]
fn random_operations_keep_the_invariant_without_prefix_cache() {
    for seed in 100..130 {
        run(seed, 400, false);
    }
}
