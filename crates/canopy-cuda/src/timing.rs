//! Timing on the device: CUDA events around enqueued runs, with L2 evicted before each run
//! where the caller asks for cold caches, and the device-to-device copy bandwidth that the
//! benchmarks' floors divide by.

use crate::backend::CudaBackend;
use crate::error::{CudaError, DriverContext, Result};
use canopy_engine::Cache;
use canopy_kernels::Kernel;
use cudarc::driver::{CudaEvent, LaunchConfig, PushKernelArg};

/// Warm-up steps [`CudaBackend::time_ms`] runs before it times.
pub const WARMUP_STEPS: usize = canopy_engine::backend::WARMUP_RUNS;

impl CudaBackend {
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
    pub(crate) fn evict_l2(&self, clean: bool) -> Result<()> {
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
}
