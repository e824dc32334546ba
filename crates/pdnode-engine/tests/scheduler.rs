//! Scheduler unit tests: plain state, no runtime, no backend. Every test ends with the KV
//! accounting check and (when everything finished) a pool with every block available.

use pdnode_core::{BlockId, FinishReason, RequestId};
use pdnode_engine::scheduler::{
    Handoff, Mode, Scheduler, SchedulerConfig, SchedulerError, SeqOutput, StepPlan, lease_id,
};
use std::collections::HashMap;
use std::time::{Duration, Instant};

fn cfg(mode: Mode, blocks: u32, bs: u32, budget: usize, max_running: usize) -> SchedulerConfig {
    SchedulerConfig {
        mode,
        num_blocks: blocks,
        block_size: bs,
        max_batch_tokens: budget,
        max_running_requests: max_running,
        prefix_cache: true,
        lease: Duration::from_secs(10),
    }
}

#[track_caller]
fn assert_clean(s: &Scheduler) {
    if let Err(e) = s.kv().check_accounting() {
        panic!("{e}");
    }
}

#[track_caller]
fn assert_all_free(s: &Scheduler) {
    assert_clean(s);
    assert!(!s.has_work());
    assert_eq!(s.kv().available(), s.kv().total(), "blocks leaked");
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| salt * 1000 + i).collect()
}

/// The token a fake model "samples" for a request at a position: deterministic.
fn token_at(id: RequestId, pos: usize) -> u32 {
    (id.0 as u32).wrapping_mul(31).wrapping_add(pos as u32 * 7) % 1000 + 1
}

/// Runs one step: each row that wants logits samples `token_at`; a request finishes after
/// `limits[id]` generated tokens.
fn step(
    s: &mut Scheduler,
    limits: &HashMap<RequestId, usize>,
    generated: &mut HashMap<RequestId, Vec<u32>>,
) -> (StepPlan, Vec<Handoff>) {
    let plan = s.next_step();
    let mut outs = Vec::new();
    for q in plan.seqs.iter().filter(|q| q.want_logits) {
        let pos = q.start_pos + q.tokens.len();
        let t = token_at(q.id, pos);
        let g = generated.entry(q.id).or_default();
        g.push(t);
        outs.push(SeqOutput {
            id: q.id,
            token: t,
            finished: g.len() >= limits.get(&q.id).copied().unwrap_or(usize::MAX),
        });
    }
    let h = s.on_step_done(&outs, Instant::now());
    (plan, h)
}

fn drive(
    s: &mut Scheduler,
    limits: &HashMap<RequestId, usize>,
) -> (Vec<StepPlan>, HashMap<RequestId, Vec<u32>>) {
    let mut generated = HashMap::new();
    let mut plans = Vec::new();
    for _ in 0..10_000 {
        if !s.has_work() {
            break;
        }
        let (p, _) = step(s, limits, &mut generated);
        assert_clean(s);
        plans.push(p);
    }
    (plans, generated)
}

#[test]
fn chunked_prefill_respects_the_budget_and_asks_for_logits_only_at_the_end() {
    let mut s = Scheduler::new(cfg(Mode::Colocated, 64, 4, 8, 8));
    let id = RequestId(1);
    s.add_request(id, prompt(20, 1)).unwrap();
    let limits = HashMap::from([(id, 3)]);
    let (plans, generated) = drive(&mut s, &limits);
    let shape: Vec<(usize, usize, bool)> = plans
        .iter()
        .map(|p| {
            (
                p.seqs[0].start_pos,
                p.seqs[0].tokens.len(),
                p.seqs[0].want_logits,
            )
        })
        .collect();
    assert_eq!(
        shape,
        vec![
            (0, 8, false),
            (8, 8, false),
            (16, 4, true),
            (20, 1, true),
            (21, 1, true)
        ]
    );
    // Each step's block table covers exactly the positions up to its last token.
    for p in &plans {
        let q = &p.seqs[0];
        assert_eq!(
            q.block_table.len(),
            (q.start_pos + q.tokens.len()).div_ceil(4)
        );
    }
    assert_eq!(generated[&id].len(), 3);
    assert_all_free(&s);
}

