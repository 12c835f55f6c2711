//! [`CudaBackend`]: the engine's [`Backend`] on one GPU.
//!
//! KV lives in device memory, contiguous or paged (a pool of fixed-size pages behind a page
//! table, the layout the radix cache uses; pages are deliberately shuffled so tests catch any
//! kernel that ignores the table). Plans are uploaded once as flat arrays (group descriptors,
//! KV ranges, query lists, masks, CSR map), after re-splitting their groups so that the decode
//! kernel keeps every SM busy.
//!
//! Stage 1 runs on CUDA cores or tensor cores; [`KernelChoice`] picks per plan. `decode_partial`
//! (CUDA cores) streams KV at the copy bandwidth for groups of one or a few query rows; a step
//! is that kernel then `merge_partials` (one warp per query × head). On tensor cores
//! (mma.sync), groups whose queries × GQA rows share their KV — the tree methods' groups — run
//! on `decode_partial_mma`: one launch of CTAs cut and ordered by
//! [`canopy_core::geometry::cut_for_gpu`], many rows of one KV head (up to 64) or one warp per
//! KV head (groups of up to 16 rows, four heads per CTA), then the merge.

use crate::compile::{arch_for, cubin};
use crate::error::{CudaError, DriverContext, Result};
use crate::probe::{device_count, nvrtc_present, GpuInfo};
use canopy_comm::Collective;
use canopy_core::geometry::{cut_for_gpu, CtaItem, CTA_ROWS};
use canopy_core::{AttnShape, AttnStates, DType, Group, Plan, Tail, TypedVec};
use canopy_engine::{Backend, Cache};
use canopy_kernels::{
    rows_config, Kernel, MmaPipeline, CTA_PER_HEAD, CTA_WORDS, DECODE_THREADS, DEEP_MERGE_CTAS,
    GROUP_KV_STREAMED, GROUP_WORDS, MERGE_WARPS, MMA_HEAD_DIMS, MMA_THREADS,
};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::ffi::c_void;
use std::ops::Range;
use std::sync::{Arc, Mutex};

type EResult<T> = canopy_engine::Result<T>;

/// A group's descriptor carries [`GROUP_KV_STREAMED`] (the tensor-core kernel loads its KV as
/// first to leave L2) when other groups read at most 1 / this of its tokens
/// ([`Plan::kv_shared_tokens`]); those few shared tokens are then read again from DRAM. FastTree joins tree 1's 8-token root to each of its four 256-token nodes (3%), and keeping
/// those groups in L2 for the root's sake cost 4% at 32/32. At 1/8, tree 7's 32-token parents,
/// joined to each of their four 256-token leaves (11%), were read again by the other three and
/// the step took 1.3% longer (BENCHMARKS, session 11).
const SHARED_TOKENS_STREAMED: u32 = 16;
/// Resident decode CTAs per SM the planner aims for. The one-row kernel fits 5 at 96 registers,
/// but 4 was faster at every length on H200 (128K: 0.263 vs 0.277 ms; 512K: 0.992 vs 1.023;
/// 1M: 1.967 vs 2.017; twice each, docs/BENCHMARKS.md); the GQA kernels fit 4 (48 KB of
/// shared memory each).
const DEFAULT_CTAS_PER_SM: u32 = 4;
/// Shortest piece the CUDA-core kernel's plans are split into to fill the GPU: below this,
/// partials and launch costs dominate.
const SIMT_MIN_SPLIT_TOKENS: u32 = 256;
/// `auto` runs plans on tensor cores when some group has at least this many query rows.
const AUTO_MMA_MIN_ROWS: usize = 4;

/// Resident merge warps per SM at the deep variant's occupancy ([`DEEP_MERGE_CTAS`] CTAs of
/// [`MERGE_WARPS`]).
/// A merge of at most this many cells per SM runs deep: all its warps are resident either way,
/// and each keeps 8 rows' loads in flight instead of 4. On H100 that took FastTree's tree 8 at
/// 32/8 (10 queries, dozens of rows each) from 37.7 to 32.6 µs; on plans of thousands of
/// queries, where half the resident warps hide less latency, it cost up to 9 µs.
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

/// Which stage-1 kernel runs a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum KernelChoice {
    /// Tensor cores where a plan's groups have several query rows, CUDA cores otherwise.
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
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    gpu: GpuInfo,
    arch: String,
    functions: Mutex<HashMap<Kernel, CudaFunction>>,
    page_size: Option<u32>,
    waves: u32,
    max_ctas_per_sm: Option<u32>,
    kernel: KernelChoice,
    pipeline: MmaPipeline,
    /// Free device memory when the backend was created.
    free_at_start: usize,
    /// Written over (or read) before each timed step that must find the caches cold, and the
    /// clean sweep's sink; allocated on first use.
    flush: Mutex<Option<(CudaSlice<u8>, CudaSlice<u32>)>>,
}

/// Warm-up steps [`CudaBackend::time_ms`] runs before it times.
pub const WARMUP_STEPS: usize = canopy_engine::backend::WARMUP_RUNS;

