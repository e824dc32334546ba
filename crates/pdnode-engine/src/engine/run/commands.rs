//! The engine loop's commands (`EngineHandle` calls): one `match` that answers each, between
//! forward steps.

use super::Loop;
use crate::engine::handle::Command;
use crate::engine::{EngineError, EngineEvent, Parked};
use crate::scheduler::Mode;
use pdnode_core::FinishReason;
use std::time::Instant;

impl Loop {
    /// Handles one command; false means stop.
    pub(super) fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Add { req, tx, staged } => {
                let id = req.id;
                let queued = self.sched.stats().waiting;
                let r = if queued >= self.cfg.max_queued_requests {
                    Err(EngineError::Overloaded { id, queued })
                } else {
                    self.new_request(&req, &tx, None).and_then(|a| {
                        self.sched
                            .add_request(id, req.prompt_token_ids)
                            .map_err(EngineError::from)?;
                        Ok(a)
                    })
                };
                match r {
                    Ok(mut a) => {
                        self.stats.prompt_tokens_total += a.prompt_len as u64;
                        a.staged = staged
                            .filter(|_| self.cfg.mode == Mode::PrefillOnly)
                            .map(|g| (g, 0));
                        self.active.insert(id, a);
                    }
                    Err(error) => {
                        let _ = tx.send(EngineEvent::Error { error });
                    }
                }
            }
            Command::AdmitTransferred {
                req,
                first_token,
                sampler,
                tx,
            } => self.admit(req, first_token, sampler, tx),
            Command::Reserve {
                id,
                prompt_len,
                reply,
            } => {
                let r = if self.active.contains_key(&id) {
                    Err(crate::scheduler::SchedulerError::DuplicateRequest { id }.into())
                } else {
                    self.sched
                        .reserve_for_transfer(id, prompt_len, Instant::now())
                        .map_err(EngineError::from)
                };
                // Nobody took the blocks (the call was dropped or timed out): nobody will
                // release them but their lease, so they go back now.
                if let Err(Ok(_)) = reply.send(r) {
                    tracing::debug!(request = %id, "a reservation's caller left: released");
                    let _ = self.sched.release_transfer(id);
                }
            }
            Command::Park { id, reply } => {
                let r = match self.active.get(&id) {
                    None => Err(EngineError::from(
                        crate::scheduler::SchedulerError::NotDecoding {
                            id,
                            why: "unknown here",
                        },
                    )),
                    Some(_) => self
                        .sched
                        .park(id, Instant::now())
                        .map_err(EngineError::from),
                };
                let r = r.and_then(|(tokens, computed, blocks)| {
                    // Dropping the request's sender ends its stream with no finish.
                    let a = self.active.remove(&id).ok_or(EngineError::from(
                        crate::scheduler::SchedulerError::NotDecoding {
                            id,
                            why: "unknown here",
                        },
                    ))?;
                    Ok(Parked {
                        tokens,
                        prompt_len: a.prompt_len,
                        generated: a.generated,
                        computed,
                        blocks,
                        sampler: a.sampler.state(),
                    })
                });
                // Nobody got the parked request (the call was dropped or timed out): its
                // stream is ended and nobody will push or release it, so its blocks go back now.
                if let Err(Ok(_)) = reply.send(r) {
                    tracing::debug!(request = %id, "a park's caller left: released");
                    let _ = self.sched.release_transfer(id);
                }
            }
            Command::ReleaseTransfer { id, reply } => {
                let _ = reply.send(self.sched.release_transfer(id).map_err(EngineError::from));
            }
            Command::Abort { id } => {
                self.sched.abort(id);
                if let Some(a) = self.active.remove(&id) {
                    let _ = a.tx.send(EngineEvent::Finished {
                        reason: FinishReason::Abort,
                        prompt_tokens: a.prompt_len,
                        output_tokens: a.generated,
                    });
                }
            }
            Command::ReadKv { id, layers, reply } => {
                let _ = reply.send(self.read_kv(id, layers));
            }
            Command::WriteKv {
                id,
                layers,
                data,
                reply,
            } => {
                let r = match self.sched.transfer_blocks(id) {
                    Some(blocks) => self
                        .backend
                        .write_kv(layers, blocks, &data)
                        .map_err(EngineError::from),
                    None => Err(EngineError::NoLease { id }),
                };
                let _ = reply.send(r);
            }
            Command::StagingKv {
                id,
                layers,
                offset,
                gather,
                hold,
                reply,
            } => {
                let r = self.lease_and_arena(id).and_then(|(blocks, s)| {
                    if gather {
                        s.gather_kv_to_staging(layers, blocks, offset)
                    } else {
                        s.scatter_kv_from_staging(layers, blocks, offset)
                    }
                    .map_err(EngineError::from)
                });
                let _ = reply.send(r);
                // The span may go back to its arena only now, after the copy.
                drop(hold);
            }
            Command::ScatterChecked {
                id,
                layers,
                offset,
                hash,
                check,
                reply,
            } => {
                let r = self.lease_and_arena(id).and_then(|(blocks, s)| {
                    if hash {
                        s.scatter_kv_from_staging_h64(layers, blocks, offset)
                            .map(|sums| check(&mut *s, Some(&sums)))
                    } else if check(&mut *s, None) {
                        s.scatter_kv_from_staging(layers, blocks, offset)
                            .map(|()| true)
                    } else {
                        Ok(false)
                    }
                    .map_err(EngineError::from)
                });
                let _ = reply.send(r);
            }
            Command::StagingRead {
                rank,
                offset,
                len,
                reply,
            } => {
                let r = match self.backend.kv_staging() {
                    None => Err(crate::backend::BackendError::NoStaging),
                    Some(s) => {
                        let mut out = vec![0u8; len];
                        s.staging_read(rank, offset, &mut out).map(|()| out)
                    }
                };
                let _ = reply.send(r.map_err(EngineError::from));
            }
            Command::StagingWrite {
                rank,
                offset,
                data,
                hold,
                reply,
            } => {
                let r = match self.backend.kv_staging() {
                    None => Err(crate::backend::BackendError::NoStaging),
                    Some(s) => s.staging_write(rank, offset, &data),
                };
                let _ = reply.send(r.map_err(EngineError::from));
                // The span may go back to its arena only now, after the write.
                drop(hold);
            }
            Command::StagingKvh64 { offset, len, reply } => {
                let r = match self.backend.kv_staging() {
                    None => Err(crate::backend::BackendError::NoStaging),
                    Some(s) => s.staging_kvh64(offset, len),
                };
                let _ = reply.send(r.map_err(EngineError::from));
            }
            Command::Stats { reply } => {
                let mut s = self.stats;
                s.scheduler = self.sched.stats();
                let _ = reply.send(Ok(s));
            }
            Command::CheckAccounting { reply } => {
                let r = self.sched.kv().check_accounting();
                let _ = reply.send(Ok(r));
            }
            Command::Shutdown => return false,
        }
        true
    }
}
