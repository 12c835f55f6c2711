//! The ranks of a model run in this process: one backend per rank, the weights uploaded once
//! per device and shared by the ranks on it, and the world the ranks exchange through —
//! threads or one MPI process per rank. On GPUs the buffers move by NCCL where every rank has
//! a GPU of its own, on the device where the ranks share one GPU, and through the host
//! otherwise (more ranks than GPUs, or no NCCL); on the CPU through the host. `generate`, `serve` and `bench decode` run their ranks here, and
//! `generate` and `serve` find their model here ([`ModelSource`]: a model on disk, or a shape
//! with random weights for timing).

use crate::bench::World;
use anyhow::Result;
use canopy_comm::{Collective, ThreadWorld};
use canopy_cuda::{CudaBackend, DeviceWorld, NcclIds, NcclTransport};
use canopy_engine::{CpuBackend, LayerOps, ModelNeeds, NodeLayout, Strategy, Transport};
use canopy_model::{LlamaConfig, WeightSource};
use canopy_runtime::serving::{Front, ServeConfig};
use canopy_runtime::{generate, GenerateRequest, Generated, ModelLayers, RandomWeights, Watch};
use std::time::Duration;

/// How long a rank waits for its peers before giving up.
const RANK_TIMEOUT: Duration = Duration::from_secs(600);

/// Where a model's weights come from: its file, read a matrix at a time for each device's
/// upload, or values drawn at random per matrix, for timing a shape without its weights.
pub type ModelWeights = Box<dyn WeightSource>;

/// One rank thread's view of its world: the calls a rank makes with whichever transport
/// the world gives it.
pub trait RankComm<B: LayerOps> {
    fn rank(&self) -> usize;
    fn generate(
        &self,
        backend: &B,
        layers: &ModelLayers<B>,
        req: &GenerateRequest,
        watch: &mut dyn Watch,
    ) -> Result<Generated>;
    /// Runs the products at a server's row counts, each the way rank 0 timed fastest
    /// ([`canopy_runtime::serving::warm_up_products`]).
    fn warm_up_products(
        &self,
        backend: &B,
        layers: &ModelLayers<B>,
        max_rows: usize,
        logit_rows: usize,
    ) -> Result<()>;
    /// Serves requests until rank 0's engine stops (rank 0 gives the `front`).
    fn serve(
        &self,
        backend: &B,
        layers: &ModelLayers<B>,
        config: &ServeConfig,
        front: Option<Front<'_>>,
    ) -> Result<()>;
}

impl<B: LayerOps, C: Collective + Transport<B>> RankComm<B> for C {
    fn rank(&self) -> usize {
        canopy_comm::Group::rank(self)
    }

    fn generate(
        &self,
        backend: &B,
        layers: &ModelLayers<B>,
        req: &GenerateRequest,
        watch: &mut dyn Watch,
    ) -> Result<Generated> {
        Ok(generate(backend, layers, req, self, watch)?)
    }

    fn warm_up_products(
        &self,
        backend: &B,
        layers: &ModelLayers<B>,
        max_rows: usize,
        logit_rows: usize,
    ) -> Result<()> {
        Ok(canopy_runtime::serving::warm_up_products(
            backend, layers, self, max_rows, logit_rows,
        )?)
    }

    fn serve(
        &self,
        backend: &B,
        layers: &ModelLayers<B>,
        config: &ServeConfig,
        front: Option<Front<'_>>,
    ) -> Result<()> {
        Ok(canopy_runtime::serving::serve(
            backend, layers, self, config, front,
        )?)
    }
}

/// A rank's work: given its backend, the layers on its device and its transport.
pub type RankBody<'a, B, T> =
    dyn Fn(&B, &ModelLayers<B>, &dyn RankComm<B>) -> Result<T> + Sync + 'a;

/// How a backend's ranks exchange its buffers: as threads of one process, or as this
/// process's rank of an MPI world.
pub trait RankThreads: LayerOps + Sized {
    /// Runs a thread per backend of `backends` (rank `r` on `backends[r]`; they sit on
    /// `devices` devices), with a transport for `strategy`; `body(rank, comm)` is each one's
    /// work.
    fn run_threads<T: Send>(
        backends: &[Self],
        devices: usize,
        strategy: Strategy,
        body: &(dyn Fn(usize, &dyn RankComm<Self>) -> Result<T> + Sync),
    ) -> Vec<Result<T>>;

