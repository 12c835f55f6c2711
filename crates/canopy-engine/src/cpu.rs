//! The CPU backend: executes any plan with the blocked f32 flash-decoding kernel of
//! `cpu_decode`, on rayon (a group's KV heads and the pieces of a long context each a
//! task of their own). It is the oracle every GPU test compares against (beside the f64
//! reference) and the backend of CPU-only machines and CI.

use crate::backend::Backend;
use crate::cpu_decode::group_partial;
use crate::{EngineError, Result};
use canopy_comm::Collective;
use canopy_core::{AttnShape, AttnStates, DType, KvElement, Plan, Tail, TypedVec};
use rayon::prelude::*;

#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

pub struct CpuKv {
    shape: AttnShape,
    tokens: usize,
    pub k: TypedVec,
    pub v: TypedVec,
    /// Page size and logical → physical page table, when plans address logical pages.
    paging: Option<(u32, Vec<u32>)>,
}

pub struct CpuQueries {
    shape: AttnShape,
    q: Vec<f32>,
}

impl CpuKv {
    /// The attention shape the pool was allocated for.
    pub fn shape(&self) -> &AttnShape {
        &self.shape
    }

    /// Tokens addressable logically: the page table's extent, or the whole storage.
    fn logical_tokens(&self) -> usize {
        match &self.paging {
            None => self.tokens,
            Some((page, table)) => table.len() * *page as usize,
        }
    }

    /// Refuses logical tokens `0..tokens` beyond what the page table maps.
    fn check_extent(&self, tokens: usize, op: &str) -> Result<()> {
        if tokens > self.logical_tokens() {
            return Err(err(format!(
                "{op} of {tokens} tokens past the {} this KV addresses",
                self.logical_tokens()
            )));
        }
        Ok(())
    }

    /// The physical token ranges behind logical tokens `start..start + n`, in logical order:
    /// through the page table when one is installed, else the same range.
    fn physical(&self, start: usize, n: usize) -> Vec<std::ops::Range<usize>> {
        let logical = start as u32..(start + n) as u32;
        match &self.paging {
            None => vec![start..start + n],
            Some((page, table)) => physical_ranges(logical, *page, table)
                .map(|r| r.start as usize..r.end as usize)
                .collect(),
        }
    }

    /// K and V bytes of logical tokens `0..tokens`, gathered in logical order.
    fn gather(&self, tokens: usize) -> (Vec<u8>, Vec<u8>) {
        let tb = self.shape.kv_token_bytes(self.k.dtype());
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for r in self.physical(0, tokens) {
            k.extend_from_slice(&self.k.as_bytes()[r.start * tb..r.end * tb]);
            v.extend_from_slice(&self.v.as_bytes()[r.start * tb..r.end * tb]);
        }
        (k, v)
    }

    /// Writes one token's `k` and `v` (in the KV's dtype) into physical slot `slot`, whatever
    /// the page table says: where the KV manager placed that token.
    pub(crate) fn write_slot(&mut self, slot: usize, k: &TypedVec, v: &TypedVec) -> Result<()> {
        let per = self.shape.kv_token_elems();
        if slot >= self.tokens || k.len() != per || v.len() != per {
            return Err(err(format!(
                "a write of one token ({} values) into slot {slot} of {} slots of {per}",
                k.len(),
                self.tokens
            )));
        }
        self.k.copy_from(slot * per, k);
        self.v.copy_from(slot * per, v);
        Ok(())
    }

    /// Writes `k` and `v` (whole tokens' bytes) at logical tokens `start..`.
    fn scatter(&mut self, start: usize, k: &[u8], v: &[u8]) {
        let tb = self.shape.kv_token_bytes(self.k.dtype());
        let mut at = 0;
        for r in self.physical(start, k.len() / tb) {
            let len = r.len() * tb;
            self.k.as_bytes_mut()[r.start * tb..r.end * tb].copy_from_slice(&k[at..at + len]);
            self.v.as_bytes_mut()[r.start * tb..r.end * tb].copy_from_slice(&v[at..at + len]);
            at += len;
        }
    }
}

