//! A multi-tenant radix tree over token ids: which worker has recently seen which prefix.
//!
//! It approximates the workers' prefix caches the way sglang-router's "approximate tree" does:
//! one shared tree, every node remembers which tenants (workers) passed through it and when. A
//! tenant's size is the number of tokens on edges it holds; eviction removes a tenant from its
//! least recently used leaves until its size fits, and drops nodes no tenant holds any more.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Tenant key: the worker's id string.
type Tenant = String;

#[derive(Debug, Default)]
struct Node {
    edge: Vec<u32>,
    parent: usize,
    children: HashMap<u32, usize>,
    /// Tenant -> last access tick.
    tenants: HashMap<Tenant, u64>,
}

#[derive(Debug)]
pub struct RadixTree {
    nodes: Vec<Option<Node>>,
    free: Vec<usize>,
    sizes: HashMap<Tenant, u64>,
}

const ROOT: usize = 0;

impl Default for RadixTree {
    fn default() -> Self {
        Self::new()
    }
}

impl RadixTree {
    pub fn new() -> Self {
        Self {
            nodes: vec![Some(Node::default())],
            free: Vec::new(),
            sizes: HashMap::new(),
        }
    }

    fn node(&self, i: usize) -> &Node {
        self.nodes[i].as_ref().expect("live node index")
    }

    fn node_mut(&mut self, i: usize) -> &mut Node {
        self.nodes[i].as_mut().expect("live node index")
    }

    fn alloc(&mut self, node: Node) -> usize {
        if let Some(i) = self.free.pop() {
            self.nodes[i] = Some(node);
            i
        } else {
            self.nodes.push(Some(node));
            self.nodes.len() - 1
        }
    }

    /// Tokens held by `tenant`.
    pub fn tenant_size(&self, tenant: &str) -> u64 {
        self.sizes.get(tenant).copied().unwrap_or(0)
    }

    /// Live nodes, the root included (for tests and metrics).
    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    fn mark(&mut self, i: usize, tenant: &str, tick: u64) {
        let len = self.node(i).edge.len() as u64;
        let fresh = self
            .node_mut(i)
            .tenants
            .insert(tenant.to_string(), tick)
            .is_none();
        if fresh {
            *self.sizes.entry(tenant.to_string()).or_default() += len;
        }
    }

    /// Records that `tenant` has seen `tokens` (at time `tick`).
    pub fn insert(&mut self, tokens: &[u32], tenant: &str, tick: u64) {
        let mut cur = ROOT;
        self.mark(ROOT, tenant, tick);
        let mut rest = tokens;
        while let Some(&first) = rest.first() {
            match self.node(cur).children.get(&first).copied() {
                None => {
                    let child = self.alloc(Node {
                        edge: rest.to_vec(),
                        parent: cur,
                        ..Node::default()
                    });
                    self.node_mut(cur).children.insert(first, child);
                    self.mark(child, tenant, tick);
                    return;
                }
                Some(child) => {
                    let edge = &self.node(child).edge;
                    let common = edge.iter().zip(rest).take_while(|(a, b)| a == b).count();
                    if common < edge.len() {
                        self.split(child, common);
                    }
                    // After a split `child` holds exactly the common part.
                    self.mark(child, tenant, tick);
                    rest = &rest[common..];
                    cur = child;
                }
            }
        }
    }

    /// Splits node `i` so that it keeps the first `at` tokens of its edge; a new child takes
    /// the rest (and the children and tenants).
    fn split(&mut self, i: usize, at: usize) {
        let node = self.node_mut(i);
        let tail = node.edge.split_off(at);
        let children = std::mem::take(&mut node.children);
        let tenants = node.tenants.clone();
        let tail_first = tail[0];
        let new = self.alloc(Node {
            edge: tail,
            parent: i,
            children,
            tenants,
        });
        let grandchildren: Vec<usize> = self.node(new).children.values().copied().collect();
        for g in grandchildren {
            self.node_mut(g).parent = new;
        }
        self.node_mut(i).children.insert(tail_first, new);
        // Sizes are unchanged: every tenant of `i` holds the same tokens, now over two nodes.
    }

    /// The longest prefix of `tokens` held by a tenant for which `allowed` holds: the number of
    /// matched tokens and the most recent such tenant at the deepest matched node.
    pub fn longest_match(
        &self,
        tokens: &[u32],
        allowed: impl Fn(&str) -> bool,
    ) -> (usize, Option<String>) {
        let mut best: (usize, Option<String>) = (0, None);
        let mut cur = ROOT;
        let mut matched = 0;
        let mut rest = tokens;
        while let Some(&first) = rest.first() {
            let Some(&child) = self.node(cur).children.get(&first) else {
                break;
            };
            let node = self.node(child);
            let common = node
                .edge
                .iter()
                .zip(rest)
                .take_while(|(a, b)| a == b)
                .count();
            let newest = node
                .tenants
                .iter()
                .filter(|(t, _)| allowed(t))
                .max_by_key(|(t, tick)| (**tick, Reverse((*t).clone())));
            let Some((tenant, _)) = newest else {
                break;
            };
            matched += common;
            best = (matched, Some(tenant.clone()));
            if common < node.edge.len() {
                break;
            }
            rest = &rest[common..];
            cur = child;
        }
        best
    }

