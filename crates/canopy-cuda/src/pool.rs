//! The device's pool of stream-ordered memory, which every buffer of a backend comes from
//! (`cuMemAllocAsync`).
//!
//! By default a pool gives its unused memory back to the driver at every synchronisation. A
//! server synchronises once a pass (to read its logits), so the next pass's first allocations
//! map memory again while the GPU waits for its first launches (in a served prompt pass's
//! trace, about 70 µs of `cuMemAllocAsync` in the pass's longest idle gap). The backend's pool
//! keeps what it has instead: its high-water mark is the largest pass's working set, which the
//! model's fit check already counts. Checks of free memory trim the pool first
//! ([`trimmed_free_bytes`]), so memory the pool holds unused counts as free.

use crate::error::{DriverContext, Result};
use cudarc::driver::sys::{self, CUmemPool_attribute, CUmemoryPool};
use cudarc::driver::{CudaContext, CudaStream};

/// The device's default pool, the one `cuMemAllocAsync` draws from on its streams.
fn default_pool(ctx: &CudaContext) -> Result<CUmemoryPool> {
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is written by the call; the device is the context's.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
        .result()
        .ctx("cuDeviceGetDefaultMemPool")?;
    Ok(pool)
}

/// Makes the device's default pool keep the memory freed into it across synchronisations.
pub(crate) fn keep_freed_memory(ctx: &CudaContext) -> Result<()> {
    let pool = default_pool(ctx)?;
    let mut threshold = u64::MAX;
    // SAFETY: the release threshold is a u64 attribute; `threshold` outlives the call.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .result()
    .ctx("cuMemPoolSetAttribute")
}

/// The device's free memory once `stream`'s queued frees have happened and the pool has given
/// back every byte it holds unused: what an allocation of lasting buffers may count on.
pub(crate) fn trimmed_free_bytes(ctx: &CudaContext, stream: &CudaStream) -> Result<u64> {
    stream.synchronize().ctx("cuStreamSynchronize")?;
    let pool = default_pool(ctx)?;
    // SAFETY: trimming releases only memory no allocation holds.
    unsafe { sys::cuMemPoolTrimTo(pool, 0) }
        .result()
        .ctx("cuMemPoolTrimTo")?;
    Ok(ctx.mem_get_info().ctx("cuMemGetInfo")?.0 as u64)
}