/// The physical token ranges behind logical range `r`, split where its pages do.
fn physical_ranges(
    r: std::ops::Range<u32>,
    page: u32,
    table: &[u32],
) -> impl Iterator<Item = std::ops::Range<u32>> + '_ {
    let mut at = r.start;
    std::iter::from_fn(move || {
        (at < r.end).then(|| {
            let (logical, offset) = (at / page, at % page);
            let len = (page - offset).min(r.end - at);
            at += len;
            let start = table[logical as usize] * page + offset;
            start..start + len
        })
    })
}

fn err(message: String) -> EngineError {
    EngineError::Backend {
        backend: "cpu",
        message,
    }
}

impl Backend for CpuBackend {
    type Kv = CpuKv;
    type Queries = CpuQueries;
    type Plan = Plan;
    type States = AttnStates;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn alloc_kv(&self, shape: &AttnShape, dtype: DType, tokens: usize) -> Result<CpuKv> {
        let n = tokens * shape.kv_token_elems();
        Ok(CpuKv {
            shape: *shape,
            tokens,
            k: TypedVec::zeros(dtype, n),
            v: TypedVec::zeros(dtype, n),
            paging: None,
        })
    }

    fn kv_dtype(&self, kv: &CpuKv) -> DType {
        kv.k.dtype()
    }

    fn set_page_table(&self, kv: &mut CpuKv, page_size: u32, table: &[u32]) -> Result<()> {
        let pages = kv.tokens / page_size.max(1) as usize;
        if page_size == 0 || table.iter().any(|&p| p as usize >= pages) {
            return Err(err(format!(
                "a page table over {pages} pages of {page_size} tokens names a page outside them"
            )));
        }
        kv.paging = Some((page_size, table.to_vec()));
        Ok(())
    }

    fn write_kv(&self, kv: &mut CpuKv, start: usize, k: &TypedVec, v: &TypedVec) -> Result<()> {
        let per = kv.shape.kv_token_elems();
        if k.dtype() != kv.k.dtype()
            || v.dtype() != kv.k.dtype()
            || k.len() != v.len()
            || !k.len().is_multiple_of(per)
        {
            return Err(err(format!(
                "write_kv wants whole tokens of {} (got K {} x {}, V {} x {})",
                kv.k.dtype(),
                k.len(),
                k.dtype(),
                v.len(),
                v.dtype()
            )));
        }
        kv.check_extent(start + k.len() / per, "write_kv")?;
        kv.scatter(start, k.as_bytes(), v.as_bytes());
        Ok(())
    }

    fn upload_queries(&self, shape: &AttnShape, q: &[f32]) -> Result<CpuQueries> {
        if !q.len().is_multiple_of(shape.q_row_elems()) {
            return Err(err(format!(
                "{} query elements are not whole rows of {}",
                q.len(),
                shape.q_row_elems()
            )));
        }
        Ok(CpuQueries {
            shape: *shape,
            q: q.to_vec(),
        })
    }

    fn upload_plan(&self, _shape: &AttnShape, plan: &Plan) -> Result<Plan> {
        Ok(plan.clone())
    }

    fn extend_plan(&self, plan: &mut Plan, tails: &[Tail]) -> Result<()> {
        plan.extend_tails(tails);
        Ok(())
    }

    fn replan(&self, _shape: &AttnShape, plan: &mut Plan, new: &Plan) -> Result<bool> {
        let same = plan.num_queries() == new.num_queries()
            && plan.num_partial_rows() == new.num_partial_rows();
        plan.clone_from(new);
        Ok(same)
    }

    fn alloc_states(&self, shape: &AttnShape, rows: usize) -> Result<AttnStates> {
        Ok(AttnStates::empty(rows, shape.q_heads, shape.head_dim))
    }

    fn alloc_partials(&self, shape: &AttnShape, plan: &Plan) -> Result<AttnStates> {
        self.alloc_states(shape, plan.num_partial_rows())
    }

    fn poison(&self, states: &mut AttnStates) -> Result<()> {
        states.o.fill(f32::NAN);
        states.lse.fill(f32::NAN);
        Ok(())
    }

