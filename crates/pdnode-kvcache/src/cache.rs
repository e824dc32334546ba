//! [`KvCache`]: the block pool, per-owner block tables, the prefix cache and transfer leases.
//!
//! # Ownership model
//! Every block is either on the free list or has exactly one [`Owner`]:
//! - `Owner::Request(id)` / `Owner::TransferLease(id)`: a *private* block of that holder's table;
//! - `Owner::PrefixCache`: a full block whose tokens are indexed by the prefix cache.
//!
//! A holder's block table may also list prefix-cache blocks: those are *shared*, counted by a
//! reference count on the cache entry (one per table listing the block). A cached block with
//! references is never evicted; an unreferenced one is reclaimed by LRU eviction when the free list
//! runs out. When a holder's blocks become full and their tokens are known
//! ([`KvCache::cache_full_blocks`]), ownership of those private blocks moves to the prefix cache
//! and the table keeps a shared reference, so freeing the holder leaves them cached.
//!
//! The invariant `free + owned == total`, single ownership, and `refs == number of tables sharing`
//! are checked by [`KvCache::check_accounting`], which every test ends with.

use crate::error::KvError;
use crate::prefix::{BlockKey, PrefixIndex, chain_key};
use pdnode_core::{BlockId, RequestId, TransferId};
use std::collections::HashMap;
use std::fmt;
use std::time::Instant;

/// Who owns a block (or, for `Request` and `TransferLease`, who holds a block table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Owner {
    Request(RequestId),
    PrefixCache,
    TransferLease(TransferId),
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Owner::Request(r) => write!(f, "request {r}"),
            Owner::PrefixCache => f.write_str("the prefix cache"),
            Owner::TransferLease(t) => write!(f, "transfer lease {t}"),
        }
    }
}

#[derive(Debug, Default)]
struct Table {
    blocks: Vec<BlockId>,
    /// Leading blocks whose chain key is known (cached, shared, or duplicates kept private).
    hashed: usize,
    last_key: Option<BlockKey>,
    /// Publishing to the prefix cache stopped (see [`KvCache::cache_full_blocks`]).
    stopped: bool,
}

/// Counts for metrics and admission decisions.
///
/// Two views of the same pool. By block owner: `free + cached + request_owned + lease_owned ==
/// total`. By who keeps a block from being reused (what `/metrics` exports):
/// `free + cached_evictable() + owned_by_requests() + owned_by_leases() == total`, where a
/// prefix-cache block that a live table shares counts as owned by that table's kind (a request
/// before a transfer lease), not as cached: eviction cannot take it. With no request and no
/// lease alive, both owned counts are 0 whatever the prefix cache holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvStats {
    pub total: usize,
    pub free: usize,
    /// Blocks owned by the prefix cache (shared or not).
    pub cached: usize,
    /// Cached blocks no table references (reclaimable).
    pub cached_unreferenced: usize,
    /// Private blocks of requests.
    pub request_owned: usize,
    /// Private blocks of transfer leases.
    pub lease_owned: usize,
    /// Cached blocks shared by at least one request's table.
    pub cached_shared_by_requests: usize,
    /// Cached blocks shared by at least one transfer lease's table and no request's.
    pub cached_shared_by_leases: usize,
    pub leases: usize,
}

impl KvStats {
    /// Blocks a running (or queued, preempted) request keeps from reuse: its private blocks and
    /// the cached blocks it shares.
    pub fn owned_by_requests(&self) -> usize {
        self.request_owned + self.cached_shared_by_requests
    }
    /// Blocks a transfer lease (a decode reservation, a prefill hand-off) keeps from reuse and
    /// no request does.
    pub fn owned_by_leases(&self) -> usize {
        self.lease_owned + self.cached_shared_by_leases
    }
    /// Blocks someone alive holds: `owned_by_requests() + owned_by_leases()`.
    pub fn owned(&self) -> usize {
        self.owned_by_requests() + self.owned_by_leases()
    }
    /// Prefix-cache blocks nobody shares: kept for reuse, reclaimed by eviction on demand.
    pub fn cached_evictable(&self) -> usize {
        self.cached_unreferenced
    }
    /// Blocks that an allocation could get now (free plus evictable).
    pub fn available(&self) -> usize {
        self.free + self.cached_unreferenced
    }
    /// Blocks held by someone and not reclaimable (equals [`KvStats::owned`]).
    pub fn in_use(&self) -> usize {
        self.total - self.available()
    }
}

