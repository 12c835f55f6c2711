//! `canopy serve`: an OpenAI-compatible server over the continuous-batching engine.
//!
//! The model's ranks run the engine ([`canopy_runtime::serving::serve`]) on this thread and
//! its rank threads (or as MPI processes, rank 0 serving HTTP); the HTTP side (tokio + axum,
//! `canopy-server`) runs on a runtime of its own and talks to rank 0 through the engine's
//! handle. SIGTERM or Ctrl-C drains: new requests get 503, the running ones finish, then the
//! server exits. A second signal, or `--drain-timeout` seconds of draining, cancels the requests
//! still in flight (their clients are told) and the server exits with a failure.

use crate::bench::{BackendKind, World};
use crate::generate_cmd::PAGE_SIZE;
use crate::ranks::{ModelSource, Placed, RankThreads};
use anyhow::{bail, Context, Result};
use canopy_core::Method;
use canopy_cuda::CudaBackend;
use canopy_engine::CpuBackend;
use canopy_model::Tokenizer;
use canopy_runtime::serving::{
    channel, EngineHandle, EngineInbox, Front, ServeConfig, WarmUp, WarmUpEnd,
};
use canopy_runtime::DEFAULT_PREFILL_CHUNK;
use canopy_server::{Abort, AppState, FloorFacts, Metrics};
use clap::builder::RangedU64ValueParser;
use clap::Args;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The CPU's `--prefill-chunk` default: a step's prompt tokens there take long enough to stall
/// the running streams visibly.
const CPU_PREFILL_CHUNK: usize = 512;

/// `--drain-timeout`'s default: long enough for most answers to finish, and a bound on a
/// drain that a client's long request (or one that stopped reading) would hold open.
const DRAIN_TIMEOUT_S: u64 = 60;

/// `--max-body`'s least value. The smallest requests are tens of bytes, but a chat with a
/// system prompt and its sampling fields takes hundreds, and a limit below that refuses every
/// useful request with the 413 meant for oversized ones; 1 KiB admits such a request.
const MIN_MAX_BODY: u64 = 1024;

/// How long the server waits, once it has cancelled the requests in flight, for the engine's
/// step and the HTTP side to end before it exits anyway: a step of a large model on the CPU,
/// or a client that reads nothing, does not hold the process.
const ABORT_GRACE: Duration = Duration::from_secs(5);

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// The address to listen on (loopback: only this machine can connect).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// The port to listen on (0: any free port; the one taken is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Request bodies larger than this many bytes get 413 [default: 32 bytes a token of
    /// --max-context, at least 4 MiB; at least 1 KiB].
    #[arg(long, value_parser = RangedU64ValueParser::<usize>::new().range(MIN_MAX_BODY..))]
    max_body: Option<usize>,
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long, value_parser = api_key)]
    api_key: Option<String>,
    /// The model's name in the API [default: the file or directory name, or the shape's].
    #[arg(long)]
    served_model_name: Option<String>,
    /// Seconds a drain (SIGTERM or Ctrl-C) waits for the requests in flight; then, or at a
    /// second signal, they are cancelled (a stream ends with an error event and `[DONE]`, a
    /// whole request gets a 503) and the server exits with a failure.
    #[arg(long, value_name = "SECONDS", default_value_t = DRAIN_TIMEOUT_S)]
    drain_timeout: u64,
}