    fn run_plan(
        &self,
        kv: &CpuKv,
        q: &CpuQueries,
        plan: &Plan,
        out: &mut AttnStates,
    ) -> Result<()> {
        let shape = &q.shape;
        if q.q.len() / shape.q_row_elems() < plan.num_queries() {
            return Err(err(format!(
                "the plan has {} queries but {} were uploaded",
                plan.num_queries(),
                q.q.len() / shape.q_row_elems()
            )));
        }
        let addressable = match &kv.paging {
            Some((page, table)) => table.len() * *page as usize,
            None => kv.tokens,
        };
        if let Some(g) = plan
            .groups()
            .iter()
            .find(|g| g.kv.iter().any(|r| r.end as usize > addressable))
        {
            return Err(err(format!(
                "a group reads {:?}, beyond the {addressable} addressable tokens",
                g.kv
            )));
        }
        // Through a page table, each group reads its pages' physical ranges, in order.
        let physical: Option<Vec<canopy_core::Group>> = kv.paging.as_ref().map(|(page, table)| {
            plan.groups()
                .iter()
                .map(|g| canopy_core::Group {
                    kv: g
                        .kv
                        .iter()
                        .flat_map(|r| physical_ranges(r.clone(), *page, table))
                        .collect(),
                    queries: g.queries.clone(),
                    mask: g.mask.clone(),
                })
                .collect()
        });
        let groups = physical.as_deref().unwrap_or(plan.groups());
        let (h, d) = (shape.q_heads, shape.head_dim);
        if (out.rows, out.heads, out.head_dim) != (plan.num_partial_rows(), h, d) {
            return Err(err(format!(
                "partials buffer is {}x{}x{}, the plan needs {}x{h}x{d}",
                out.rows,
                out.heads,
                out.head_dim,
                plan.num_partial_rows()
            )));
        }
        // Carve the output into each group's rows so groups run in parallel without locks.
        let mut work = Vec::with_capacity(groups.len());
        let (mut o_rest, mut lse_rest) = (out.o.as_mut_slice(), out.lse.as_mut_slice());
        for g in groups {
            let rows = g.queries.len();
            let (o, o_tail) = std::mem::take(&mut o_rest).split_at_mut(rows * h * d);
            let (lse, lse_tail) = std::mem::take(&mut lse_rest).split_at_mut(rows * h);
            o_rest = o_tail;
            lse_rest = lse_tail;
            work.push((g, o, lse));
        }
        fn run<E: KvElement>(
            shape: &AttnShape,
            q: &[f32],
            k: &[E],
            v: &[E],
            work: Vec<(&canopy_core::Group, &mut [f32], &mut [f32])>,
        ) {
            work.into_par_iter()
                .for_each(|(g, o, lse)| group_partial(shape, g, q, k, v, o, lse));
        }
        match (&kv.k, &kv.v) {
            (TypedVec::F32(k), TypedVec::F32(v)) => run(shape, &q.q, k, v, work),
            (TypedVec::F16(k), TypedVec::F16(v)) => run(shape, &q.q, k, v, work),
            (TypedVec::Bf16(k), TypedVec::Bf16(v)) => run(shape, &q.q, k, v, work),
            _ => return Err(err("K and V dtypes differ".into())),
        }
        Ok(())
    }

    fn merge(&self, partials: &AttnStates, plan: &Plan, out: &mut AttnStates) -> Result<()> {
        let (h, d) = (partials.heads, partials.head_dim);
        if (out.rows, out.heads, out.head_dim) != (plan.num_queries(), h, d) {
            let want = format!("{}x{h}x{d}", plan.num_queries());
            return Err(err(format!(
                "output buffer is {}x{}x{}, the plan needs {want}",
                out.rows, out.heads, out.head_dim
            )));
        }
        out.o
            .par_chunks_mut(h * d)
            .zip(out.lse.par_chunks_mut(h))
            .enumerate()
            .for_each(|(qi, (o, lse))| {
                o.fill(0.0);
                lse.fill(canopy_core::EMPTY_LSE);
                for &row in plan.rows_of(qi) {
                    let r = row as usize;
                    for head in 0..h {
                        canopy_core::merge_state(
                            &mut o[head * d..(head + 1) * d],
                            &mut lse[head],
                            partials.o_of(r, head),
                            partials.lse[r * h + head],
                        );
                    }
                }
            });
        Ok(())
    }

