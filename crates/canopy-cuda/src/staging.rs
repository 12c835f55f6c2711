//! Host-to-device copies of large buffers (a model's weights) through two page-locked
//! buffers.
//!
//! A copy from pageable memory makes the driver stage it itself, one piece at a time, and the
//! call returns only when the last piece has landed. Here the host fills one page-locked
//! buffer (on every core) while the copy engine empties the other, so the transfer runs at the
//! link's rate and the host's copying hides behind it.

use crate::backend::CudaBackend;
use crate::error::{DriverContext, Result};
use cudarc::driver::{CudaEvent, CudaSlice, DevicePtrMut, PinnedHostSlice};
use rayon::prelude::*;

/// Bytes of each staging buffer: big enough that a copy's fixed cost (microseconds) is small
/// beside its transfer (a third of a millisecond at 50 GB/s), small enough that two of them
/// per rank stay a small part of the host's page-locked memory.
pub(crate) const STAGE_BYTES: usize = 16 << 20;

/// Bytes a host thread copies at once while a staging buffer is filled.
const FILL_TASK_BYTES: usize = 1 << 20;

/// The two page-locked buffers, and the copy each was last emptied by.
pub(crate) struct Staging {
    buffers: [PinnedHostSlice<u8>; 2],
    emptied: [Option<CudaEvent>; 2],
}

impl CudaBackend {
    /// A device buffer holding `host`; through the staging buffers where `host` is larger than
    /// one of them, else by one ordinary copy. Returns once every byte has landed.
    pub(crate) fn upload_staged(&self, host: &[u8]) -> Result<CudaSlice<u8>> {
        if host.len() <= STAGE_BYTES {
            let data = self.upload(host)?;
            self.stream.synchronize().ctx("cuStreamSynchronize")?;
            return Ok(data);
        }
        self.refuse_while_capturing("a weight upload")?;
        let mut device = self.alloc::<u8>(host.len())?;
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        if staging.is_none() {
            // SAFETY: the buffers are written before any copy reads them.
            let buffer = || unsafe { self.ctx.alloc_pinned::<u8>(STAGE_BYTES) };
            *staging = Some(Staging {
                buffers: [
                    buffer().ctx("allocating page-locked host memory")?,
                    buffer().ctx("allocating page-locked host memory")?,
                ],
                emptied: [None, None],
            });
        }
        let staging = staging.as_mut().expect("made above");
        let (base, guard) = device.device_ptr_mut(&self.stream);
        for (i, piece) in host.chunks(STAGE_BYTES).enumerate() {
            let which = i % 2;
            if let Some(copy) = staging.emptied[which].take() {
                copy.synchronize().ctx("cuEventSynchronize")?;
            }
            let buffer = staging.buffers[which]
                .as_mut_slice()
                .ctx("cuEventSynchronize")?;
            let buffer = &mut buffer[..piece.len()];
            buffer
                .par_chunks_mut(FILL_TASK_BYTES)
                .zip(piece.par_chunks(FILL_TASK_BYTES))
                .for_each(|(to, from)| to.copy_from_slice(from));
            let at = base + (i * STAGE_BYTES) as u64;
            // SAFETY: `at..at + piece.len()` lies inside `device`, and the buffer is not
            // written again before the event recorded after this copy has completed.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(at, buffer, self.stream.cu_stream())
            }
            .ctx("cuMemcpyHtoDAsync")?;
            staging.emptied[which] = Some(self.stream.record_event(None).ctx("cuEventRecord")?);
        }
        self.stream.synchronize().ctx("cuStreamSynchronize")?;
        staging.emptied = [None, None];
        drop(guard);
        Ok(device)
    }
}
