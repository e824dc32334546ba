//! Prefill on the decode node (conditional disaggregation; docs/runtime-semantics.md, "Prefill on
//! the decode node"): a `ReserveKv` whose prefill node is this decode node itself asks for no
//! hand-off. The request is kept as a colocated engine keeps its requests, by a
//! [`ColocatedNode`](super::super::colocated::ColocatedNode) over this node's decode-only engine
//! (which runs local prompts): the reservation mints a fresh secret and holds no blocks;
//! `Prefill` here checks it, starts the request and answers its first token; `Decode` streams
//! the rest of that engine stream; `Abort` with the secret stops it; one nobody claims within the
//! lease is aborted by the sweep. The engine frees the request's blocks however it ends.

use super::*;

impl PdNode {
    /// Whether `req` asks this decode node to prefill the request itself: the prefill node the
    /// router paired with the reservation is this node.
    pub(super) fn prefills_here(&self, req: &ReserveKv) -> bool {
        self.role == Role::Decode && req.prefill_node == self.id
    }

    /// Whether `id` is reserved or prefilled here for a prefill on this node.
    pub(super) fn holds_here(&self, id: RequestId) -> bool {
        self.role == Role::Decode && self.here.knows(id)
    }

    /// `ReserveKv` for a prefill here: refused for an id reserved or running here already
    /// (either way), like any reservation.
    pub(super) async fn reserve_here(&self, req: ReserveKv) -> Result<KvTarget, NodeError> {
        {
            let r = self.reserving.lock().unwrap_or_else(|p| p.into_inner());
            self.refuse_known(&r, req.request_id)?;
        }
        self.here.do_reserve(req).await
    }

    /// One reservation per request id, of either kind: refused for an id being reserved,
    /// reserved or running here (`reserving` is the caller's lock of [`PdNode::reserving`]).
    pub(super) fn refuse_known(
        &self,
        reserving: &HashMap<RequestId, Arc<CancellationToken>>,
        id: RequestId,
    ) -> Result<(), NodeError> {
        if reserving.contains_key(&id)
            || self.slots().contains_key(&id)
            || self.held.contains(id)
            || self.here.knows(id)
        {
            return Err(nerr(
                ErrorKind::InvalidRequest,
                format!("request {id} is reserved or running on {} already", self.id),
            ));
        }
        Ok(())
    }

    /// Requests reserved or prefilled here for a prefill on this node, waiting for their next
    /// call.
    pub fn pending_here(&self) -> usize {
        self.here.pending()
    }
}
