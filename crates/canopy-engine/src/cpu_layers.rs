//! The CPU backend's [`LayerOps`]: host f32 matrices and the ops of [`crate::host_ops`]
//! (GEMMs on the `gemm` crate, the rest on rayon). Weights of any dtype are widened to f32 at
//! upload, so the CPU computes what a GPU computes from the same rounded weights; a quantized
//! model's weights read in f32 are kept as their codes ([`CpuWeight`]), whose values are the
//! same.

use crate::cpu::{CpuBackend, CpuKv, CpuQueries};
use crate::cpu_weight::CpuWeight;
use crate::host_ops::{causal_attention, rms_norm, rope_in_place, swiglu, CodedPanels};
use crate::layer_ops::{
    check_logit_places, check_logprob_terms, check_pick_logits, check_softmax_totals,
    check_top_logits, check_walk_tails, expect_gather, expect_size, expect_states_gather, KeyBlock,
    LayerOps, ModelNeeds,
};
use crate::{Backend, EngineError, Result};
use canopy_core::logits::{top_tokens, TailWalk};
use canopy_core::{
    AttnShape, AttnStates, CodedMatrix, CodedSliceMut, DType, TypedSliceMut, TypedVec,
};

/// A row-major `rows × cols` f32 matrix on the host: the CPU's activations and weights.
#[derive(Debug, Clone, PartialEq)]
pub struct HostMatrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

/// `m` as a KV cache of `dtype` holds it: rounded, or as it is in f32.
fn as_cached(m: &HostMatrix, dtype: DType) -> std::borrow::Cow<'_, [f32]> {
    match dtype {
        DType::F32 => std::borrow::Cow::Borrowed(&m.data),
        _ => m.data.iter().map(|&x| dtype.round(x)).collect(),
    }
}

fn err(message: String) -> EngineError {
    EngineError::Backend {
        backend: "cpu",
        message,
    }
}

/// Refuses a product `x · wᵀ` whose inner sizes disagree or whose output is not `x.rows ×
/// out_cols`.
fn check_matmul(
    op: &str,
    x: &HostMatrix,
    w: &CpuWeight,
    out: &HostMatrix,
    out_cols: usize,
) -> Result<()> {
    expect_size("cpu", op, "the weight's columns", w.dims().1, x.cols)?;
    expect_size("cpu", op, "the output's rows", out.rows, x.rows)?;
    expect_size("cpu", op, "the output's columns", out.cols, out_cols)
}

/// Host bytes a rank's thread holds in the allocator's heap beyond the buffers it asks for.
/// The binary's allocator (mimalloc) backs its arenas with transparent huge pages, and each
/// thread's heap touches a few 2 MiB pages, one where it first allocates each range of sizes:
/// `generate` on SmolLM2 peaked 12.3-12.6 MB higher a thread rank from 1 to 128 ranks.
const RANK_THREAD_HEAP: u64 = 16 << 20;

/// Host bytes one rank's forward pass holds at once on the CPU: each of `max_rows` rows'
/// activations (the residual stream, its norm and a projection's output; q, the states and
/// the attention output; k and v; the MLP's gate and up), each of the `attention_rows` rows a
/// prefill's attention gathers from every rank, and the logits of the pass and of those a
/// decode loop keeps.
///
/// A gathered row holds five copies of a row of states at once: its query, its attention
/// states (`o` and the log-normaliser), the merge's packed states (and maxima), the collective's
/// staged copy of them, and the output taken from the merge.
pub fn pass_bytes(needs: &ModelNeeds) -> u64 {
    let s = &needs.shape;
    let row_floats = 3 * needs.hidden
        + 3 * s.q_row_elems()
        + s.q_heads
        + 2 * s.kv_token_elems()
        + 2 * needs.intermediate;
    let attention_floats = 5 * (s.q_row_elems() + s.q_heads);
    let floats = (needs.max_rows as u64)
        .saturating_mul(row_floats as u64)
        .saturating_add((needs.attention_rows as u64).saturating_mul(attention_floats as u64))
        .saturating_add((needs.logit_rows as u64).saturating_mul(needs.vocab as u64));
    floats.saturating_mul(4)
}