#[test]
fn decode_first_then_prefill_with_the_rest_of_the_budget() {
    let mut s = Scheduler::new(cfg(Mode::Colocated, 256, 4, 10, 16));
    let mut limits = HashMap::new();
    for i in 1..=6 {
        let id = RequestId(i);
        s.add_request(id, prompt(7, i as u32)).unwrap();
        limits.insert(id, 5);
    }
    let (plans, generated) = drive(&mut s, &limits);
    for p in &plans {
        assert!(p.num_tokens() <= 10, "budget exceeded: {}", p.num_tokens());
        // Decodes come first, and no decode is left out while prefills run.
        // (Every prompt is 7 tokens, so a decode is a step at position 7 or later.)
        let first_prefill = p.seqs.iter().position(|q| q.start_pos < 7);
        if let Some(fp) = first_prefill {
            assert!(p.seqs[fp..].iter().all(|q| q.start_pos < 7), "{p:?}");
        }
    }
    // A request that reached decode is scheduled every step until it finishes.
    for i in 1..=6 {
        let id = RequestId(i);
        let steps: Vec<usize> = plans
            .iter()
            .enumerate()
            .filter(|(_, p)| p.seqs.iter().any(|q| q.id == id && q.start_pos >= 7))
            .map(|(k, _)| k)
            .collect();
        assert_eq!(steps.len(), 4);
        assert!(
            steps.windows(2).all(|w| w[1] == w[0] + 1),
            "{id}: {steps:?}"
        );
        assert_eq!(generated[&id].len(), 5);
    }
    assert_all_free(&s);
}

#[test]
fn max_running_requests_caps_the_batch() {
    let mut s = Scheduler::new(cfg(Mode::Colocated, 256, 4, 100, 2));
    let mut limits = HashMap::new();
    for i in 1..=5 {
        s.add_request(RequestId(i), prompt(3, i as u32)).unwrap();
        limits.insert(RequestId(i), 4);
    }
    let (plans, generated) = drive(&mut s, &limits);
    assert!(plans.iter().all(|p| p.seqs.len() <= 2));
    assert_eq!(generated.len(), 5);
    assert_all_free(&s);
}

#[test]
fn preemption_frees_the_latest_and_recomputes_with_generated_tokens() {
    // 2 positions per block, 6 blocks: two requests of 4 prompt tokens cannot both reach 8.
    let mut s = Scheduler::new(cfg(Mode::Colocated, 6, 2, 64, 8));
    let (a, b) = (RequestId(1), RequestId(2));
    s.add_request(a, prompt(4, 1)).unwrap();
    s.add_request(b, prompt(4, 2)).unwrap();
    let limits = HashMap::from([(a, 6), (b, 6)]);
    let (plans, generated) = drive(&mut s, &limits);
    let first = plans
        .iter()
        .position(|p| !p.preempted.is_empty())
        .expect("a preemption");
    assert_eq!(plans[first].preempted, vec![b], "LIFO victim");
    // b comes back as a prefill over its prompt plus what it had generated.
    let back = plans[first + 1..]
        .iter()
        .flat_map(|p| p.seqs.iter())
        .find(|q| q.id == b)
        .unwrap();
    let b_before: usize = plans[..first]
        .iter()
        .flat_map(|p| p.seqs.iter())
        .filter(|q| q.id == b && q.want_logits)
        .count();
    assert_eq!(back.start_pos + back.tokens.len(), 4 + b_before);
    assert!(back.tokens.len() > 1);
    assert_eq!(
        s.stats().preemptions_total as usize,
        plans.iter().map(|p| p.preempted.len()).sum::<usize>()
    );
    // Outputs are the same as without memory pressure.
    let mut roomy = Scheduler::new(cfg(Mode::Colocated, 64, 2, 64, 8));
    roomy.add_request(a, prompt(4, 1)).unwrap();
    roomy.add_request(b, prompt(4, 2)).unwrap();
    let (_, expected) = drive(&mut roomy, &limits);
    assert_eq!(generated, expected);
    assert_all_free(&s);
    assert_all_free(&roomy);
}

#[test]
fn a_sequence_that_outgrows_the_pool_ends_with_length() {
    let mut s = Scheduler::new(cfg(Mode::Colocated, 3, 2, 64, 8));
    let id = RequestId(1);
    s.add_request(id, prompt(4, 1)).unwrap();
    let mut generated = HashMap::new();
    let limits = HashMap::from([(id, 100)]);
    let mut ended = None;
    for _ in 0..20 {
        let (p, _) = step(&mut s, &limits, &mut generated);
        if let Some(f) = p.finished.first() {
            ended = Some(*f);
            break;
        }
    }
    assert_eq!(ended, Some((id, FinishReason::Length)));
    assert_all_free(&s);
}

