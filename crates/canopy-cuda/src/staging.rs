//! Host-to-device copies of a model's weights through two page-locked buffers.
//!
//! A copy from pageable memory makes the driver stage it itself, one piece at a time, and the
//! call returns only when the last piece has landed. Here the weight's reader writes one
//! page-locked buffer (on every core) while the copy engine empties the other, so the host's
//! reading hides behind the transfer, or the transfer behind the reading, whichever is
//! shorter. The reader writes straight into the buffer the copy engine reads: a weight read
//! from a file crosses the host's memory once, from the page cache into this buffer.

use crate::backend::CudaBackend;
use crate::error::{CudaError, DriverContext};
use canopy_core::{DType, TypedSliceMut};
use canopy_engine::EngineError;
use cudarc::driver::{CudaEvent, CudaSlice, DevicePtrMut, PinnedHostSlice};

/// Bytes of each staging buffer: a part big enough to spread its reading over every core,
/// and that a copy's fixed cost (microseconds) is small beside its transfer (about a
/// millisecond at 30-50 GB/s); small enough that two of them per rank stay a small part of
/// the host's page-locked memory, and that the copy of a weight's last part, which nothing
/// overlaps, is short.
pub(crate) const STAGE_BYTES: usize = 32 << 20;

/// The two page-locked buffers, and the copy each was last emptied by.
pub(crate) struct Staging {
    buffers: [PinnedHostSlice<u8>; 2],
    emptied: [Option<CudaEvent>; 2],
}

impl CudaBackend {
    /// A device buffer of `len` elements of `dtype` that `fill` writes a part at a time
    /// ([`canopy_engine::LayerOps::upload_weight_with`]), each part into a staging buffer
    /// that is copied to the device while `fill` writes the next. Returns once the last part
    /// is queued, so that the next weight's first part is read while this one's last is
    /// copied: the buffer is ready in this backend's stream order, and on other streams after
    /// [`CudaBackend::finish_uploads`]. An error from `fill` is returned as it is, once the
    /// copies already queued have ended.
    pub(crate) fn upload_filled<E: From<EngineError>>(
        &self,
        dtype: DType,
        len: usize,
        fill: &mut dyn FnMut(usize, TypedSliceMut) -> Result<(), E>,
    ) -> Result<CudaSlice<u8>, E> {
        let cuda = |e: CudaError| E::from(EngineError::from(e));
        self.refuse_while_capturing("a weight upload")
            .map_err(cuda)?;
        let width = dtype.size_bytes();
        let mut device = self.alloc::<u8>(len * width).map_err(cuda)?;
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        if staging.is_none() {
            // SAFETY: the buffers are written before any copy reads them.
            let buffer = || unsafe { self.ctx.alloc_pinned::<u8>(STAGE_BYTES) };
            let page_locked = "allocating page-locked host memory";
            *staging = Some(Staging {
                buffers: [
                    buffer().ctx(page_locked).map_err(cuda)?,
                    buffer().ctx(page_locked).map_err(cuda)?,
                ],
                emptied: [None, None],
            });
        }
        let staging = staging.as_mut().expect("made above");
        let part_len = STAGE_BYTES / width;
        let (base, guard) = device.device_ptr_mut(&self.stream);
        let mut copy_parts = || -> Result<(), E> {
            for (i, first) in (0..len).step_by(part_len).enumerate() {
                let which = i % 2;
                if let Some(copy) = staging.emptied[which].take() {
                    copy.synchronize().ctx("cuEventSynchronize").map_err(cuda)?;
                }
                let buffer = staging.buffers[which]
                    .as_mut_slice()
                    .ctx("cuEventSynchronize")
                    .map_err(cuda)?;
                let bytes = &mut buffer[..part_len.min(len - first) * width];
                let part = TypedSliceMut::from_bytes_mut(dtype, bytes)
                    .expect("page-locked memory is page-aligned and parts are whole elements");
                fill(first, part)?;
                let at = base + (first * width) as u64;
                // SAFETY: `at..at + bytes.len()` lies inside `device`, and the buffer is not
                // written again before the event recorded after this copy has completed.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(at, &*bytes, self.stream.cu_stream())
                }
                .ctx("cuMemcpyHtoDAsync")
                .map_err(cuda)?;
                let copied = self.stream.record_event(None).ctx("cuEventRecord");
                staging.emptied[which] = Some(copied.map_err(cuda)?);
            }
            Ok(())
        };
        if let Err(e) = copy_parts() {
            // `device` is freed on return: the copies into it end first.
            let _ = self.stream.synchronize();
            return Err(e);
        }
        drop(guard);
        Ok(device)
    }

    /// Waits for every copy [`CudaBackend::upload_filled`] has queued.
    pub(crate) fn finish_uploads(&self) -> crate::error::Result<()> {
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        self.stream.synchronize().ctx("cuStreamSynchronize")?;
        if let Some(staging) = staging.as_mut() {
            staging.emptied = [None, None];
        }
        Ok(())
    }
}