/// The engine's options: the model and where it runs, and how requests are batched. `serve`
/// and `bench serve`'s own server take the same.
#[derive(Args)]
pub struct EngineArgs {
    #[command(flatten)]
    run: crate::ranks::ModelRunArgs,
    /// Planner of each rank's part of the live KV tree (q-guided reads each request's KV on
    /// its own; the tree planners read shared prefixes once).
    #[arg(long, default_value = "auto")]
    method: Method,
    /// The longest context (prompt and max_tokens) of a request [default: the model's].
    #[arg(long)]
    max_context: Option<usize>,
    /// KV tokens of every rank's pool together [default: 4 × --max-context].
    #[arg(long)]
    kv_tokens: Option<usize>,
    /// The most sample rows decoded in one step.
    #[arg(long, default_value_t = 64, value_parser = crate::bench::at_least_one)]
    max_batch: usize,
    /// Prompt tokens prefilled per step, at most (the step's chunks run together, beside the
    /// step's decode rows, which wait for them) [default: 8192 on a GPU, where a pass of fewer
    /// rows reads the weights for less work; 512 on the CPU, where a step's prompt tokens hold
    /// the running streams longest].
    #[arg(long, value_parser = crate::bench::at_least_one)]
    prefill_chunk: Option<usize>,
    /// Requests waiting for admission, at most; past it, 429. At least 1: a request's prompts
    /// each wait there, so a queue of none would refuse every request.
    #[arg(long, default_value_t = 256, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    max_queue: usize,
    /// Run every decode step kernel by kernel, never replaying a recorded CUDA graph.
    #[arg(long)]
    eager: bool,
}

/// Where the HTTP side listens and what it accepts.
pub struct HttpOptions {
    pub host: String,
    pub port: u16,
    /// `None`: [`default_max_body`] of the engine's longest context.
    pub max_body: Option<usize>,
    pub api_key: Option<String>,
    pub served_model_name: Option<String>,
    /// How long a drain begun by a signal waits for the requests in flight before it cancels
    /// them.
    pub drain_timeout: Duration,
}

impl HttpOptions {
    /// Any free loopback port, `serve`'s defaults otherwise.
    pub fn loopback() -> HttpOptions {
        HttpOptions {
            host: "127.0.0.1".into(),
            port: 0,
            max_body: None,
            api_key: None,
            served_model_name: None,
            drain_timeout: Duration::from_secs(DRAIN_TIMEOUT_S),
        }
    }
}

/// The largest request body a server of `max_context` tokens accepts by default: a prompt
/// that fills the context, sent as token ids (up to 7 bytes each in a JSON array) or as text
/// escaped to `\uXXXX` (6 bytes a character), within 32 bytes a token; never under 4 MiB.
pub fn default_max_body(max_context: usize) -> usize {
    max_context.saturating_mul(32).max(4 << 20)
}

/// Parses `--api-key`, refusing a key that no `Authorization` header can carry, since with
/// one every route but /health would answer 401 to every request: an empty or blank key, one
/// with whitespace at either end (a header's value is read without it), or one with
/// characters other than visible ASCII and spaces (all a header value holds as text).
fn api_key(key: &str) -> Result<String, String> {
    if key.trim().is_empty() {
        return Err(
            "the key is empty; give a key for clients to send, or leave --api-key out to serve without one"
                .into(),
        );
    }
    if key.trim() != key {
        return Err(
            "the key starts or ends with whitespace, which no Authorization header carries".into(),
        );
    }
    if let Some(c) = key.chars().find(|&c| !c.is_ascii_graphic() && c != ' ') {
        return Err(format!(
            "the key holds {c:?}; an Authorization header carries visible ASCII characters and spaces only"
        ));
    }
    Ok(key.to_string())
}

pub fn run(a: ServeArgs) -> Result<()> {
    let http = HttpOptions {
        host: a.host,
        port: a.port,
        max_body: a.max_body,
        api_key: a.api_key,
        served_model_name: a.served_model_name,
        drain_timeout: Duration::from_secs(a.drain_timeout),
    };
    serve(&a.engine, http, |_, _| {})
}