#[test]
fn prefix_cache_hits_skip_cached_positions() {
    let mut s = Scheduler::new(cfg(Mode::Colocated, 64, 4, 64, 8));
    let p = prompt(12, 3);
    s.add_request(RequestId(1), p.clone()).unwrap();
    drive(&mut s, &HashMap::from([(RequestId(1), 2)]));
    s.add_request(RequestId(2), p.clone()).unwrap();
    let plan = s.next_step();
    // 12 tokens, 3 full blocks cached; the last token is always recomputed for its logits.
    assert_eq!(plan.seqs[0].start_pos, 8);
    assert_eq!(plan.seqs[0].tokens, p[8..].to_vec());
    assert_eq!(plan.seqs[0].block_table.len(), 3);
    s.on_step_done(
        &[SeqOutput {
            id: RequestId(2),
            token: 5,
            finished: true,
        }],
        Instant::now(),
    );
    assert_all_free(&s);
}

#[test]
fn prefill_only_hands_blocks_to_a_lease_until_released_or_expired() {
    let mut s = Scheduler::new(cfg(Mode::PrefillOnly, 32, 4, 64, 8));
    let (a, b) = (RequestId(1), RequestId(2));
    s.add_request(a, prompt(10, 1)).unwrap();
    s.add_request(b, prompt(6, 2)).unwrap();
    let mut generated = HashMap::new();
    let (_, handoffs) = step(&mut s, &HashMap::new(), &mut generated);
    assert_eq!(handoffs.len(), 2);
    assert!(
        !s.has_work(),
        "prefill-only requests leave the batch after the first token"
    );
    let ha = &handoffs[0];
    assert_eq!(ha.id, a);
    assert_eq!(ha.first_token, generated[&a][0]);
    assert_eq!(ha.blocks.len(), 3);
    assert_eq!(ha.lease, lease_id(a));
    assert_eq!(s.transfer_blocks(a).unwrap(), ha.blocks.as_slice());
    assert_clean(&s);
    assert!(s.kv().available() < 32 - 3);
    // a's hand-off completes; b's lease expires.
    assert!(s.release_transfer(a).unwrap() > 0);
    assert!(s.release_transfer(a).is_err());
    assert!(s.expire(Instant::now()).is_empty());
    assert_eq!(s.expire(Instant::now() + Duration::from_secs(11)), vec![b]);
    assert_all_free(&s);
}

#[test]
fn prefill_only_request_that_finishes_on_its_first_token_frees_instead_of_leasing() {
    let mut s = Scheduler::new(cfg(Mode::PrefillOnly, 32, 4, 64, 8));
    s.add_request(RequestId(1), prompt(5, 1)).unwrap();
    let mut generated = HashMap::new();
    let (_, h) = step(&mut s, &HashMap::from([(RequestId(1), 1)]), &mut generated);
    assert!(h.is_empty());
    assert_all_free(&s);
}

#[test]
fn decode_only_reserves_admits_and_decodes_from_the_transferred_blocks() {
    let mut s = Scheduler::new(cfg(Mode::DecodeOnly, 32, 4, 64, 8));
    let id = RequestId(7);
    let p = prompt(9, 7);
    let now = Instant::now();
    let blocks = s.reserve_for_transfer(id, p.len(), now).unwrap();
    assert_eq!(blocks.len(), 3);
    assert!(matches!(
        s.reserve_for_transfer(id, p.len(), now),
        Err(SchedulerError::DuplicateRequest { .. })
    ));
    assert!(matches!(
        s.admit_transferred(id, prompt(13, 7), 42),
        Err(SchedulerError::ReservationMismatch { .. })
    ));
    s.admit_transferred(id, p.clone(), 42).unwrap();
    let plan = s.next_step();
    assert_eq!(plan.seqs.len(), 1);
    let q = &plan.seqs[0];
    assert_eq!((q.start_pos, q.tokens.clone()), (9, vec![42]));
    assert_eq!(q.block_table, blocks);
    s.on_step_done(
        &[SeqOutput {
            id,
            token: 43,
            finished: false,
        }],
        now,
    );
    let plan = s.next_step();
    assert_eq!(plan.seqs[0].start_pos, 10);
    assert_eq!(plan.seqs[0].block_table[..3], blocks[..]);
    s.on_step_done(
        &[SeqOutput {
            id,
            token: 44,
            finished: true,
        }],
        now,
    );
    assert_all_free(&s);
}