impl LayerOps for CpuBackend {
    type Tensor = HostMatrix;
    type Weight = CpuWeight;
    /// The CPU records nothing: no graph exists.
    type Graph = std::convert::Infallible;

    fn preferred_dtype(&self) -> DType {
        DType::F32
    }

    fn check_model(&self, needs: &ModelNeeds) -> Result<()> {
        let s = &needs.shape;
        if s.kv_heads == 0 || !s.q_heads.is_multiple_of(s.kv_heads) {
            return Err(err(format!(
                "{} query heads cannot share {} KV heads evenly",
                s.q_heads, s.kv_heads
            )));
        }
        if !s.head_dim.is_multiple_of(2) {
            return Err(err(format!(
                "head dim {} is odd; RoPE rotates pairs of dimensions",
                s.head_dim
            )));
        }
        let ranks = needs.ranks_here.max(1);
        let per_rank = pass_bytes(needs).saturating_add(RANK_THREAD_HEAP);
        crate::memory::ensure_host_fits(
            needs
                .kv_bytes()
                .saturating_add(per_rank.saturating_mul(ranks as u64)),
            &format!(
                "the KV cache ({} layers × {} tokens) and {ranks} rank(s)' passes and heaps \
                 ({:.1} MiB each)",
                needs.layers,
                needs.kv_tokens,
                per_rank as f64 / (1u64 << 20) as f64
            ),
        )
    }

    fn upload_weight(&self, data: &TypedVec, rows: usize, cols: usize) -> Result<CpuWeight> {
        expect_size(
            "cpu",
            "upload_weight",
            "the element count",
            data.len(),
            rows * cols,
        )?;
        Ok(CpuWeight::Dense(HostMatrix {
            rows,
            cols,
            data: data.to_f32_vec(),
        }))
    }

    /// The whole weight as one part. The CPU computes in f32: a weight read in f32 is kept as
    /// read, with no copy; one read in a 16-bit dtype is widened once.
    fn upload_weight_with<E: From<EngineError>>(
        &self,
        dtype: DType,
        (rows, cols): (usize, usize),
        fill: &mut dyn FnMut(usize, TypedSliceMut) -> Result<(), E>,
    ) -> Result<CpuWeight, E> {
        let mut data = TypedVec::zeros(dtype, rows * cols);
        fill(0, data.slice_mut(0..rows * cols))?;
        let data = match data {
            TypedVec::F32(values) => values,
            other => other.to_f32_vec(),
        };
        Ok(CpuWeight::Dense(HostMatrix { rows, cols, data }))
    }

    /// The whole weight as one part, kept as its codes; in f32 where its groups cannot be
    /// packed.
    fn upload_coded_weight<E: From<EngineError>>(
        &self,
        (rows, cols): (usize, usize),
        group: usize,
        fill: &mut dyn FnMut(usize, CodedSliceMut) -> Result<(), E>,
    ) -> Option<Result<CpuWeight, E>> {
        if !CodedPanels::packs_groups_of(group) {
            return None;
        }
        let mut coded = CodedMatrix::zeros(rows, cols, group)?;
        Some(fill(0, coded.slice_mut()).map(|()| CpuWeight::Coded(CodedPanels::pack(&coded))))
    }

    fn tensor(&self, rows: usize, cols: usize) -> Result<HostMatrix> {
        Ok(HostMatrix {
            rows,
            cols,
            data: vec![0.0; rows * cols],
        })
    }

    fn upload_tensor(&self, data: &[f32], rows: usize, cols: usize) -> Result<HostMatrix> {
        expect_size(
            "cpu",
            "upload_tensor",
            "the element count",
            data.len(),
            rows * cols,
        )?;
        Ok(HostMatrix {
            rows,
            cols,
            data: data.to_vec(),
        })
    }

    fn download_tensor(&self, t: &HostMatrix) -> Result<Vec<f32>> {
        Ok(t.data.clone())
    }

