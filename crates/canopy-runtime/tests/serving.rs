//! The serving engine on the tiny fixture model (CPU): requests that join while others
//! decode, share prefixes through the radix cache, are prefilled in chunks and sampled `n`
//! times each give exactly the greedy tokens transformers gives each prompt alone — on one
//! rank, and on two ranks (threads) with the tree merge and with the ring; clients that go
//! away free their pages.

use canopy_comm::ThreadWorld;
use canopy_core::{DType, Method};
use canopy_engine::{CpuBackend, MergeCollective};
use canopy_model::Model;
use canopy_runtime::serving::warm_up_products;
use canopy_runtime::serving::{
    channel, serve, EngineHandle, EngineInbox, Event, EventSink, FinishReason, Front, ServeConfig,
    ServeRequest, WarmUp, WarmUpEnd,
};
use canopy_runtime::{DecodeStrategy, ModelLayers, SamplingParams};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A prompt's token ids and transformers' greedy continuation of it.
type Reference = (Vec<u32>, Vec<u32>);

fn fixture_model() -> (Model, Value) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/gqa-hd64");
    let model = Model::load(&dir, DType::F32).expect("the fixture loads");
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("its reference");
    (model, serde_json::from_str(&text).expect("JSON"))
}

fn fixture() -> (Model, Vec<Reference>) {
    let (model, reference) = fixture_model();
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    // Prompts of 1, 7, 33 and 100 tokens, each a prefix of the next, and transformers'
    // 32 greedy tokens after each.
    let prompts = reference["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (ids(&p["token_ids"]), ids(&p["greedy_tokens"])))
        .collect();
    (model, prompts)
}

/// The fixture model's layers on the CPU.
fn cpu_layers(model: &Model) -> ModelLayers<CpuBackend> {
    ModelLayers::upload(&CpuBackend, &model.config, &model.weights, &mut |_| {})
        .expect("the weights upload")
}

/// A client: its events, and a switch that makes it go away.
struct Client {
    tx: Sender<Event>,
    gone: Arc<AtomicBool>,
    /// Go away after this many tokens.
    leave_after: Option<usize>,
    tokens: usize,
}

impl EventSink for Client {
    fn send(&mut self, event: Event) -> bool {
        if let Event::Token { .. } = event {
            self.tokens += 1;
            if self.leave_after.is_some_and(|n| self.tokens >= n) {
                self.gone.store(true, Ordering::SeqCst);
            }
        }
        !self.gone.load(Ordering::SeqCst) && self.tx.send(event).is_ok()
    }

    fn is_closed(&self) -> bool {
        self.gone.load(Ordering::SeqCst)
    }
}

fn submit(
    handle: &EngineHandle,
    prompt: &[u32],
    max_tokens: usize,
    samples: usize,
    leave_after: Option<usize>,
) -> Receiver<Event> {
    submit_with(
        handle,
        prompt,
        max_tokens,
        samples,
        leave_after,
        (None, None),
    )
}

fn submit_with(
    handle: &EngineHandle,
    prompt: &[u32],
    max_tokens: usize,
    samples: usize,
    leave_after: Option<usize>,
    (logprobs, prompt_logprobs): (Option<usize>, Option<usize>),
) -> Receiver<Event> {
    let (tx, rx) = std::sync::mpsc::channel();
    let sink = Client {
        tx,
        gone: Arc::new(AtomicBool::new(false)),
        leave_after,
        tokens: 0,
    };
    handle
        .submit(ServeRequest {
            prompt: prompt.to_vec(),
            max_tokens,
            samples,
            sampling: SamplingParams::default(),
            seed: 0,
            stop: Vec::new(),
            ignore_eos: false,
            logprobs,
            prompt_logprobs,
            logit_bias: Vec::new(),
            sink: Box::new(sink),
        })
        .expect("the request is accepted");
    rx
}

/// Each sample's tokens and finish reason, and the cached prompt tokens.
fn collect(rx: &Receiver<Event>, samples: usize) -> (Vec<Vec<u32>>, Vec<FinishReason>, usize) {
    let mut tokens = vec![Vec::new(); samples];
    let mut reasons = Vec::new();
    let mut cached = 0;
    while reasons.len() < samples {
        match rx.recv_timeout(Duration::from_secs(120)).expect("an event") {
            Event::Started { cached_tokens } => cached = cached_tokens,
            Event::Token { sample, token, .. } => tokens[sample].push(token),
            Event::Finished { reason, .. } => reasons.push(reason),
            Event::PromptLogprobs { .. } => panic!("not asked for"),
            Event::Failed(e) => panic!("the request failed: {e}"),
        }
    }
    (tokens, reasons, cached)
}

fn config(strategy: DecodeStrategy) -> ServeConfig {
    ServeConfig {
        strategy,
        method: Method::Auto,
        page_size: 16,
        kv_dtype: DType::F32,
        pages_per_rank: 48,
        max_batch: 6,
        max_context: 256,
        prefill_chunk: 24,
        graphs: true,
        // The CPU records no passes; padding runs here so that its rows are checked too.
        pad_rows: true,
    }
}

/// Runs an engine on `ranks` threads while `client` talks to it, then drains it.
fn with_engine(
    model: &Model,
    layers: &ModelLayers<CpuBackend>,
    ranks: usize,
    config: &ServeConfig,
    client: impl FnOnce(&EngineHandle),
) -> EngineHandle {
    let (handle, inbox) = channel(config.limits(ranks), 64);
    let inbox: Mutex<Option<EngineInbox>> = Mutex::new(Some(inbox));
    std::thread::scope(|s| {
        let engine = s.spawn(|| {
            ThreadWorld::run(ranks, Duration::from_secs(120), |comm| {
                // Only rank 0 takes the inbox (a rank that took it first would drop it).
                let front = (canopy_comm::Group::rank(&comm) == 0)
                    .then(|| inbox.lock().unwrap().take())
                    .flatten()
                    .map(|inbox| Front {
                        inbox,
                        tokenizer: &model.tokenizer,
                        stop_tokens: Vec::new(),
                    });
                serve(&CpuBackend, layers, &comm, config, front)
            })
        });
        // A client's failed assertion still drains the engine, so the test fails instead of
        // waiting on it.
        let client = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| client(&handle)));
        handle.drain();
        let ranks = engine.join().expect("the engine thread");
        if let Err(panic) = client {
            std::panic::resume_unwind(panic);
        }
        for r in ranks {
            r.expect("every rank served");
        }
    });
    handle
}

