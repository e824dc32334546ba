//! The accounting check behind [`crate::KvCache::check_accounting`].

use crate::{KvCache, KvError, Owner};
use std::collections::HashMap;

/// Every bookkeeping invariant; [`KvError::Accounting`] lists every violation found.
pub(crate) fn check(kv: &KvCache) -> Result<(), KvError> {
    let crate::cache::Parts {
        owner,
        free,
        tables,
        prefix,
        leases,
    } = kv.parts();
    let total = owner.len();
    let mut errs = Vec::new();
    let mut on_free = vec![false; total];
    for b in free {
        let i = b.0 as usize;
        if i >= total {
            errs.push(format!("{b} on the free list is outside the pool"));
            continue;
        }
        if on_free[i] {
            errs.push(format!("{b} is on the free list twice"));
        }
        on_free[i] = true;
        if let Some(o) = owner[i] {
            errs.push(format!("{b} is on the free list but owned by {o}"));
        }
    }
    let s = kv.stats();
    if s.free + s.cached_evictable() + s.owned_by_requests() + s.owned_by_leases() != total
        || s.owned() != s.in_use()
    {
        errs.push(format!(
            "the owned/cached/free split does not add up: {s:?}"
        ));
    }
    let owned = owner.iter().filter(|o| o.is_some()).count();
    if free.len() + owned != total {
        errs.push(format!(
            "free {} + owned {owned} != total {total}",
            free.len()
        ));
    }
    for (i, o) in owner.iter().enumerate() {
        if o.is_none() && !on_free[i] {
            errs.push(format!("blk{i} has no owner and is not free (leaked)"));
        }
    }
    let mut listed_by_owner = vec![0u32; total];
    let mut shares: HashMap<usize, u32> = HashMap::new();
    for (holder, blocks) in &tables {
        if *holder == Owner::PrefixCache {
            errs.push("the prefix cache holds a block table".into());
        }
        if let Owner::TransferLease(l) = holder
            && !leases.contains_key(l)
        {
            errs.push(format!("{holder} has a table but no deadline"));
        }
        for b in *blocks {
            let i = b.0 as usize;
            match owner.get(i).copied().flatten() {
                Some(o) if o == *holder => listed_by_owner[i] += 1,
                Some(Owner::PrefixCache) => *shares.entry(i).or_default() += 1,
                Some(o) => errs.push(format!("{holder} lists {b}, which {o} owns")),
                None => errs.push(format!("{holder} lists {b}, which is free")),
            }
        }
    }
    for l in leases.keys() {
        if !tables.iter().any(|(o, _)| *o == Owner::TransferLease(*l)) {
            errs.push(format!("lease {l} has a deadline but no table"));
        }
    }
    for (i, o) in owner.iter().enumerate() {
        match o {
            Some(Owner::Request(_) | Owner::TransferLease(_)) if listed_by_owner[i] != 1 => {
                errs.push(format!(
                    "blk{i} owned by {} is listed {} times in its table",
                    o.map_or(String::new(), |o| o.to_string()),
                    listed_by_owner[i]
                ));
            }
            Some(Owner::PrefixCache) => {
                let refs = prefix
                    .by_block
                    .get(&pdnode_core::BlockId(i as u32))
                    .and_then(|k| prefix.entries.get(k))
                    .map(|e| e.refs);
                let want = shares.get(&i).copied().unwrap_or(0);
                match refs {
                    None => errs.push(format!("blk{i} owned by the prefix cache is not indexed")),
                    Some(r) if r != want => {
                        errs.push(format!("blk{i}: {r} refs recorded, {want} tables share it"))
                    }
                    _ => {}
                }
            }
            _ => {}
        }
    }
    for b in prefix.by_block.keys() {
        if owner.get(b.0 as usize).copied().flatten() != Some(Owner::PrefixCache) {
            errs.push(format!(
                "{b} is indexed by the prefix cache but not owned by it"
            ));
        }
    }
    prefix.check(&mut errs);
    if errs.is_empty() {
        Ok(())
    } else {
        Err(KvError::Accounting {
            details: errs.join("; "),
        })
    }
}