/// Serves until the engine is drained (SIGTERM, Ctrl-C, or a caller's
/// [`EngineHandle::drain`]) or fails; a drain that had to cancel requests in flight (a second
/// signal, or the drain's timeout) is an error. On rank 0, `ready(address, handle)` is called
/// once the model is on its devices: on the CPU before the engine takes its first step, on a
/// GPU once the engine has run its warm-up request ([`WarmUp`]). Requests sent earlier wait in
/// the queue.
pub fn serve(
    e: &EngineArgs,
    http: HttpOptions,
    ready: impl FnOnce(std::net::SocketAddr, &EngineHandle) + Send,
) -> Result<()> {
    let crate::ranks::OpenedRun {
        world,
        ranks,
        kind,
        model,
        dtype,
    } = e.run.open()?;
    crate::bench::note_eager_unused(kind, e.eager);
    let capacity = model.config.max_position_embeddings;
    let max_context = e.max_context.unwrap_or(capacity);
    if max_context > capacity {
        bail!("--max-context {max_context} exceeds the model's {capacity} positions");
    }
    if max_context < 2 {
        bail!("--max-context {max_context} leaves no room for a request: one needs a prompt token and a token to generate");
    }
    let kv_tokens = e.kv_tokens.unwrap_or(4 * max_context);
    if kv_tokens < max_context {
        bail!("--kv-tokens {kv_tokens} holds less than one request of --max-context {max_context} tokens: raise --kv-tokens or lower --max-context");
    }
    let config = ServeConfig {
        strategy: e.run.strategy(),
        method: e.method,
        page_size: PAGE_SIZE,
        kv_dtype: dtype,
        pages_per_rank: kv_tokens.div_ceil(PAGE_SIZE as usize * ranks) as u32,
        max_batch: e.max_batch,
        max_context,
        prefill_chunk: e.prefill_chunk.unwrap_or(match kind {
            BackendKind::Cpu => CPU_PREFILL_CHUNK,
            BackendKind::Cuda => DEFAULT_PREFILL_CHUNK,
        }),
        graphs: !e.eager,
        // Padded rows pay for themselves where steps replay recorded passes: on a GPU.
        pad_rows: !e.eager && kind == BackendKind::Cuda,
    };
    let ModelSource {
        name,
        config: model_config,
        weights: source,
        tokenizer,
        chat_template,
        ..
    } = model;
    let tokenizer = Arc::new(tokenizer);
    let weight_bytes = model_config.weight_bytes(dtype);
    let needs = |here: usize| Ok(config.needs(&model_config, dtype, here)?);
    let (handle, inbox) = channel(config.limits(ranks), e.max_queue);
    let rank0 = is_rank0(&world);
    if !rank0 {
        ignore_stop_signals();
    }
    let cuda = |ordinal: usize| -> Result<CudaBackend> {
        Ok(CudaBackend::new(ordinal)?.with_paging(PAGE_SIZE)?)
    };
    let http = rank0
        .then(|| -> Result<Http> {
            // Rank 0 runs on device 0: its decode passes' floor is priced at its bandwidth.
            let copy_bandwidth = match kind {
                BackendKind::Cpu => None,
                BackendKind::Cuda => Some(canopy_cuda::bench::measure_copy_bandwidth(&cuda(0)?)?),
            };
            let abort = Abort::new();
            let state = AppState {
                engine: handle.clone(),
                tokenizer: tokenizer.clone(),
                template: chat_template.map(Arc::new),
                model: http.served_model_name.clone().unwrap_or(name),
                vocab: model_config.vocab_size,
                api_key: http.api_key.clone(),
                metrics: Metrics::new(FloorFacts {
                    weight_bytes,
                    copy_bandwidth,
                }),
                created: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
                body_limit: http.max_body.unwrap_or(default_max_body(max_context)),
                abort: abort.clone(),
            };
            let stop = Stop {
                handle: handle.clone(),
                abort,
                drain_timeout: http.drain_timeout,
            };
            Http::start(&http.host, http.port, state, stop)
        })
        .transpose()?;
    let inbox = Mutex::new(rank0.then_some(inbox));
    // On a GPU every rank first runs its products at the row counts its steps will run.
    let warm_up_rows = match kind {
        BackendKind::Cpu => 0,
        BackendKind::Cuda => config.most_step_rows(),
    };
    let rank = RankWork {
        inbox: &inbox,
        tokenizer: &tokenizer,
        stop_tokens: &model_config.eos_token_ids,
        config: &config,
        warm_up_rows,
    };
    let ready = || {
        if let Some(h) = &http {
            h.ready(&handle);
            ready(h.addr, &handle);
        }
    };
    let served = match kind {
        BackendKind::Cpu => {
            let backend = |_| Ok(CpuBackend);
            let placed = Placed::new(
                &world,
                ranks,
                1,
                &backend,
                &model_config,
                source.as_ref(),
                &needs,
            )?;
            ready();
            rank.serve(&world, ranks, &placed)
        }
        BackendKind::Cuda => {
            let gpus = canopy_cuda::probe::device_count()?;
            let placed = Placed::new(
                &world,
                ranks,
                gpus,
                &cuda,
                &model_config,
                source.as_ref(),
                &needs,
            )?;
            // Clients are told the server is ready once its warm-up has run.
            let warm_up = match &http {
                Some(_) => Some(WarmUp::submit(
                    &handle,
                    config.prefill_chunk,
                    model_config.vocab_size,
                )?),
                None => None,
            };
            std::thread::scope(|s| {
                s.spawn(|| match warm_up.map(WarmUp::wait) {
                    Some(WarmUpEnd::Stopped) => {}
                    Some(WarmUpEnd::Failed(reason)) => {
                        eprintln!("canopy serve: the warm-up request failed: {reason}");
                        ready();
                    }
                    Some(WarmUpEnd::Done) | None => ready(),
                });
                let served = rank.serve(&world, ranks, &placed);
                // An engine that never took the inbox leaves the warm-up queued there: dropped
                // with it, so the thread above stops waiting.
                drop(inbox.lock().unwrap_or_else(|p| p.into_inner()).take());
                served
            })
        }
    };
    // The engine has stopped (drained, or on an error): the HTTP side finishes its streams.
    let stopped = http.map(Http::stop).transpose();
    served?;
    stopped?;
    Ok(())
}