#[test]
fn concurrent_requests_get_what_each_prompt_gets_alone() {
    let (model, prompts) = fixture();
    let layers = cpu_layers(&model);
    for (ranks, strategy) in [
        (1, DecodeStrategy::Tree(MergeCollective::Auto)),
        (2, DecodeStrategy::Tree(MergeCollective::Allreduce2)),
        (2, DecodeStrategy::Ring),
    ] {
        let cfg = config(strategy);
        let handle = with_engine(&model, &layers, ranks, &cfg, |h| {
            // The longest prompt first, so that the others find its prefix cached.
            let (long, long_want) = &prompts[3];
            let first = submit(h, long, 32, 1, None);
            let (got, reasons, cached) = collect(&first, 1);
            assert_eq!(cached, 0);
            assert_eq!(&got[0], long_want, "{ranks} ranks {strategy:?}");
            assert_eq!(reasons, [FinishReason::Length]);
            // Then every prompt three times at once (more rows than the batch holds), with
            // two samples each and different lengths; one client leaves early.
            let mut pending = Vec::new();
            for round in 0..3 {
                for (i, (prompt, want)) in prompts.iter().enumerate() {
                    let max_tokens = 8 + 8 * ((round + i) % 4);
                    let samples = 1 + (round + i) % 2;
                    let rx = submit(h, prompt, max_tokens, samples, None);
                    pending.push((rx, want, max_tokens, samples, prompt.len()));
                }
            }
            let leaver = submit(h, long, 32, 2, Some(3));
            for (rx, want, max_tokens, samples, len) in pending {
                let (got, reasons, cached) = collect(&rx, samples);
                for g in &got {
                    assert_eq!(
                        g[..],
                        want[..max_tokens],
                        "{ranks} ranks {strategy:?}, {len} tokens"
                    );
                }
                assert!(reasons.iter().all(|&r| r == FinishReason::Length));
                // Whole pages of the prompt, short of its last token, were cached.
                assert_eq!(cached, (len - 1) / 16 * 16, "{len} tokens");
            }
            // The leaver's events stop; it never finishes.
            let mut seen = 0;
            while let Ok(e) = leaver.recv_timeout(Duration::from_secs(5)) {
                assert!(!matches!(e, Event::Finished { .. }));
                seen += 1;
            }
            assert!(seen <= 4, "{seen} events after leaving");
        });
        let st = handle.status();
        assert_eq!((st.running, st.waiting), (0, 0));
        assert_eq!(
            st.pages_used, st.pages_cached,
            "only cached prefixes hold pages once every request has ended"
        );
        assert!(st.prefix_hit_tokens > 0 && st.prefix_hit_tokens <= st.prefix_queried_tokens);
        assert!(st.failure.is_none());
        // Every decode pass was timed, and priced at the distinct KV it reads on rank 0: on
        // one rank, each row's own token and a prompt token at least.
        let shape = model.config.attn_shape();
        let token_bytes = 2 * shape.kv_token_bytes(DType::F32) * model.config.num_hidden_layers;
        assert!(!st.decode.is_empty());
        for (&rows, d) in &st.decode {
            let least = if ranks == 1 { rows + 1 } else { 1 };
            assert!((1..=cfg.max_batch).contains(&rows));
            assert!(d.passes > 0 && d.seconds > 0.0);
            assert!(
                d.kv_bytes >= d.passes * (least * token_bytes) as u64,
                "{rows} rows: {d:?}"
            );
        }
    }
}

