//! [`CudaBackend`]: the engine's [`Backend`] on one GPU, and its configuration.
//!
//! KV lives in device memory, contiguous or paged ([`crate::kv`]: a pool of fixed-size pages
//! behind a page table, the layout the radix cache uses; pages are deliberately shuffled so
//! tests catch any kernel that ignores the table). Plans are uploaded once as flat arrays
//! ([`crate::descriptors`]: group descriptors, KV ranges, query lists, masks, CSR map), after
//! re-splitting their groups so that the decode kernel keeps every SM busy.
//!
//! Stage 1 runs on CUDA cores or tensor cores; [`KernelChoice`] picks per plan. `decode_partial`
//! (CUDA cores) streams KV at the copy bandwidth for groups of one or a few query rows; a step
//! is that kernel then the merge: `merge_partials` (one warp per query × head), or
//! `merge_partials_wide` (a CTA per query × head) where few cells have many rows each — a
//! short batch over long contexts cut into many pieces. On tensor cores
//! (mma.sync), groups whose queries × GQA rows share their KV — the tree methods' groups — run
//! on `decode_partial_mma`: one launch of CTAs cut and ordered by
//! [`canopy_core::geometry::cut_for_gpu`], many rows of one KV head (up to 64) or one warp per
//! KV head (groups of up to 16 rows, four heads per CTA), then the merge. Kernels are loaded
//! and launched through [`crate::launch`]; timing is [`crate::timing`].

use crate::compile::arch_for;
use crate::descriptors::{
    room, write_extents, CudaPlan, CutPlan, HostPlan, WordLayout, MASK_ROOM_PIECE,
    PARTIAL_ROOM_PIECE,
};
use crate::error::{CudaError, DriverContext, Result};
use crate::kv::{CudaKv, Paging};
use crate::launch::Params;
use crate::probe::{device_count, nvrtc_present, GpuInfo};
use canopy_comm::Collective;
use canopy_core::geometry::{
    cuda_core_slots, cut_for_cuda_cores, cut_for_gpu, cut_slots, max_cta_rows, merge_is_wide,
    runs_on_tensor_cores, tensor_cores_fit, MAX_CTAS_PER_SM,
};
use canopy_core::{AttnShape, AttnStates, DType, Plan, Tail, TypedVec};
use canopy_engine::{Backend, Cache};
use canopy_kernels::{
    dtype_code, rows_config, Kernel, MmaPipeline, DECODE_THREADS, DEEP_MERGE_CTAS, MERGE_WARPS,
    MMA_THREADS, WIDE_MERGE_DIMS, WIDE_MERGE_THREADS,
};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtrMut, LaunchConfig,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub(crate) type EResult<T> = canopy_engine::Result<T>;

/// Resident merge warps per SM at the deep variant's occupancy ([`DEEP_MERGE_CTAS`] CTAs of
/// [`MERGE_WARPS`]). A merge of at most this many cells per SM runs deep: all its warps are
/// resident either way, and each keeps 8 rows' loads in flight instead of 4. On H100 that took
/// FastTree's tree 8 at 32/8 (10 queries, dozens of rows each) from 37.7 to 32.6 µs; on plans
/// of thousands of queries, where half the resident warps hide less latency, it cost up to
/// 9 µs.
const DEEP_MERGE_CELLS_PER_SM: usize = DEEP_MERGE_CTAS * MERGE_WARPS;

/// A pipeline the tensor-core kernel is written for, or why not.
fn check_pipeline(pipeline: MmaPipeline) -> Result<MmaPipeline> {
    if !pipeline.is_supported() {
        return Err(CudaError::Unsupported(format!(
            "tensor-core pipeline of {}-token tiles in {} stages: tiles are 32 or 64 tokens, stages 2, 3 or 4",
            pipeline.tile, pipeline.stages
        )));
    }
    Ok(pipeline)
}

/// The merge kernel for `cells` (query, head) cells of `head_dim` elements on a GPU of
/// `multiprocessors` SMs: the wide one where its CTAs fit in one wave, so that each cell's rows
/// are walked by a CTA at once (one bf16 query at 32 q / 8 kv heads x 128 and 32K: 55.9 µs
/// against 80.5 with the deep warp merge; at 9 q / 3 kv heads x 64: 15.9 against 28.5, H100,
/// session 15). Past one wave its fixed latency is paid per wave: FastTree's tree 0 at 32/8 (64
/// queries of a few rows, 8192 CTAs) took 41.6 µs with a first form of it against 20.8 with the
/// deep merge. `rounded`: its entry that also writes the outputs rounded.
fn merge_kernel(cells: usize, head_dim: usize, multiprocessors: usize, rounded: bool) -> Kernel {
    if merge_is_wide(cells, head_dim, multiprocessors) {
        return Kernel::MergeWide { rounded };
    }
    Kernel::Merge {
        deep: cells <= DEEP_MERGE_CELLS_PER_SM * multiprocessors,
        rounded,
    }
}