#[test]
fn an_expired_reservation_frees_its_blocks_and_cannot_be_admitted() {
    let mut s = Scheduler::new(cfg(Mode::DecodeOnly, 16, 4, 64, 8));
    let id = RequestId(3);
    let now = Instant::now();
    s.reserve_for_transfer(id, 12, now).unwrap();
    assert_eq!(s.next_deadline(), Some(now + Duration::from_secs(10)));
    assert_eq!(s.expire(now + Duration::from_secs(10)), vec![id]);
    assert!(matches!(
        s.admit_transferred(id, prompt(12, 3), 1),
        Err(SchedulerError::Kv { .. })
    ));
    assert_all_free(&s);
}

#[test]
fn abort_frees_everything_at_every_stage() {
    let mut s = Scheduler::new(cfg(Mode::Colocated, 64, 4, 8, 8));
    let now = Instant::now();
    // waiting
    s.add_request(RequestId(1), prompt(40, 1)).unwrap();
    s.add_request(RequestId(2), prompt(5, 2)).unwrap();
    assert!(s.abort(RequestId(2)));
    // running mid-prefill, and aborted between the plan and its results
    let plan = s.next_step();
    assert!(!plan.seqs[0].want_logits);
    assert!(s.abort(RequestId(1)));
    s.on_step_done(&[], now);
    assert!(!s.abort(RequestId(1)), "already gone");
    // reserved for transfer, and admitted but not yet running
    s.reserve_for_transfer(RequestId(3), 8, now).unwrap();
    assert!(s.abort(RequestId(3)));
    s.reserve_for_transfer(RequestId(4), 8, now).unwrap();
    s.admit_transferred(RequestId(4), prompt(8, 4), 9).unwrap();
    assert!(s.abort(RequestId(4)));
    assert_all_free(&s);
    // prefill-only lease
    let mut p = Scheduler::new(cfg(Mode::PrefillOnly, 64, 4, 64, 8));
    p.add_request(RequestId(5), prompt(6, 5)).unwrap();
    step(&mut p, &HashMap::new(), &mut HashMap::new());
    assert!(p.transfer_blocks(RequestId(5)).is_some());
    assert!(p.abort(RequestId(5)));
    assert_all_free(&p);
}

#[test]
fn bad_requests_are_refused_with_typed_errors() {
    let mut s = Scheduler::new(cfg(Mode::Colocated, 4, 4, 64, 8));
    assert!(matches!(
        s.add_request(RequestId(1), vec![]),
        Err(SchedulerError::EmptyPrompt { .. })
    ));
    assert!(matches!(
        s.add_request(RequestId(1), prompt(16, 1)),
        Err(SchedulerError::TooLarge {
            needed: 5,
            total: 4,
            ..
        })
    ));
    s.add_request(RequestId(1), prompt(3, 1)).unwrap();
    assert!(matches!(
        s.add_request(RequestId(1), prompt(3, 1)),
        Err(SchedulerError::DuplicateRequest { .. })
    ));
    assert!(s.release_transfer(RequestId(9)).is_err());
    assert!(s.abort(RequestId(1)));
    assert_all_free(&s);
    let _ = BlockId(0);
}

#[test]
fn many_random_requests_finish_with_a_clean_pool() {
    // A tight pool with a shared prompt stem: preemption, prefix hits and chunking all at once.
    let mut s = Scheduler::new(cfg(Mode::Colocated, 24, 4, 16, 6));
    let stem = prompt(9, 99);
    let mut limits = HashMap::new();
    for i in 1..=30u64 {
        let mut p = stem[..(i as usize % 9) + 1].to_vec();
        p.extend(prompt((i as usize * 7) % 13, i as u32));
        s.add_request(RequestId(i), p).unwrap();
        limits.insert(RequestId(i), 1 + (i as usize * 5) % 17);
    }
    let (_, generated) = drive(&mut s, &limits);
    for (id, n) in &limits {
        assert_eq!(generated[id].len(), *n, "{id}");
    }
    assert_all_free(&s);
}