    fn dims(&self, t: &HostMatrix) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn gather_rows(&self, src: &HostMatrix, rows: &[usize], out: &mut HostMatrix) -> Result<()> {
        expect_size(
            "cpu",
            "gather_rows",
            "the output's columns",
            out.cols,
            src.cols,
        )?;
        expect_gather("cpu", rows, src.rows, out.rows)?;
        let c = src.cols;
        for (to, &from) in out.data.chunks_exact_mut(c).zip(rows) {
            to.copy_from_slice(&src.data[from * c..(from + 1) * c]);
        }
        Ok(())
    }

    fn gather_states(&self, src: &AttnStates, rows: &[usize], out: &mut AttnStates) -> Result<()> {
        let (heads, d) = (src.heads, src.head_dim);
        let dims = |s: &AttnStates| (s.rows, s.heads, s.head_dim);
        expect_states_gather("cpu", rows, dims(src), dims(out))?;
        for (i, &from) in rows.iter().enumerate() {
            out.lse[i * heads..(i + 1) * heads]
                .copy_from_slice(&src.lse[from * heads..(from + 1) * heads]);
            let (to, from) = (i * heads * d, from * heads * d);
            out.o[to..to + heads * d].copy_from_slice(&src.o[from..from + heads * d]);
        }
        Ok(())
    }