/// Which stage-1 kernel runs a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum KernelChoice {
    /// Tensor cores where some group of a plan has several query rows (two where the KV heads
    /// come in fours), CUDA cores otherwise.
    #[default]
    Auto,
    /// The CUDA-core kernel (`decode_partial`) for every plan.
    Simt,
    /// The tensor-core kernel (`decode_partial_mma`) wherever the dtype and head dim allow.
    Mma,
}

impl KernelChoice {
    pub const ALL: [KernelChoice; 3] = [KernelChoice::Auto, KernelChoice::Simt, KernelChoice::Mma];

    pub fn name(self) -> &'static str {
        match self {
            KernelChoice::Auto => "auto",
            KernelChoice::Simt => "simt",
            KernelChoice::Mma => "mma",
        }
    }
}

impl std::str::FromStr for KernelChoice {
    type Err = CudaError;
    fn from_str(s: &str) -> Result<Self> {
        KernelChoice::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                CudaError::Unsupported(format!("unknown kernel `{s}`: use auto, simt or mma"))
            })
    }
}

/// The engine's backend on one GPU.
pub struct CudaBackend {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) gpu: GpuInfo,
    pub(crate) arch: String,
    pub(crate) functions: Mutex<HashMap<Kernel, CudaFunction>>,
    page_size: Option<u32>,
    waves: u32,
    max_ctas_per_sm: Option<u32>,
    kernel: KernelChoice,
    pub(crate) pipeline: MmaPipeline,
    /// Free device memory when the backend was created.
    free_at_start: usize,
    /// Written over (or read) before each timed step that must find the caches cold, and the
    /// clean sweep's sink; allocated on first use.
    pub(crate) flush: Mutex<Option<(CudaSlice<u8>, CudaSlice<u32>)>>,
    /// The dense layers' cuBLAS handle and scratch, made on first use.
    pub(crate) layers: crate::layers::LayerState,
    /// Recording decode passes: whether one is being captured, and the epoch of what they read.
    pub(crate) graph: crate::graph::GraphState,
    /// The page-locked buffers weights are uploaded through, made on first use.
    pub(crate) staging: Mutex<Option<crate::staging::Staging>>,
    /// The tail walks' device buffers, kept between steps.
    pub(crate) walk_scratch: Mutex<crate::layers::WalkScratch>,
}

pub struct CudaQueries {
    pub(crate) q: CudaSlice<f32>,
    pub(crate) rows: usize,
}

/// Device states: `rows × heads × head_dim` outputs and `rows × heads` lse.
pub struct CudaStates {
    pub(crate) rows: usize,
    pub(crate) heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) o: CudaSlice<f32>,
    pub(crate) lse: CudaSlice<f32>,
}

