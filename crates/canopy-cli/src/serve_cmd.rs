//! `canopy serve`: an OpenAI-compatible server over the continuous-batching engine.
//!
//! The model's ranks run the engine ([`canopy_runtime::serving::serve`]) on this thread and
//! its rank threads (or as MPI processes, rank 0 serving HTTP); the HTTP side (tokio + axum,
//! `canopy-server`) runs on a runtime of its own and talks to rank 0 through the engine's
//! handle. SIGTERM or Ctrl-C drains: new requests get 503, the running ones finish, then the
//! server exits.

use crate::bench::{BackendKind, World};
use crate::generate_cmd::PAGE_SIZE;
use crate::ranks::{Placed, RankThreads, WeightSource};
use anyhow::{bail, Context, Result};
use canopy_core::Method;
use canopy_cuda::CudaBackend;
use canopy_engine::CpuBackend;
use canopy_model::{Model, Tokenizer};
use canopy_runtime::serving::{channel, EngineHandle, EngineInbox, Front, ServeConfig};
use canopy_server::{AppState, Metrics};
use clap::Args;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    run: crate::ranks::ModelRunArgs,
    /// The address to listen on (loopback: only this machine can connect).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// The port to listen on (0: any free port; the one taken is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
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
    /// Prompt tokens prefilled per step, between decode steps.
    #[arg(long, default_value_t = 512, value_parser = crate::bench::at_least_one)]
    prefill_chunk: usize,
    /// Requests waiting for admission, at most; past it, 429.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Request bodies larger than this many bytes get 413.
    #[arg(long, default_value_t = 4 << 20)]
    max_body: usize,
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long)]
    api_key: Option<String>,
    /// The model's name in the API [default: the file or directory name].
    #[arg(long)]
    served_model_name: Option<String>,
}

pub fn run(a: ServeArgs) -> Result<()> {
    let crate::ranks::OpenedRun {
        world,
        ranks,
        kind,
        model,
        dtype,
        path,
    } = a.run.open()?;
    let capacity = model.config.max_position_embeddings;
    let max_context = a.max_context.unwrap_or(capacity);
    if max_context > capacity {
        bail!("--max-context {max_context} exceeds the model's {capacity} positions");
    }
    let kv_tokens = a.kv_tokens.unwrap_or(4 * max_context);
    let config = ServeConfig {
        strategy: a.run.strategy(),
        method: a.method,
        page_size: PAGE_SIZE,
        kv_dtype: dtype,
        pages_per_rank: kv_tokens.div_ceil(PAGE_SIZE as usize * ranks) as u32,
        max_batch: a.max_batch,
        max_context,
        prefill_chunk: a.prefill_chunk,
    };
    let name = a.served_model_name.clone().unwrap_or_else(|| {
        path.file_name()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned())
    });
    let Model {
        config: model_config,
        weights,
        tokenizer,
        chat_template,
        ..
    } = model;
    let tokenizer = Arc::new(tokenizer);
    let weight_bytes = weights.size_bytes() as u64;
    let needs = |here: usize| Ok(config.needs(&model_config, dtype, weight_bytes, here)?);
    let (handle, inbox) = channel(config.limits(ranks), a.max_queue);
    let rank0 = is_rank0(&world);
    let http = rank0
        .then(|| {
            let state = AppState {
                engine: handle.clone(),
                tokenizer: tokenizer.clone(),
                template: chat_template.map(Arc::new),
                model: name,
                vocab: model_config.vocab_size,
                api_key: a.api_key.clone(),
                metrics: Metrics::default(),
                created: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
            };
            Http::start(&a.host, a.port, state, a.max_body, handle.clone())
        })
        .transpose()?;
    let inbox = Mutex::new(rank0.then_some(inbox));
    let rank = RankWork {
        inbox: &inbox,
        tokenizer: &tokenizer,
        stop_tokens: &model_config.eos_token_ids,
        config: &config,
    };
    let source = WeightSource::Loaded(weights);
    let ready = || {
        if let Some(h) = &http {
            h.ready(&handle);
        }
    };
    let served = match kind {
        BackendKind::Cpu => {
            let backend = |_| Ok(CpuBackend);
            let placed = Placed::new(&world, ranks, 1, &backend, &model_config, source, &needs)?;
            ready();
            rank.serve(&world, ranks, &placed)
        }
        BackendKind::Cuda => {
            let gpus = canopy_cuda::probe::device_count()?;
            let backend = |ordinal: usize| -> Result<CudaBackend> {
                Ok(CudaBackend::new(ordinal)?.with_paging(PAGE_SIZE)?)
            };
            let placed = Placed::new(&world, ranks, gpus, &backend, &model_config, source, &needs)?;
            ready();
            rank.serve(&world, ranks, &placed)
        }
    };
    // The engine has stopped (drained, or on an error): the HTTP side finishes its streams.
    if let Some(h) = http {
        h.stop()?;
    }
    served
}

/// What every rank of this process shares.
struct RankWork<'a> {
    /// Rank 0's: the handles' commands.
    inbox: &'a Mutex<Option<EngineInbox>>,
    tokenizer: &'a Tokenizer,
    stop_tokens: &'a [u32],
    config: &'a ServeConfig,
}

impl RankWork<'_> {
    /// Every rank of this process serves until rank 0's engine stops.
    fn serve<B: RankThreads>(&self, world: &World, ranks: usize, placed: &Placed<B>) -> Result<()> {
        placed.run(world, ranks, &|backend, layers, comm| {
            let inbox = (comm.rank() == 0)
                .then(|| self.inbox.lock().expect("inbox lock").take())
                .flatten();
            let front = inbox.map(|inbox| Front {
                inbox,
                tokenizer: self.tokenizer,
                stop_tokens: self.stop_tokens.to_vec(),
            });
            comm.serve(backend, layers, self.config, front)
        })?;
        Ok(())
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
}

impl Http {
    /// Binds `host:port` and starts serving; requests wait in the engine's queue until the
    /// engine runs.
    fn start(
        host: &str,
        port: u16,
        state: AppState,
        max_body: usize,
        handle: EngineHandle,
    ) -> Result<Http> {
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
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let server = runtime.spawn(canopy_server::serve(
            listener,
            Arc::new(state),
            max_body,
            async move {
                let _ = stopped.wait_for(|&s| s).await;
            },
        ));
        // SIGTERM or Ctrl-C: drain (new requests get 503, the running ones finish).
        runtime.spawn(async move {
            shutdown_signal().await;
            eprintln!("canopy serve: draining (new requests get 503)");
            handle.drain();
        });
        Ok(Http {
            runtime,
            server,
            stop,
            addr,
        })
    }

    /// Says where the server listens, once the model is on its devices.
    fn ready(&self, handle: &EngineHandle) {
        let limits = handle.limits();
        eprintln!(
            "canopy serve: listening on http://{} (context {} tokens, KV cache {} tokens)",
            self.addr,
            limits.max_context,
            limits.pages * limits.page_size
        );
    }

    /// Stops accepting, and waits for the responses in flight.
    fn stop(self) -> Result<()> {
        let _ = self.stop.send(true);
        self.runtime
            .block_on(self.server)
            .context("the HTTP server")?
            .context("the HTTP server")?;
        Ok(())
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {},
                    _ = term.recv() => {},
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
