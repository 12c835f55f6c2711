//! The cross-rank merge on the device: the combine kernels between NCCL collectives, and the
//! calibration of the merge's cost model on this world's communicators.

use super::RankComms;
use crate::backend::CudaStates;
use crate::error::{CudaError, DriverContext, Result};
use crate::nccl::{group, NcclComm, NcclOp, Watchdog};
use crate::CudaBackend;
use canopy_engine::cost::{CallKind, CostModel};
use canopy_engine::{MergeCollective, MergeOps};
use cudarc::driver::CudaSlice;

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

    /// This rank's lse into `max`, then MAX over `comm`.
    fn max_over(
        &mut self,
        backend: &CudaBackend,
        comm: &NcclComm,
        states: &CudaStates,
    ) -> Result<()> {
        backend
            .copy_lse(states, &mut self.max)
            .map_err(CudaError::from)?;
        comm.all_reduce_in_place("all_reduce(max)", &mut self.max, NcclOp::Max)
    }

    /// The paper's all-reduce merge over `comm`: MAX, then the numerator and denominator
    /// summed in two calls (`fused = false`) or one.
    fn all_reduce_merge(
        &mut self,
        backend: &CudaBackend,
        comm: &NcclComm,
        fused: bool,
        states: &mut CudaStates,
    ) -> Result<()> {
        let (cells, n) = (self.cells as usize, (self.cells * self.d) as usize);
        self.max_over(backend, comm, states)?;
        backend
            .combine_weights(states, &self.max, &mut self.packed)
            .map_err(CudaError::from)?;
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
        backend
            .combine_finish(&self.packed, &self.max, states)
            .map_err(CudaError::from)
    }

    /// Replaces this rank's states with the merge over all ranks.
    pub(super) fn run(
        &mut self,
        backend: &CudaBackend,
        comms: &RankComms,
        how: MergeCollective,
        states: &mut CudaStates,
    ) -> Result<()> {
        if self.ranks == 1 {
            return Ok(());
        }
        let (cells, n) = (self.cells as usize, (self.cells * self.d) as usize);
        match how {
            MergeCollective::Allreduce3 => {
                self.all_reduce_merge(backend, &comms.world, false, states)
            }
            MergeCollective::Allreduce2 => {
                self.all_reduce_merge(backend, &comms.world, true, states)
            }
            MergeCollective::Allgather => {
                backend
                    .pack_states(states, &mut self.packed, 0)
                    .map_err(CudaError::from)?;
                comms
                    .world
                    .all_gather("all_gather", &self.packed, &mut self.gathered)?;
                backend
                    .combine_gathered(&self.gathered, self.ranks, states)
                    .map_err(CudaError::from)
            }
            MergeCollective::Hierarchical => {
                let node = comms.node.as_ref().ok_or_else(|| {
                    CudaError::Unsupported("hierarchical merge without a node communicator".into())
                })?;
                if node.size() > 1 {
                    // Inside the node: MAX, then the weighted sums reduced onto the leader.
                    self.max_over(backend, node, states)?;
                    backend
                        .combine_weights(states, &self.max, &mut self.packed)
                        .map_err(CudaError::from)?;
                    node.reduce_in_place("reduce(packed, node)", &mut self.packed, NcclOp::Sum, 0)?;
                    if node.rank() == 0 {
                        backend
                            .combine_finish(&self.packed, &self.max, states)
                            .map_err(CudaError::from)?;
                    }
                }
                if let Some(leaders) = comms.leaders.as_ref().filter(|l| l.size() > 1) {
                    self.all_reduce_merge(backend, leaders, true, states)?;
                }
                if node.size() > 1 {
                    group(node.rank(), || {
                        node.broadcast_in_place(
                            "broadcast(o, node)",
                            &mut states.o.slice_mut(0..n),
                            0,
                        )?;
                        node.broadcast_in_place(
                            "broadcast(lse, node)",
                            &mut states.lse.slice_mut(0..cells),
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