impl CudaBackend {
    /// A backend on GPU `ordinal`, or a clear error if the driver, NVRTC or GPU is missing.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::DeviceOutOfRange { ordinal, count });
        }
        if !nvrtc_present() {
            return Err(CudaError::NoNvrtc);
        }
        let ctx = CudaContext::new(ordinal).ctx(format!("creating a context on GPU {ordinal}"))?;
        // One stream per backend orders everything; per-buffer event tracking would only add
        // event records and waits to every launch.
        // SAFETY: no buffers exist yet on this context.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().ctx("cuStreamCreate")?;
        let gpu = GpuInfo::read(&ctx)?;
        let arch = arch_for(gpu.compute_capability);
        let (free_at_start, _) = ctx.mem_get_info().ctx("cuMemGetInfo")?;
        Ok(CudaBackend {
            free_at_start,
            ctx,
            stream,
            gpu,
            arch,
            functions: Mutex::new(HashMap::new()),
            waves: 1,
            max_ctas_per_sm: Some(MAX_CTAS_PER_SM as u32),
            kernel: KernelChoice::Auto,
            pipeline: MmaPipeline::default(),
            page_size: None,
            flush: Mutex::new(None),
            layers: Default::default(),
            graph: Default::default(),
            staging: Mutex::new(None),
            walk_scratch: Mutex::default(),
        })
    }

    /// Stores KV in pages of `page_size` tokens (a power of two from 16 to 256).
    pub fn with_paging(mut self, page_size: u32) -> Result<CudaBackend> {
        if !(16..=256).contains(&page_size) || !page_size.is_power_of_two() {
            return Err(CudaError::Unsupported(format!(
                "page size {page_size} must be a power of two from 16 to 256"
            )));
        }
        self.page_size = Some(page_size);
        Ok(self)
    }

    /// Splits plans into `waves` waves of resident CTAs (default 1): more, smaller CTAs shorten
    /// the tail where a few CTAs finish alone, at the cost of more partial rows.
    pub fn with_waves(mut self, waves: u32) -> CudaBackend {
        self.waves = waves.max(1);
        self
    }

    /// Plans for at most `n` resident CTAs per SM (default 4; `None`: as many as fit).
    pub fn with_ctas_per_sm(mut self, n: Option<u32>) -> CudaBackend {
        self.max_ctas_per_sm = n;
        self
    }

    /// Which stage-1 kernel runs plans (default: auto).
    pub fn with_kernel(mut self, kernel: KernelChoice) -> CudaBackend {
        self.kernel = kernel;
        self
    }

    /// How the tensor-core kernels stream KV (default: [`MmaPipeline::default`]).
    pub fn with_mma_pipeline(mut self, pipeline: MmaPipeline) -> Result<CudaBackend> {
        self.pipeline = check_pipeline(pipeline)?;
        Ok(self)
    }

    pub fn gpu(&self) -> &GpuInfo {
        &self.gpu
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Whether plans of `shape` whose largest group has `max_rows` rows run on tensor cores
    /// (given 16-bit KV). The default choice is `auto`'s device model's too.
    fn tensor_cores_for(&self, shape: &AttnShape, max_rows: usize) -> bool {
        match self.kernel {
            KernelChoice::Simt => false,
            KernelChoice::Mma => tensor_cores_fit(shape),
            KernelChoice::Auto => runs_on_tensor_cores(shape, max_rows),
        }
    }

    /// `plan` cut for this GPU and laid out as the kernels read it.
    fn cut_plan(&self, shape: &AttnShape, plan: &Plan) -> Result<CutPlan> {
        let max_rows = max_cta_rows(plan, shape);
        let tensor_cores = self.tensor_cores_for(shape, max_rows);
        let rows = rows_config(max_rows);
        // One balanced wave: as many CTAs as fit on the GPU at once, or fewer where more measured
        // slower (`cut_slots`, `cuda_core_slots`). The plan is uploaded before it meets its KV,
        // so the bf16 kernel's occupancy stands for every dtype: the f16 and f32 variants use
        // the same shared memory and no more registers (compiler resource report), so their true
        // occupancy is never lower and the wave never spills into a second.
        let res = if tensor_cores {
            self.mma_resources(DType::Bf16, shape.head_dim)?
        } else {
            self.decode_resources(DType::Bf16, shape.head_dim, rows)?
        };
        let per_sm = res
            .ctas_per_sm
            .min(self.max_ctas_per_sm.unwrap_or(u32::MAX))
            .max(1) as usize;
        let sms = self.gpu.multiprocessors as usize;
        let waves = self.waves as usize;
        let (plan, items) = if tensor_cores {
            cut_for_gpu(plan, shape, cut_slots(plan, shape, sms, per_sm) * waves)
        } else {
            let slots = cuda_core_slots(max_rows, sms, per_sm) * waves;
            (cut_for_cuda_cores(plan, shape, slots), Vec::new())
        };
        Ok(CutPlan {
            layout: WordLayout::of(&plan, &items),
            plan,
            items,
            rows,
            tensor_cores,
        })
    }

    /// A cut plan uploaded into buffers of its own, with room for larger plans to be written
    /// over it ([`WordLayout::with_room`]). A recorded pass that read the plan it replaces is
    /// stale: its owner ([`RankAttention`](canopy_engine::RankAttention)) says so by its
    /// generation, so no graph epoch moves here.
    fn upload_cut(&self, cut: CutPlan) -> Result<CudaPlan> {
        self.refuse_while_capturing("a plan")?;
        let layout = WordLayout::with_room(&cut.layout);
        let host = HostPlan::lay_out(&cut.plan, &cut.items, layout);
        // SAFETY: every element is written before the buffer is read.
        let mut staging = unsafe { self.ctx.alloc_pinned::<u32>(host.words.len().max(1)) }
            .ctx("cuMemHostAlloc")?;
        staging.as_mut_slice().ctx("cuEventSynchronize")?[..host.words.len()]
            .copy_from_slice(&host.words);
        let mut words = self.alloc::<u32>(host.words.len())?;
        self.stream
            .memcpy_htod(&staging, &mut words)
            .ctx("cuMemcpyHtoD")?;
        Ok(CudaPlan {
            rows: cut.rows,
            tensor_cores: cut.tensor_cores,
            direct: cut.plan.rows_are_queries(),
            words,
            staging,
            layout: host.layout,
            partial_room: room(cut.plan.num_partial_rows(), PARTIAL_ROOM_PIECE),
            masks: self.upload_with_room(&host.masks, MASK_ROOM_PIECE)?,
            shared: host.shared,
            plan: cut.plan,
            items: cut.items,
        })
    }

    /// An uploaded plan rewritten in place: its staging buffer (already rewritten) copied
    /// over its words by one asynchronous copy, and `masks` written over its masks, in place
    /// while they fit. The plan's buffers keep their addresses.
    fn send_rewritten(&self, p: &mut CudaPlan, masks: &[u64]) -> Result<()> {
        self.stream
            .memcpy_htod(&p.staging, &mut p.words)
            .ctx("cuMemcpyHtoD")?;
        self.write_or_grow(masks, &mut p.masks, "a plan's masks")
    }

    pub(crate) fn alloc<T: cudarc::driver::DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        // SAFETY: every buffer is written (upload, kernel or poison) before it is read, but an
        // activation's padding rows, whose products are computed and never read
        // (`product_rows`); the host never reads device memory it has not written.
        unsafe { self.stream.alloc::<T>(len.max(1)) }.ctx(format!(
            "allocating {} bytes",
            len * std::mem::size_of::<T>()
        ))
    }

    /// Refuses page tables of pages other than this backend's (`with_paging`).
    fn check_page_size(&self, page_size: u32) -> Result<()> {
        match self.page_size {
            None => Err(CudaError::Unsupported(format!(
                "this CUDA backend stores KV contiguously; create it with with_paging({page_size}) to read KV through page tables"
            ))),
            Some(size) if size != page_size => Err(CudaError::Unsupported(format!(
                "a page table of {page_size}-token pages for KV paged in {size}-token pages; create the backend with with_paging({page_size})"
            ))),
            Some(_) => Ok(()),
        }
    }

    /// `host` written over the front of `buf`, which keeps its address (a recorded pass then
    /// reads the new values) while `host` fits; else `buf` is replaced by a buffer of the next
    /// power of two, which moves the graph epoch. Stream order puts the write after the
    /// kernels queued before that read `buf`.
    pub(crate) fn write_or_grow<T: cudarc::driver::DeviceRepr>(
        &self,
        host: &[T],
        buf: &mut CudaSlice<T>,
        what: &str,
    ) -> Result<()> {
        self.refuse_while_capturing(what)?;
        if host.len() > buf.len() {
            self.renew(what)?;
            *buf = self.alloc::<T>(host.len().next_power_of_two())?;
        }
        if !host.is_empty() {
            self.stream
                .memcpy_htod(host, &mut buf.slice_mut(..host.len()))
                .ctx("cuMemcpyHtoD")?;
        }
        Ok(())
    }

    /// The merge of `partials` by `plan` into `out`, which also writes `out`'s outputs rounded
    /// to a 16-bit dtype into `rounded` where given (`rows × heads · head_dim` elements).
    pub(crate) fn merge_rounded(
        &self,
        partials: &CudaStates,
        plan: &CudaPlan,
        out: &mut CudaStates,
        rounded: Option<(&CudaSlice<u16>, DType)>,
    ) -> Result<()> {
        let nq = plan.plan.num_queries() as u32;
        if out.rows != nq as usize {
            return Err(CudaError::Unsupported(format!(
                "output has {} rows for {nq} queries",
                out.rows
            )));
        }
        if nq == 0 {
            return Ok(());
        }
        let cells = nq as usize * partials.heads;
        let sms = self.gpu.multiprocessors as usize;
        let kernel = merge_kernel(cells, partials.head_dim, sms, rounded.is_some());
        let f = self.function(kernel)?;
        let (heads, d) = (partials.heads as i32, partials.head_dim as i32);
        let s = &self.stream;
        let mut params = Params::default()
            .buffer(&partials.o, s)
            .buffer(&partials.lse, s)
            .buffer(&plan.words.slice(plan.layout.query_ptr.clone()), s)
            .buffer(&plan.words.slice(plan.layout.query_rows.clone()), s)
            .buffer(&out.o, s)
            .buffer(&out.lse, s)
            .u32(nq)
            .i32(heads)
            .i32(d);
        if let Some((buf, dtype)) = rounded {
            params = params.buffer(buf, s).u32(dtype_code(dtype));
        }
        let cfg = match kernel {
            Kernel::MergeWide { .. } => LaunchConfig {
                grid_dim: ((cells * partials.head_dim / WIDE_MERGE_DIMS) as u32, 1, 1),
                block_dim: (WIDE_MERGE_THREADS as u32, 1, 1),
                shared_mem_bytes: 0,
            },
            _ => LaunchConfig {
                grid_dim: (cells.div_ceil(MERGE_WARPS) as u32, 1, 1),
                block_dim: (MERGE_WARPS as u32 * 32, 1, 1),
                shared_mem_bytes: 0,
            },
        };
        // SAFETY: the arguments are the merge kernels' parameters, in order, and live through
        // the call; the CSR rows index the partial buffers; `rounded` holds the output's
        // elements (the caller's word).
        unsafe { self.launch_dependent(&f, cfg, &params) }
            .ctx(format!("launching {}", kernel.entry()))?;
        Ok(())
    }

    pub(crate) fn upload<T: cudarc::driver::DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        self.upload_into(host, host.len())
    }

    /// `host` uploaded into a buffer with room for what later writes in place may add: a
    /// quarter more, rounded up to whole `piece`s, and one piece at least.
    fn upload_with_room<T: cudarc::driver::DeviceRepr>(
        &self,
        host: &[T],
        piece: usize,
    ) -> Result<CudaSlice<T>> {
        self.upload_into(host, room(host.len(), piece).max(piece))
    }

    fn upload_into<T: cudarc::driver::DeviceRepr>(
        &self,
        host: &[T],
        len: usize,
    ) -> Result<CudaSlice<T>> {
        self.refuse_while_capturing("a host upload")?;
        let mut d = self.alloc::<T>(len)?;
        if !host.is_empty() {
            self.stream
                .memcpy_htod(host, &mut d.slice_mut(..host.len()))
                .ctx("cuMemcpyHtoD")?;
        }
        Ok(d)
    }

    /// Free device memory on this GPU now.
    pub fn free_bytes(&self) -> Result<u64> {
        Ok(self.ctx.mem_get_info().ctx("cuMemGetInfo")?.0 as u64)
    }

    /// K and V storage for `tokens` tokens, in pages of `page_size` tokens behind a shuffled
    /// table, or contiguous.
    fn kv_storage(
        &self,
        shape: &AttnShape,
        dtype: DType,
        tokens: usize,
        page_size: Option<u32>,
    ) -> Result<CudaKv> {
        self.renew("a KV pool")?;
        let token_bytes = shape.kv_token_bytes(dtype);
        let (slots, paging) = match page_size {
            None => (tokens, None),
            Some(size) => {
                let pages = tokens.div_ceil(size as usize);
                // A fixed shuffle of the physical pages (multiplicative, coprime stride).
                let stride = (1..=pages.max(1))
                    .rev()
                    .find(|s| gcd(*s, pages.max(1)) == 1 && *s * 2 <= pages + 1)
                    .unwrap_or(1);
                let host: Vec<u32> = (0..pages)
                    .map(|i| ((i * stride + 3) % pages.max(1)) as u32)
                    .collect();
                let device = std::sync::Arc::new(self.upload(&host)?);
                (
                    pages * size as usize,
                    Some(Paging {
                        shift: size.trailing_zeros(),
                        host,
                        device,
                    }),
                )
            }
        };
        let bytes = slots * token_bytes;
        let free = self
            .ctx
            .mem_get_info()
            .map(|(free, _)| free)
            .unwrap_or(usize::MAX);
        if 2 * bytes > free {
            return Err(CudaError::Unsupported(format!(
                "{tokens} tokens of KV need {:.1} GiB but GPU {} has {:.1} GiB free; use more ranks or a shorter context",
                2.0 * bytes as f64 / (1u64 << 30) as f64,
                self.gpu.ordinal,
                free as f64 / (1u64 << 30) as f64
            )));
        }
        Ok(CudaKv {
            shape: *shape,
            dtype,
            tokens,
            k: self.alloc(bytes)?,
            v: self.alloc(bytes)?,
            paging,
        })
    }

    /// Device memory in use on this GPU beyond what was in use when the backend was created
    /// (buffers, NCCL's, and the kernels'): this rank's footprint while its buffers live.
    pub fn device_bytes_in_use(&self) -> Result<u64> {
        let (free, _) = self.ctx.mem_get_info().ctx("cuMemGetInfo")?;
        Ok(self.free_at_start.saturating_sub(free) as u64)
    }
}