#[derive(Debug)]
pub struct KvCache {
    block_size: usize,
    owner: Vec<Option<Owner>>,
    free: Vec<BlockId>,
    tables: HashMap<Owner, Table>,
    prefix: PrefixIndex,
    leases: HashMap<TransferId, Instant>,
    prefix_enabled: bool,
}

impl KvCache {
    /// A pool of `num_blocks` blocks of `block_size` positions; `prefix_cache` turns caching on.
    pub fn new(num_blocks: u32, block_size: u32, prefix_cache: bool) -> Self {
        Self {
            block_size: block_size.max(1) as usize,
            owner: vec![None; num_blocks as usize],
            // Reverse order so that block 0 is handed out first (readable tests and logs).
            free: (0..num_blocks).rev().map(BlockId).collect(),
            tables: HashMap::new(),
            prefix: PrefixIndex::default(),
            leases: HashMap::new(),
            prefix_enabled: prefix_cache,
        }
    }

    pub fn total(&self) -> usize {
        self.owner.len()
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn prefix_cache_enabled(&self) -> bool {
        self.prefix_enabled
    }
    /// Blocks needed for `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
    /// Blocks an allocation could get now: free plus unreferenced cached blocks.
    pub fn available(&self) -> usize {
        self.free.len() + self.prefix.unreferenced()
    }

    pub fn stats(&self) -> KvStats {
        let mut s = KvStats {
            total: self.total(),
            free: self.free.len(),
            cached_unreferenced: self.prefix.unreferenced(),
            leases: self.leases.len(),
            ..KvStats::default()
        };
        for o in self.owner.iter().flatten() {
            match o {
                Owner::Request(_) => s.request_owned += 1,
                Owner::PrefixCache => s.cached += 1,
                Owner::TransferLease(_) => s.lease_owned += 1,
            }
        }
        if s.cached > s.cached_unreferenced {
            // Attribute each shared cached block once: 2 = a request shares it, 1 = only leases.
            let mut by = vec![0u8; self.total()];
            for (o, t) in &self.tables {
                let k = match o {
                    Owner::Request(_) => 2,
                    Owner::TransferLease(_) => 1,
                    Owner::PrefixCache => continue,
                };
                for b in &t.blocks {
                    let i = b.0 as usize;
                    if self.owner.get(i) == Some(&Some(Owner::PrefixCache)) {
                        by[i] = by[i].max(k);
                    }
                }
            }
            for k in by {
                match k {
                    2 => s.cached_shared_by_requests += 1,
                    1 => s.cached_shared_by_leases += 1,
                    _ => {}
                }
            }
        }
        s
    }

    /// The owner of a block (`None`: free).
    pub fn owner_of(&self, block: BlockId) -> Result<Option<Owner>, KvError> {
        self.owner
            .get(block.0 as usize)
            .copied()
            .ok_or(KvError::UnknownBlock {
                block,
                total: self.total(),
            })
    }

    /// The block table of a holder, in position order.
    pub fn table(&self, owner: Owner) -> Option<&[BlockId]> {
        self.tables.get(&owner).map(|t| t.blocks.as_slice())
    }

    pub fn holds(&self, owner: Owner) -> bool {
        self.tables.contains_key(&owner)
    }

    /// Cached blocks matching the leading full blocks of `tokens`, covering at most `max_tokens`
    /// positions. Takes no reference: pass the result to [`KvCache::allocate`] right away.
    pub fn match_prefix(&mut self, tokens: &[u32], max_tokens: usize) -> Vec<BlockId> {
        if !self.prefix_enabled {
            return Vec::new();
        }
        self.prefix
            .match_prefix(tokens, self.block_size, max_tokens / self.block_size)
    }

    fn take_blocks(&mut self, n: usize, owner: Owner) -> Result<Vec<BlockId>, KvError> {
        if n > self.total() {
            return Err(KvError::TooLarge {
                needed: n,
                total: self.total(),
            });
        }
        if n > self.available() {
            return Err(KvError::OutOfBlocks {
                needed: n,
                available: self.available(),
            });
        }
        let mut out: Vec<BlockId> = Vec::with_capacity(n);
        while out.len() < n {
            let b = match self.free.pop() {
                Some(b) => b,
                None => match self.prefix.evict_one() {
                    Some(b) => b,
                    None => {
                        // Unreachable when the counters are right; give everything back.
                        for b in out.drain(..) {
                            self.owner[b.0 as usize] = None;
                            self.free.push(b);
                        }
                        return Err(KvError::Accounting {
                            details: "available() promised blocks eviction could not free".into(),
                        });
                    }
                },
            };
            self.owner[b.0 as usize] = Some(owner);
            out.push(b);
        }
        Ok(out)
    }

    fn check_holder(&self, owner: Owner) -> Result<(), KvError> {
        if owner == Owner::PrefixCache {
            return Err(KvError::InvalidOwner { owner });
        }
        Ok(())
    }

    /// Creates `owner`'s block table: shares on the cached `prefix` blocks (from
    /// [`KvCache::match_prefix`]) followed by `new_blocks` private blocks.
    pub fn allocate(
        &mut self,
        owner: Owner,
        prefix: &[BlockId],
        new_blocks: usize,
    ) -> Result<&[BlockId], KvError> {
        self.check_holder(owner)?;
        if self.tables.contains_key(&owner) {
            return Err(KvError::OwnerExists { owner });
        }
        for (i, &b) in prefix.iter().enumerate() {
            let ok = self.owner_of(b)? == Some(Owner::PrefixCache) && self.prefix.acquire(b);
            if !ok {
                for &r in &prefix[..i] {
                    self.prefix.release(r);
                }
                return Err(KvError::NotCached { block: b });
            }
        }
        let fresh = match self.take_blocks(new_blocks, owner) {
            Ok(f) => f,
            Err(e) => {
                for &r in prefix {
                    self.prefix.release(r);
                }
                return Err(e);
            }
        };
        let last_key = prefix
            .last()
            .and_then(|b| self.prefix.by_block.get(b).copied());
        let mut blocks = prefix.to_vec();
        blocks.extend(fresh);
        let t = self.tables.entry(owner).or_default();
        *t = Table {
            blocks,
            hashed: prefix.len(),
            last_key,
            stopped: false,
        };
        Ok(&t.blocks)
    }

    /// Appends `n` private blocks to `owner`'s table (creating it if absent).
    pub fn grow(&mut self, owner: Owner, n: usize) -> Result<&[BlockId], KvError> {
        self.check_holder(owner)?;
        let fresh = self.take_blocks(n, owner)?;
        let t = self.tables.entry(owner).or_default();
        t.blocks.extend(fresh);
        Ok(&t.blocks)
    }

    /// Publishes `owner`'s full blocks to the prefix cache. `tokens` are the tokens whose KV is
    /// in the table's blocks (position order, from position 0). A block whose prefix is already
    /// cached (another request computed the same tokens) is deduplicated: the table switches to a
    /// share of the cached block and its private copy is freed, so a table's shares always form
    /// a chain from the root. Returns how many private blocks left the table's ownership.
    pub fn cache_full_blocks(&mut self, owner: Owner, tokens: &[u32]) -> Result<usize, KvError> {
        if !self.prefix_enabled {
            return Ok(0);
        }
        let bs = self.block_size;
        let t = self
            .tables
            .get_mut(&owner)
            .ok_or(KvError::UnknownOwner { owner })?;
        let full = (tokens.len() / bs).min(t.blocks.len());
        let mut moved = 0;
        while t.hashed < full && !t.stopped {
            let i = t.hashed;
            let chunk = &tokens[i * bs..(i + 1) * bs];
            let block = t.blocks[i];
            let key = chain_key(t.last_key, chunk);
            match self.owner[block.0 as usize] {
                Some(Owner::PrefixCache) => {}
                Some(o) if o == owner => {
                    if let Some((_, cached)) = self.prefix.lookup(t.last_key, chunk) {
                        self.prefix.acquire(cached);
                        t.blocks[i] = cached;
                        self.owner[block.0 as usize] = None;
                        self.free.push(block);
                    } else if self.prefix.insert(t.last_key, chunk, block).is_some() {
                        self.owner[block.0 as usize] = Some(Owner::PrefixCache);
                    } else {
                        // A hash collision or an uncached parent: an entry here would be
                        // unreachable or wrong, so stop publishing this table.
                        t.stopped = true;
                        break;
                    }
                    moved += 1;
                }
                _ => {
                    t.stopped = true;
                    break;
                }
            }
            t.last_key = Some(key);
            t.hashed += 1;
        }
        Ok(moved)
    }

    /// Drops `owner`'s table: private blocks go back to the free list, shares are released
    /// (those blocks stay cached). Returns the number of blocks freed.
    pub fn free(&mut self, owner: Owner) -> Result<usize, KvError> {
        let t = self
            .tables
            .remove(&owner)
            .ok_or(KvError::UnknownOwner { owner })?;
        if let Owner::TransferLease(l) = owner {
            self.leases.remove(&l);
        }
        let mut freed = 0;
        for &b in t.blocks.iter().rev() {
            match self.owner[b.0 as usize] {
                Some(o) if o == owner => {
                    self.owner[b.0 as usize] = None;
                    self.free.push(b);
                    freed += 1;
                }
                Some(Owner::PrefixCache) => {
                    self.prefix.release(b);
                }
                _ => {}
            }
        }
        Ok(freed)
    }

    /// Hands `from`'s whole table (private blocks and shares) to `to`.
    pub fn move_table(&mut self, from: Owner, to: Owner) -> Result<&[BlockId], KvError> {
        self.check_holder(to)?;
        if self.tables.contains_key(&to) {
            return Err(KvError::OwnerExists { owner: to });
        }
        let t = self
            .tables
            .remove(&from)
            .ok_or(KvError::UnknownOwner { owner: from })?;
        if let Owner::TransferLease(l) = from {
            self.leases.remove(&l);
        }
        for &b in &t.blocks {
            let o = &mut self.owner[b.0 as usize];
            if *o == Some(from) {
                *o = Some(to);
            }
        }
        let t = self.tables.entry(to).or_insert(t);
        Ok(&t.blocks)
    }

    /// Reserves `n` private blocks under a new transfer lease that expires at `deadline`.
    pub fn reserve(
        &mut self,
        lease: TransferId,
        n: usize,
        deadline: Instant,
    ) -> Result<&[BlockId], KvError> {
        let owner = Owner::TransferLease(lease);
        if self.tables.contains_key(&owner) {
            return Err(KvError::OwnerExists { owner });
        }
        self.leases.insert(lease, deadline);
        match self.allocate(owner, &[], n) {
            Ok(_) => Ok(self.table(owner).unwrap_or(&[])),
            Err(e) => {
                self.leases.remove(&lease);
                Err(e)
            }
        }
    }

    /// Puts a request's whole table under a transfer lease (prefill side, until hand-off).
    pub fn lease_request(
        &mut self,
        req: RequestId,
        lease: TransferId,
        deadline: Instant,
    ) -> Result<&[BlockId], KvError> {
        self.move_table(Owner::Request(req), Owner::TransferLease(lease))?;
        self.leases.insert(lease, deadline);
        Ok(self.table(Owner::TransferLease(lease)).unwrap_or(&[]))
    }

    /// Hands a lease's blocks to a request (decode side, once the KV has arrived).
    pub fn commit_lease(
        &mut self,
        lease: TransferId,
        req: RequestId,
    ) -> Result<&[BlockId], KvError> {
        if !self.leases.contains_key(&lease) {
            return Err(KvError::UnknownLease { lease });
        }
        self.move_table(Owner::TransferLease(lease), Owner::Request(req))
    }

    /// Frees a lease's blocks (hand-off done or aborted). Returns the blocks freed.
    pub fn release_lease(&mut self, lease: TransferId) -> Result<usize, KvError> {
        if !self.leases.contains_key(&lease) {
            return Err(KvError::UnknownLease { lease });
        }
        self.free(Owner::TransferLease(lease))
    }

    pub fn lease_deadline(&self, lease: TransferId) -> Option<Instant> {
        self.leases.get(&lease).copied()
    }

    /// The earliest lease deadline, for a loop that wants to wake up in time to expire it.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.leases.values().min().copied()
    }