    /// Runs `body` as this process's rank of `comm`, on `backend` (one of `devices`).
    #[cfg(feature = "mpi")]
    fn run_mpi<T>(
        comm: &canopy_comm::MpiComm,
        backend: &Self,
        devices: usize,
        strategy: Strategy,
        body: &dyn Fn(&dyn RankComm<Self>) -> Result<T>,
    ) -> Result<T>;
}

/// Host threads, or MPI's own calls.
impl RankThreads for CpuBackend {
    fn run_threads<T: Send>(
        backends: &[Self],
        _: usize,
        _: Strategy,
        body: &(dyn Fn(usize, &dyn RankComm<Self>) -> Result<T> + Sync),
    ) -> Vec<Result<T>> {
        // Each rank's host ops run on its share of the threads, the rank's own among them.
        host_threads(backends.len(), &|rank, comm| {
            canopy_engine::host_ops::work_in_own_pool(backends.len());
            body(rank, comm)
        })
    }

    #[cfg(feature = "mpi")]
    fn run_mpi<T>(
        comm: &canopy_comm::MpiComm,
        _: &Self,
        _: usize,
        _: Strategy,
        body: &dyn Fn(&dyn RankComm<Self>) -> Result<T>,
    ) -> Result<T> {
        canopy_engine::host_ops::work_in_own_pool(1);
        body(comm)
    }
}

/// NCCL where every rank has a GPU of its own; ranks that share one GPU exchange buffers on
/// it (streams of one context); more ranks than GPUs, or no NCCL, stage them through the
/// host.
impl RankThreads for CudaBackend {
    fn run_threads<T: Send>(
        backends: &[Self],
        devices: usize,
        strategy: Strategy,
        body: &(dyn Fn(usize, &dyn RankComm<Self>) -> Result<T> + Sync),
    ) -> Vec<Result<T>> {
        let ranks = backends.len();
        if ranks > 1 && devices == 1 {
            return DeviceWorld::run(ranks, RANK_TIMEOUT, |comm| {
                body(canopy_comm::Group::rank(&comm), &comm)
            });
        }
        if ranks > devices {
            HOST_STAGING.call_once(|| crate::launcher::note(format_args!(
                "{ranks} ranks on {devices} GPUs: NCCL takes one rank a GPU, so the ranks exchange through the host; run at most {devices} ranks, or all of them on one GPU (CUDA_VISIBLE_DEVICES), to exchange on the devices"
            )));
        }
        if ranks == 1 || ranks > devices || !nccl_usable() {
            return host_threads(ranks, body);
        }
        canopy_cuda::nccl::connect_at_init();
        let ids = match NcclIds::new(1) {
            Ok(ids) => ids,
            Err(e) => return vec![Err(e.into())],
        };
        ThreadWorld::run(ranks, RANK_TIMEOUT, |host| {
            let r = canopy_comm::Group::rank(&host);
            let layout = NodeLayout::single(ranks);
            let comm =
                NcclTransport::new(&host, &backends[r], &ids, layout, strategy, RANK_TIMEOUT)?;
            canopy_cuda::nccl::noting_failure(r, body(r, &comm))
        })
    }

    #[cfg(feature = "mpi")]
    fn run_mpi<T>(
        comm: &canopy_comm::MpiComm,
        backend: &Self,
        devices: usize,
        strategy: Strategy,
        body: &dyn Fn(&dyn RankComm<Self>) -> Result<T>,
    ) -> Result<T> {
        use canopy_comm::Group;
        // NCCL needs a GPU per rank: the busiest node's ranks must not outnumber its GPUs.
        let busiest = comm.busiest_node_ranks()?;
        if comm.size() > 1 && busiest > devices {
            HOST_STAGING.call_once(|| crate::launcher::note(format_args!(
                "{busiest} processes on a node of {devices} GPU(s): NCCL takes one process a GPU, so the ranks exchange through MPI on the host; start at most {devices} a node, or run the ranks as threads of one process (--ranks), to exchange on the devices"
            )));
        }
        if comm.size() == 1 || busiest > devices || !nccl_usable() {
            return body(comm);
        }
        canopy_cuda::nccl::connect_at_init();
        let layout = canopy_engine::strategy::node_layout(comm, None)?;
        let ids = NcclIds::from_rank0(comm, layout.nodes())?;
        let nccl = NcclTransport::new(comm, backend, &ids, layout, strategy, RANK_TIMEOUT)?;
        body(&nccl)
    }
}

