//! The scheduler's steps run on the books without a model.

use super::*;
use crate::forward::WholeRows;
use crate::sampling::RowTerms;
use crate::serving::handle::{channel, DecodePasses, EngineHandle, EventSink, ServeRequest};
use crate::SamplingParams;
use canopy_core::logits::TailWalk;
use std::sync::{Arc, Mutex};

const PAGE: usize = 16;
const VOCAB: usize = 128;
const EOS: u32 = 2;

/// A client that keeps every event.
struct Keep(Arc<Mutex<Vec<Event>>>);

impl EventSink for Keep {
    fn send(&mut self, event: Event) -> bool {
        self.0.lock().unwrap().push(event);
        true
    }

    fn is_closed(&self) -> bool {
        false
    }
}

/// A client that takes `left` events and is gone at the next one, unnoticed until then.
struct Leaves {
    left: usize,
}

impl EventSink for Leaves {
    fn send(&mut self, _: Event) -> bool {
        self.left = self.left.saturating_sub(1);
        self.left > 0
    }

    fn is_closed(&self) -> bool {
        false
    }
}

fn engine() -> (EngineHandle, EngineInbox, Books, Tokenizer) {
    let limits = Limits {
        max_context: 256,
        max_samples: 8,
        page_size: PAGE,
        pages: 64,
    };
    let (handle, inbox) = channel(limits, 16);
    let books = Books::new(1, PAGE as u32, 64, 0).unwrap();
    (handle, inbox, books, Tokenizer::code_points(VOCAB).unwrap())
}

fn submit(
    h: &EngineHandle,
    prompt: Vec<u32>,
    max_tokens: usize,
    ignore_eos: bool,
) -> Arc<Mutex<Vec<Event>>> {
    let events = Arc::new(Mutex::new(Vec::new()));
    submit_to(
        h,
        prompt,
        max_tokens,
        ignore_eos,
        Box::new(Keep(events.clone())),
    );
    events
}

fn submit_to(
    h: &EngineHandle,
    prompt: Vec<u32>,
    max_tokens: usize,
    ignore_eos: bool,
    sink: Box<dyn EventSink>,
) {
    let r = request(prompt, max_tokens, sink);
    h.submit(ServeRequest { ignore_eos, ..r }).unwrap();
}

/// A greedy request of one sample of `prompt` for `max_tokens` tokens, its events to `sink`.
fn request(prompt: Vec<u32>, max_tokens: usize, sink: Box<dyn EventSink>) -> ServeRequest {
    ServeRequest {
        prompt,
        max_tokens,
        samples: 1,
        sampling: SamplingParams::default(),
        seed: 0,
        stop: Vec::new(),
        ignore_eos: false,
        logprobs: None,
        prompt_logprobs: None,
        logit_bias: Vec::new(),
        sink,
    }
}

/// Logits whose greedy token is `token`, for `rows` rows.
fn pick(token: u32, rows: usize) -> Vec<f32> {
    let mut one = vec![0.0; VOCAB];
    one[token as usize] = 1.0;
    one.repeat(rows)
}

/// [`pick`]'s logits narrowed to `k` tokens a row, as a backend's `top_logits` leaves them.
fn narrowed(token: u32, rows: usize, k: usize) -> StepLogits {
    use canopy_engine::LayerOps;
    let backend = canopy_engine::CpuBackend;
    let logits = backend
        .upload_tensor(&pick(token, rows), rows, VOCAB)
        .unwrap();
    let mut top = backend.tensor(rows, 2 * k).unwrap();
    backend.top_logits(&logits, k, &mut top).unwrap();
    StepLogits::top(k, top.data)
}