#[test]
fn a_transferred_prompt_that_fills_its_blocks_gets_a_block_for_its_first_decode() {
    let mut s = Scheduler::new(cfg(Mode::DecodeOnly, 8, 4, 64, 8));
    let id = RequestId(1);
    let blocks = s.reserve_for_transfer(id, 8, Instant::now()).unwrap();
    assert_eq!(blocks.len(), 2);
    s.admit_transferred(id, prompt(8, 1), 5).unwrap();
    let plan = s.next_step();
    assert_eq!(plan.seqs[0].start_pos, 8);
    assert_eq!(plan.seqs[0].block_table.len(), 3);
    assert_eq!(plan.seqs[0].block_table[..2], blocks[..]);
    assert!(s.abort(id));
    assert_all_free(&s);
}

/// splitmix64, so a failing seed replays.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) % n.max(1) as u64) as usize
    }
}

#[test]
fn random_operations_in_every_mode_keep_the_accounting_and_free_everything() {
    for seed in 0..300u64 {
        let mut r = Rng(seed);
        let mode = [Mode::Colocated, Mode::PrefillOnly, Mode::DecodeOnly][r.below(3)];
        let bs = 1 + r.below(4) as u32;
        let mut s = Scheduler::new(cfg(
            mode,
            8 + r.below(40) as u32,
            bs,
            1 + r.below(32),
            1 + r.below(8),
        ));
        let t0 = Instant::now();
        let mut ids: Vec<RequestId> = Vec::new();
        let mut reserved: Vec<(RequestId, usize)> = Vec::new();
        for op in 0..200u64 {
            let now = t0 + Duration::from_millis(op * 50);
            let id = RequestId(seed * 1000 + op);
            match r.below(8) {
                0 | 1 => {
                    let stem = r.below(3) as u32;
                    let mut p = prompt(1 + r.below(12), stem);
                    p.extend(prompt(r.below(5), 50 + op as u32));
                    if s.add_request(id, p).is_ok() {
                        ids.push(id);
                    }
                }
                2..=4 => {
                    let plan = s.next_step();
                    let outs: Vec<SeqOutput> = plan
                        .seqs
                        .iter()
                        .filter(|q| q.want_logits)
                        .map(|q| SeqOutput {
                            id: q.id,
                            token: (q.start_pos + q.tokens.len()) as u32,
                            finished: r.below(5) == 0,
                        })
                        .collect();
                    s.on_step_done(&outs, now);
                }
                5 if !ids.is_empty() => {
                    let victim = ids.swap_remove(r.below(ids.len()));
                    s.abort(victim);
                }
                6 => {
                    let len = 1 + r.below(16);
                    if s.reserve_for_transfer(id, len, now).is_ok() {
                        reserved.push((id, len));
                    }
                }
                7 if !reserved.is_empty() => {
                    let (rid, len) = reserved.swap_remove(r.below(reserved.len()));
                    match r.below(3) {
                        0 => {
                            let _ = s.release_transfer(rid);
                        }
                        _ => {
                            if s.admit_transferred(rid, prompt(len, 7), 1).is_ok() {
                                ids.push(rid);
                            }
                        }
                    }
                }
                _ => {
                    s.expire(now);
                }
            }
            if let Err(e) = s.kv().check_accounting() {
                panic!("seed {seed} op {op}: {e}");
            }
        }
        for id in ids {
            s.abort(id);
        }
        s.expire(t0 + Duration::from_secs(3600));
        assert_all_free(&s);
    }
}

#[test]
fn more_running_slots_than_budget_are_clamped_so_no_decode_starves() {
    let mut s = Scheduler::new(cfg(Mode::Colocated, 64, 4, 3, 10));
    assert_eq!(s.config().max_running_requests, 3);
    let mut limits = HashMap::new();
    for i in 1..=6 {
        s.add_request(RequestId(i), prompt(2, i as u32)).unwrap();
        limits.insert(RequestId(i), 4);
    }
    let (plans, generated) = drive(&mut s, &limits);
    assert!(plans.iter().all(|p| p.num_tokens() <= 3));
    assert!(generated.values().all(|g| g.len() == 4));
    assert_all_free(&s);
}

