//! The CPU backend's [`MergeOps`]: host vectors and the merge's elementwise steps as loops,
//! in the order the GPU's combine kernels take them.

use crate::cpu::CpuBackend;
use crate::layer_ops::expect_room;
use crate::merge::MergeOps;
use crate::{EngineError, Result};
use canopy_core::{merge_state, AttnStates, EMPTY_LSE};
use std::ops::Range;

fn err(message: String) -> EngineError {
    EngineError::Backend {
        backend: "cpu",
        message,
    }
}

/// `exp(lse - max)`, with empty states (and all-empty columns) weighing zero.
fn weight(lse: f32, max: f32) -> f32 {
    if lse == EMPTY_LSE {
        0.0
    } else {
        (lse - max).exp()
    }
}

impl MergeOps for CpuBackend {
    type Buf = Vec<f32>;

    fn alloc_buf(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn buf_to_host(&self, buf: &Vec<f32>, range: Range<usize>) -> Result<Vec<f32>> {
        expect_room("cpu", "buf_to_host", buf.len(), range.end)?;
        Ok(buf[range].to_vec())
    }

    fn buf_from_host(&self, host: &[f32], buf: &mut Vec<f32>, at: usize) -> Result<()> {
        expect_room("cpu", "buf_from_host", buf.len(), at + host.len())?;
        buf[at..at + host.len()].copy_from_slice(host);
        Ok(())
    }

    fn copy_lse(&self, states: &AttnStates, max: &mut Vec<f32>) -> Result<()> {
        self.buf_from_host(&states.lse, max, 0)
    }

    fn combine_weights(&self, s: &AttnStates, max: &Vec<f32>, packed: &mut Vec<f32>) -> Result<()> {
        let (cells, d) = (s.lse.len(), s.head_dim);
        expect_room("cpu", "combine_weights", max.len(), cells)?;
        expect_room("cpu", "combine_weights", packed.len(), cells * (d + 1))?;
        let (num, den) = packed.split_at_mut(cells * d);
        for i in 0..cells {
            let w = weight(s.lse[i], max[i]);
            den[i] = w;
            num[i * d..(i + 1) * d]
                .iter_mut()
                .zip(&s.o[i * d..(i + 1) * d])
                .for_each(|(n, &o)| *n = o * w);
        }
        Ok(())
    }

    fn combine_finish(&self, packed: &Vec<f32>, max: &Vec<f32>, s: &mut AttnStates) -> Result<()> {
        let (cells, d) = (s.lse.len(), s.head_dim);
        expect_room("cpu", "combine_finish", max.len(), cells)?;
        expect_room("cpu", "combine_finish", packed.len(), cells * (d + 1))?;
        let (num, den) = packed.split_at(cells * d);
        for i in 0..cells {
            let o = &mut s.o[i * d..(i + 1) * d];
            if den[i] > 0.0 {
                o.iter_mut()
                    .zip(&num[i * d..(i + 1) * d])
                    .for_each(|(o, &n)| *o = n / den[i]);
                s.lse[i] = max[i] + den[i].ln();
            } else {
                o.fill(0.0);
                s.lse[i] = EMPTY_LSE;
            }
        }
        Ok(())
    }

    fn pack_states(&self, s: &AttnStates, buf: &mut Vec<f32>, at: usize) -> Result<()> {
        self.buf_from_host(&s.o, buf, at)?;
        self.buf_from_host(&s.lse, buf, at + s.o.len())
    }

    fn combine_gathered(
        &self,
        gathered: &Vec<f32>,
        count: usize,
        s: &mut AttnStates,
    ) -> Result<()> {
        let (n, cells, d) = (s.o.len(), s.lse.len(), s.head_dim);
        expect_room(
            "cpu",
            "combine_gathered",
            gathered.len(),
            count * (n + cells),
        )?;
        self.clear_states(s)?;
        for packed in gathered.chunks(n + cells).take(count) {
            let (o, lse) = packed.split_at(n);
            for i in 0..cells {
                merge_state(
                    &mut s.o[i * d..(i + 1) * d],
                    &mut s.lse[i],
                    &o[i * d..(i + 1) * d],
                    lse[i],
                );
            }
        }
        Ok(())
    }

    fn merge_into(&self, acc: &mut AttnStates, x: &AttnStates) -> Result<()> {
        if (acc.rows, acc.heads, acc.head_dim) != (x.rows, x.heads, x.head_dim) {
            return Err(err("merge_into: states of different shapes".into()));
        }
        acc.merge_from(x);
        Ok(())
    }

    fn clear_states(&self, s: &mut AttnStates) -> Result<()> {
        s.o.fill(0.0);
        s.lse.fill(EMPTY_LSE);
        Ok(())
    }
}