/// Runs `step` on `books` as every rank would, without a model: every chunk stored, every
/// row's (and prompt's) next token `token`. The last step's tokens are told where the
/// engine tells them, once the pass is launched.
fn run(s: &mut Scheduler, books: &mut Books, step: &Step, token: u32) {
    assert!(books.begin(step).is_empty());
    let (rows, failed) = books.decode(&step.decode);
    assert!(failed.is_empty());
    s.tell_told();
    let mut logits = narrowed(token, rows.rows.len(), step.reach.expect("greedy rows"));
    if let StepLogits::Top {
        whole,
        terms,
        totals,
        picked,
        ..
    } = &mut logits
    {
        for (i, row) in rows.rows.iter().enumerate() {
            if step.whole.contains(&(row.id, row.sample)) {
                whole.insert(i, pick(token, 1));
            }
            if step.terms.contains(&(row.id, row.sample)) {
                // `pick`'s row: one logit of 1, the others 0 (the lowest of them next).
                let lse = ((VOCAB - 1) as f64 + 1f64.exp()).ln() as f32;
                let top = vec![(token, 1.0), (u32::from(token == 0), 0.0)];
                terms.insert(i, RowTerms { lse, top });
            }
            if let Some(&(_, t)) = step.totals.iter().find(|(p, _)| *p == (row.id, row.sample)) {
                totals.insert(i, 1.0 + (VOCAB - 1) as f32 * (-1.0 / t).exp());
            }
            if let Some((_, picks)) = step.picks.iter().find(|(p, _)| *p == (row.id, row.sample)) {
                let logit = |t: u32| (t, f32::from(u8::from(t == token)));
                picked.insert(i, picks.iter().map(|&t| logit(t)).collect());
            }
        }
    }
    let mut chunks = Vec::new();
    let (passes, failed) = books.prefill_passes(&step.prefill, 0, None);
    assert!(failed.is_empty());
    for (chunk, _, stored) in passes.into_iter().flat_map(|p| p.chunks) {
        assert!(stored);
        books.chunk_done(chunk).unwrap();
        chunks.push(ChunkDone {
            chunk,
            logits: Some(pick(token, 1)),
            prompt_logprobs: Vec::new(),
        });
    }
    // Every decode row's whole logits are `pick(token, 1)`.
    let read_whole = |places: &[usize]| {
        let rows = places.iter().flat_map(|_| pick(token, 1)).collect();
        Ok(WholeRows::new(VOCAB, rows))
    };
    let walk_tails = |walks: &[(usize, &TailWalk)]| {
        let row = pick(token, 1);
        let land = |w: &TailWalk| w.land(&row).map(|t| (t, row[t as usize]));
        Ok(walks.iter().map(|(_, w)| land(w)).collect())
    };
    let past = PastReads {
        read_whole: &read_whole,
        walk_tails: &walk_tails,
    };
    let decoded = (!rows.rows.is_empty()).then_some(Decoded {
        rows: &rows,
        logits: &logits,
        cost: Some((0.5, 10)),
        past,
    });
    let clock = StepClock {
        began: Instant::now(),
        prefill_seconds: 0.25,
    };
    s.observe(books, decoded, &chunks, Vec::new(), Some(clock));
}

fn started(events: &Mutex<Vec<Event>>) -> Option<usize> {
    events.lock().unwrap().iter().find_map(|e| match e {
        Event::Started { cached_tokens } => Some(*cached_tokens),
        _ => None,
    })
}

#[test]
fn a_request_waits_for_a_prefix_being_prefilled_and_others_pass_it() {
    let (h, inbox, mut books, tokenizer) = engine();
    let mut s = Scheduler::new(inbox, &tokenizer, vec![EOS], h.limits(), 24);
    let shared: Vec<u32> = (0..40).map(|i| 10 + i % 50).collect();
    let first = submit(&h, [&shared[..], &[3, 4]].concat(), 4, false);
    let second = submit(&h, [&shared[..], &[5, 6, 7]].concat(), 4, false);
    let other = submit(&h, vec![9; 20], 4, false);
    // The second shares two whole pages with the first, which is not cached yet: it
    // waits; the third shares nothing and is admitted.
    let step = s.next_step(&books);
    assert_eq!(step.admit.iter().map(|a| a.id).collect::<Vec<_>>(), [0, 2]);
    run(&mut s, &mut books, &step, 20);
    assert_eq!(started(&first), Some(0));
    assert_eq!(started(&other), Some(0));
    assert_eq!(started(&second), None);
    // 24 prompt tokens a step: the first prompt (42) needs two steps.
    let step = s.next_step(&books);
    assert!(step.admit.is_empty());
    run(&mut s, &mut books, &step, 20);
    let step = s.next_step(&books);
    assert_eq!(step.admit.iter().map(|a| a.id).collect::<Vec<_>>(), [1]);
    run(&mut s, &mut books, &step, 20);
    assert_eq!(
        started(&second),
        Some(32),
        "two whole pages read from the cache"
    );
    let st = h.status();
    assert_eq!(st.prefix_hit_tokens, 32);
    // One decode pass so far: the first request's row, in the third step.
    let one = DecodePasses {
        passes: 1,
        seconds: 0.5,
        kv_bytes: 10,
    };
    assert_eq!(st.decode.into_iter().collect::<Vec<_>>(), [(1, one)]);
    assert_eq!((st.busy_steps, st.prefill_seconds), (3, 0.75));
    assert!(st.busy_seconds > 0.0);
}

