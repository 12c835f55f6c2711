//! Loading kernels from the registry ([`canopy_kernels::Kernel`]) as CUDA functions, cached per
//! backend; their resources (registers, spills, shared memory, occupancy); and the launch
//! wrappers: stage 1 (both kernels share one signature) and programmatic dependent launches.

use crate::backend::{CudaBackend, CudaQueries, CudaStates, EResult};
use crate::compile::cubin;
use crate::descriptors::CudaPlan;
use crate::error::{DriverContext, Result};
use crate::kv::CudaKv;
use canopy_core::DType;
use canopy_kernels::{rows_config, Kernel, DECODE_THREADS, MMA_THREADS};
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use std::ffi::c_void;

/// Registers and memory of a compiled kernel (spills show as local bytes).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct KernelResources {
    pub registers: i32,
    pub local_bytes: i32,
    pub shared_bytes: i32,
    pub ctas_per_sm: u32,
}

/// A kernel's parameters for [`CudaBackend::launch_dependent`], one 64-bit word each: device
/// pointers whole, 32-bit values in the low bytes (the driver reads as many bytes as the
/// parameter has, and the host is little-endian).
#[derive(Default)]
pub(crate) struct Params(Vec<u64>);

impl Params {
    /// The device address of `buffer` on `stream`.
    pub(crate) fn buffer<T>(
        mut self,
        buffer: &impl cudarc::driver::DevicePtr<T>,
        stream: &cudarc::driver::CudaStream,
    ) -> Self {
        self.0.push(buffer.device_ptr(stream).0);
        self
    }

    /// The device address of `buffer`, or a null pointer when there is none.
    pub(crate) fn optional_buffer<T>(
        mut self,
        buffer: Option<&impl cudarc::driver::DevicePtr<T>>,
        stream: &cudarc::driver::CudaStream,
    ) -> Self {
        self.0.push(buffer.map_or(0, |b| b.device_ptr(stream).0));
        self
    }

    pub(crate) fn u32(mut self, v: u32) -> Self {
        self.0.push(u64::from(v));
        self
    }

    pub(crate) fn i32(self, v: i32) -> Self {
        self.u32(v as u32)
    }

    pub(crate) fn f32(self, v: f32) -> Self {
        self.u32(v.to_bits())
    }
}

impl CudaBackend {
    /// `kernel` as a CUDA function of this backend's context: compiled (or read from the
    /// cache) and loaded on first use, then kept.
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
            Kernel::Prefill {
                head_dim,
                entry: "prefill_attention",
                ..
            } => Some(canopy_kernels::PrefillLaunch::for_device(&self.arch, head_dim).shared_bytes),
            _ => None,
        };
        if let Some(shared) = shared {
            use cudarc::driver::sys::CUfunction_attribute as Attr;
            f.set_attribute(
                Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared as i32,
            )
            .ctx("cuFuncSetAttribute(max dynamic shared memory)")?;
            // All of L1 as shared memory, so the most CTAs fit on every SM.
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

    /// Launches `f` on the main stream as a programmatic dependent of the kernel before it
    /// (sm_90 and later; an ordinary launch before): its CTAs may be scheduled while that
    /// kernel's last wave runs, and must wait in `wait_for_previous_grid` before reading its
    /// output or writing anything it reads.
    ///
    /// # Safety
    /// `params` must be `f`'s parameters, in order, and every pointer among them valid for
    /// what `f` does with it.
    pub(crate) unsafe fn launch_dependent(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        params: &Params,
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        // SAFETY: as this function's.
        unsafe { self.launch_params(f, cfg, params, true) }
    }

    /// Launches `f` on the main stream with `params`, as a programmatic dependent of the
    /// kernel before it where `dependent` (see [`CudaBackend::launch_dependent`]), else once
    /// that kernel has finished.
    ///
    /// # Safety
    /// As [`CudaBackend::launch_dependent`]'s.
    pub(crate) unsafe fn launch_params(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        params: &Params,
        dependent: bool,
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        use cudarc::driver::sys;
        let mut args: Vec<*mut c_void> = params
            .0
            .iter()
            .map(|w| w as *const u64 as *mut c_void)
            .collect();
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
            numAttrs: u32::from(dependent && self.gpu.compute_capability.0 >= 9),
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
    pub(crate) fn launch_stage1(
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
            Some(p) => b.arg(&*p.device),
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
}