#[test]
fn a_warm_up_runs_to_its_end_and_leaves_requests_their_answers() {
    let (model, prompts) = fixture();
    let layers = cpu_layers(&model);
    let cfg = config(DecodeStrategy::Tree(MergeCollective::Auto));
    // Every rank of three warms up, the others after rank 0's choices reach them.
    let (rows, logit_rows) = (cfg.most_step_rows(), 2 * cfg.max_batch);
    let warmed = ThreadWorld::run(3, Duration::from_secs(60), |comm| {
        warm_up_products(&CpuBackend, &layers, &comm, rows, logit_rows)
    });
    for w in warmed {
        w.expect("the products run at every count on every rank");
    }
    let handle = with_engine(&model, &layers, 1, &cfg, |h| {
        // Longer than a request may be: the warm-up's prompt is cut to fit.
        let warm_up = WarmUp::submit(h, 10 * cfg.max_context, model.config.vocab_size)
            .expect("the warm-up is accepted");
        let rx: Vec<_> = prompts
            .iter()
            .map(|(p, want)| (submit(h, p, 32, 1, None), want))
            .collect();
        assert_eq!(warm_up.wait(), WarmUpEnd::Done);
        for (rx, want) in rx {
            let (got, _, _) = collect(&rx, 1);
            assert_eq!(&got[0], want);
        }
    });
    let st = handle.status();
    assert_eq!(st.running, 0);
    // The warm-up decodes two tokens beside the requests' 32 each.
    assert_eq!(st.generated_tokens, 32 * prompts.len() as u64 + 2, "{st:?}");
}

#[test]
fn a_small_cache_evicts_and_still_serves_everything() {
    let (model, prompts) = fixture();
    let layers = cpu_layers(&model);
    // 12 pages: the 100-token prompt and 32 tokens take 9, so requests wait for each other
    // and cached prefixes are evicted.
    let cfg = ServeConfig {
        pages_per_rank: 12,
        ..config(DecodeStrategy::Tree(MergeCollective::Auto))
    };
    let handle = with_engine(&model, &layers, 1, &cfg, |h| {
        let rx: Vec<_> = prompts
            .iter()
            .rev()
            .chain(prompts.iter())
            .map(|(p, want)| (submit(h, p, 32, 1, None), want))
            .collect();
        for (rx, want) in rx {
            let (got, _, _) = collect(&rx, 1);
            assert_eq!(&got[0], want);
        }
    });
    let st = handle.status();
    assert!(st.pages_used <= 12);
    assert_eq!(st.running, 0);
}

