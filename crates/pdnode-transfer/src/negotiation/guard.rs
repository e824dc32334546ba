//! Blocks a side owns for one hand-off, released exactly once: explicitly, or when dropped.

use pdnode_core::BlockId;

type OnRelease = Box<dyn FnOnce(Vec<BlockId>) + Send>;

pub struct BlockGuard {
    blocks: Vec<BlockId>,
    on_release: Option<OnRelease>,
}

impl BlockGuard {
    /// `on_release` gets the blocks back (e.g. the KV cache's free list).
    pub fn new(
        blocks: Vec<BlockId>,
        on_release: impl FnOnce(Vec<BlockId>) + Send + 'static,
    ) -> Self {
        BlockGuard {
            blocks,
            on_release: Some(Box::new(on_release)),
        }
    }

    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Gives the blocks back now.
    pub fn release(mut self) {
        self.do_release();
    }

    /// Keeps the blocks (ownership passes on, e.g. into decode's running batch).
    pub fn keep(mut self) -> Vec<BlockId> {
        self.on_release = None;
        std::mem::take(&mut self.blocks)
    }

    fn do_release(&mut self) {
        if let Some(f) = self.on_release.take() {
            f(std::mem::take(&mut self.blocks));
        }
    }
}

impl Drop for BlockGuard {
    fn drop(&mut self) {
        self.do_release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn released_once_on_drop_or_explicitly_never_when_kept() {
        let freed = Arc::new(Mutex::new(Vec::new()));
        let f = freed.clone();
        drop(BlockGuard::new(vec![BlockId(1)], move |b| {
            f.lock().unwrap().extend(b)
        }));
        let f = freed.clone();
        BlockGuard::new(vec![BlockId(2)], move |b| f.lock().unwrap().extend(b)).release();
        let f = freed.clone();
        let kept = BlockGuard::new(vec![BlockId(3)], move |b| f.lock().unwrap().extend(b)).keep();
        assert_eq!(kept, vec![BlockId(3)]);
        assert_eq!(*freed.lock().unwrap(), vec![BlockId(1), BlockId(2)]);
    }
}
