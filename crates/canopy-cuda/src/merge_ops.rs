//! The CUDA backend's [`MergeOps`]: device buffers and the combine kernels (`combine.cu`)
//! that run between the cross-rank merge's collectives, on the backend's stream.

use crate::backend::{CudaBackend, CudaStates};
use crate::error::{CudaError, DriverContext, Result};
use crate::launch::Params;
use canopy_core::DType;
use canopy_engine::layer_ops::expect_room;
use canopy_engine::{MergeOps, Result as EResult};
use canopy_kernels::{dtype_code, Kernel};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use std::ops::Range;

/// `(cells, d)` of states, as the kernels take them.
fn dims(s: &CudaStates) -> (u32, u32) {
    ((s.rows * s.heads) as u32, s.head_dim as u32)
}

impl CudaBackend {
    /// `x` merged into `acc` (`combine_pair`), which also writes the merged outputs rounded to
    /// a 16-bit dtype into `rounded` where given (`rows × heads · head_dim` elements).
    pub(crate) fn combine_pair(
        &self,
        acc: &mut CudaStates,
        x: &CudaStates,
        rounded: Option<(&CudaSlice<u16>, DType)>,
    ) -> Result<()> {
        if (acc.rows, acc.heads, acc.head_dim) != (x.rows, x.heads, x.head_dim) {
            return Err(CudaError::Unsupported(
                "merge_into: states of different shapes".into(),
            ));
        }
        let (cells, d) = dims(acc);
        let f = self.function(Kernel::Combine("combine_pair"))?;
        let s = self.stream();
        let params = Params::default()
            .buffer(&acc.o, s)
            .buffer(&acc.lse, s)
            .buffer(&x.o, s)
            .buffer(&x.lse, s)
            .u32(d)
            .optional_buffer(rounded.map(|(buf, _)| buf), s)
            .u32(rounded.map_or(0, |(_, dtype)| dtype_code(dtype)));
        let grid = LaunchConfig {
            grid_dim: (cells.max(1), 1, 1),
            block_dim: (d.min(128), 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one block per cell of two states of the same shape (checked); reads and
        // writes cells × d outputs and cells lse, and writes cells × d elements of `rounded`
        // (the caller's word).
        unsafe { self.launch_params(&f, grid, &params, false) }.ctx("launching combine_pair")?;
        Ok(())
    }

    /// A grid-stride launch over the `cells × (d + 1)` elements of a combine kernel.
    fn combine_grid(&self, cells: u32, d: u32) -> LaunchConfig {
        let n = cells as u64 * (d as u64 + 1);
        let blocks = n
            .div_ceil(256)
            .min(4 * self.gpu().multiprocessors as u64)
            .max(1) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

impl MergeOps for CudaBackend {
    type Buf = CudaSlice<f32>;

    fn alloc_buf(&self, len: usize) -> EResult<CudaSlice<f32>> {
        // A recorded pass reads the merge buffers of its attention, whose generation moves
        // when they are made anew.
        self.refuse_while_capturing("a merge buffer")?;
        Ok(self.alloc(len)?)
    }

    fn buf_to_host(&self, buf: &CudaSlice<f32>, range: Range<usize>) -> EResult<Vec<f32>> {
        expect_room("cuda", "buf_to_host", buf.len(), range.end)?;
        let host = self
            .stream()
            .clone_dtoh(&buf.slice(range))
            .ctx("cuMemcpyDtoH")?;
        Ok(host)
    }

    fn buf_from_host(&self, host: &[f32], buf: &mut CudaSlice<f32>, at: usize) -> EResult<()> {
        expect_room("cuda", "buf_from_host", buf.len(), at + host.len())?;
        if !host.is_empty() {
            self.stream()
                .memcpy_htod(host, &mut buf.slice_mut(at..at + host.len()))
                .ctx("cuMemcpyHtoD")?;
        }
        Ok(())
    }

    fn copy_lse(&self, s: &CudaStates, max: &mut CudaSlice<f32>) -> EResult<()> {
        let cells = s.rows * s.heads;
        expect_room("cuda", "copy_lse", max.len(), cells)?;
        self.stream()
            .memcpy_dtod(&s.lse.slice(0..cells), &mut max.slice_mut(0..cells))
            .ctx("cuMemcpyDtoD")?;
        Ok(())
    }

    fn combine_weights(
        &self,
        s: &CudaStates,
        max: &CudaSlice<f32>,
        packed: &mut CudaSlice<f32>,
    ) -> EResult<()> {
        let (cells, d) = dims(s);
        expect_room("cuda", "combine_weights", max.len(), cells as usize)?;
        expect_room(
            "cuda",
            "combine_weights",
            packed.len(),
            (cells * (d + 1)) as usize,
        )?;
        let f = self.function(Kernel::Combine("combine_weights"))?;
        let mut b = self.stream().launch_builder(&f);
        b.arg(&s.o)
            .arg(&s.lse)
            .arg(max)
            .arg(packed)
            .arg(&cells)
            .arg(&d);
        // SAFETY: reads cells × (d + 1) values of the states and cells of `max`, writes
        // cells × (d + 1) into `packed` (all checked above).
        unsafe { b.launch(self.combine_grid(cells, d)) }.ctx("launching combine_weights")?;
        Ok(())
    }

    fn combine_finish(
        &self,
        packed: &CudaSlice<f32>,
        max: &CudaSlice<f32>,
        s: &mut CudaStates,
    ) -> EResult<()> {
        let (cells, d) = dims(s);
        expect_room("cuda", "combine_finish", max.len(), cells as usize)?;
        expect_room(
            "cuda",
            "combine_finish",
            packed.len(),
            (cells * (d + 1)) as usize,
        )?;
        let f = self.function(Kernel::Combine("combine_finish"))?;
        let mut b = self.stream().launch_builder(&f);
        b.arg(packed)
            .arg(max)
            .arg(&mut s.o)
            .arg(&mut s.lse)
            .arg(&cells)
            .arg(&d);
        // SAFETY: reads `packed` and `max` (checked), writes one state per cell.
        unsafe { b.launch(self.combine_grid(cells, d)) }.ctx("launching combine_finish")?;
        Ok(())
    }

    fn pack_states(&self, s: &CudaStates, buf: &mut CudaSlice<f32>, at: usize) -> EResult<()> {
        let (cells, n) = (s.rows * s.heads, s.rows * s.heads * s.head_dim);
        expect_room("cuda", "pack_states", buf.len(), at + n + cells)?;
        let stream = self.stream();
        stream
            .memcpy_dtod(&s.o.slice(0..n), &mut buf.slice_mut(at..at + n))
            .ctx("cuMemcpyDtoD")?;
        stream
            .memcpy_dtod(
                &s.lse.slice(0..cells),
                &mut buf.slice_mut(at + n..at + n + cells),
            )
            .ctx("cuMemcpyDtoD")?;
        Ok(())
    }

    fn combine_gathered(
        &self,
        gathered: &CudaSlice<f32>,
        count: usize,
        s: &mut CudaStates,
    ) -> EResult<()> {
        let (cells, d) = dims(s);
        expect_room(
            "cuda",
            "combine_gathered",
            gathered.len(),
            count * (cells * (d + 1)) as usize,
        )?;
        let count = count as u32;
        let f = self.function(Kernel::Combine("combine_gathered"))?;
        let mut b = self.stream().launch_builder(&f);
        b.arg(gathered)
            .arg(&count)
            .arg(&mut s.o)
            .arg(&mut s.lse)
            .arg(&cells)
            .arg(&d);
        // SAFETY: reads `count` packed states of cells × (d + 1) values (checked), writes one
        // state per cell.
        unsafe { b.launch(self.combine_grid(cells, d)) }.ctx("launching combine_gathered")?;
        Ok(())
    }

    fn merge_into(&self, acc: &mut CudaStates, x: &CudaStates) -> EResult<()> {
        Ok(self.combine_pair(acc, x, None)?)
    }

    fn clear_states(&self, s: &mut CudaStates) -> EResult<()> {
        let stream = self.stream();
        stream.memset_zeros(&mut s.o).ctx("cuMemsetD8Async")?;
        let empty = vec![f32::NEG_INFINITY; s.lse.len()];
        stream.memcpy_htod(&empty, &mut s.lse).ctx("cuMemcpyHtoD")?;
        Ok(())
    }
}