    fn download(&self, states: &AttnStates) -> Result<AttnStates> {
        Ok(states.clone())
    }

    fn send_kv<C: Collective>(
        &self,
        kv: &CpuKv,
        tokens: usize,
        comm: &C,
        peer: usize,
    ) -> Result<()> {
        kv.check_extent(tokens, "send_kv")?;
        let (k, v) = kv.gather(tokens);
        comm.send(&k, peer)?;
        comm.send(&v, peer)?;
        Ok(())
    }

    fn recv_kv<C: Collective>(
        &self,
        kv: &mut CpuKv,
        tokens: usize,
        comm: &C,
        peer: usize,
    ) -> Result<()> {
        kv.check_extent(tokens, "recv_kv")?;
        let n = tokens * kv.shape.kv_token_bytes(kv.k.dtype());
        let (mut k, mut v) = (vec![0u8; n], vec![0u8; n]);
        comm.recv(&mut k, peer)?;
        comm.recv(&mut v, peer)?;
        kv.scatter(0, &k, &v);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use canopy_core::{plan, random_tree, Method, PlannerConfig, ProblemData, Shard, TreeView};

    /// A plan read through a shuffled page table equals the same plan over contiguous KV.
    #[test]
    fn paged_kv_reads_what_contiguous_kv_holds() {
        let shape = AttnShape {
            q_heads: 4,
            kv_heads: 2,
            head_dim: 16,
            scale: None,
        };
        let dtype = DType::F32;
        let page = 4u32;
        for seed in 0..8 {
            let tree = random_tree(seed, 12, 23);
            let tokens = tree.total_tokens() as usize;
            let pages = tokens.div_ceil(page as usize);
            let data = ProblemData::random(&shape, dtype, tree.num_queries(), tokens, seed);
            // Logical page i lives at physical page table[i]: a reversed pool.
            let table: Vec<u32> = (0..pages as u32).rev().collect();
            let per = shape.kv_token_elems();
            let b = CpuBackend;
            let mut flat = b.alloc_kv(&shape, dtype, tokens).unwrap();
            b.write_kv(&mut flat, 0, &data.k, &data.v).unwrap();
            let mut paged = b.alloc_kv(&shape, dtype, pages * page as usize).unwrap();
            for (logical, &physical) in table.iter().enumerate() {
                let start = logical * page as usize;
                let end = (start + page as usize).min(tokens);
                let (k, v) = (
                    data.k.slice(start * per..end * per),
                    data.v.slice(start * per..end * per),
                );
                b.write_kv(&mut paged, physical as usize * page as usize, &k, &v)
                    .unwrap();
            }
            b.set_page_table(&mut paged, page, &table).unwrap();
            let shard = Shard::whole(&tree);
            let p = plan(
                &TreeView::new(&tree, &shard),
                Method::DeftFlatten,
                &shape,
                &PlannerConfig::default(),
            )
            .unwrap();
            let q = b.upload_queries(&shape, &data.q).unwrap();
            let run = |kv: &CpuKv| {
                let mut partials = b.alloc_partials(&shape, &p).unwrap();
                let mut out = b.alloc_states(&shape, tree.num_queries()).unwrap();
                b.step(kv, &q, &p, &mut partials, &mut out).unwrap();
                out
            };
            let (want, got) = (run(&flat), run(&paged));
            assert_eq!(want.o, got.o, "seed {seed}");
            assert_eq!(want.lse, got.lse, "seed {seed}");
        }
        let mut kv = CpuBackend.alloc_kv(&shape, dtype, 8).unwrap();
        assert!(
            CpuBackend.set_page_table(&mut kv, 4, &[0, 2]).is_err(),
            "page 2 of 2"
        );
    }
}