/// `ranks` threads exchanging through the host; `body(rank, comm)` is each one's work.
fn host_threads<B: LayerOps, T: Send>(
    ranks: usize,
    body: &(dyn Fn(usize, &dyn RankComm<B>) -> Result<T> + Sync),
) -> Vec<Result<T>> {
    ThreadWorld::run(ranks, RANK_TIMEOUT, |comm| {
        body(canopy_comm::Group::rank(&comm), &comm)
    })
}

/// Why GPUs' ranks stage their buffers through the host is noted once a process: a bench runs
/// its ranks several times (warm-ups, rank counts), for one reason.
static HOST_STAGING: std::sync::Once = std::sync::Once::new();

/// Whether NCCL can be loaded; without it, GPUs' ranks stage their buffers through the host
/// (with a note, once a process).
fn nccl_usable() -> bool {
    let present = canopy_cuda::probe::nccl_present();
    if !present {
        HOST_STAGING.call_once(|| crate::launcher::note("NCCL (libnccl.so.2) could not be loaded: the GPUs' ranks exchange through the host; install NCCL for device-to-device merges"));
    }
    present
}

/// This process's ranks: a backend each, and one copy of the weights per device.
pub struct Placed<B: LayerOps> {
    backends: Vec<B>,
    devices: usize,
    layers: Vec<(usize, ModelLayers<B>)>,
}

impl<B: RankThreads> Placed<B> {
    /// Backends for this process's ranks of a world of `ranks` (rank `r` on device
    /// `r % devices`, made by `backend(device)`); each device used is checked against
    /// `needs(ranks on it)`, then gets the weights.
    pub fn new(
        world: &World,
        ranks: usize,
        devices: usize,
        backend: &dyn Fn(usize) -> Result<B>,
        config: &LlamaConfig,
        weights: &dyn WeightSource,
        needs: &dyn Fn(usize) -> Result<ModelNeeds>,
    ) -> Result<Placed<B>> {
        let devices = devices.max(1);
        // The ranks of this process, by the index that places them on a device: every rank
        // for threads; under MPI this process's, by its rank on its node.
        let local: Vec<usize> = match world {
            World::Threads => (0..ranks).collect(),
            #[cfg(feature = "mpi")]
            World::Mpi(comm) => vec![comm.local_rank()],
        };
        let mut used: Vec<usize> = local.iter().map(|&r| r % devices).collect();
        used.sort_unstable();
        used.dedup();
        let backends = local
            .iter()
            .map(|&r| backend(r % devices))
            .collect::<Result<Vec<B>>>()?;
        let mut layers = Vec::new();
        for &device in &used {
            let here = local.iter().filter(|&&r| r % devices == device).count();
            let first = local
                .iter()
                .position(|&r| r % devices == device)
                .expect("a used device has a rank");
            let b = &backends[first];
            b.check_model(&needs(here)?.on_device_holding(here, ranks))?;
            let bar = upload_bar(config.num_hidden_layers, b.name(), device);
            let mut tick = |_| bar.inc(1);
            let uploaded = ModelLayers::upload(b, config, weights, &mut tick)?;
            bar.finish_and_clear();
            layers.push((device, uploaded));
        }
        Ok(Placed {
            backends,
            devices,
            layers,
        })
    }

    /// The layers on rank `rank`'s device.
    fn layers_of(&self, rank: usize) -> &ModelLayers<B> {
        &self
            .layers
            .iter()
            .find(|(d, _)| *d == rank % self.devices)
            .expect("every device used has its layers")
            .1
    }

