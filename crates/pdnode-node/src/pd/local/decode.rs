//! The decode side of a PD node: `ReserveKv` (the engine's blocks, the staging span, the KV
//! capability) and `Decode` (the claim, the check of what landed, the scatter, the admission).

use super::*;

impl PdNode {
    pub(super) async fn do_reserve(&self, req: ReserveKv) -> Result<KvTarget, NodeError> {
        self.expect_role(Role::Decode, "ReserveKv")?;
        self.sweep();
        let id = req.request_id;
        let prompt_len = req.prompt_token_ids.len();
        let token = Arc::new(CancellationToken::new());
        {
            let mut r = self.reserving.lock().unwrap_or_else(|p| p.into_inner());
            // One reservation per request id: a second one must never take the place (and
            // the capability) of a reservation its prefill node may be putting into.
            self.refuse_known(&r, id)?;
            r.insert(id, token.clone());
        }
        let reserving = Reserving {
            node: self,
            id,
            token,
        };
        // Armed before the engine is asked: a call dropped while the engine reserves, or after
        // it did but before the reservation is handed out (the router's deadline, the router
        // gone), gives the blocks back at once (the abort queues behind the reservation), not
        // at the lease's end. `refuse_known` above made `id` new here, so the abort touches
        // nothing else.
        let mut lease = EngineAbortOnDrop {
            engine: &self.engine,
            id,
            armed: true,
        };
        let blocks = match self.engine.reserve_for_transfer(id, prompt_len).await {
            Ok(b) => b,
            Err(e) => {
                lease.armed = false;
                return Err(eerr(&e));
            }
        };
        let layout = self.layout().clone();
        let per_rank = layout.num_layers as usize * blocks.len() * layout.block_layer_bytes();
        let aborted = || {
            nerr(
                ErrorKind::Cancelled,
                format!("ReserveKv of {id} aborted while it was being reserved"),
            )
        };
        let staged = tokio::select! {
            s = self.receive_staging(id, per_rank) => s,
            // An abort ends a wait for arena room at once (not at the wait's deadline).
            () = reserving.token.cancelled() => Err(aborted()),
        };
        // An abort that came before the engine saw the reservation: give it back here.
        let staged = staged.and_then(|s| {
            if reserving.token.is_cancelled() {
                Err(aborted())
            } else {
                Ok(s)
            }
        });
        let (staging, ranks, staging_offset, fence) = match staged {
            Ok(s) => s,
            Err(e) => {
                let _ = self.engine.release_transfer(id).await;
                return Err(e);
            }
        };
        let generation = self.generation.fetch_add(1, Ordering::Relaxed);
        let deadline_ms = unix_ms().saturating_add(self.lease.as_millis() as u64);
        // The KV capability: bound to this request, generation, span and expiry, under this
        // process's key (docs/protocol.md, "Capabilities").
        let secret = self.cap_key.mint(&Grant {
            request: id.0,
            generation,
            offset: staging_offset,
            len: per_rank as u64,
            expires_ms: deadline_ms,
        });
        let worker_address = match &self.mover {
            KvMover::Ucx(t) => {
                use pdnode_transfer::KvTransport;
                t.local_address()
            }
            KvMover::InProcess(_) => Vec::new(),
        };
        let target = KvTarget {
            request: id,
            decode_node: self.id.clone(),
            decode_grpc_addr: String::new(),
            transport: self.mover.transport_kind(),
            worker_address,
            ranks,
            blocks: blocks.clone(),
            layout,
            secret: secret.as_bytes().to_vec(),
            lease_deadline_ms: deadline_ms,
            placement: Placement::Staging {
                offset: staging_offset,
            },
            staging_generation: generation,
            fence_record: fence.is_some(),
            verify: fence.is_some_and(|f| f.verify),
        };
        let slot = DecodeSlot {
            fsm: Reservation::new(id, generation, secret, Instant::now(), self.lease)
                .with_expiry(deadline_ms),
            blocks: blocks.len(),
            staging,
            fence,
        };
        // From "being reserved" to "reserved" in one step under `reserving`, so an abort sees
        // one or the other: cancelled before this point, nothing is handed out.
        let cancelled = {
            let mut r = self.reserving.lock().unwrap_or_else(|p| p.into_inner());
            let cancelled = reserving.token.is_cancelled();
            if !cancelled {
                if r.get(&id).is_some_and(|t| Arc::ptr_eq(t, &reserving.token)) {
                    r.remove(&id);
                }
                self.slots().insert(id, slot);
            }
            cancelled
        };
        if cancelled {
            // Nobody saw the target: its span (dropped here) is free at once.
            let _ = self.engine.release_transfer(id).await;
            return Err(aborted());
        }
        lease.armed = false;
        Ok(target)
    }