    /// Frees every lease whose deadline is at or before `now`; returns their ids.
    pub fn expire(&mut self, now: Instant) -> Vec<TransferId> {
        let mut gone: Vec<TransferId> = self
            .leases
            .iter()
            .filter(|(_, d)| **d <= now)
            .map(|(l, _)| *l)
            .collect();
        gone.sort();
        for l in &gone {
            // Cannot fail: the lease was just listed.
            let _ = self.free(Owner::TransferLease(*l));
            self.leases.remove(l);
        }
        gone
    }

    /// Checks every bookkeeping invariant; `Err` lists all violations.
    pub fn check_accounting(&self) -> Result<(), KvError> {
        crate::check::check(self)
    }

    pub(crate) fn parts(&self) -> Parts<'_> {
        Parts {
            owner: &self.owner,
            free: &self.free,
            tables: self
                .tables
                .iter()
                .map(|(o, t)| (*o, t.blocks.as_slice()))
                .collect(),
            prefix: &self.prefix,
            leases: &self.leases,
        }
    }
}

/// A read-only view of the state, for the accounting check.
pub(crate) struct Parts<'a> {
    pub owner: &'a [Option<Owner>],
    pub free: &'a [BlockId],
    pub tables: Vec<(Owner, &'a [BlockId])>,
    pub prefix: &'a PrefixIndex,
    pub leases: &'a HashMap<TransferId, Instant>,
}