#[test]
fn log_probabilities_are_the_models_beside_requests_without_them() {
    let (model, reference) = fixture_model();
    let layers = cpu_layers(&model);
    let cfg = config(DecodeStrategy::Tree(MergeCollective::Auto));
    let case = &reference["prompts"][2];
    let prompt: Vec<u32> = serde_json::from_value(case["token_ids"].clone()).unwrap();
    let greedy: Vec<u32> = serde_json::from_value(case["greedy_tokens"].clone()).unwrap();
    let logits: Vec<f64> = serde_json::from_value(case["logits_last"].clone()).unwrap();
    let log_total = logits.iter().map(|x| x.exp()).sum::<f64>().ln();
    with_engine(&model, &layers, 1, &cfg, |h| {
        let plain = submit(h, &prompt[..5], 12, 1, None);
        let with = submit_with(h, &prompt, 12, 2, None, (Some(4), None));
        let mut drawn = vec![Vec::new(); 2];
        let mut finished = 0;
        while finished < 2 {
            match with
                .recv_timeout(Duration::from_secs(120))
                .expect("an event")
            {
                Event::Token {
                    sample,
                    token,
                    logprobs,
                    ..
                } => drawn[sample].push((token, logprobs.expect("asked for"))),
                Event::Finished { .. } => finished += 1,
                Event::Started { .. } | Event::PromptLogprobs { .. } => {}
                Event::Failed(e) => panic!("{e}"),
            }
        }
        for sample in &drawn {
            let tokens: Vec<u32> = sample.iter().map(|(t, _)| *t).collect();
            assert_eq!(tokens, greedy[..12]);
            // The first token's against transformers' logits of the prompt's last row.
            let first = &sample[0].1;
            assert_eq!(first.top.len(), 4);
            for &(t, lp) in &first.top {
                let want = logits[t as usize] - log_total;
                assert!(
                    (f64::from(lp) - want).abs() < 1e-4,
                    "{t}: {lp} against {want}"
                );
            }
            let mut by_logit: Vec<usize> = (0..logits.len()).collect();
            by_logit.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
            let top: Vec<usize> = first.top.iter().map(|&(t, _)| t as usize).collect();
            assert_eq!(top, by_logit[..4]);
            // A greedy token is its row's most likely, and probabilities are at most 1.
            for (token, lp) in sample {
                assert_eq!((lp.top[0].0, lp.top[0].1), (*token, lp.logprob));
                assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1 && w[0].1 <= 0.0));
            }
        }
        // The request beside them reports none.
        let mut plain_tokens = 0;
        loop {
            match plain
                .recv_timeout(Duration::from_secs(120))
                .expect("an event")
            {
                Event::Token { logprobs, .. } => {
                    assert!(logprobs.is_none());
                    plain_tokens += 1;
                }
                Event::Finished { .. } => break,
                Event::Started { .. } => {}
                Event::PromptLogprobs { .. } => panic!("not asked for"),
                Event::Failed(e) => panic!("{e}"),
            }
        }
        assert_eq!(plain_tokens, 12);
        // The prompt's own log-probabilities, computed whole although the prompt is cached,
        // in chunks of the prefill; the first against transformers' logits of row 0.
        let whole = submit_with(h, &prompt, 2, 1, None, (None, Some(3)));
        let (mut cached, mut reported) = (None, Vec::new());
        loop {
            match whole
                .recv_timeout(Duration::from_secs(120))
                .expect("an event")
            {
                Event::Started { cached_tokens } => cached = Some(cached_tokens),
                Event::PromptLogprobs { sample, logprobs } => {
                    assert_eq!(sample, 0);
                    reported.extend(logprobs);
                }
                Event::Token { logprobs, .. } => {
                    assert!(logprobs.is_none());
                    assert_eq!(
                        reported.len(),
                        prompt.len() - 1,
                        "all before the first token"
                    );
                }
                Event::Finished { .. } => break,
                Event::Failed(e) => panic!("{e}"),
            }
        }
        assert_eq!(cached, Some(0));
        let row0: Vec<f64> = serde_json::from_value(case["logits_pos0"].clone()).unwrap();
        let total0 = row0.iter().map(|x| x.exp()).sum::<f64>().ln();
        let want = row0[prompt[1] as usize] - total0;
        assert!((f64::from(reported[0].logprob) - want).abs() < 1e-4);
        for (lp, &next) in reported.iter().zip(&prompt[1..]) {
            assert_eq!(lp.top.len(), 3);
            assert!(lp.logprob <= lp.top[0].1 + 1e-6, "{next}: {lp:?}");
            assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
        }
    });
}