/// Device KV: K and V bytes and, when paged, the page table.
pub struct CudaKv {
    shape: AttnShape,
    dtype: DType,
    tokens: usize,
    pub(crate) k: CudaSlice<u8>,
    pub(crate) v: CudaSlice<u8>,
    paging: Option<Paging>,
}

impl CudaKv {
    /// Bytes of K (or V) of the first `tokens` tokens of contiguous storage.
    pub(crate) fn bytes_of(&self, tokens: usize) -> usize {
        tokens * self.shape.kv_token_bytes(self.dtype)
    }
}

struct Paging {
    shift: u32,
    /// Logical page → physical page, on the host (for copies) and on the device (for kernels).
    host: Vec<u32>,
    device: CudaSlice<u32>,
}

pub struct CudaQueries {
    q: CudaSlice<f32>,
    rows: usize,
}

/// An uploaded plan.
pub struct CudaPlan {
    plan: Plan,
    rows: usize,
    /// Run on tensor cores when the KV's dtype allows (16-bit).
    tensor_cores: bool,
    /// The cut's CTAs, longest first.
    items: Vec<CtaItem>,
    /// Every u32 array of the plan in one buffer (one allocation and one copy per upload, and
    /// one copy per in-place update), at `layout`'s offsets.
    words: CudaSlice<u32>,
    /// Page-locked host copy of `words` that an in-place update writes and copies from, so
    /// the copy is asynchronous (a pageable copy waits on the host).
    staging: PinnedHostSlice<u32>,
    layout: WordLayout,
    masks: CudaSlice<u64>,
    /// Each group's tokens that others read too ([`Plan::kv_shared_tokens`]), kept up to date
    /// through in-place updates for the descriptors' flags.
    shared: Vec<u32>,
    /// Query `i`'s one partial row is row `i`: stage 1 writes the output and no merge runs.
    direct: bool,
}

/// Where each array of a plan lies in [`CudaPlan`]'s word buffer. The arrays an in-place
/// update rewrites come first, so it rewrites one prefix of the staging buffer.
#[derive(Debug, Clone)]
struct WordLayout {
    /// `decode_partial_mma`'s descriptors, [`CTA_WORDS`] per CTA.
    ctas: Range<usize>,
    /// [`GROUP_WORDS`] per group, for `decode_partial`.
    groups: Range<usize>,
    ranges: Range<usize>,
    queries: Range<usize>,
    query_ptr: Range<usize>,
    query_rows: Range<usize>,
}

impl CudaPlan {
    /// The plan as executed (after splitting for parallelism).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Whether stage 1 runs on tensor cores for KV of `dtype`.
    pub fn uses_tensor_cores(&self, dtype: DType) -> bool {
        self.tensor_cores && dtype != DType::F32
    }
}

/// A cut plan's arrays as the kernels read them, on the host.
struct HostPlan {
    words: Vec<u32>,
    layout: WordLayout,
    masks: Vec<u64>,
    shared: Vec<u32>,
}

impl HostPlan {
    fn lay_out(plan: &Plan, items: &[CtaItem]) -> HostPlan {
        let layout = WordLayout::of(plan, items);
        let mut words = vec![0; layout.query_rows.end];
        let shared = plan.kv_shared_tokens();
        let masks = write_extents(plan, &shared, items, &layout, &mut words);
        let mut at = layout.queries.start;
        for g in plan.groups() {
            words[at..at + g.queries.len()].copy_from_slice(&g.queries);
            at += g.queries.len();
        }
        let (query_ptr, query_rows) = plan.csr();
        words[layout.query_ptr.clone()].copy_from_slice(query_ptr);
        words[layout.query_rows.clone()].copy_from_slice(query_rows);
        HostPlan {
            words,
            layout,
            masks,
            shared,
        }
    }
}

impl WordLayout {
    fn of(plan: &Plan, items: &[CtaItem]) -> WordLayout {
        let groups = plan.groups();
        let (query_ptr, query_rows) = plan.csr();
        let mut end = 0;
        let mut next = |len: usize| {
            end += len;
            end - len..end
        };
        WordLayout {
            ctas: next(items.len() * CTA_WORDS),
            groups: next(groups.len() * GROUP_WORDS),
            ranges: next(groups.iter().map(|g| 2 * g.kv.len()).sum()),
            queries: next(groups.iter().map(|g| g.queries.len()).sum()),
            query_ptr: next(query_ptr.len()),
            query_rows: next(query_rows.len()),
        }
    }
}