impl Backend for CudaBackend {
    type Kv = CudaKv;
    type Queries = CudaQueries;
    type Plan = CudaPlan;
    type States = CudaStates;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn alloc_kv(&self, shape: &AttnShape, dtype: DType, tokens: usize) -> EResult<CudaKv> {
        Ok(self.kv_storage(shape, dtype, tokens, self.page_size)?)
    }

    /// Contiguous: NCCL moves each of K and V in one piece, with no pages gathered before or
    /// scattered after.
    fn alloc_ring_kv(&self, shape: &AttnShape, dtype: DType, tokens: usize) -> EResult<CudaKv> {
        Ok(self.kv_storage(shape, dtype, tokens, None)?)
    }

    fn kv_dtype(&self, kv: &CudaKv) -> DType {
        kv.dtype
    }

    fn write_kv(&self, kv: &mut CudaKv, start: usize, k: &TypedVec, v: &TypedVec) -> EResult<()> {
        if k.dtype() != kv.dtype || v.dtype() != kv.dtype || k.len() != v.len() {
            return Err(CudaError::Unsupported(format!(
                "write_kv wants K and V of {} of equal length",
                kv.dtype
            ))
            .into());
        }
        let per = kv.shape.kv_token_elems();
        if !k.len().is_multiple_of(per) || start + k.len() / per > kv.tokens {
            return Err(CudaError::Unsupported(format!(
                "write_kv of {} elements at token {start} does not fit {} tokens",
                k.len(),
                kv.tokens
            ))
            .into());
        }
        Ok(self.write_bytes(kv, start, k.as_bytes(), v.as_bytes())?)
    }

