//! The Registrar's decisions, without a runtime.

use pdnode_core::NodeCard;
use pdnode_core::card::NodeCapacity;

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RegistrarState {
    last_published: Option<NodeCapacity>,
    pub publishes: u64,
}

impl RegistrarState {
    pub fn new(published: NodeCapacity) -> Self {
        Self {
            last_published: Some(published),
            publishes: 0,
        }
    }

    /// The card to publish for the current load, if it differs from the last one published.
    pub fn next_card(&mut self, current: &NodeCard, load: &NodeCapacity) -> Option<NodeCard> {
        if self.last_published.as_ref() == Some(load) {
            return None;
        }
        self.last_published = Some(load.clone());
        self.publishes += 1;
        let mut c = current.clone();
        c.capacity = load.clone();
        Some(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdnode_core::card::NodeAddresses;
    use pdnode_core::{NodeId, Role};

    #[test]
    fn publishes_only_changes() {
        let card = NodeCard {
            id: NodeId::new("n"),
            role: Role::Decode,
            cluster: "c".into(),
            model_id: "m".into(),
            model_fingerprint: "f".into(),
            kv_layout: None,
            tp_size: 1,
            addresses: NodeAddresses::default(),
            capacity: NodeCapacity::default(),
            version: "0".into(),
            started_at_ms: 0,
            colocated: false,
            sglang: None,
            draining: false,
        };
        let mut s = RegistrarState::new(NodeCapacity::default());
        assert!(s.next_card(&card, &NodeCapacity::default()).is_none());
        let busy = NodeCapacity {
            running_requests: 2,
            ..Default::default()
        };
        let c = s.next_card(&card, &busy).unwrap();
        assert_eq!(c.capacity.running_requests, 2);
        assert!(s.next_card(&c, &busy).is_none());
        assert_eq!(s.publishes, 1);
    }
}