/// What every rank of this process shares.
struct RankWork<'a> {
    /// Rank 0's: the handles' commands.
    inbox: &'a Mutex<Option<EngineInbox>>,
    tokenizer: &'a Tokenizer,
    stop_tokens: &'a [u32],
    config: &'a ServeConfig,
    /// Each rank runs its products at the row counts of up to this many rows before it
    /// serves (none on the CPU).
    warm_up_rows: usize,
}

impl RankWork<'_> {
    /// Every rank of this process serves until rank 0's engine stops.
    fn serve<B: RankThreads>(&self, world: &World, ranks: usize, placed: &Placed<B>) -> Result<()> {
        placed.run(
            world,
            ranks,
            self.config.strategy,
            &|backend, layers, comm| {
                // Taken first: a rank 0 that fails below drops it, and with it what waits.
                let inbox = (comm.rank() == 0)
                    .then(|| self.inbox.lock().expect("inbox lock").take())
                    .flatten();
                // Up to a step's decode rows and prompt chunks' last rows.
                let logit_rows = 2 * self.config.max_batch;
                comm.warm_up_products(backend, layers, self.warm_up_rows, logit_rows)?;
                let front = inbox.map(|inbox| Front {
                    inbox,
                    tokenizer: self.tokenizer,
                    stop_tokens: self.stop_tokens.to_vec(),
                });
                comm.serve(backend, layers, self.config, front)
            },
        )?;
        Ok(())
    }
}

/// A rank other than 0 (an MPI process of its own) ignores SIGTERM and SIGINT while it
/// serves: it stops at rank 0's stop step, once rank 0 has drained, so that a signal sent to
/// every process of the job (its process group, its container) drains the server rather than
/// end the ranks whose part of the KV cache rank 0's requests still read. SIGKILL, which
/// Open MPI's mpirun sends a few seconds after the SIGTERM with which it ends a job, still
/// ends it.
fn ignore_stop_signals() {
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to "ignore" runs no code of ours in a handler.
    unsafe {
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
        libc::signal(libc::SIGINT, libc::SIG_IGN);
    }
}

