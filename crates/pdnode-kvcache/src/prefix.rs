//! The prefix cache index: a radix tree over *full* blocks of token ids, keyed by hash chains.
//!
//! Each node is one full block; its key is `chain_key(parent_key, block_tokens)`, so a key names
//! the whole prefix up to and including that block (vLLM's hash-chained block keys). Each entry
//! also stores its parent key and its own tokens, and a lookup compares both, so a 64-bit hash
//! collision can never hand out a wrong block: it only misses.
//!
//! Reference counting: an entry's `refs` is the number of block tables (running requests,
//! transfer leases) that currently share its block. An entry is *evictable* when `refs == 0` and
//! it has no children (a leaf); eviction takes the least recently used evictable leaf, which may
//! turn its parent into an evictable leaf. Because a table always shares a whole chain from the
//! root, every unreferenced entry can eventually be evicted, so `unreferenced()` is exactly the
//! number of cached blocks that eviction can reclaim.

use pdnode_core::BlockId;
use std::collections::{BTreeSet, HashMap};

pub(crate) type BlockKey = u64;

/// The key of a block whose prefix up to the previous block has key `parent`.
pub(crate) fn chain_key(parent: Option<BlockKey>, tokens: &[u32]) -> BlockKey {
    fn mix(mut z: u64) -> u64 {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    let mut h = mix(parent.map_or(0x9e37_79b9_7f4a_7c15, |p| p ^ 0x5851_f42d_4c95_7f2d));
    for &t in tokens {
        h = mix(h ^ u64::from(t).wrapping_add(0x9e37_79b9_7f4a_7c15));
    }
    mix(h ^ tokens.len() as u64)
}

#[derive(Debug)]
pub(crate) struct Entry {
    pub block: BlockId,
    pub parent: Option<BlockKey>,
    pub tokens: Box<[u32]>,
    pub children: u32,
    pub refs: u32,
    pub last_used: u64,
}

#[derive(Debug, Default)]
pub(crate) struct PrefixIndex {
    pub entries: HashMap<BlockKey, Entry>,
    pub by_block: HashMap<BlockId, BlockKey>,
    evictable: BTreeSet<(u64, BlockKey)>,
    unreferenced: usize,
    tick: u64,
}

impl PrefixIndex {
    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// Cached blocks no table shares (reclaimable by eviction).
    pub fn unreferenced(&self) -> usize {
        self.unreferenced
    }

    /// The cached block for `tokens` after prefix `parent`, if any (exact match).
    pub fn lookup(&self, parent: Option<BlockKey>, tokens: &[u32]) -> Option<(BlockKey, BlockId)> {
        let key = chain_key(parent, tokens);
        let e = self.entries.get(&key)?;
        (e.parent == parent && *e.tokens == *tokens).then_some((key, e.block))
    }

    /// Inserts `block` as the cached block for `tokens` after `parent`, shared once by the caller.
    /// Returns `None` (and changes nothing) when the key is taken or the parent is not cached.
    pub fn insert(
        &mut self,
        parent: Option<BlockKey>,
        tokens: &[u32],
        block: BlockId,
    ) -> Option<BlockKey> {
        let key = chain_key(parent, tokens);
        if self.entries.contains_key(&key) || self.by_block.contains_key(&block) {
            return None;
        }
        if let Some(p) = parent {
            let pe = self.entries.get_mut(&p)?;
            pe.children += 1;
            let (tick, leaf) = (pe.last_used, pe.refs == 0 && pe.children == 1);
            if leaf {
                self.evictable.remove(&(tick, p));
            }
        }
        let last_used = self.next_tick();
        self.entries.insert(
            key,
            Entry {
                block,
                parent,
                tokens: tokens.into(),
                children: 0,
                refs: 1,
                last_used,
            },
        );
        self.by_block.insert(block, key);
        Some(key)
    }

    /// Adds a share on a cached block and marks it used.
    pub fn acquire(&mut self, block: BlockId) -> bool {
        let Some(&key) = self.by_block.get(&block) else {
            return false;
        };
        let tick = self.next_tick();
        let Some(e) = self.entries.get_mut(&key) else {
            return false;
        };
        if e.refs == 0 {
            self.unreferenced -= 1;
            if e.children == 0 {
                self.evictable.remove(&(e.last_used, key));
            }
        }
        e.refs += 1;
        e.last_used = tick;
        true
    }

    /// Drops a share on a cached block. Returns false if the block is not cached or not shared.
    pub fn release(&mut self, block: BlockId) -> bool {
        let Some(&key) = self.by_block.get(&block) else {
            return false;
        };
        let tick = self.next_tick();
        let Some(e) = self.entries.get_mut(&key) else {
            return false;
        };
        if e.refs == 0 {
            return false;
        }
        e.refs -= 1;
        e.last_used = tick;
        if e.refs == 0 {
            self.unreferenced += 1;
            if e.children == 0 {
                self.evictable.insert((tick, key));
            }
        }
        true
    }

    /// Removes the least recently used unshared leaf; returns its block (now ownerless).
    pub fn evict_one(&mut self) -> Option<BlockId> {
        let (_, key) = self.evictable.pop_first()?;
        let e = self.entries.remove(&key)?;
        self.by_block.remove(&e.block);
        self.unreferenced -= 1;
        if let Some(p) = e.parent
            && let Some(pe) = self.entries.get_mut(&p)
        {
            pe.children -= 1;
            if pe.children == 0 && pe.refs == 0 {
                self.evictable.insert((pe.last_used, p));
            }
        }
        Some(e.block)
    }

    /// Cached blocks matching the leading full blocks of `tokens`, at most `max_blocks`.
    pub fn match_prefix(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        max_blocks: usize,
    ) -> Vec<BlockId> {
        let mut out = Vec::new();
        let mut parent = None;
        for chunk in tokens.chunks_exact(block_size).take(max_blocks) {
            let Some((key, block)) = self.lookup(parent, chunk) else {
                break;
            };
            out.push(block);
            parent = Some(key);
        }
        out
    }

    /// Internal consistency of the index (children counts, evictable set, counters).
    pub fn check(&self, errs: &mut Vec<String>) {
        let mut children: HashMap<BlockKey, u32> = HashMap::new();
        let mut unref = 0;
        for (k, e) in &self.entries {
            if self.by_block.get(&e.block) != Some(k) {
                errs.push(format!(
                    "prefix entry {k:x}: reverse map does not point back"
                ));
            }
            if let Some(p) = e.parent {
                if !self.entries.contains_key(&p) {
                    errs.push(format!("prefix entry {k:x}: parent {p:x} missing"));
                }
                *children.entry(p).or_default() += 1;
            }
            if e.refs == 0 {
                unref += 1;
            }
            let evictable = e.refs == 0 && e.children == 0;
            if evictable != self.evictable.contains(&(e.last_used, *k)) {
                errs.push(format!("prefix entry {k:x}: evictable set out of date"));
            }
        }
        for (k, e) in &self.entries {
            if children.get(k).copied().unwrap_or(0) != e.children {
                errs.push(format!(
                    "prefix entry {k:x}: children count {} wrong",
                    e.children
                ));
            }
        }
        if unref != self.unreferenced {
            errs.push(format!(
                "prefix index: unreferenced counter {} != {unref}",
                self.unreferenced
            ));
        }
        if self.evictable.len() > self.entries.len() || self.by_block.len() != self.entries.len() {
            errs.push("prefix index: side tables out of sync".into());
        }
    }
}