    /// Installs `table` through [`CudaBackend::set_page_table`], on KV paged in `page_size`
    /// tokens as this backend's ([`CudaBackend::with_paging`]).
    fn set_page_table(&self, kv: &mut CudaKv, page_size: u32, table: &[u32]) -> EResult<()> {
        self.check_page_size(page_size)?;
        Ok(CudaBackend::set_page_table(self, kv, table)?)
    }

    fn set_page_tables(&self, kvs: &mut [CudaKv], page_size: u32, table: &[u32]) -> EResult<()> {
        self.check_page_size(page_size)?;
        Ok(CudaBackend::set_page_tables(self, kvs, table)?)
    }

    fn upload_queries(&self, shape: &AttnShape, q: &[f32]) -> EResult<CudaQueries> {
        Ok(CudaQueries {
            q: self.upload(q)?,
            rows: q.len() / shape.q_row_elems(),
        })
    }

    fn upload_plan(&self, shape: &AttnShape, plan: &Plan) -> EResult<CudaPlan> {
        Ok(self.upload_cut(self.cut_plan(shape, plan)?)?)
    }

    fn replan(&self, shape: &AttnShape, p: &mut CudaPlan, new: &Plan) -> EResult<bool> {
        let cut = self.cut_plan(shape, new)?;
        // The kernels take the arrays at the layout's places, a CTA for every descriptor's
        // place (used or not), the kernel (tensor cores or not, and the CUDA cores' rows), the
        // queries and the merge's kind as launch arguments, and the partials as made: where
        // the new plan fits all of them, only the words change.
        let kernel = cut.tensor_cores == p.tensor_cores
            && cut.rows == p.rows
            && cut.plan.rows_are_queries() == p.direct;
        let arrays = p.layout.holds(&cut.layout);
        let queries = cut.plan.num_queries() == p.plan.num_queries();
        let partial_rows = cut.plan.num_partial_rows();
        // Masks that outgrow the room would make their buffer anew, which every recorded pass
        // of this backend reads through its epoch; a plan made anew moves only this
        // attention's generation.
        let host = (kernel && arrays && queries && partial_rows <= p.partial_room)
            .then(|| HostPlan::lay_out(&cut.plan, &cut.items, p.layout.clone()));
        let masks = host.as_ref().map(|h| h.masks.len());
        let Some(host) = host.filter(|h| h.masks.len() <= p.masks.len()) else {
            tracing::debug!(
                kernel,
                arrays,
                queries,
                partial_rows,
                partial_room = p.partial_room,
                masks,
                mask_room = p.masks.len(),
                "a plan made anew: it does not fit the buffers of the one it replaces"
            );
            *p = self.upload_cut(cut)?;
            return Ok(false);
        };
        self.refuse_while_capturing("a plan")?;
        // The wait is for the staging buffer's last copy, long done by now.
        let staging = p.staging.as_mut_slice().ctx("cuEventSynchronize")?;
        staging[..host.words.len()].copy_from_slice(&host.words);
        self.send_rewritten(p, &host.masks)?;
        p.plan = cut.plan;
        p.items = cut.items;
        p.shared = host.shared;
        Ok(true)
    }