    /// Runs `body` on the first `ranks` ranks (threads), or on this MPI rank, over a
    /// transport for `strategy`; returns rank 0's result (`None` on other MPI ranks). Every
    /// rank's error is reported.
    pub fn run<T: Send>(
        &self,
        world: &World,
        ranks: usize,
        strategy: Strategy,
        body: &RankBody<B, T>,
    ) -> Result<Option<T>> {
        match world {
            World::Threads => {
                let devices = self.devices.min(ranks);
                let results =
                    B::run_threads(&self.backends[..ranks], devices, strategy, &|r, comm| {
                        body(&self.backends[r], self.layers_of(r), comm)
                    });
                let mut results = results.into_iter();
                let first = results.next().expect("one rank at least")?;
                for r in results {
                    r?;
                }
                Ok(Some(first))
            }
            #[cfg(feature = "mpi")]
            World::Mpi(comm) => {
                let me = canopy_comm::Group::rank(comm);
                let backend = &self.backends[0];
                let layers = self.layers_of(comm.local_rank());
                let out = B::run_mpi(comm, backend, self.devices, strategy, &|c| {
                    body(backend, layers, c)
                })?;
                Ok((me == 0).then_some(out))
            }
        }
    }
}

/// Progress of a weight upload, a layer per step.
fn upload_bar(layers: usize, backend: &str, device: usize) -> indicatif::ProgressBar {
    let bar = canopy_model::progress_bar(layers as u64, format!("uploading to {backend} {device}"));
    bar.set_message("layers");
    bar
}

/// The options of a command that runs a model over ranks (`generate`, `serve`, `bench serve`):
/// which model, on which backend and dtype, over how many ranks started how, and how the ranks
/// combine their attention.
#[derive(clap::Args, Debug)]
pub struct ModelRunArgs {
    /// A Hugging Face model directory or a `.gguf` file [default: SmolLM2-135M-Instruct,
    /// fetched into $CANOPY_MODEL_CACHE or ~/.cache/canopy/models on first use].
    #[arg(long, conflicts_with = "arch")]
    pub model: Option<std::path::PathBuf>,
    /// A model shape without its weights, for timing: llama-3.1-8b, llama-3.2-3b, llama-3.2-1b
    /// or smollm2-135m (needs --random-weights). Its tokenizer is a stand-in, one token per
    /// character (see `Tokenizer::code_points`), and it has no chat template.
    #[arg(long, requires = "random_weights")]
    pub arch: Option<String>,
    /// Random weights of the model's shape instead of its own: what it says means nothing.
    /// With --arch, a preset shape's; otherwise the model's (--model, or the default one),
    /// whose config, tokenizer and chat template are read as usual but not its weights.
    #[arg(long)]
    pub random_weights: bool,
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: crate::bench::BackendChoice,
    /// The dtype of the weights and the KV cache (arithmetic is fp32) [default: f32 on the
    /// CPU, bf16 on a GPU].
    #[arg(long)]
    pub dtype: Option<canopy_core::DType>,
    /// Ranks the KV cache is sharded over: threads of this process [default: 1]; under mpirun
    /// or srun, the world size.
    #[arg(long)]
    pub ranks: Option<usize>,
    /// How ranks combine their attention at decode.
    #[arg(long, value_enum, default_value = "tree")]
    pub strategy: crate::generate_cmd::DecodeChoice,
    /// The tree's merge: allreduce3, allreduce2, allgather, hierarchical or auto. On GPUs of
    /// one host that map each other's memory, allgather runs as one kernel over that memory
    /// (`CANOPY_PEER_MERGE=off`: NCCL's all-gather).
    #[arg(long, default_value = "auto")]
    pub collective: canopy_engine::MergeCollective,
    /// How ranks are started: threads of this process, or one process per rank (detected
    /// under mpirun/srun).
    #[arg(long, value_enum)]
    pub launcher: Option<crate::bench::Launcher>,
}

/// What [`ModelRunArgs::open`] found: the world and its rank count, the backend, and the model
/// in its dtype.
pub struct OpenedRun {
    pub world: World,
    pub ranks: usize,
    pub kind: crate::bench::BackendKind,
    pub model: ModelSource,
    pub dtype: canopy_core::DType,
}

/// A model to run: its shape, where its weights come from, its tokenizer and chat template.
pub struct ModelSource {
    /// The file or directory name, or the shape's.
    pub name: String,
    /// Where it was read from (`None` for a shape).
    pub path: Option<std::path::PathBuf>,
    pub config: LlamaConfig,
    pub weights: ModelWeights,
    pub tokenizer: canopy_model::Tokenizer,
    pub chat_template: Option<canopy_model::ChatTemplate>,
}