#[test]
fn only_the_rows_that_need_them_are_read_further() {
    let (h, inbox, mut books, tokenizer) = engine();
    let mut s = Scheduler::new(inbox, &tokenizer, vec![EOS], h.limits(), 64);
    let (reported, biased) = (
        Arc::new(Mutex::new(Vec::new())),
        Arc::new(Mutex::new(Vec::new())),
    );
    let submit_with = |prompt: Vec<u32>, logprobs, logit_bias, events: &Arc<_>| {
        let r = request(prompt, 4, Box::new(Keep(Arc::clone(events))));
        h.submit(ServeRequest {
            logprobs,
            logit_bias,
            ..r
        })
        .unwrap()
    };
    let plain = submit(&h, vec![7; 5], 4, false);
    let first = s.next_step(&books);
    run(&mut s, &mut books, &first, 20);
    // One greedy row: narrowed to its likeliest token, read no further.
    let step = s.next_step(&books);
    assert_eq!(
        (step.reach, step.whole.len(), step.terms.len()),
        (Some(1), 0, 0)
    );
    run(&mut s, &mut books, &step, 20);
    let reports = submit_with(vec![8; 5], Some(2), Vec::new(), &reported);
    let bias = submit_with(vec![9; 5], None, vec![(3, 1.5)], &biased);
    let step = s.next_step(&books);
    run(&mut s, &mut books, &step, 20);
    // Beside it now: a greedy row that reports log-probabilities has its row's terms read,
    // and a row whose bias may lift a token reaches one token further, with that token's
    // logit picked.
    let step = s.next_step(&books);
    assert_eq!(step.reach, Some(2));
    assert_eq!(
        (step.terms.clone(), step.whole.clone()),
        (vec![(reports, 0)], vec![])
    );
    assert_eq!(step.picks, [((bias, 0), vec![3])]);
    run(&mut s, &mut books, &step, 20);
    s.tell_told();
    let logprobs = |events: &Mutex<Vec<Event>>| {
        let events = events.lock().unwrap();
        events
            .iter()
            .filter_map(|e| match e {
                Event::Token { logprobs, .. } => Some(logprobs.clone()),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(logprobs(&plain), [None, None, None, None]);
    assert_eq!(logprobs(&biased), [None, None]);
    // The token drawn from the narrowed row, its log-probability from the row's terms.
    let lse = ((VOCAB - 1) as f64 + 1f64.exp()).ln() as f32;
    let want = TokenLogprobs {
        logprob: 1.0 - lse,
        top: vec![(20, 1.0 - lse), (0, -lse)],
    };
    assert_eq!(logprobs(&reported), [Some(want.clone()), Some(want)]);
}

#[test]
fn ignore_eos_draws_past_the_end_of_sequence_token() {
    let (h, inbox, mut books, tokenizer) = engine();
    let mut s = Scheduler::new(inbox, &tokenizer, vec![EOS], h.limits(), 64);
    let stops = submit(&h, vec![7; 5], 3, false);
    let goes_on = submit(&h, vec![8; 5], 3, true);
    for _ in 0..3 {
        let step = s.next_step(&books);
        run(&mut s, &mut books, &step, EOS);
    }
    s.tell_told();
    let ends = |events: &Mutex<Vec<Event>>| {
        let events = events.lock().unwrap();
        let tokens = events
            .iter()
            .filter(|e| matches!(e, Event::Token { token: EOS, .. }))
            .count();
        let reason = events.iter().find_map(|e| match e {
            Event::Finished { reason, .. } => Some(*reason),
            _ => None,
        });
        (tokens, reason)
    };
    assert_eq!(ends(&stops), (1, Some(FinishReason::Stop)));
    assert_eq!(ends(&goes_on), (3, Some(FinishReason::Length)));
}

#[test]
fn a_request_whose_client_left_runs_until_its_pages_are_freed() {
    let (h, inbox, mut books, tokenizer) = engine();
    let mut s = Scheduler::new(inbox, &tokenizer, vec![EOS], h.limits(), 64);
    // Started, then the first token: the client is found gone when that token is told,
    // while the next step's pass runs.
    submit_to(&h, vec![7; 40], 8, false, Box::new(Leaves { left: 2 }));
    let step = s.next_step(&books);
    run(&mut s, &mut books, &step, 20);
    let step = s.next_step(&books);
    assert!(step.end.is_empty());
    run(&mut s, &mut books, &step, 20);
    let st = h.status();
    assert!(st.pages_used > 0);
    assert_eq!(
        st.running, 1,
        "a request ended in a step holds its pages until the next: {st:?}"
    );
    let step = s.next_step(&books);
    assert_eq!(step.end, [0]);
    run(&mut s, &mut books, &step, 20);
    let st = h.status();
    assert_eq!(st.running, 0);
    assert_eq!(
        st.pages_used, st.pages_cached,
        "only the cached prefix holds pages"
    );
}

#[test]
fn tokens_are_told_once_the_next_pass_is_launched_unless_stop_strings_wait_on_them() {
    let (h, inbox, mut books, tokenizer) = engine();
    let mut s = Scheduler::new(inbox, &tokenizer, vec![EOS], h.limits(), 64);
    let with_stop = |prompt: Vec<u32>, stop: &str| {
        let events = Arc::new(Mutex::new(Vec::new()));
        let r = request(prompt, 4, Box::new(Keep(Arc::clone(&events))));
        let stop = vec![stop.into()];
        h.submit(ServeRequest { stop, ..r }).unwrap();
        events
    };
    let plain = submit(&h, vec![7; 5], 4, false);
    let never = with_stop(vec![8; 5], "never");
    let stopped = with_stop(vec![9; 5], "AA");
    let tokens = |events: &Mutex<Vec<Event>>| {
        let events = events.lock().unwrap();
        events
            .iter()
            .filter(|e| matches!(e, Event::Token { .. }))
            .count()
    };
    // Every row draws 'A' (65). The prompts' step draws each request's first token: a request
    // with stop strings hears of it at once, the other once the next step's pass is launched.
    let step = s.next_step(&books);
    run(&mut s, &mut books, &step, 65);
    assert_eq!(
        (tokens(&plain), tokens(&never), tokens(&stopped)),
        (0, 1, 1)
    );
    let step = s.next_step(&books);
    assert_eq!(
        step.decode.len(),
        3,
        "every sample goes on before the first is told"
    );
    run(&mut s, &mut books, &step, 65);
    assert_eq!(
        (tokens(&plain), tokens(&never), tokens(&stopped)),
        (1, 2, 2)
    );
    // "AA" ended its request at once, its text held back from the stop string on.
    let finished = stopped.lock().unwrap().iter().find_map(|e| match e {
        Event::Finished { reason, text, .. } => Some((*reason, text.clone())),
        _ => None,
    });
    assert_eq!(finished, Some((FinishReason::Stop, String::new())));
    let step = s.next_step(&books);
    assert_eq!((step.decode.len(), step.end.len()), (2, 1));
    s.tell_told();
    assert_eq!(tokens(&plain), 2);
}