    /// Removes `tenant` from its least recently used leaves until it holds at most `max_tokens`.
    pub fn evict_tenant(&mut self, tenant: &str, max_tokens: u64) {
        if self.tenant_size(tenant) <= max_tokens {
            return;
        }
        let mut heap: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
        for (i, slot) in self.nodes.iter().enumerate() {
            if let Some(n) = slot
                && i != ROOT
                && self.is_tenant_leaf(i, tenant)
            {
                heap.push(Reverse((n.tenants[tenant], i)));
            }
        }
        while self.tenant_size(tenant) > max_tokens {
            let Some(Reverse((_, i))) = heap.pop() else {
                break;
            };
            let parent = self.node(i).parent;
            self.unmark(i, tenant);
            if parent != ROOT && self.is_tenant_leaf(parent, tenant) {
                heap.push(Reverse((self.node(parent).tenants[tenant], parent)));
            }
        }
    }

    /// Removes a tenant entirely (its worker left).
    pub fn remove_tenant(&mut self, tenant: &str) {
        self.evict_tenant(tenant, 0);
        if let Some(root) = self.nodes[ROOT].as_mut() {
            root.tenants.remove(tenant);
        }
        self.sizes.remove(tenant);
    }

    /// Tenants known to the tree.
    pub fn tenants(&self) -> Vec<String> {
        self.sizes.keys().cloned().collect()
    }

    fn is_tenant_leaf(&self, i: usize, tenant: &str) -> bool {
        let n = self.node(i);
        n.tenants.contains_key(tenant)
            && n.children
                .values()
                .all(|&c| !self.node(c).tenants.contains_key(tenant))
    }

    fn unmark(&mut self, i: usize, tenant: &str) {
        let len = self.node(i).edge.len() as u64;
        if self.node_mut(i).tenants.remove(tenant).is_some()
            && let Some(s) = self.sizes.get_mut(tenant)
        {
            *s = s.saturating_sub(len);
        }
        let n = self.node(i);
        if n.tenants.is_empty() && n.children.is_empty() && i != ROOT {
            let parent = n.parent;
            let first = n.edge[0];
            self.node_mut(parent).children.remove(&first);
            self.nodes[i] = None;
            self.free.push(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn match_follows_splits_and_tenants() {
        let mut t = RadixTree::new();
        t.insert(&[1, 2, 3, 4], "a", 1);
        t.insert(&[1, 2, 9], "b", 2);
        assert_eq!(t.tenant_size("a"), 4);
        assert_eq!(t.tenant_size("b"), 3);
        let any = |_: &str| true;
        assert_eq!(
            t.longest_match(&[1, 2, 3, 4, 5], any),
            (4, Some("a".into()))
        );
        assert_eq!(t.longest_match(&[1, 2, 9, 9], any), (3, Some("b".into())));
        // At the shared [1, 2] both match; the most recent wins.
        assert_eq!(t.longest_match(&[1, 2, 7], any), (2, Some("b".into())));
        // Only "a" allowed: "b"'s branch does not count.
        assert_eq!(
            t.longest_match(&[1, 2, 9], |x: &str| x == "a"),
            (2, Some("a".into()))
        );
        assert_eq!(t.longest_match(&[5], any), (0, None));
    }

    #[test]
    fn eviction_drops_lru_leaves_and_frees_nodes() {
        let mut t = RadixTree::new();
        t.insert(&[1, 2, 3], "a", 1);
        t.insert(&[4, 5, 6], "a", 2);
        t.insert(&[4, 5, 6], "b", 3);
        assert_eq!(t.tenant_size("a"), 6);
        t.evict_tenant("a", 3);
        assert_eq!(t.tenant_size("a"), 3);
        // The older branch [1,2,3] went, the newer stayed.
        let only_a = |x: &str| x == "a";
        assert_eq!(t.longest_match(&[1, 2, 3], only_a), (0, None));
        assert_eq!(t.longest_match(&[4, 5, 6], only_a), (3, Some("a".into())));
        let before = t.node_count();
        t.remove_tenant("b");
        t.remove_tenant("a");
        assert!(t.node_count() < before);
        assert_eq!(t.node_count(), 1, "only the root is left");
        assert_eq!(t.tenant_size("a"), 0);
    }
}