    pub(super) async fn do_decode(&self, req: DecodeCall) -> Result<DecodeStream, NodeError> {
        self.expect_role(Role::Decode, "Decode")?;
        let id = req.request_id;
        let slot = {
            let mut slots = self.slots();
            let claimed = match slots.get_mut(&id) {
                None => Err(ClaimError::Ended),
                Some(s) => s.fsm.claim(&req.secret, unix_ms()),
            };
            match claimed {
                Err(ClaimError::Ended) => {
                    return Err(nerr(
                        ErrorKind::InvalidRequest,
                        format!(
                            "no KV reservation for {id} on {} (expired or never made)",
                            self.id
                        ),
                    ));
                }
                // The reservation stays for its rightful caller.
                Err(ClaimError::WrongSecret) => {
                    return Err(nerr(
                        ErrorKind::InvalidRequest,
                        format!("wrong secret for the KV reservation of {id}"),
                    ));
                }
                // Left for the sweep, which ends it at its fence deadline.
                Err(ClaimError::Expired) => {
                    return Err(nerr(
                        ErrorKind::InvalidRequest,
                        format!("the KV capability of {id} expired (its lease deadline passed)"),
                    ));
                }
                // Claimed: from here an abort must present the capability to `held`.
                Ok(()) => match slots.remove(&id) {
                    Some(s) => {
                        let hold = self.held.try_hold(id, *s.fsm.capability());
                        (s, hold)
                    }
                    None => return Err(nerr(ErrorKind::Internal, "reservation vanished")),
                },
            }
        };
        let (slot, hold) = slot;
        // `ReserveKv` refuses an id running here, so this does not happen; if it did, the
        // reservation is given up like a refused one.
        let Some(hold) = hold else {
            let _ = self.engine.release_transfer(id).await;
            self.release_staging(id, slot, ReleaseCause::Refused);
            return Err(nerr(
                ErrorKind::Internal,
                format!("request {id} is running on {} already", self.id),
            ));
        };
        // Claimed: until the engine admits the request (its stream then owns it), any way out
        // of here, an error or the call dropped, gives the blocks back at once. The router's
        // abort after a failed `Decode` finds nothing left to stop.
        let mut claimed = EngineAbortOnDrop {
            engine: &self.engine,
            id,
            armed: true,
        };
        // Nothing is scattered unless this reservation's own writer finished (its fence record)
        // and, with `transfer.verify`, the bytes are the ones it sent.
        let current = tracing::Span::current();
        current.record("checked", slot.fence.is_some());
        current.record("verified", slot.fence.is_some_and(|f| f.verify));
        if let Err(e) = self.check_landed(id, &slot).await {
            return Err(self.refuse_landed(id, slot, e).await);
        }
        let layout = self.layout();
        let layers = layout.num_layers;
        let per_rank = layers as usize * slot.blocks * layout.block_layer_bytes();
        let stride = slot.fence.map_or(per_rank, |f| f.stride);
        let failed = |e: NodeError| Landing::Failed(e);
        let scattered = match (&slot.staging, slot.fence) {
            (Staging::None, _) => Ok(()),
            // Device memory: checked and scattered in one visit of the engine loop.
            (Staging::Arena(slice), Some(spec)) if spec.device => {
                self.scatter_checked(id, &slot, spec, slice.offset(), layers)
                    .await
            }
            (Staging::Arena(slice), _) => self
                .engine
                .scatter_kv(id, 0..layers, slice.offset())
                .await
                .map_err(|e| failed(eerr(&e))),
            (Staging::Host(h), _) => match copy_ranks(&h.reg, self.tp_ranks(), per_rank, stride) {
                Ok(data) => self
                    .engine
                    .write_kv(id, 0..layers, data)
                    .await
                    .map_err(|e| failed(eerr(&e))),
                Err(e) => Err(failed(nerr(e.kind(), e.to_string()))),
            },
        };
        let scattered = match scattered {
            Err(Landing::Refused(e)) => return Err(self.refuse_landed(id, slot, e).await),
            Err(Landing::Failed(e)) => Err(e),
            Ok(()) => Ok(()),
        };
        // The writer finished (its records are there, or the prefill node answered after its
        // flush): the staging (arena span or host region) is free from here on.
        self.release_staging(id, slot, ReleaseCause::Scattered);
        if let Err(e) = scattered {
            let _ = self.engine.release_transfer(id).await;
            return Err(e);
        }
        let prompt = req.prompt_token_ids.clone();
        if prompt.is_empty() {
            self.engine.abort(id);
            return Err(nerr(
                ErrorKind::InvalidRequest,
                "Decode needs the prompt token ids",
            ));
        }
        let stream = self
            .engine
            .admit_transferred(
                GenerateRequest {
                    id,
                    prompt_token_ids: prompt,
                    sampling: crate::pd::engine_sampling(req.sampling.clone()),
                },
                req.first_token_id,
                // Continue prefill's random stream: seeded sampling draws what a colocated
                // engine draws. Without it (an older router) the sampler starts from the seed.
                req.sampler.map(|s| pdnode_engine::sampling::SamplerState {
                    seed: s.seed,
                    word_pos: s.word_pos,
                }),
            )
            .map_err(|e| eerr(&e))?;
        claimed.armed = false;
        // The capability stays held (for `abort`) as long as the stream. A node draining by
        // migration (`request_migrations`) sends one `migrate` message on it first.
        let st = StreamState {
            rx: stream,
            done: false,
            _hold: hold,
            drain: Some(self.migration_watch()),
        };
        let s = futures::stream::unfold(st, |mut st| async move {
            loop {
                if st.done {
                    return None;
                }
                let next = match st.drain.as_mut() {
                    Some(w) => tokio::select! {
                        biased;
                        r = w.wait_for(|asked| *asked) => Next::Drain(r.is_ok()),
                        ev = st.rx.next() => Next::Event(ev),
                    },
                    None => Next::Event(st.rx.next().await),
                };
                match next {
                    Next::Drain(asked) => {
                        st.drain = None;
                        if asked {
                            let ask = DecodeChunk {
                                migrate: true,
                                ..Default::default()
                            };
                            return Some((Ok(ask), st));
                        }
                    }
                    // A parked request's engine stream ends with no finish: so does this one.
                    Next::Event(None) => return None,
                    Next::Event(Some(ev)) => {
                        let (item, last) =
                            decode_chunk(ev, "decode engine answered like a prefill engine");
                        st.done = last;
                        return Some((item, st));
                    }
                }
            }
        });
        Ok(Box::pin(s))
    }
}

/// A decode stream's state: the engine stream, whether it ended, the capability held while it
/// runs, and the drain-by-migration watch until its `migrate` message went out.
struct StreamState {
    rx: pdnode_engine::engine::RequestStream,
    done: bool,
    _hold: crate::pd::held::Hold,
    drain: Option<tokio::sync::watch::Receiver<bool>>,
}

enum Next {
    Drain(bool),
    Event(Option<EngineEvent>),
}