impl ModelSource {
    /// The model at `path` (the default model, fetched if need be, when none), or the shape
    /// `arch`; with `random` (required for a shape), random weights drawn from `seed` instead
    /// of its own. A shape's tokenizer is the code-point stand-in, its context its preset's.
    pub fn open(
        path: Option<&std::path::Path>,
        arch: Option<&str>,
        random: bool,
        dtype: canopy_core::DType,
        seed: u64,
    ) -> Result<ModelSource> {
        use anyhow::Context;
        if let Some(arch) = arch {
            anyhow::ensure!(
                random,
                "a shape (--arch {arch}) has no weights: add --random-weights"
            );
            let config = canopy_model::preset(arch)?;
            return Ok(ModelSource {
                weights: Box::new(RandomWeights::new(&config, dtype, seed)),
                name: arch.to_string(),
                path: None,
                tokenizer: canopy_model::Tokenizer::code_points(config.vocab_size)?,
                config,
                chat_template: None,
            });
        }
        let path = match path {
            Some(p) => p.to_path_buf(),
            None => canopy_model::default_model().context("fetching the default model")?,
        };
        let model = canopy_model::Model::load(&path, dtype)
            .with_context(|| format!("loading the model at {}", path.display()))?;
        let weights: ModelWeights = if random {
            Box::new(RandomWeights::new(&model.config, dtype, seed))
        } else {
            Box::new(model.weights)
        };
        Ok(ModelSource {
            name: path
                .file_name()
                .map_or("model".into(), |n| n.to_string_lossy().into_owned()),
            path: Some(path),
            config: model.config,
            weights,
            tokenizer: model.tokenizer,
            chat_template: model.chat_template,
        })
    }

    /// The chat template, or why there is none.
    pub fn chat_template(&self) -> Result<&canopy_model::ChatTemplate> {
        Ok(self
            .chat_template
            .as_ref()
            .ok_or(canopy_model::ModelError::NoChatTemplate)?)
    }
}

/// The seed of random weights: any gives the same timing.
const RANDOM_WEIGHTS_SEED: u64 = 0;

impl ModelRunArgs {
    /// The world, the backend and the model (see [`ModelSource::open`]) in the dtype asked
    /// for or the one the backend prefers: f32 on the CPU, bf16 on CUDA.
    pub fn open(&self) -> Result<OpenedRun> {
        let world = World::new(self.launcher)?;
        let ranks = world.ranks(self.ranks, 1)?;
        let kind = crate::bench::resolve_backend(self.backend)?;
        let collective_set = self.collective != canopy_engine::MergeCollective::Auto;
        if self.strategy == crate::generate_cmd::DecodeChoice::Ring {
            crate::bench::note_no_effect(
                &[("--collective", collective_set)],
                "the ring passes KV blocks from rank to rank and merges no partials across ranks",
            );
        } else if ranks == 1 {
            crate::bench::note_no_effect(
                &[("--collective", collective_set)],
                "one rank has no partials of other ranks to merge (--ranks P takes it)",
            );
        }
        let dtype = self.dtype.unwrap_or(match kind {
            crate::bench::BackendKind::Cpu => CpuBackend.preferred_dtype(),
            crate::bench::BackendKind::Cuda => canopy_core::DType::Bf16,
        });
        let model = ModelSource::open(
            self.model.as_deref(),
            self.arch.as_deref(),
            self.random_weights,
            dtype,
            RANDOM_WEIGHTS_SEED,
        )?;
        Ok(OpenedRun {
            world,
            ranks,
            kind,
            model,
            dtype,
        })
    }

    /// The decode strategy the options name.
    pub fn strategy(&self) -> canopy_runtime::DecodeStrategy {
        match self.strategy {
            crate::generate_cmd::DecodeChoice::Tree => {
                canopy_runtime::DecodeStrategy::Tree(self.collective)
            }
            crate::generate_cmd::DecodeChoice::Ring => canopy_runtime::DecodeStrategy::Ring,
        }
    }
}