    fn extend_plan(&self, p: &mut CudaPlan, tails: &[Tail]) -> EResult<()> {
        if tails.is_empty() {
            return Ok(());
        }
        p.plan.extend_tails(tails);
        p.plan.grow_shared_tokens(&mut p.shared, tails);
        // Same groups and CTAs: only token counts, range ends and masks change. The arrays
        // keep their lengths and places (masks grow), so the descriptors and ranges are
        // rewritten in the staging buffer, whose queries and CSR stay as uploaded, and one
        // asynchronous copy takes it over. The wait is for the staging buffer's last copy,
        // long done by now.
        let staging = p.staging.as_mut_slice().ctx("cuEventSynchronize")?;
        let masks = write_extents(&p.plan, &p.shared, &p.items, &p.layout, staging);
        // A masked group's new tokens set bits in its last block or add blocks.
        Ok(self.send_rewritten(p, &masks)?)
    }

    fn alloc_states(&self, shape: &AttnShape, rows: usize) -> EResult<CudaStates> {
        // A recorded pass reads the states of its attention, whose generation moves when they
        // are made anew.
        self.refuse_while_capturing("attention states")?;
        Ok(CudaStates {
            rows,
            heads: shape.q_heads,
            head_dim: shape.head_dim,
            o: self.alloc(rows * shape.q_row_elems())?,
            lse: self.alloc(rows * shape.q_heads)?,
        })
    }