    fn tensor_buf<'t>(&self, t: &'t HostMatrix) -> &'t Vec<f32> {
        &t.data
    }

    fn tensor_buf_mut<'t>(&self, t: &'t mut HostMatrix) -> &'t mut Vec<f32> {
        &mut t.data
    }

    fn embed(&self, table: &CpuWeight, ids: &[u32], out: &mut HostMatrix) -> Result<()> {
        let (rows, h) = table.dims();
        expect_size("cpu", "embed", "the output's rows", out.rows, ids.len())?;
        expect_size("cpu", "embed", "the output's columns", out.cols, h)?;
        for (row, &id) in out.data.chunks_mut(h).zip(ids) {
            if id as usize >= rows {
                return Err(err(format!(
                    "token id {id} is outside the embedding table of {rows} rows"
                )));
            }
            table.copy_row(id as usize, row);
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &HostMatrix,
        weight: &CpuWeight,
        eps: f32,
        out: &mut HostMatrix,
    ) -> Result<()> {
        let weight = weight.values("rms_norm")?;
        expect_size(
            "cpu",
            "rms_norm",
            "the weight's length",
            weight.len(),
            x.cols,
        )?;
        expect_size(
            "cpu",
            "rms_norm",
            "the output's size",
            out.data.len(),
            x.data.len(),
        )?;
        rms_norm(&x.data, weight, eps, &mut out.data);
        Ok(())
    }

    fn matmul(&self, x: &HostMatrix, w: &CpuWeight, out: &mut HostMatrix) -> Result<()> {
        check_matmul("matmul", x, w, out, w.dims().0)?;
        w.product(x, &mut out.data, false);
        Ok(())
    }

    fn matmul_add(&self, x: &HostMatrix, w: &CpuWeight, acc: &mut HostMatrix) -> Result<()> {
        check_matmul("matmul_add", x, w, acc, w.dims().0)?;
        w.product(x, &mut acc.data, true);
        Ok(())
    }

    fn matmul_swiglu(&self, x: &HostMatrix, w: &CpuWeight, out: &mut HostMatrix) -> Result<()> {
        let n = w.dims().0;
        if !n.is_multiple_of(2) {
            return Err(err(format!(
                "matmul_swiglu: a fused gate|up weight has an even number of rows, not {n}"
            )));
        }
        check_matmul("matmul_swiglu", x, w, out, n / 2)?;
        let mut gate_up = vec![0.0; x.rows * n];
        w.product(x, &mut gate_up, false);
        swiglu(&gate_up, out.cols, &mut out.data);
        Ok(())
    }

    fn rope_split(
        &self,
        qkv: &HostMatrix,
        positions: &[u32],
        inv_freq: &CpuWeight,
        q: &mut HostMatrix,
        k: &mut HostMatrix,
        v: &mut HostMatrix,
    ) -> Result<()> {
        let rows = qkv.rows;
        for (what, t) in [("q", &*q), ("k", &*k), ("v", &*v)] {
            expect_size(
                "cpu",
                "rope_split",
                &format!("the rows of {what}"),
                t.rows,
                rows,
            )?;
        }
        expect_size(
            "cpu",
            "rope_split",
            "the width of qkv",
            qkv.cols,
            q.cols + k.cols + v.cols,
        )?;
        expect_size("cpu", "rope_split", "the width of v", v.cols, k.cols)?;
        expect_size(
            "cpu",
            "rope_split",
            "the number of positions",
            positions.len(),
            rows,
        )?;
        let inv_freq = inv_freq.values("rope_split")?;
        let head = 2 * inv_freq.len();
        if head == 0 || !q.cols.is_multiple_of(head) || !k.cols.is_multiple_of(head) {
            return Err(err(format!(
                "rope_split: rows of {} and {} values are not whole heads of {head}",
                q.cols, k.cols
            )));
        }
        for (r, row) in qkv.data.chunks(qkv.cols.max(1)).enumerate().take(rows) {
            let (qr, rest) = row.split_at(q.cols);
            let (kr, vr) = rest.split_at(k.cols);
            q.data[r * q.cols..(r + 1) * q.cols].copy_from_slice(qr);
            k.data[r * k.cols..(r + 1) * k.cols].copy_from_slice(kr);
            v.data[r * v.cols..(r + 1) * v.cols].copy_from_slice(vr);
        }
        rope_in_place(&mut q.data, positions, inv_freq);
        rope_in_place(&mut k.data, positions, inv_freq);
        Ok(())
    }

    fn store_kv(
        &self,
        kv: &mut CpuKv,
        k: &HostMatrix,
        v: &HostMatrix,
        rows: &[(u32, u32)],
    ) -> Result<()> {
        expect_size(
            "cpu",
            "store_kv",
            "the size of v",
            v.data.len(),
            k.data.len(),
        )?;
        let dtype = kv.k.dtype();
        let per = k.cols;
        for &(row, slot) in rows {
            if row as usize >= k.rows {
                return Err(err(format!(
                    "store_kv: row {row} of a matrix of {} rows",
                    k.rows
                )));
            }
            let at = row as usize * per..(row as usize + 1) * per;
            kv.write_slot(
                slot as usize,
                &TypedVec::from_f32(dtype, &k.data[at.clone()]),
                &TypedVec::from_f32(dtype, &v.data[at]),
            )?;
        }
        Ok(())
    }

    fn tensor_queries(&self, shape: &AttnShape, q: &HostMatrix) -> Result<CpuQueries> {
        self.upload_queries(shape, &q.data)
    }

    fn empty_states(&self, shape: &AttnShape, rows: usize) -> Result<AttnStates> {
        Ok(AttnStates::empty(rows, shape.q_heads, shape.head_dim))
    }

    fn causal_attention_from(
        &self,
        shape: &AttnShape,
        q: &HostMatrix,
        q_pos: &[u32],
        q_from: Option<&[u32]>,
        keys: KeyBlock<'_, HostMatrix>,
        states: &mut AttnStates,
    ) -> Result<()> {
        let op = "causal_attention";
        let (k, v, k_pos) = (keys.k, keys.v, keys.positions);
        expect_size("cpu", op, "the query positions", q_pos.len(), q.rows)?;
        if let Some(from) = q_from {
            expect_size("cpu", op, "the query windows' starts", from.len(), q.rows)?;
        }
        expect_size("cpu", op, "the key positions", k_pos.len(), k.rows)?;
        expect_size("cpu", op, "the size of v", v.data.len(), k.data.len())?;
        expect_size("cpu", op, "the states' rows", states.rows, q.rows)?;
        expect_size("cpu", op, "the query width", q.cols, shape.q_row_elems())?;
        expect_size("cpu", op, "the key width", k.cols, shape.kv_token_elems())?;
        let (k, v) = (as_cached(k, keys.dtype), as_cached(v, keys.dtype));
        causal_attention(
            &q.data,
            q_pos,
            q_from,
            &k,
            &v,
            k_pos,
            shape,
            &mut states.o,
            &mut states.lse,
        );
        Ok(())
    }

    fn load_kv(&self, kv: &CpuKv, slots: &[u32]) -> Result<(HostMatrix, HostMatrix)> {
        let per = kv.shape().kv_token_elems();
        let read = |cache: &TypedVec| -> Result<HostMatrix> {
            let mut data = Vec::with_capacity(slots.len() * per);
            for &slot in slots {
                let at = slot as usize * per;
                if at + per > cache.len() {
                    return Err(err(format!(
                        "load_kv: slot {slot} of a pool of {} slots",
                        cache.len() / per.max(1)
                    )));
                }
                data.extend(cache.slice(at..at + per).to_f32_vec());
            }
            Ok(HostMatrix {
                rows: slots.len(),
                cols: per,
                data,
            })
        };
        Ok((read(&kv.k)?, read(&kv.v)?))
    }

    fn states_output(&self, states: &AttnStates, out: &mut HostMatrix) -> Result<()> {
        expect_size(
            "cpu",
            "states_output",
            "the output's size",
            out.data.len(),
            states.o.len(),
        )?;
        out.data.copy_from_slice(&states.o);
        Ok(())
    }

    fn top_logits(&self, logits: &HostMatrix, k: usize, out: &mut HostMatrix) -> Result<()> {
        check_top_logits("cpu", (logits.rows, logits.cols), k, (out.rows, out.cols))?;
        for (row, out) in logits
            .data
            .chunks_exact(logits.cols.max(1))
            .zip(out.data.chunks_exact_mut(2 * k))
        {
            let (values, ids) = out.split_at_mut(k);
            for (i, t) in top_tokens(row, k).into_iter().enumerate() {
                values[i] = row[t as usize];
                ids[i] = f32::from_bits(t);
            }
        }
        Ok(())
    }

    /// The log-normaliser in f64, rounded once: the oracle the GPU's fp32 sum is held to.
    fn logprob_terms(
        &self,
        logits: &HostMatrix,
        targets: &[u32],
        out: &mut HostMatrix,
    ) -> Result<()> {
        check_logprob_terms(
            "cpu",
            (logits.rows, logits.cols),
            targets,
            (out.rows, out.cols),
        )?;
        for ((row, &t), out) in logits
            .data
            .chunks_exact(logits.cols.max(1))
            .zip(targets)
            .zip(out.data.chunks_exact_mut(2))
        {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f64 = row.iter().map(|&x| f64::from(x - max).exp()).sum();
            out[0] = (f64::from(max) + sum.ln()) as f32;
            out[1] = row[t as usize];
        }
        Ok(())
    }

    fn softmax_totals(
        &self,
        logits: &HostMatrix,
        temperatures: &[f32],
        out: &mut HostMatrix,
    ) -> Result<()> {
        check_softmax_totals("cpu", logits.rows, temperatures, (out.rows, out.cols))?;
        let rows = logits.data.chunks_exact(logits.cols.max(1));
        for ((row, &t), out) in rows.zip(temperatures).zip(&mut out.data) {
            *out = canopy_core::logits::softmax_total(row, t);
        }
        Ok(())
    }

    fn pick_logits(
        &self,
        logits: &HostMatrix,
        picks: &[(u32, u32)],
        out: &mut HostMatrix,
    ) -> Result<()> {
        let dims = ((logits.rows, logits.cols), (out.rows, out.cols));
        check_pick_logits("cpu", dims.0, picks, dims.1)?;
        for (&(r, t), out) in picks.iter().zip(&mut out.data) {
            *out = logits.data[r as usize * logits.cols + t as usize];
        }
        Ok(())
    }

    fn walk_tails(
        &self,
        logits: &HostMatrix,
        walks: &[(usize, &TailWalk)],
        out: &mut HostMatrix,
    ) -> Result<()> {
        let dims = ((logits.rows, logits.cols), (out.rows, out.cols));
        check_walk_tails("cpu", dims.0, walks, dims.1)?;
        for (&(r, walk), out) in walks.iter().zip(out.data.chunks_exact_mut(2)) {
            let row = &logits.data[r * logits.cols..(r + 1) * logits.cols];
            let landed = walk.land(row);
            out[0] = f32::from_bits(landed.unwrap_or(u32::MAX));
            out[1] = landed.map_or(f32::NAN, |t| row[t as usize]);
        }
        Ok(())
    }

    fn set_logits(&self, logits: &mut HostMatrix, places: &[(u32, u32)], value: f32) -> Result<()> {
        check_logit_places("cpu", "set_logits", (logits.rows, logits.cols), places)?;
        for &(r, t) in places {
            logits.data[r as usize * logits.cols + t as usize] = value;
        }
        Ok(())
    }

    fn end_capture(&self) -> Result<Self::Graph> {
        Err(err("the cpu backend records no graphs".into()))
    }

    fn replay(&self, graph: &Self::Graph) -> Result<()> {
        match *graph {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matrix(rows: usize, cols: usize, seed: u32) -> HostMatrix {
        let data = (0..rows * cols)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        HostMatrix { rows, cols, data }
    }

    fn weight(rows: usize, cols: usize, seed: u32) -> CpuWeight {
        CpuWeight::Dense(matrix(rows, cols, seed))
    }

    /// A 135M model's needs at one row, with the KV of 64 tokens a rank.
    fn small_model_needs() -> ModelNeeds {
        ModelNeeds {
            shape: AttnShape::new(9, 3, 64).unwrap(),
            hidden: 576,
            intermediate: 1536,
            vocab: 49_152,
            layers: 30,
            weight_dtype: DType::F32,
            weight_bytes: 540 << 20,
            kv_dtype: DType::F32,
            kv_tokens: 64,
            max_rows: 1,
            attention_rows: 1,
            attention_keys: 0,
            logit_rows: 4,
            peer_devices: 0,
            ranks_here: 1,
        }
    }

    #[test]
    fn every_rank_on_the_host_is_priced_its_passes() {
        let needs = small_model_needs();
        let one = pass_bytes(&needs);
        // The four rows of logits alone are 768 KiB.
        assert!(one > 4 * 49_152 * 4 && one < 1 << 20, "{one}");
        let wider = ModelNeeds {
            max_rows: 512,
            ..needs.clone()
        };
        assert!(pass_bytes(&wider) > one + 511 * (3 * 576 + 2 * 1536) * 4);
        assert!(CpuBackend
            .check_model(&needs.clone().on_device_holding(1, 1))
            .is_ok());
        // A small KV cache beside ten million ranks' passes, which fit no host.
        let crowd = ModelNeeds {
            kv_tokens: 64,
            ..needs.on_device_holding(10_000_000, 10_000_000)
        };
        assert!(crowd.kv_bytes() < 1 << 30);
        let msg = CpuBackend.check_model(&crowd).unwrap_err().to_string();
        assert!(
            msg.contains("10000000 rank(s)' passes and heaps") && msg.contains("fewer ranks"),
            "{msg}"
        );
    }

    #[test]
    fn fused_ops_equal_their_parts() {
        let b = CpuBackend;
        // rope_split: q of two heads of 4, k and v of one head, over two rows.
        let qkv = matrix(2, 16, 5);
        let inv = CpuWeight::Dense(HostMatrix {
            rows: 1,
            cols: 2,
            data: vec![1.0, 0.01],
        });
        let inv_values = [1.0, 0.01];
        let (mut q, mut k, mut v) = (
            b.tensor(2, 8).unwrap(),
            b.tensor(2, 4).unwrap(),
            b.tensor(2, 4).unwrap(),
        );
        b.rope_split(&qkv, &[3, 9], &inv, &mut q, &mut k, &mut v)
            .unwrap();
        let cols = |from: usize, n: usize| -> Vec<f32> {
            (0..2)
                .flat_map(|r| qkv.data[r * 16 + from..r * 16 + from + n].to_vec())
                .collect()
        };
        let (mut q_want, mut k_want) = (cols(0, 8), cols(8, 4));
        rope_in_place(&mut q_want, &[3, 9], &inv_values);
        rope_in_place(&mut k_want, &[3, 9], &inv_values);
        assert_eq!(q.data, q_want);
        assert_eq!(k.data, k_want);
        assert_eq!(v.data, cols(12, 4));
        assert!(b
            .rope_split(&qkv, &[3], &inv, &mut q, &mut k, &mut v)
            .is_err());

        // matmul_swiglu against matmul and the activation by hand.
        let (x, w) = (matrix(3, 8, 6), weight(10, 8, 7));
        let mut fused = b.tensor(3, 5).unwrap();
        b.matmul_swiglu(&x, &w, &mut fused).unwrap();
        let mut gate_up = b.tensor(3, 10).unwrap();
        b.matmul(&x, &w, &mut gate_up).unwrap();
        for r in 0..3 {
            for c in 0..5 {
                let (g, u) = (gate_up.data[r * 10 + c], gate_up.data[r * 10 + 5 + c]);
                let want = g / (1.0 + (-g).exp()) * u;
                assert!((fused.data[r * 5 + c] - want).abs() < 1e-6);
            }
        }
        assert!(b.matmul_swiglu(&x, &weight(9, 8, 1), &mut fused).is_err());
    }

    #[test]
    fn shapes_that_disagree_are_errors_not_panics() {
        let b = CpuBackend;
        let (x, w) = (matrix(2, 8, 1), weight(3, 6, 2));
        let mut out = b.tensor(2, 3).unwrap();
        assert!(b
            .matmul(&x, &w, &mut out)
            .unwrap_err()
            .to_string()
            .contains("the weight's columns is 6, expected 8"));
        let table = weight(4, 8, 3);
        let mut rows = b.tensor(2, 8).unwrap();
        assert!(b
            .embed(&table, &[1, 4], &mut rows)
            .unwrap_err()
            .to_string()
            .contains("token id 4"));
        assert!(b.copy_rows(&x, 1, &mut b.tensor(2, 8).unwrap()).is_err());
        let e = b.gather_rows(&x, &[0, 2], &mut b.tensor(2, 8).unwrap());
        assert!(e
            .unwrap_err()
            .to_string()
            .contains("row 2 of a tensor of 2 rows"));
        assert!(b.upload_weight(&TypedVec::F32(vec![0.0; 5]), 2, 3).is_err());
    }

    #[test]
    fn top_logits_keeps_each_row_s_likeliest_in_order() {
        let b = CpuBackend;
        let logits = b
            .upload_tensor(&[0.5, 2.0, -1.0, 2.0, 1.0, 1.0, 0.0, 3.0], 2, 4)
            .unwrap();
        let mut out = b.tensor(2, 4).unwrap();
        b.top_logits(&logits, 2, &mut out).unwrap();
        let ids: Vec<u32> = [2, 3, 6, 7]
            .iter()
            .map(|&i| out.data[i].to_bits())
            .collect();
        assert_eq!(ids, vec![1, 3, 3, 0], "equal logits: the lower token first");
        assert_eq!(
            (out.data[0], out.data[1], out.data[4], out.data[5]),
            (2.0, 2.0, 3.0, 1.0)
        );
        for k in [0, 5, crate::TOP_LOGITS_MAX + 1] {
            let mut out = b.tensor(2, 2 * k).unwrap();
            assert!(b.top_logits(&logits, k, &mut out).is_err(), "k = {k}");
        }
        assert!(
            b.top_logits(&logits, 1, &mut out).is_err(),
            "2 × 4 is not 2 × 2"
        );
    }

    #[test]
    fn pick_logits_reads_each_pick_and_refuses_one_past_the_logits() {
        let b = CpuBackend;
        let logits = matrix(3, 5, 4);
        let mut out = b.tensor(3, 1).unwrap();
        b.pick_logits(&logits, &[(2, 4), (0, 0), (2, 4)], &mut out)
            .unwrap();
        assert_eq!(out.data, [logits.data[14], logits.data[0], logits.data[14]]);
        let mut one = b.tensor(1, 1).unwrap();
        for pick in [(3, 0), (0, 5)] {
            let e = b.pick_logits(&logits, &[pick], &mut one).unwrap_err();
            assert!(e.to_string().contains("past logits of 3 rows × 5"), "{e}");
        }
        assert!(b.pick_logits(&logits, &[(0, 0)], &mut out).is_err());
        let mut set = logits.clone();
        b.set_logits(&mut set, &[(1, 2), (2, 0)], f32::NEG_INFINITY)
            .unwrap();
        let changed: Vec<usize> = (0..15).filter(|&i| set.data[i] != logits.data[i]).collect();
        assert_eq!(changed, [7, 10]);
        assert_eq!(set.data[7], f32::NEG_INFINITY);
        assert!(b.set_logits(&mut set, &[(3, 0)], 0.0).is_err());
    }

    #[test]
    fn weights_widen_to_f32_and_rows_copy_and_gather() {
        let b = CpuBackend;
        let w = b
            .upload_weight(&TypedVec::from_f32(DType::Bf16, &[1.5, -2.0]), 1, 2)
            .unwrap();
        assert_eq!(w.values("a test").unwrap(), [1.5, -2.0]);
        for dtype in [DType::Bf16, DType::F32] {
            let mut parts = Vec::new();
            let filled = b
                .upload_weight_with(dtype, (2, 2), &mut |first, mut part| {
                    parts.push((first, part.len()));
                    let values = TypedVec::from_f32(dtype, &[0.5, -1.0, 3.0, 4.0]);
                    part.as_bytes_mut().copy_from_slice(values.as_bytes());
                    Ok::<(), EngineError>(())
                })
                .unwrap();
            assert_eq!(parts, [(0, 4)], "{dtype}: one part, the whole weight");
            assert_eq!(filled.dims(), (2, 2));
            assert_eq!(
                filled.values("a test").unwrap(),
                [0.5, -1.0, 3.0, 4.0],
                "{dtype}"
            );
        }
        let x = matrix(3, 4, 7);
        let mut last = b.tensor(1, 4).unwrap();
        b.copy_rows(&x, 2, &mut last).unwrap();
        assert_eq!(last.data, x.data[8..12]);
        let mut picked = b.tensor(3, 4).unwrap();
        b.gather_rows(&x, &[2, 0, 2], &mut picked).unwrap();
        let want: Vec<f32> = [&x.data[8..12], &x.data[0..4], &x.data[8..12]].concat();
        assert_eq!(picked.data, want);
    }

    #[test]
    fn store_kv_writes_the_named_rows_only() {
        let b = CpuBackend;
        let shape = AttnShape::new(2, 1, 64).unwrap();
        let mut kv = b.alloc_kv(&shape, DType::F32, 4).unwrap();
        let (k, v) = (matrix(2, 64, 5), matrix(2, 64, 6));
        b.store_kv(&mut kv, &k, &v, &[(1, 3)]).unwrap();
        assert_eq!(kv.k.to_f32_vec()[192..256], k.data[64..128]);
        assert_eq!(kv.v.to_f32_vec()[192..256], v.data[64..128]);
        assert!(kv.k.to_f32_vec()[..192].iter().all(|&x| x == 0.0));
        assert!(b.store_kv(&mut kv, &k, &v, &[(2, 0)]).is_err());
    }

    /// A coded weight is kept as codes where its groups can be packed, and left to the f32
    /// upload where they cannot, without its codes being asked for.
    #[test]
    fn coded_weights_in_groups_panels_cannot_hold_go_to_f32() {
        for (group, packed) in [(16, true), (32, true), (12, false)] {
            let mut fills = 0;
            let upload =
                CpuBackend.upload_coded_weight::<EngineError>((8, 96), group, &mut |_, _| {
                    fills += 1;
                    Ok(())
                });
            assert_eq!(upload.is_some(), packed, "groups of {group}");
            assert_eq!(fills, usize::from(packed), "groups of {group}");
            if let Some(weight) = upload {
                assert!(matches!(weight.unwrap(), CpuWeight::Coded(_)));
            }
        }
    }
}