/// Writes the arrays that an in-place update changes (CTA descriptors, group descriptors and
/// KV ranges) at `layout`'s places in `words`, and returns the masks that the descriptors point
/// into; `shared` is the plan's [`Plan::kv_shared_tokens`]. An update calls it on the staging
/// buffer directly. On the build host, for few-shot b = 50's 380 CTAs, it takes 2 µs; the
/// previous lay-out, which built every array again and copied them into place, took 31 µs.
fn write_extents(
    plan: &Plan,
    shared: &[u32],
    items: &[CtaItem],
    layout: &WordLayout,
    words: &mut [u32],
) -> Vec<u64> {
    let mut masks = Vec::new();
    let (mut range_at, mut query_at) = (0, 0);
    for (i, (g, &base)) in plan.groups().iter().zip(plan.partial_base()).enumerate() {
        let mask = match &g.mask {
            Some(_) => {
                let at = masks.len();
                masks.extend(block_mask(g));
                (at + 1) as u32
            }
            None => 0,
        };
        let d = layout.groups.start + i * GROUP_WORDS;
        words[d..d + GROUP_WORDS].copy_from_slice(&[
            range_at as u32,
            g.kv.len() as u32,
            query_at as u32,
            g.queries.len() as u32,
            base,
            mask,
            g.tokens(),
            if shared[i] * SHARED_TOKENS_STREAMED <= g.tokens() {
                GROUP_KV_STREAMED
            } else {
                0
            },
        ]);
        let r = layout.ranges.start + 2 * range_at;
        for (j, kv) in g.kv.iter().enumerate() {
            words[r + 2 * j] = kv.start;
            words[r + 2 * j + 1] = kv.end;
        }
        range_at += g.kv.len();
        query_at += g.queries.len();
    }
    // The CUDA-core kernel runs one CTA per group × KV head (its grid's y; it also runs
    // tensor-core plans when their KV is f32); the tensor-core kernel one per CTA descriptor,
    // in the cut's order: the group's descriptor, then its head and first KV range.
    for (i, c) in items.iter().enumerate() {
        let g = c.group as usize;
        let d = layout.groups.start + g * GROUP_WORDS;
        let at = layout.ctas.start + i * CTA_WORDS;
        words.copy_within(d..d + GROUP_WORDS, at);
        let first = &plan.groups()[g].kv[0];
        let head = c.kv_head | if c.per_head { CTA_PER_HEAD } else { 0 };
        words[at + GROUP_WORDS..at + CTA_WORDS].copy_from_slice(&[head, first.start, first.end, 0]);
    }
    masks
}

/// A masked group's mask as the kernels read it (`mask_word` in `common.cuh`): per
/// 64-token block of its tokens, one word per query, bit `t` for the block's token `t`. A
/// thread that tests one query's scores over a tile then loads one word, where the plan's
/// token-major mask would need one per token. The plan's set bits are visited, not every
/// (token, query) pair: a growing masked plan is laid out again on every update.
fn block_mask(g: &Group) -> Vec<u64> {
    let Some(mask) = &g.mask else {
        return Vec::new();
    };
    let queries = g.queries.len();
    let mut words = vec![0u64; (g.tokens() as usize).div_ceil(64) * queries];
    for (t, token_words) in mask.chunks(g.mask_words()).enumerate() {
        for (w, &bits) in token_words.iter().enumerate() {
            let mut rest = bits;
            while rest != 0 {
                let j = 64 * w + rest.trailing_zeros() as usize;
                words[t / 64 * queries + j] |= 1 << (t % 64);
                rest &= rest - 1;
            }
        }
    }
    words
}

/// Device states: `rows × heads × head_dim` outputs and `rows × heads` lse.
pub struct CudaStates {
    rows: usize,
    heads: usize,
    head_dim: usize,
    pub(crate) o: CudaSlice<f32>,
    pub(crate) lse: CudaSlice<f32>,
}