/// `park` takes a request only between two decode steps: not while it is queued, mid-prefill
/// (chunked), or in a planned step; between two steps its blocks (exactly those of its
/// computed positions) go under its lease, and releasing the lease frees everything.
#[test]
fn park_takes_a_request_only_between_two_decode_steps() {
    let not_decoding =
        |r: Result<_, SchedulerError>| matches!(r, Err(SchedulerError::NotDecoding { .. }));
    // Budget 8: a 20-token prompt takes three chunks.
    let mut s = Scheduler::new(cfg(Mode::Colocated, 64, 4, 8, 8));
    let id = RequestId(1);
    s.add_request(id, prompt(20, 1)).unwrap();
    assert!(not_decoding(s.park(id, Instant::now())), "queued");
    let limits = HashMap::new();
    let mut generated = HashMap::new();
    step(&mut s, &limits, &mut generated);
    assert!(not_decoding(s.park(id, Instant::now())), "mid-prefill");
    // A planned step holds it until its outputs are in.
    let plan = s.next_step();
    assert!(plan.seqs.iter().any(|q| q.id == id));
    assert!(not_decoding(s.park(id, Instant::now())), "in a step");
    let outs: Vec<SeqOutput> = plan
        .seqs
        .iter()
        .filter(|q| q.want_logits)
        .map(|q| SeqOutput {
            id: q.id,
            token: token_at(q.id, q.start_pos + q.tokens.len()),
            finished: false,
        })
        .collect();
    s.on_step_done(&outs, Instant::now());
    // The last chunk (its first token), one decode step, then park.
    for _ in 0..2 {
        step(&mut s, &limits, &mut generated);
    }
    let (tokens, computed, blocks) = s.park(id, Instant::now()).unwrap();
    assert_eq!(computed, tokens.len() - 1);
    assert_eq!(tokens.len(), 20 + 2, "the prompt and two sampled tokens");
    assert_eq!(blocks.len(), computed.div_ceil(4));
    assert_eq!(s.transfer_blocks(id), Some(&blocks[..]));
    assert!(!s.has_work() || s.next_step().seqs.iter().all(|q| q.id != id));
    assert!(not_decoding(s.park(id, Instant::now())), "parked already");
    assert_clean(&s);
    s.release_transfer(id).unwrap();
    assert_eq!(s.kv().available(), s.kv().total(), "blocks leaked");
    assert_clean(&s);
}

/// A reservation that would leave the head of the waiting queue short of blocks is refused
/// (Unavailable: the router tries another node), so new work cannot starve a request that
/// waits to run (a preempted one, or an older prompt); one that leaves it room is granted, and
/// with nothing waiting the larger one fits too.
#[test]
fn a_reservation_waits_behind_the_head_of_the_queue() {
    use pdnode_core::ErrorKind;
    use pdnode_core::error::Classify;
    // One running request at most, so b waits while a runs.
    let mut s = Scheduler::new(cfg(Mode::Colocated, 12, 2, 64, 1));
    let (a, b) = (RequestId(1), RequestId(2));
    s.add_request(a, prompt(4, 1)).unwrap();
    s.add_request(b, prompt(8, 2)).unwrap();
    let limits = HashMap::from([(a, 3), (b, 3)]);
    let mut generated = HashMap::new();
    step(&mut s, &limits, &mut generated);
    let avail = s.kv().available();
    let head = 4; // b's 8 tokens, 2 a block
    assert!(avail > head, "{avail}");
    let over = avail - head + 1;
    let e = s
        .reserve_for_transfer(RequestId(9), over * 2, Instant::now())
        .unwrap_err();
    assert!(
        matches!(e, SchedulerError::WaitingFirst { waiting, .. } if waiting == b),
        "{e}"
    );
    assert_eq!(e.kind(), ErrorKind::Unavailable);
    let fits = avail - head;
    let got = s
        .reserve_for_transfer(RequestId(10), fits * 2, Instant::now())
        .unwrap();
    assert_eq!(got.len(), fits);
    s.release_transfer(RequestId(10)).unwrap();
    drive(&mut s, &limits);
    s.reserve_for_transfer(RequestId(9), over * 2, Instant::now())
        .unwrap();
    s.release_transfer(RequestId(9)).unwrap();
    assert_all_free(&s);
}
