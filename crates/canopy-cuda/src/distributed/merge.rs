//! The cross-rank merge on the device: the combine kernels between NCCL collectives, and the
//! calibration of the merge's cost model on this world's communicators.

use super::RankComms;
use crate::error::{CudaError, DriverContext, Result};
use crate::nccl::{group, NcclComm, NcclOp, Watchdog};
use crate::CudaBackend;
use canopy_engine::cost::{CallKind, CostModel};
use canopy_engine::MergeCollective;
use canopy_kernels::Kernel;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// Device buffers and launches of the cross-rank merge.
pub(super) struct DeviceMerge {
    cells: u32,
    d: u32,
    ranks: usize,
    max: CudaSlice<f32>,
    packed: CudaSlice<f32>,
    gathered: CudaSlice<f32>,
}

impl DeviceMerge {
    pub(super) fn new(
        backend: &CudaBackend,
        cells: usize,
        d: usize,
        ranks: usize,
    ) -> Result<DeviceMerge> {
        Ok(DeviceMerge {
            cells: cells as u32,
            d: d as u32,
            ranks,
            max: backend.alloc(cells)?,
            packed: backend.alloc(cells * (d + 1))?,
            gathered: backend.alloc(ranks * cells * (d + 1))?,
        })
    }

    /// A grid-stride launch over the cells × (d + 1) elements of a combine kernel.
    fn grid(&self, backend: &CudaBackend) -> LaunchConfig {
        let n = self.cells as u64 * (self.d as u64 + 1);
        let blocks = n
            .div_ceil(256)
            .min(4 * backend.gpu().multiprocessors as u64)
            .max(1) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Times this world's all-reduce and all-gather at the merge's two payload sizes and fits
    /// the cost model; every rank takes the slowest rank's timings, so all choose alike.
    pub(super) fn calibrate(
        &mut self,
        backend: &CudaBackend,
        world: &NcclComm,
        watchdog: &Watchdog,
    ) -> Result<CostModel> {
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        const REPS: usize = 20;
        let stream = backend.stream();
        let mut slowest = backend.alloc::<f32>(1)?;
        CostModel::calibrate(
            self.ranks,
            self.cells as u64,
            self.d as u64,
            |kind, bytes| -> Result<f64> {
                let n = (bytes / 4) as usize;
                let mut one = || match kind {
                    CallKind::AllGather => world.all_gather(
                        "all_gather(calibration)",
                        &self.packed.slice(0..n),
                        &mut self.gathered.slice_mut(0..n * self.ranks),
                    ),
                    _ => world.all_reduce_in_place(
                        "all_reduce(calibration)",
                        &mut self.packed.slice_mut(0..n),
                        NcclOp::Sum,
                    ),
                };
                one()?;
                let start = stream
                    .record_event(Some(CU_EVENT_DEFAULT))
                    .ctx("cuEventRecord")?;
                for _ in 0..REPS {
                    one()?;
                }
                let end = stream
                    .record_event(Some(CU_EVENT_DEFAULT))
                    .ctx("cuEventRecord")?;
                watchdog.wait(&end, &[world])?;
                let us = start.elapsed_ms(&end).ctx("cuEventElapsedTime")? * 1e3 / REPS as f32;
                stream
                    .memcpy_htod(&[us], &mut slowest)
                    .ctx("cuMemcpyHtoD")?;
                world.all_reduce_in_place(
                    "all_reduce(calibration max)",
                    &mut slowest,
                    NcclOp::Max,
                )?;
                Ok(f64::from(
                    stream.clone_dtoh(&slowest).ctx("cuMemcpyDtoH")?[0],
                ))
            },
        )
    }

    /// The weights `exp(lse - max)` and weighted outputs of this rank's states into `packed`.
    fn weights(
        &mut self,
        backend: &CudaBackend,
        o: &CudaSlice<f32>,
        lse: &CudaSlice<f32>,
    ) -> Result<()> {
        let f = backend.function(Kernel::Combine("combine_weights"))?;
        let grid = self.grid(backend);
        let mut b = backend.stream().launch_builder(&f);
        b.arg(o)
            .arg(lse)
            .arg(&self.max)
            .arg(&mut self.packed)
            .arg(&self.cells)
            .arg(&self.d);
        // SAFETY: reads cells × (d + 1) floats and writes as many into `packed`.
        unsafe { b.launch(grid) }.ctx("launching combine_weights")?;
        Ok(())
    }

    /// Normalised (o, lse) from the summed `packed` and `max`.
    fn finish(
        &self,
        backend: &CudaBackend,
        o: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let f = backend.function(Kernel::Combine("combine_finish"))?;
        let mut b = backend.stream().launch_builder(&f);
        b.arg(&self.packed)
            .arg(&self.max)
            .arg(o)
            .arg(lse)
            .arg(&self.cells)
            .arg(&self.d);
        // SAFETY: reads `packed` and `max`, writes cells × d outputs and cells lse.
        unsafe { b.launch(self.grid(backend)) }.ctx("launching combine_finish")?;
        Ok(())
    }

    /// This rank's lse into `max`, then MAX over `comm`.
    fn max_over(
        &mut self,
        backend: &CudaBackend,
        comm: &NcclComm,
        lse: &CudaSlice<f32>,
    ) -> Result<()> {
        backend
            .stream()
            .memcpy_dtod(&lse.slice(0..self.cells as usize), &mut self.max)
            .ctx("cuMemcpyDtoD")?;
        comm.all_reduce_in_place("all_reduce(max)", &mut self.max, NcclOp::Max)
    }

    /// The paper's all-reduce merge over `comm`: MAX, then the numerator and denominator
    /// summed in two calls (`fused = false`) or one.
    fn all_reduce_merge(
        &mut self,
        backend: &CudaBackend,
        comm: &NcclComm,
        fused: bool,
        o: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (cells, n) = (self.cells as usize, (self.cells * self.d) as usize);
        self.max_over(backend, comm, lse)?;
        self.weights(backend, o, lse)?;
        if fused {
            comm.all_reduce_in_place("all_reduce(packed)", &mut self.packed, NcclOp::Sum)?;
        } else {
            comm.all_reduce_in_place(
                "all_reduce(numerator)",
                &mut self.packed.slice_mut(0..n),
                NcclOp::Sum,
            )?;
            comm.all_reduce_in_place(
                "all_reduce(denominator)",
                &mut self.packed.slice_mut(n..n + cells),
                NcclOp::Sum,
            )?;
        }
        self.finish(backend, o, lse)
    }

    /// Replaces this rank's (o, lse) with the merge over all ranks.
    pub(super) fn run(
        &mut self,
        backend: &CudaBackend,
        comms: &RankComms,
        how: MergeCollective,
        o: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if self.ranks == 1 {
            return Ok(());
        }
        let stream = backend.stream();
        let (cells, n) = (self.cells as usize, (self.cells * self.d) as usize);
        match how {
            MergeCollective::Allreduce3 => {
                self.all_reduce_merge(backend, &comms.world, false, o, lse)
            }
            MergeCollective::Allreduce2 => {
                self.all_reduce_merge(backend, &comms.world, true, o, lse)
            }
            MergeCollective::Allgather => {
                stream
                    .memcpy_dtod(&o.slice(0..n), &mut self.packed.slice_mut(0..n))
                    .ctx("cuMemcpyDtoD")?;
                stream
                    .memcpy_dtod(
                        &lse.slice(0..cells),
                        &mut self.packed.slice_mut(n..n + cells),
                    )
                    .ctx("cuMemcpyDtoD")?;
                comms
                    .world
                    .all_gather("all_gather", &self.packed, &mut self.gathered)?;
                let ranks = self.ranks as u32;
                let f = backend.function(Kernel::Combine("combine_gathered"))?;
                let mut b = stream.launch_builder(&f);
                b.arg(&self.gathered)
                    .arg(&ranks)
                    .arg(&mut *o)
                    .arg(&mut *lse)
                    .arg(&self.cells)
                    .arg(&self.d);
                // SAFETY: reads ranks × cells × (d + 1) gathered floats, writes one state per
                // cell.
                unsafe { b.launch(self.grid(backend)) }.ctx("launching combine_gathered")?;
                Ok(())
            }
            MergeCollective::Hierarchical => {
                let node = comms.node.as_ref().ok_or_else(|| {
                    CudaError::Unsupported("hierarchical merge without a node communicator".into())
                })?;
                if node.size() > 1 {
                    // Inside the node: MAX, then the weighted sums reduced onto the leader.
                    self.max_over(backend, node, lse)?;
                    self.weights(backend, o, lse)?;
                    node.reduce_in_place("reduce(packed, node)", &mut self.packed, NcclOp::Sum, 0)?;
                    if node.rank() == 0 {
                        self.finish(backend, o, lse)?;
                    }
                }
                if let Some(leaders) = comms.leaders.as_ref().filter(|l| l.size() > 1) {
                    self.all_reduce_merge(backend, leaders, true, o, lse)?;
                }
                if node.size() > 1 {
                    group(node.rank(), || {
                        node.broadcast_in_place("broadcast(o, node)", &mut o.slice_mut(0..n), 0)?;
                        node.broadcast_in_place(
                            "broadcast(lse, node)",
                            &mut lse.slice_mut(0..cells),
                            0,
                        )
                    })?;
                }
                Ok(())
            }
            MergeCollective::Auto => Err(CudaError::Unsupported(
                "the auto collective must be resolved before the timed steps".into(),
            )),
        }
    }
}