/// Registers and memory of a compiled kernel (spills show as local bytes).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct KernelResources {
    pub registers: i32,
    pub local_bytes: i32,
    pub shared_bytes: i32,
    pub ctas_per_sm: u32,
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
            max_ctas_per_sm: Some(DEFAULT_CTAS_PER_SM),
            kernel: KernelChoice::Auto,
            pipeline: MmaPipeline::default(),
            page_size: None,
            flush: Mutex::new(None),
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

    pub(crate) fn function(&self, kernel: Kernel) -> Result<CudaFunction> {
        let mut fns = self.functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = fns.get(&kernel) {
            return Ok(f.clone());
        }
        let name = kernel.entry();
        let module = self
            .ctx
            .load_module(Ptx::from_binary(cubin(&kernel.variant(), &self.arch)?))
            .ctx("cuModuleLoadData")?;
        let f = module
            .load_function(name)
            .ctx(format!("cuModuleGetFunction({name})"))?;
        let shared = match kernel {
            Kernel::DecodeMma {
                head_dim, pipeline, ..
            } => Some(pipeline.shared_bytes(head_dim)),
            _ => None,
        };
        if let Some(shared) = shared {
            use cudarc::driver::sys::CUfunction_attribute as Attr;
            f.set_attribute(
                Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared as i32,
            )
            .ctx("cuFuncSetAttribute(max dynamic shared memory)")?;
            // All of L1 as shared memory, so three CTAs fit on every SM.
            f.set_attribute(
                Attr::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                100,
            )
            .ctx("cuFuncSetAttribute(shared memory carveout)")?;
        }
        fns.insert(kernel, f.clone());
        Ok(f)
    }

    /// Registers, spills, shared memory and occupancy of the decode kernel for a configuration.
    pub fn decode_resources(
        &self,
        dtype: DType,
        head_dim: usize,
        rows: usize,
    ) -> Result<KernelResources> {
        let f = self.function(Kernel::Decode {
            dtype,
            head_dim,
            rows: rows_config(rows),
        })?;
        Ok(KernelResources {
            registers: f.num_regs().ctx("cuFuncGetAttribute")?,
            local_bytes: f.local_size_bytes().ctx("cuFuncGetAttribute")?,
            shared_bytes: f.shared_size_bytes().ctx("cuFuncGetAttribute")?,
            ctas_per_sm: f
                .occupancy_max_active_blocks_per_multiprocessor(DECODE_THREADS, 0, None)
                .ctx("cuOccupancy")?,
        })
    }

    /// Registers, spills, shared memory and occupancy of the tensor-core kernel.
    pub fn mma_resources(&self, dtype: DType, head_dim: usize) -> Result<KernelResources> {
        let pipeline = self.pipeline;
        let f = self.function(Kernel::DecodeMma {
            dtype,
            head_dim,
            pipeline,
        })?;
        let shared = pipeline.shared_bytes(head_dim);
        Ok(KernelResources {
            registers: f.num_regs().ctx("cuFuncGetAttribute")?,
            local_bytes: f.local_size_bytes().ctx("cuFuncGetAttribute")?,
            shared_bytes: shared as i32,
            ctas_per_sm: f
                .occupancy_max_active_blocks_per_multiprocessor(MMA_THREADS, shared, None)
                .ctx("cuOccupancy")?,
        })
    }

    /// Whether plans of `shape` run on tensor cores (given 16-bit KV).
    fn tensor_cores_for(&self, shape: &AttnShape, max_rows: usize) -> bool {
        let supported = MMA_HEAD_DIMS.contains(&shape.head_dim) && shape.group_size() <= CTA_ROWS;
        match self.kernel {
            KernelChoice::Simt => false,
            KernelChoice::Mma => supported,
            KernelChoice::Auto => supported && max_rows >= AUTO_MMA_MIN_ROWS,
        }
    }

    pub(crate) fn alloc<T: cudarc::driver::DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        // SAFETY: every buffer is written (upload, kernel or poison) before it is read.
        unsafe { self.stream.alloc::<T>(len.max(1)) }.ctx(format!(
            "allocating {} bytes",
            len * std::mem::size_of::<T>()
        ))
    }

    fn upload<T: cudarc::driver::DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        let mut d = self.alloc::<T>(host.len())?;
        if !host.is_empty() {
            self.stream.memcpy_htod(host, &mut d).ctx("cuMemcpyHtoD")?;
        }
        Ok(d)
    }

    /// Fills tokens `dst..dst + count` of `kv` with the hashed random values of global tokens
    /// `first_token..` (see `canopy_core::data`), on the device: a rank fills its shard of a
    /// tensor that the f64 oracle regenerates whole on the CPU.
    pub fn fill_random(
        &self,
        kv: &mut CudaKv,
        dst: usize,
        count: usize,
        seed: u64,
        first_token: u64,
    ) -> Result<()> {
        // Paged KV is filled by physical slot (the pool), whatever the page table says.
        let slots = kv.k.len() / kv.bytes_of(1);
        if dst + count > slots {
            return Err(CudaError::Unsupported(format!(
                "random fill of slots {dst}..{} past the {slots} allocated",
                dst + count
            )));
        }
        let f = self.function(Kernel::Fill(kv.dtype))?;
        let per = kv.shape.kv_token_elems();
        let bytes = kv.bytes_of(1);
        let n = (count * per) as u64;
        let first = first_token * per as u64;
        let amp = canopy_core::data::KV_AMPLITUDE;
        let cfg = LaunchConfig {
            grid_dim: (self.gpu.multiprocessors * 8, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        for (buf, stream_id) in [
            (&mut kv.k, canopy_core::data::STREAM_K),
            (&mut kv.v, canopy_core::data::STREAM_V),
        ] {
            let mut view = buf.slice_mut(dst * bytes..(dst + count) * bytes);
            let mut b = self.stream.launch_builder(&f);
            b.arg(&mut view)
                .arg(&n)
                .arg(&first)
                .arg(&seed)
                .arg(&stream_id)
                .arg(&amp);
            // SAFETY: the kernel writes n elements of the dtype into a view of that size.
            unsafe { b.launch(cfg) }.ctx("launching fill_random")?;
        }
        Ok(())
    }

    /// Installs a page table (logical page → physical page) on paged KV: a growing tree's
    /// snapshot maps its logical pages onto the pool's shared physical pages this way.
    pub fn set_page_table(&self, kv: &mut CudaKv, table: &[u32]) -> Result<()> {
        let Some(p) = kv.paging.as_mut() else {
            return Err(CudaError::Unsupported(
                "page tables need paged KV (with_paging)".into(),
            ));
        };
        let pages = p.device.len() as u32;
        if table.len() > p.device.len() || table.iter().any(|&x| x >= pages) {
            return Err(CudaError::Unsupported(format!(
                "a page table of {} entries over a pool of {pages} pages",
                table.len()
            )));
        }
        if !table.is_empty() {
            self.stream
                .memcpy_htod(table, &mut p.device.slice_mut(..table.len()))
                .ctx("cuMemcpyHtoD")?;
        }
        p.host[..table.len()].copy_from_slice(table);
        Ok(())
    }

    /// Measured device-to-device copy bandwidth (bytes read + written per second) over
    /// `bytes`-sized buffers: the ceiling the benchmarks' floors divide by.
    pub fn copy_bandwidth(&self, bytes: usize, iters: usize) -> Result<f64> {
        let src = self.alloc::<u8>(bytes)?;
        let mut dst = self.alloc::<u8>(bytes)?;
        let times = self.time_ms(iters, Cache::Warm, || {
            self.stream.memcpy_dtod(&src, &mut dst).ctx("cuMemcpyDtoD")
        })?;
        Ok(2.0 * bytes as f64 / (canopy_core::stats::median(&times) * 1e-3))
    }

    /// Runs `f` `iters` times after three warm-ups, timing each run with CUDA events. All runs
    /// are enqueued before any is waited for, so the GPU never idles on the host's launches.
    pub fn time_ms<E: From<CudaError>>(
        &self,
        iters: usize,
        cache: Cache,
        f: impl FnMut() -> std::result::Result<(), E>,
    ) -> std::result::Result<Vec<f64>, E> {
        self.time_ms_until(
            iters,
            cache,
            |e| e.synchronize().ctx("cuEventSynchronize"),
            f,
        )
    }

    /// [`time_ms`](Self::time_ms), waiting for the last event with `wait` (a watchdog).
    pub fn time_ms_until<E: From<CudaError>>(
        &self,
        iters: usize,
        cache: Cache,
        wait: impl Fn(&CudaEvent) -> Result<()>,
        mut f: impl FnMut() -> std::result::Result<(), E>,
    ) -> std::result::Result<Vec<f64>, E> {
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        for _ in 0..WARMUP_STEPS {
            f()?;
        }
        let mut events: Vec<(CudaEvent, CudaEvent)> = Vec::with_capacity(iters);
        for _ in 0..iters {
            if cache != Cache::Warm {
                self.evict_l2(cache == Cache::ColdClean)?;
            }
            let start = self
                .stream
                .record_event(Some(CU_EVENT_DEFAULT))
                .ctx("cuEventRecord")?;
            f()?;
            let end = self
                .stream
                .record_event(Some(CU_EVENT_DEFAULT))
                .ctx("cuEventRecord")?;
            events.push((start, end));
        }
        if let Some((_, last)) = events.last() {
            wait(last)?;
        }
        events
            .iter()
            .map(|(s, e)| Ok(s.elapsed_ms(e).ctx("cuEventElapsedTime")? as f64))
            .collect()
    }

    /// Writes over a buffer of four times the L2's size (at least 64 MiB) on the stream, so
    /// that the next kernel finds none of its data in L2, only dirty lines; `clean` reads the
    /// (zeroed) buffer instead, so that the lines left are clean.
    fn evict_l2(&self, clean: bool) -> Result<()> {
        let mut flush = self.flush.lock().expect("flush buffer lock");
        if flush.is_none() {
            let bytes = (4 * self.gpu.l2_bytes as usize).max(64 << 20);
            let buf = self
                .stream
                .alloc_zeros::<u8>(bytes)
                .ctx(format!("allocating {bytes} bytes to evict L2"))?;
            let sink = self
                .stream
                .alloc_zeros::<u32>(1)
                .ctx("allocating 4 bytes")?;
            *flush = Some((buf, sink));
        }
        let (buf, sink) = flush.as_mut().expect("allocated above");
        if !clean {
            return self.stream.memset_zeros(buf).ctx("cuMemsetD8Async");
        }
        let f = self.function(Kernel::Read)?;
        let n = (buf.len() / 16) as u64;
        let cfg = LaunchConfig {
            grid_dim: (self.gpu.multiprocessors * 8, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&f);
        b.arg(&*buf).arg(&n).arg(sink);
        // SAFETY: the kernel reads n 16-byte words of `buf` and may write one u32 of `sink`.
        unsafe { b.launch(cfg) }.ctx("launching read16")?;
        Ok(())
    }

    /// Launches `f` on the main stream as a programmatic dependent of the kernel before it
    /// (sm_90 and later; an ordinary launch before): its CTAs may be scheduled while that
    /// kernel's last wave runs, and must wait in `wait_for_previous_grid` before reading its
    /// output.
    ///
    /// # Safety
    /// `args` must point at values of `f`'s parameters, in order, alive until this returns.
    unsafe fn launch_dependent(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: &mut [*mut c_void],
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        use cudarc::driver::sys;
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            // SAFETY: an all-zero attribute value is valid (every member is plain data).
            value: unsafe { std::mem::zeroed() },
        };
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(self.gpu.compute_capability.0 >= 9),
        };
        self.ctx.bind_to_thread()?;
        // SAFETY: `config` and `attr` outlive the call; the caller vouches for `args`.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }

    /// Launches a stage-1 kernel (both share one signature) on the stream.
    fn launch_stage1(
        &self,
        kernel: Kernel,
        cfg: LaunchConfig,
        kv: &CudaKv,
        q: &CudaQueries,
        plan: &CudaPlan,
        partials: &mut CudaStates,
    ) -> EResult<()> {
        let f = self.function(kernel)?;
        let shape = &kv.shape;
        let null = 0u64;
        let (q_heads, kv_heads) = (shape.q_heads as i32, shape.kv_heads as i32);
        let scale_log2 = shape.softmax_scale() * std::f32::consts::LOG2_E;
        let shift = kv.paging.as_ref().map_or(0u32, |p| p.shift);
        let l = &plan.layout;
        let descriptors = plan.words.slice(match kernel {
            Kernel::DecodeMma { .. } => l.ctas.clone(),
            _ => l.groups.clone(),
        });
        let (ranges, queries) = (
            plan.words.slice(l.ranges.clone()),
            plan.words.slice(l.queries.clone()),
        );
        let mut b = self.stream.launch_builder(&f);
        b.arg(&kv.k)
            .arg(&kv.v)
            .arg(&q.q)
            .arg(&descriptors)
            .arg(&ranges)
            .arg(&queries)
            .arg(&plan.masks);
        match &kv.paging {
            Some(p) => b.arg(&p.device),
            None => b.arg(&null),
        };
        b.arg(&shift)
            .arg(&mut partials.o)
            .arg(&mut partials.lse)
            .arg(&q_heads)
            .arg(&kv_heads)
            .arg(&scale_log2);
        // SAFETY: arguments match the kernel's signature; every index the kernel forms comes
        // from the validated plan (groups of at most 64 rows for the tensor-core kernel, 16 on
        // its one-warp-per-head path, CTAs naming groups and heads that exist), within the
        // buffers allocated for it.
        unsafe { b.launch(cfg) }.ctx(format!("launching {}", kernel.entry()))?;
        Ok(())
    }

    /// Free device memory on this GPU now.
    pub fn free_bytes(&self) -> Result<u64> {
        Ok(self.ctx.mem_get_info().ctx("cuMemGetInfo")?.0 as u64)
    }

    /// Device memory in use on this GPU beyond what was in use when the backend was created
    /// (buffers, NCCL's, and the kernels'): this rank's footprint while its buffers live.
    pub fn device_bytes_in_use(&self) -> Result<u64> {
        let (free, _) = self.ctx.mem_get_info().ctx("cuMemGetInfo")?;
        Ok(self.free_at_start.saturating_sub(free) as u64)
    }

    /// Physical byte ranges holding logical tokens `start..start + n`, in logical order.
    fn segments(kv: &CudaKv, start: usize, n: usize) -> Vec<(usize, std::ops::Range<usize>)> {
        let tb = kv.bytes_of(1);
        match &kv.paging {
            None => vec![(0, start * tb..(start + n) * tb)],
            Some(p) => {
                let size = 1usize << p.shift;
                let mut out = Vec::new();
                let (mut t, end) = (start, start + n);
                while t < end {
                    let (page, within) = (t >> p.shift, t & (size - 1));
                    let take = (size - within).min(end - t);
                    let phys = p.host[page] as usize * size + within;
                    out.push(((t - start) * tb, phys * tb..(phys + take) * tb));
                    t += take;
                }
                out
            }
        }
    }

    fn write_bytes(&self, kv: &mut CudaKv, start: usize, k: &[u8], v: &[u8]) -> Result<()> {
        let n = k.len() / kv.bytes_of(1);
        for (host_at, dev) in Self::segments(kv, start, n) {
            let len = dev.len();
            self.stream
                .memcpy_htod(&k[host_at..host_at + len], &mut kv.k.slice_mut(dev.clone()))
                .ctx("cuMemcpyHtoD")?;
            self.stream
                .memcpy_htod(&v[host_at..host_at + len], &mut kv.v.slice_mut(dev))
                .ctx("cuMemcpyHtoD")?;
        }
        Ok(())
    }

    fn read_bytes(&self, kv: &CudaKv, n: usize) -> Result<(Vec<u8>, Vec<u8>)> {
        let bytes = kv.bytes_of(n);
        let (mut k, mut v) = (vec![0u8; bytes], vec![0u8; bytes]);
        for (host_at, dev) in Self::segments(kv, 0, n) {
            let len = dev.len();
            self.stream
                .memcpy_dtoh(&kv.k.slice(dev.clone()), &mut k[host_at..host_at + len])
                .ctx("cuMemcpyDtoH")?;
            self.stream
                .memcpy_dtoh(&kv.v.slice(dev), &mut v[host_at..host_at + len])
                .ctx("cuMemcpyDtoH")?;
        }
        self.stream.synchronize().ctx("cuStreamSynchronize")?;
        Ok((k, v))
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
        let token_bytes = shape.kv_token_bytes(dtype);
        let (slots, paging) = match self.page_size {
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
                let device = self.upload(&host)?;
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
            ))
            .into());
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

    fn upload_queries(&self, shape: &AttnShape, q: &[f32]) -> EResult<CudaQueries> {
        Ok(CudaQueries {
            q: self.upload(q)?,
            rows: q.len() / shape.q_row_elems(),
        })
    }

    fn upload_plan(&self, shape: &AttnShape, plan: &Plan) -> EResult<CudaPlan> {
        let gqa = shape.group_size();
        // A CTA holds at most 64 rows (either kernel: the CUDA-core one would otherwise loop over
        // the KV once per 8 rows); larger groups become CTAs that read the same KV from L2.
        let plan = plan.split_queries((CTA_ROWS / gqa).max(1));
        let max_rows = plan
            .groups()
            .iter()
            .map(|g| g.queries.len())
            .max()
            .unwrap_or(1)
            * gqa;
        let tensor_cores = self.tensor_cores_for(shape, max_rows);
        let rows = rows_config(max_rows);
        // One balanced wave: as many CTAs as fit on the GPU at once. The plan is uploaded before
        // it meets its KV, so the bf16 kernel's occupancy stands for every dtype: the f16 and f32
        // variants use the same shared memory and no more registers (compiler resource report),
        // so their true occupancy is never lower and the wave never spills into a second.
        let res = if tensor_cores {
            self.mma_resources(DType::Bf16, shape.head_dim)?
        } else {
            self.decode_resources(DType::Bf16, shape.head_dim, rows)?
        };
        let per_sm = res
            .ctas_per_sm
            .min(self.max_ctas_per_sm.unwrap_or(u32::MAX))
            .max(1);
        let capacity = (self.gpu.multiprocessors * per_sm * self.waves) as usize;
        let (plan, items) = if tensor_cores {
            cut_for_gpu(&plan, shape, capacity)
        } else {
            // Round down: one CTA past the resident capacity costs a whole second wave.
            let target = (capacity / shape.kv_heads).max(1);
            let plan = plan.split_for_parallelism(target, SIMT_MIN_SPLIT_TOKENS);
            (plan, Vec::new())
        };
        let host = HostPlan::lay_out(&plan, &items);
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
            rows,
            tensor_cores,
            direct: plan.rows_are_queries(),
            words,
            staging,
            layout: host.layout,
            masks: self.upload(&host.masks)?,
            shared: host.shared,
            plan,
            items,
        })
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
        self.stream
            .memcpy_htod(&p.staging, &mut p.words)
            .ctx("cuMemcpyHtoD")?;
        // A masked group's new tokens set bits in its last block or add blocks: masks that
        // exist are uploaded again.
        if !masks.is_empty() {
            p.masks = self.upload(&masks)?;
        }
        Ok(())
    }

    fn alloc_states(&self, shape: &AttnShape, rows: usize) -> EResult<CudaStates> {
        Ok(CudaStates {
            rows,
            heads: shape.q_heads,
            head_dim: shape.head_dim,
            o: self.alloc(rows * shape.q_row_elems())?,
            lse: self.alloc(rows * shape.q_heads)?,
        })
    }

    fn alloc_partials(&self, shape: &AttnShape, plan: &CudaPlan) -> EResult<CudaStates> {
        self.alloc_states(shape, plan.plan.num_partial_rows())
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
        if partials.rows != plan.plan.num_partial_rows() || q.rows < plan.plan.num_queries() {
            return Err(
                CudaError::Unsupported("partials or queries do not match the plan".into()).into(),
            );
        }
        let groups = plan.plan.groups().len() as u32;
        if groups == 0 {
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
                grid_dim: (groups, kv_heads, 1),
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
            grid_dim: ((plan.layout.ctas.len() / CTA_WORDS) as u32, 1, 1),
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
        let nq = plan.plan.num_queries() as u32;
        if out.rows != nq as usize {
            return Err(CudaError::Unsupported(format!(
                "output has {} rows for {nq} queries",
                out.rows
            ))
            .into());
        }
        if nq == 0 {
            return Ok(());
        }
        let cells = nq as usize * partials.heads;
        let deep = cells <= DEEP_MERGE_CELLS_PER_SM * self.gpu.multiprocessors as usize;
        let f = self.function(Kernel::Merge { deep })?;
        let (heads, d) = (partials.heads as i32, partials.head_dim as i32);
        let s = &self.stream;
        let (po, _) = partials.o.device_ptr(s);
        let (plse, _) = partials.lse.device_ptr(s);
        let query_ptr = plan.words.slice(plan.layout.query_ptr.clone());
        let query_rows = plan.words.slice(plan.layout.query_rows.clone());
        let (query_ptr, _) = query_ptr.device_ptr(s);
        let (query_rows, _) = query_rows.device_ptr(s);
        let (out_o, _) = out.o.device_ptr_mut(s);
        let (out_lse, _) = out.lse.device_ptr_mut(s);
        let cfg = LaunchConfig {
            grid_dim: (cells.div_ceil(MERGE_WARPS) as u32, 1, 1),
            block_dim: (MERGE_WARPS as u32 * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = [
            &po as *const _ as *mut c_void,
            &plse as *const _ as *mut c_void,
            &query_ptr as *const _ as *mut c_void,
            &query_rows as *const _ as *mut c_void,
            &out_o as *const _ as *mut c_void,
            &out_lse as *const _ as *mut c_void,
            &nq as *const _ as *mut c_void,
            &heads as *const _ as *mut c_void,
            &d as *const _ as *mut c_void,
        ];
        // SAFETY: the arguments are merge_partials' parameters, in order, and live through the
        // call; the CSR rows index the partial buffers.
        unsafe { self.launch_dependent(&f, cfg, &mut args) }.ctx("launching merge_partials")?;
        Ok(())
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

    /// An in-place update writes exactly what laying the extended plan out afresh writes, masks
    /// included.
    #[test]
    fn extents_written_in_place_match_a_fresh_lay_out() {
        let mask = [vec![0b11u64; 8], vec![0b01; 4]].concat();
        let groups = vec![
            Group::unmasked(vec![0..8], vec![0, 1, 2]),
            Group {
                kv: vec![0..8, 20..24],
                queries: vec![0, 1],
                mask: Some(mask),
            },
            Group::unmasked(vec![8..16], vec![2]),
        ];
        let plan = Plan::new(3, groups).unwrap();
        let shape = AttnShape::new(32, 8, 128).unwrap();
        let (mut plan, items) = cut_for_gpu(&plan, &shape, 8);
        let before = HostPlan::lay_out(&plan, &items);
        let tails = [
            Tail {
                end: 24,
                new_end: 26,
            },
            Tail {
                end: 16,
                new_end: 19,
            },
        ];
        plan.extend_tails(&tails);
        let fresh = HostPlan::lay_out(&plan, &items);
        assert_ne!(before.words, fresh.words, "the tails change the words");
        let mut words = before.words.clone();
        let mut shared = before.shared.clone();
        plan.grow_shared_tokens(&mut shared, &tails);
        let masks = write_extents(&plan, &shared, &items, &before.layout, &mut words);
        assert_eq!(words, fresh.words);
        assert_eq!(masks, fresh.masks);
        assert_ne!(masks, before.masks, "the masked group grew");
    }

    /// Every CTA's descriptor carries its group's flag: set where other groups read at most
    /// 1 / SHARED_TOKENS_STREAMED of the group's tokens, clear where they read more.
    #[test]
    fn descriptors_carry_the_streaming_flag() {
        let groups = vec![
            Group::unmasked(vec![0..64], (0..20).collect()),
            Group::unmasked(vec![32..96], vec![20]),
            Group::unmasked(vec![92..160], vec![21]),
        ];
        let plan = Plan::new(22, groups).unwrap();
        let shape = AttnShape::new(32, 8, 128).unwrap();
        let (plan, items) = cut_for_gpu(&plan, &shape, 4);
        let host = HostPlan::lay_out(&plan, &items);
        let expected: Vec<u32> = plan
            .groups()
            .iter()
            .zip(plan.kv_shared_tokens())
            .map(|(g, shared)| match g.kv[0].start {
                92 => {
                    assert_eq!(shared, 4, "the last group shares 4 of 68 tokens");
                    GROUP_KV_STREAMED
                }
                _ => {
                    assert!(shared * SHARED_TOKENS_STREAMED > g.tokens());
                    0
                }
            })
            .collect();
        for (i, item) in items.iter().enumerate() {
            let flags = host.words[host.layout.ctas.start + i * CTA_WORDS + GROUP_WORDS - 1];
            assert_eq!(
                flags, expected[item.group as usize],
                "CTA {i} of group {}",
                item.group
            );
        }
    }

    /// The kernels' block layout says what the plan's mask says, token by token, across
    /// block boundaries.
    #[test]
    fn block_masks_agree_with_the_plan() {
        let (tokens, queries) = (150usize, 5usize);
        let mask: Vec<u64> = (0..tokens)
            .map(|t| (t as u64 * 2654435761) >> 7 & 0b11111)
            .collect();
        let g = Group {
            kv: vec![0..100, 300..350],
            queries: (0..queries as u32).collect(),
            mask: Some(mask),
        };
        let words = block_mask(&g);
        assert_eq!(words.len(), 3 * queries);
        for t in 0..tokens {
            for j in 0..queries {
                let bit = words[t / 64 * queries + j] >> (t % 64) & 1 == 1;
                assert_eq!(bit, g.visible(t, j), "token {t} query {j}");
            }
        }
    }
}