fn is_rank0(world: &World) -> bool {
    match world {
        World::Threads => true,
        #[cfg(feature = "mpi")]
        World::Mpi(comm) => canopy_comm::Group::rank(comm) == 0,
    }
}

/// The HTTP side: a tokio runtime on threads of its own, serving until the engine stops.
struct Http {
    runtime: tokio::runtime::Runtime,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    stop: tokio::sync::watch::Sender<bool>,
    addr: std::net::SocketAddr,
    /// Set once the requests in flight were cancelled.
    abort: Abort,
}

/// How a signal stops the server: the engine's handle drains, then `abort` cancels what is
/// still in flight after `drain_timeout` or at a second signal.
struct Stop {
    handle: EngineHandle,
    abort: Abort,
    drain_timeout: Duration,
}

impl Http {
    /// Binds `host:port` and starts serving; requests wait in the engine's queue until the
    /// engine runs.
    fn start(host: &str, port: u16, state: AppState, stop: Stop) -> Result<Http> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("canopy-http")
            .enable_all()
            .build()
            .context("starting the HTTP runtime")?;
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind((host, port)))
            .with_context(|| format!("listening on {host}:{port}"))?;
        let addr = listener.local_addr()?;
        let (stopping, mut stopped) = tokio::sync::watch::channel(false);
        let server = runtime.spawn(canopy_server::serve(
            listener,
            Arc::new(state),
            async move {
                let _ = stopped.wait_for(|&s| s).await;
            },
        ));
        let abort = stop.abort.clone();
        runtime.spawn(stop.on_signals());
        Ok(Http {
            runtime,
            server,
            stop: stopping,
            addr,
            abort,
        })
    }

    /// Says where the server listens, once the model is on its devices (and warmed up).
    fn ready(&self, handle: &EngineHandle) {
        let limits = handle.limits();
        eprintln!(
            "canopy serve: listening on http://{} (context {} tokens, KV cache {} tokens)",
            self.addr,
            limits.max_context,
            limits.pages * limits.page_size
        );
    }

    /// Stops accepting, and waits for the responses in flight; an error if they were
    /// cancelled.
    fn stop(self) -> Result<()> {
        let _ = self.stop.send(true);
        self.runtime
            .block_on(self.server)
            .context("the HTTP server")?
            .context("the HTTP server")?;
        if self.abort.is_aborted() {
            bail!("stopped before the requests in flight finished: a second signal or --drain-timeout cancelled them");
        }
        Ok(())
    }
}

impl Stop {
    /// SIGTERM or Ctrl-C drains: new requests get 503, the running ones finish. A second
    /// signal, or the drain's timeout, cancels those still in flight; if they have not ended
    /// within [`ABORT_GRACE`] (or at a third signal), the process exits at once.
    async fn on_signals(self) {
        let mut signals = StopSignals::new();
        signals.next().await;
        eprintln!(
            "canopy serve: draining (new requests get 503; a second signal, or {} s, cancels the requests in flight)",
            self.drain_timeout.as_secs()
        );
        self.handle.drain();
        let why = tokio::select! {
            () = signals.next() => "a second signal",
            () = tokio::time::sleep(self.drain_timeout) => "the drain timed out",
        };
        eprintln!("canopy serve: {why}: cancelling the requests in flight");
        self.abort.abort();
        tokio::select! {
            () = signals.next() => {}
            () = tokio::time::sleep(ABORT_GRACE) => {}
        }
        eprintln!("canopy serve: the requests in flight have not ended; exiting now");
        std::process::exit(1);
    }
}