    /// Room for the partial rows of plans written over this one ([`Backend::replan`]).
    fn alloc_partials(&self, shape: &AttnShape, plan: &CudaPlan) -> EResult<CudaStates> {
        self.alloc_states(shape, plan.partial_room)
    }

    fn poison(&self, s: &mut CudaStates) -> EResult<()> {
        for buf in [&mut s.o, &mut s.lse] {
            let bytes = buf.len() * 4;
            let (ptr, _sync) = buf.device_ptr_mut(&self.stream);
            // SAFETY: writes exactly the buffer's bytes; 0xFFFFFFFF is a NaN in f32.
            unsafe {
                cudarc::driver::result::memset_d8_async(ptr, 0xFF, bytes, self.stream.cu_stream())
            }
            .ctx("cuMemsetD8Async")?;
        }
        Ok(())
    }

    fn run_plan(
        &self,
        kv: &CudaKv,
        q: &CudaQueries,
        plan: &CudaPlan,
        partials: &mut CudaStates,
    ) -> EResult<()> {
        let shape = &kv.shape;
        if partials.rows < plan.plan.num_partial_rows() || q.rows < plan.plan.num_queries() {
            return Err(
                CudaError::Unsupported("partials or queries do not match the plan".into()).into(),
            );
        }
        if plan.plan.groups().is_empty() {
            return Ok(());
        }
        let tensor_cores = plan.uses_tensor_cores(kv.dtype);
        let (dtype, head_dim, kv_heads) = (kv.dtype, shape.head_dim, shape.kv_heads as u32);
        if !tensor_cores {
            let kernel = Kernel::Decode {
                dtype,
                head_dim,
                rows: plan.rows,
            };
            let cfg = LaunchConfig {
                grid_dim: (plan.layout.groups() as u32, kv_heads, 1),
                block_dim: (DECODE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            return self.launch_stage1(kernel, cfg, kv, q, plan, partials);
        }
        // Tensor cores: one CTA per descriptor of the cut plan.
        let kernel = Kernel::DecodeMma {
            dtype,
            head_dim,
            pipeline: self.pipeline,
        };
        let cfg = LaunchConfig {
            // A plan with groups has CTAs (an empty list is a one-word allocation: 0 here).
            grid_dim: (plan.layout.ctas() as u32, 1, 1),
            block_dim: (MMA_THREADS, 1, 1),
            shared_mem_bytes: self.pipeline.shared_bytes(head_dim) as u32,
        };
        self.launch_stage1(kernel, cfg, kv, q, plan, partials)
    }

    /// A plan whose partial rows are its queries in order (each query's whole context in one
    /// group: Q-guided's whole paths) skips the merge, which would only copy them: stage 1
    /// writes the output.
    fn step(
        &self,
        kv: &CudaKv,
        q: &CudaQueries,
        plan: &CudaPlan,
        partials: &mut CudaStates,
        out: &mut CudaStates,
    ) -> EResult<()> {
        if plan.direct {
            return self.run_plan(kv, q, plan, out);
        }
        self.run_plan(kv, q, plan, partials)?;
        self.merge(partials, plan, out)
    }

    fn merge(&self, partials: &CudaStates, plan: &CudaPlan, out: &mut CudaStates) -> EResult<()> {
        Ok(self.merge_rounded(partials, plan, out, None)?)
    }

    fn download(&self, s: &CudaStates) -> EResult<AttnStates> {
        let mut o = self.stream.clone_dtoh(&s.o).ctx("cuMemcpyDtoH")?;
        let mut lse = self.stream.clone_dtoh(&s.lse).ctx("cuMemcpyDtoH")?;
        self.stream.synchronize().ctx("cuStreamSynchronize")?;
        o.truncate(s.rows * s.heads * s.head_dim);
        lse.truncate(s.rows * s.heads);
        Ok(AttnStates {
            rows: s.rows,
            heads: s.heads,
            head_dim: s.head_dim,
            o,
            lse,
        })
    }

    /// Waits for this backend's stream (other ranks' streams on the GPU run on).
    fn synchronize(&self) -> EResult<()> {
        Ok(self.stream.synchronize().ctx("cuStreamSynchronize")?)
    }

    fn bytes_in_use(&self) -> EResult<Option<u64>> {
        Ok(Some(self.device_bytes_in_use()?))
    }

    fn time_steps(
        &self,
        iters: usize,
        cache: Cache,
        step: &mut dyn FnMut() -> EResult<()>,
    ) -> EResult<Vec<f64>> {
        self.time_ms(iters, cache, step)
    }

    /// Stages through host memory; the NCCL transport replaces this with device send/recv.
    fn send_kv<C: Collective>(
        &self,
        kv: &CudaKv,
        tokens: usize,
        comm: &C,
        peer: usize,
    ) -> EResult<()> {
        let (k, v) = self.read_bytes(kv, tokens)?;
        comm.send(&k, peer)?;
        comm.send(&v, peer)?;
        Ok(())
    }

    fn recv_kv<C: Collective>(
        &self,
        kv: &mut CudaKv,
        tokens: usize,
        comm: &C,
        peer: usize,
    ) -> EResult<()> {
        let bytes = kv.bytes_of(tokens);
        let (mut k, mut v) = (vec![0u8; bytes], vec![0u8; bytes]);
        comm.recv(&mut k, peer)?;
        comm.recv(&mut v, peer)?;
        Ok(self.write_bytes(kv, 0, &k, &v)?)
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A few queries over long contexts merge wide; FastTree's trees (320 cells or more at 32
    /// heads) keep the warp merges, deep up to 32 cells per SM.
    #[test]
    fn merges_of_few_cells_run_wide() {
        let h100 = 132;
        assert_eq!(
            merge_kernel(32, 128, h100, false),
            Kernel::MergeWide { rounded: false }
        );
        assert_eq!(
            merge_kernel(9, 64, h100, false),
            Kernel::MergeWide { rounded: false }
        );
        assert_eq!(
            merge_kernel(4 * 32, 128, h100, true),
            Kernel::MergeWide { rounded: true }
        );
        assert_eq!(
            merge_kernel(5 * 32, 128, h100, false),
            Kernel::Merge {
                deep: true,
                rounded: false
            }
        );
        assert_eq!(
            merge_kernel(10 * 32, 128, h100, true),
            Kernel::Merge {
                deep: true,
                rounded: true
            }
        );
        assert_eq!(
            merge_kernel(8 * 32, 64, h100, false),
            Kernel::MergeWide { rounded: false }
        );
        assert_eq!(
            merge_kernel(1024 * 32, 128, h100, false),
            Kernel::Merge {
                deep: false,
                rounded: false
            }
        );
    }
}