/// SIGTERM and SIGINT (Ctrl-C), each registered once for the server's life: every signal
/// after the first is seen too, and none falls back to the default action of ending the
/// process at once.
struct StopSignals {
    #[cfg(unix)]
    term: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    int: Option<tokio::signal::unix::Signal>,
}

impl StopSignals {
    #[cfg(unix)]
    fn new() -> StopSignals {
        use tokio::signal::unix::{signal, SignalKind};
        StopSignals {
            term: signal(SignalKind::terminate()).ok(),
            int: signal(SignalKind::interrupt()).ok(),
        }
    }

    #[cfg(not(unix))]
    fn new() -> StopSignals {
        StopSignals {}
    }

    /// The next SIGTERM or SIGINT (never, where neither could be registered).
    #[cfg(unix)]
    async fn next(&mut self) {
        async fn one(signal: &mut Option<tokio::signal::unix::Signal>) {
            if let Some(s) = signal {
                if s.recv().await.is_some() {
                    return;
                }
            }
            std::future::pending().await
        }
        tokio::select! {
            () = one(&mut self.term) => {}
            () = one(&mut self.int) => {}
        }
    }

    /// The next Ctrl-C (never, where it could not be registered).
    #[cfg(not(unix))]
    async fn next(&mut self) {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{default_max_body, ServeArgs};
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    /// `canopy serve`'s arguments, or clap's refusal of them as it prints it.
    fn parse(args: &[&str]) -> Result<ServeArgs, String> {
        let argv = std::iter::once("serve").chain(args.iter().copied());
        Cli::try_parse_from(argv)
            .map(|c| c.serve)
            .map_err(|e| e.to_string())
    }

    /// A key no client could send is refused at start, with the reason; others are kept as
    /// given.
    #[test]
    fn keys_no_header_carries_are_refused() {
        for (key, reason) in [
            ("", "the key is empty"),
            ("  \t", "the key is empty"),
            (" sk-a", "whitespace"),
            ("sk-a\n", "whitespace"),
            ("sk-\u{e9}", "visible ASCII"),
        ] {
            let e = parse(&["--api-key", key]).err().unwrap_or_default();
            assert!(
                e.contains("--api-key") && e.contains(reason),
                "{key:?}: {e}"
            );
        }
        for key in ["sk-local", "a b"] {
            let a = parse(&["--api-key", key]).unwrap();
            assert_eq!(a.api_key.as_deref(), Some(key));
        }
        assert_eq!(parse(&[]).unwrap().api_key, None);
    }

    /// A queue of no requests, or a body limit under 1 KiB, is refused at start; the least
    /// values pass.
    #[test]
    fn an_empty_queue_and_a_tiny_body_limit_are_refused() {
        for args in [
            ["--max-queue", "0"],
            ["--max-body", "0"],
            ["--max-body", "1023"],
        ] {
            let e = parse(&args).err().unwrap_or_default();
            assert!(
                e.contains(args[0]) && e.contains("is not in"),
                "{args:?}: {e}"
            );
        }
        let a = parse(&["--max-queue", "1", "--max-body", "1024"]).unwrap();
        assert_eq!((a.engine.max_queue, a.max_body), (1, Some(1024)));
        let a = parse(&[]).unwrap();
        assert_eq!((a.engine.max_queue, a.max_body), (256, None));
    }

    /// The default body limit admits a prompt that fills the context, as a JSON array of
    /// token ids of the largest vocabularies, and stays at 4 MiB for short contexts.
    #[test]
    fn the_default_body_limit_admits_a_full_context() {
        assert_eq!(default_max_body(8192), 4 << 20);
        for context in [131_072usize, 1 << 20, 10 << 20] {
            let ids = format!("[{}]", vec!["262143"; context].join(","));
            let body = format!(r#"{{"prompt": {ids}, "max_tokens": 1}}"#);
            assert!(body.len() <= default_max_body(context), "{context}");
        }
    }
}
