//! The CUDA backend's `LayerOps` against the CPU backend's, op by op, on fresh random inputs.
//!
//! Each check runs one generic routine on both backends and compares what comes back: the
//! same host inputs (random, never zero), outputs poisoned with NaN before every op, so that
//! an element a kernel fails to write shows. GEMMs are also held to an f64 reference that
//! rounds the activation to the weight's dtype, as the GPU's 16-bit GEMMs do (the CPU
//! multiplies the f32 activation, so its distance to the GPU is that rounding). The KV store
//! goes through a paged pool and the decode kernels read it back, so `store_kv`,
//! `take_queries` and the page tables are checked together.
//!
//! Without a GPU (no driver, no device, no NVRTC) every test prints why and passes. The seed
//! is printed; `CANOPY_TEST_SEED` repeats a run.

mod common;
mod compare;
use common::{gpu, rng};
use compare::{check, check_swiglu, poisoned, values};

use canopy_comm::{Collective, ThreadWorld};
use canopy_core::{AttnShape, AttnStates, DType, Group, Plan, TypedVec};
use canopy_cuda::CudaBackend;
use canopy_engine::{Backend, CachedKeys, CpuBackend, KeyBlock, LayerOps, ModelNeeds, Result};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::time::Duration;

struct DenseInputs {
    dtype: DType,
    rows: usize,
    hidden: usize,
    intermediate: usize,
    vocab: usize,
    ids: Vec<u32>,
    table: Vec<f32>,
    x: Vec<f32>,
    norm: Vec<f32>,
    w: Vec<f32>,
    gate: Vec<f32>,
    heads: Vec<f32>,
    positions: Vec<u32>,
    inv_freq: Vec<f32>,
}

impl DenseInputs {
    fn new(
        rng: &mut ChaCha8Rng,
        dtype: DType,
        rows: usize,
        (hidden, intermediate): (usize, usize),
    ) -> DenseInputs {
        // Eight rows take heads of 6 columns: RoPE's kernels then rotate one pair at a time
        // instead of four.
        let head_dim = if rows == 8 { 6 } else { 64 };
        let (vocab, heads) = (37, 3);
        let round = |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(|x| dtype.round(x)).collect() };
        let mut ids: Vec<u32> = (0..rows).map(|_| rng.gen_range(0..vocab as u32)).collect();
        ids[0] = vocab as u32 - 1;
        DenseInputs {
            dtype,
            rows,
            hidden,
            intermediate,
            vocab,
            ids,
            table: round(values(rng, vocab * hidden, 1.0)),
            x: values(rng, rows * hidden, 2.0),
            norm: round(values(rng, hidden, 1.5)),
            w: round(values(rng, intermediate * hidden, 0.2)),
            gate: values(rng, rows * intermediate, 8.0),
            heads: values(rng, rows * heads * head_dim, 1.0),
            // Long contexts' positions: the angles are large, their reduction must be exact.
            positions: (0..rows).map(|_| rng.gen_range(0..131_072)).collect(),
            inv_freq: (0..head_dim / 2)
                .map(|i| 500_000f32.powf(-2.0 * i as f32 / head_dim as f32))
                .collect(),
        }
    }
}

/// What the dense ops give, in order: embed, rms_norm, matmul, matmul_add, matmul_swiglu,
/// rope_split, copy_rows, gather_rows.
fn dense<B: LayerOps>(b: &B, inp: &DenseInputs) -> Result<Vec<(&'static str, Vec<f32>)>> {
    let (rows, h, i) = (inp.rows, inp.hidden, inp.intermediate);
    let typed = |v: &[f32]| TypedVec::from_f32(inp.dtype, v);
    let table = b.upload_weight(&typed(&inp.table), inp.vocab, h)?;
    let norm = b.upload_weight(&typed(&inp.norm), 1, h)?;
    let w = b.upload_weight(&typed(&inp.w), i, h)?;
    let x = b.upload_tensor(&inp.x, rows, h)?;
    let mut out = Vec::new();

    let mut embedded = poisoned(b, rows, h)?;
    b.embed(&table, &inp.ids, &mut embedded)?;
    out.push(("embed", b.download_tensor(&embedded)?));

    let mut normed = poisoned(b, rows, h)?;
    b.rms_norm(&x, &norm, 1e-5, &mut normed)?;
    out.push(("rms_norm", b.download_tensor(&normed)?));

    let mut product = poisoned(b, rows, i)?;
    b.matmul(&x, &w, &mut product)?;
    out.push(("matmul", b.download_tensor(&product)?));

    // A projection and the residual after it, onto values of the output's magnitude.
    let mut acc = b.upload_tensor(&inp.gate, rows, i)?;
    b.matmul_add(&x, &w, &mut acc)?;
    out.push(("matmul_add", b.download_tensor(&acc)?));

    // w's rows as a fused gate|up weight.
    let mut act = poisoned(b, rows, i / 2)?;
    b.matmul_swiglu(&x, &w, &mut act)?;
    out.push(("matmul_swiglu", b.download_tensor(&act)?));

    // The products of a normed activation in one op (which may normalise the rows as the
    // product reads them): the same bits as rms_norm then the product.
    for (name, swiglu) in [
        ("matmul after rms_norm", false),
        ("matmul_swiglu after it", true),
    ] {
        let width = if swiglu { i / 2 } else { i };
        let (mut scratch, mut fused) = (poisoned(b, rows, h)?, poisoned(b, rows, width)?);
        let mut two_ops = poisoned(b, rows, width)?;
        if swiglu {
            b.rms_norm_matmul_swiglu(&x, (&norm, 1e-5), &w, &mut scratch, &mut fused)?;
            b.matmul_swiglu(&normed, &w, &mut two_ops)?;
        } else {
            b.rms_norm_matmul(&x, (&norm, 1e-5), &w, &mut scratch, &mut fused)?;
            b.matmul(&normed, &w, &mut two_ops)?;
        }
        let (fused, two_ops) = (b.download_tensor(&fused)?, b.download_tensor(&two_ops)?);
        let same = fused
            .iter()
            .zip(&two_ops)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{name}: one op differs from two");
        out.push((name, fused));
    }

    // A fused projection of one q head, one k head and one v head.
    let d = 2 * inp.inv_freq.len();
    let qkv = b.upload_tensor(&inp.heads, rows, 3 * d)?;
    let inv_freq = b.upload_weight(&TypedVec::F32(inp.inv_freq.clone()), 1, d / 2)?;
    let (mut q, mut k, mut v) = (
        poisoned(b, rows, d)?,
        poisoned(b, rows, d)?,
        poisoned(b, rows, d)?,
    );
    b.rope_split(&qkv, &inp.positions, &inv_freq, &mut q, &mut k, &mut v)?;
    out.push(("rope_split q", b.download_tensor(&q)?));
    out.push(("rope_split k", b.download_tensor(&k)?));
    out.push(("rope_split v", b.download_tensor(&v)?));

    let (first, take) = (rows / 3, rows - rows / 3);
    let mut tail = poisoned(b, take, h)?;
    b.copy_rows(&x, first, &mut tail)?;
    out.push(("copy_rows", b.download_tensor(&tail)?));
    // Scattered rows, runs of consecutive ones among them, and a row twice.
    let picks: Vec<usize> = [rows - 1, 0, 1, 2, rows / 2, rows / 2, 3]
        .map(|r| r % rows)
        .to_vec();
    let mut picked = poisoned(b, picks.len(), h)?;
    b.gather_rows(&x, &picks, &mut picked)?;
    out.push(("gather_rows", b.download_tensor(&picked)?));
    Ok(out)
}

/// `x · wᵀ` in f64 with `x` rounded to `dtype`, as the GPU's GEMM takes it.
fn matmul_reference(inp: &DenseInputs) -> Vec<f32> {
    let (h, n) = (inp.hidden, inp.intermediate);
    let mut out = Vec::with_capacity(inp.rows * n);
    for r in 0..inp.rows {
        let x = &inp.x[r * h..(r + 1) * h];
        for j in 0..n {
            let w = &inp.w[j * h..(j + 1) * h];
            let dot: f64 = x
                .iter()
                .zip(w)
                .map(|(&a, &b)| f64::from(inp.dtype.round(a)) * f64::from(b))
                .sum();
            out.push(dot as f32);
        }
    }
    out
}

#[test]
fn dense_ops_match_the_cpu() {
    let Some(gpu) = gpu("dense_ops_match_the_cpu") else {
        return;
    };
    let mut rng = rng("dense_ops_match_the_cpu");
    for dtype in DType::ALL {
        // Up to GEMV_MAX_ROWS rows of these small weights take the GEMV kernels, more take
        // cuBLAS (a large weight's products run on cuBLAS from 3 rows: `gemv_takes_rows`).
        // Widths that are not whole blocks of the GEMV's k or groups of its columns, and one
        // long enough (4160) for every warp of a sliced GEMV to load several rounds of blocks.
        // On cuBLAS, a 16-bit gate|up product of 116 columns a half takes SwiGLU's one-column
        // path, of 128 its eight-column path.
        let shapes = [
            (1, (160, 232)),
            (5, (160, 232)),
            (8, (160, 232)),
            (67, (160, 232)),
            (67, (160, 256)),
        ];
        let long = [(1, (4160, 40)), (3, (4160, 40))];
        for (rows, dims) in shapes.into_iter().chain(long) {
            eprintln!("{dtype} weights, {rows} rows, {dims:?}:");
            let inp = DenseInputs::new(&mut rng, dtype, rows, dims);
            let got = dense(&gpu, &inp).unwrap();
            let want = dense(&CpuBackend, &inp).unwrap();
            for ((op, g), (_, w)) in got.iter().zip(&want) {
                // The CPU's GEMM multiplies the unrounded activation: 16-bit weights are
                // held to the f64 reference of what the GPU computes instead.
                let product = op.starts_with("matmul");
                let tolerance = match (*op, dtype) {
                    ("embed" | "copy_rows" | "gather_rows" | "rope_split v", _) => 0.0,
                    (_, DType::F32) if product => 1e-5,
                    (_, DType::F16) if product => 2e-3,
                    (_, DType::Bf16) if product => 1e-2,
                    _ => 1e-5,
                };
                // SwiGLU's outputs are held to the gate|up product they were made from.
                let product_of = match *op {
                    "matmul_swiglu" => Some("matmul"),
                    "matmul_swiglu after it" => Some("matmul after rms_norm"),
                    _ => None,
                };
                match product_of {
                    Some(name) => {
                        let gate_up = &want.iter().find(|(op, _)| *op == name).unwrap().1;
                        check_swiglu(&format!("{op} vs cpu"), g, w, gate_up, tolerance);
                    }
                    None => check(&format!("{op} vs cpu"), g, w, tolerance),
                }
            }
            let product = &got.iter().find(|(op, _)| *op == "matmul").unwrap().1;
            let reference = matmul_reference(&inp);
            check("matmul vs f64", product, &reference, 1e-5);
            let summed: Vec<f32> = reference
                .iter()
                .zip(&inp.gate)
                .map(|(p, g)| p + g)
                .collect();
            let added = &got.iter().find(|(op, _)| *op == "matmul_add").unwrap().1;
            check("matmul_add vs f64", added, &summed, 1e-5);
        }
    }
}

/// Every product of a GEMM operand (`gemm_operand`) equals the same product of a plain tensor
/// holding the same values, bit for bit, whichever op wrote it: `rms_norm`, `matmul_swiglu`
/// and `states_output` write the operand's rounded copy beside it (more rows than the GEMV
/// takes), and `copy_rows` into it leaves no stale copy behind. `states_matmul_add` equals
/// `states_output` then `matmul_add`, reading the states in place where the GEMV takes them.
#[test]
fn gemm_operands_feed_products_like_plain_tensors() {
    let Some(gpu) = gpu("gemm_operands_feed_products_like_plain_tensors") else {
        return;
    };
    let mut rng = rng("gemm_operands_feed_products_like_plain_tensors");
    // q_heads · head_dim within the weight's columns, so the o projection's weight is a
    // slice of the inputs' weight.
    let shape = AttnShape {
        q_heads: 2,
        kv_heads: 1,
        head_dim: 64,
        scale: None,
    };
    for dtype in DType::ALL {
        for rows in [5, 67] {
            eprintln!("{dtype} weights, {rows} rows:");
            let (h, i) = (160, 232);
            let inp = DenseInputs::new(&mut rng, dtype, rows, (h, i));
            let got = operand_products(&gpu, &inp, &shape, &mut rng).unwrap();
            for (op, plain, operand) in got {
                assert!(plain.iter().all(|v| v.is_finite()), "{op}: not finite");
                let same = plain
                    .iter()
                    .zip(&operand)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                eprintln!("  {op:<44} bit for bit: {same}");
                assert!(
                    same,
                    "{dtype}, {rows} rows, {op}: an operand's product differs"
                );
            }
        }
    }
}

/// `x` (the host rows of `t`'s product's shape) plus the product of `t` with `w`.
fn added<B: LayerOps>(b: &B, x: &[f32], t: &B::Tensor, w: &B::Weight) -> Result<Vec<f32>> {
    let rows = b.dims(t).0;
    let mut acc = b.upload_tensor(x, rows, x.len() / rows)?;
    b.matmul_add(t, w, &mut acc)?;
    b.download_tensor(&acc)
}

/// (op, product of a plain tensor, product of a GEMM operand).
type Products = Vec<(&'static str, Vec<f32>, Vec<f32>)>;

/// Each producer's output read by a product, from a plain tensor and from a GEMM operand.
fn operand_products(
    b: &CudaBackend,
    inp: &DenseInputs,
    shape: &AttnShape,
    rng: &mut ChaCha8Rng,
) -> Result<Products> {
    let (rows, h, i) = (inp.rows, inp.hidden, inp.intermediate);
    let typed = |v: &[f32]| TypedVec::from_f32(inp.dtype, v);
    let norm = b.upload_weight(&typed(&inp.norm), 1, h)?;
    let w = b.upload_weight(&typed(&inp.w), i, h)?;
    let w_back = b.upload_weight(&typed(&inp.w[..h * i / 2]), h, i / 2)?;
    let q_cols = shape.q_row_elems();
    let w_o = b.upload_weight(&typed(&inp.w[..h * q_cols]), h, q_cols)?;
    let x = b.upload_tensor(&inp.x, rows, h)?;
    let mut out = Vec::new();

    let mut plain = poisoned(b, rows, h)?;
    let mut operand = b.gemm_operand(rows, h, &w)?;
    let mut products = Vec::new();
    for t in [&mut plain, &mut operand] {
        b.rms_norm(&x, &norm, 1e-5, t)?;
        let mut p = poisoned(b, rows, i)?;
        b.matmul(t, &w, &mut p)?;
        products.push(b.download_tensor(&p)?);
    }
    out.push((
        "rms_norm, then matmul",
        products.remove(0),
        products.remove(0),
    ));

    let mut acts = [
        poisoned(b, rows, i / 2)?,
        b.gemm_operand(rows, i / 2, &w_back)?,
    ];
    for act in &mut acts {
        b.matmul_swiglu(&plain, &w, act)?;
    }
    out.push((
        "matmul_swiglu, then matmul_add",
        added(b, &inp.x, &acts[0], &w_back)?,
        added(b, &inp.x, &acts[1], &w_back)?,
    ));

    let positions: Vec<u32> = (0..rows as u32).collect();
    let q = b.upload_tensor(&values(rng, rows * q_cols, 1.0), rows, q_cols)?;
    let (k, v) = (
        values(rng, rows * shape.kv_token_elems(), 1.0),
        values(rng, rows * shape.kv_token_elems(), 1.0),
    );
    let k = b.upload_tensor(&k, rows, shape.kv_token_elems())?;
    let v = b.upload_tensor(&v, rows, shape.kv_token_elems())?;
    let mut states = b.empty_states(shape, rows)?;
    let keys = KeyBlock {
        k: &k,
        v: &v,
        positions: &positions,
        dtype: inp.dtype,
    };
    b.causal_attention(shape, &q, &positions, keys, &mut states)?;
    let mut attn = [
        poisoned(b, rows, q_cols)?,
        b.gemm_operand(rows, q_cols, &w_o)?,
    ];
    for a in &mut attn {
        b.states_output(&states, a)?;
    }
    out.push((
        "states_output, then matmul_add",
        added(b, &inp.x, &attn[0], &w_o)?,
        added(b, &inp.x, &attn[1], &w_o)?,
    ));
    // The output projection of the states themselves (the GEMV reads them in place).
    let mut acc = b.upload_tensor(&inp.x, rows, h)?;
    let mut scratch = b.gemm_operand(rows, q_cols, &w_o)?;
    b.states_matmul_add(&states, &w_o, &mut scratch, &mut acc)?;
    out.push((
        "states_matmul_add",
        added(b, &inp.x, &attn[0], &w_o)?,
        b.download_tensor(&acc)?,
    ));

    // An operand overwritten by copy_rows: its product is x's, not the norm's.
    b.copy_rows(&x, 0, &mut operand)?;
    let mut p = poisoned(b, rows, i)?;
    b.matmul(&operand, &w, &mut p)?;
    let mut want = poisoned(b, rows, i)?;
    b.matmul(&x, &w, &mut want)?;
    out.push((
        "copy_rows over an operand, then matmul",
        b.download_tensor(&want)?,
        b.download_tensor(&p)?,
    ));
    Ok(out)
}

/// Random positions of `rows` rows, and `(row, slot)` stores of every row but each third,
/// in scrambled slots of a pool of `pool` tokens, with those slots in order.
fn rope_rows(
    rng: &mut ChaCha8Rng,
    rows: usize,
    pool: usize,
) -> (Vec<u32>, Vec<(u32, u32)>, Vec<u32>) {
    let positions = (0..rows).map(|_| rng.gen_range(0..131_072)).collect();
    let stores: Vec<(u32, u32)> = (0..rows as u32)
        .filter(|r| r % 3 != 2)
        .map(|r| (r, (r * 29 + 5) % pool as u32))
        .collect();
    let slots = stores.iter().map(|&(_, slot)| slot).collect();
    (positions, stores, slots)
}

/// Llama 3's RoPE frequencies for heads of `head_dim`.
fn rope_frequencies(head_dim: usize) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| 500_000f32.powf(-2.0 * i as f32 / head_dim as f32))
        .collect()
}

/// The outputs the RoPE tests compare, in the order their runs return them.
const STORED_QKV: [&str; 5] = ["q", "k", "v", "stored k", "stored v"];

/// Asserts that `got` equals `want`, which is written in full, bit for bit.
fn same_bits(case: &str, want: &[f32], got: &[f32]) {
    assert!(want.iter().all(|x| x.is_finite()), "{case}: not written");
    let same = want
        .iter()
        .zip(got)
        .all(|(x, y)| x.to_bits() == y.to_bits());
    eprintln!("  {case:<60} bit for bit: {same}");
    assert!(same, "{case}: the fused op differs");
}

/// RoPE fused into the KV append (`rope_split_store`) writes the same q, k and v, and the
/// same cache slots, bit for bit, as `rope_split` then `store_kv`, for every KV dtype, with
/// some rows not stored and the stored ones in scrambled slots.
#[test]
fn rope_fused_into_the_kv_append_matches_the_two_ops() {
    let Some(gpu) = gpu("rope_fused_into_the_kv_append_matches_the_two_ops") else {
        return;
    };
    let mut rng = rng("rope_fused_into_the_kv_append_matches_the_two_ops");
    let shape = AttnShape::new(8, 2, 64).unwrap();
    let (rows, pool) = (37usize, 64usize);
    let (q_cols, kv_cols) = (shape.q_row_elems(), shape.kv_token_elems());
    let qkv = values(&mut rng, rows * (q_cols + 2 * kv_cols), 1.0);
    let (positions, stores, slots) = rope_rows(&mut rng, rows, pool);
    let inv_freq = rope_frequencies(shape.head_dim);
    for dtype in DType::ALL {
        let run = |fused: bool| -> Result<Vec<Vec<f32>>> {
            let b = &gpu;
            let fused_qkv = b.upload_tensor(&qkv, rows, q_cols + 2 * kv_cols)?;
            let inv_freq = b.upload_weight(&TypedVec::F32(inv_freq.clone()), 1, inv_freq.len())?;
            let mut kv = b.alloc_kv(&shape, dtype, pool)?;
            let nan = TypedVec::from_f32(dtype, &vec![f32::NAN; pool * kv_cols]);
            b.write_kv(&mut kv, 0, &nan, &nan)?;
            let (mut q, mut k, mut v) = (
                poisoned(b, rows, q_cols)?,
                poisoned(b, rows, kv_cols)?,
                poisoned(b, rows, kv_cols)?,
            );
            if fused {
                let outputs = (&mut q, &mut k, &mut v);
                b.rope_split_store(&fused_qkv, &positions, &inv_freq, outputs, &mut kv, &stores)?;
            } else {
                b.rope_split(&fused_qkv, &positions, &inv_freq, &mut q, &mut k, &mut v)?;
                b.store_kv(&mut kv, &k, &v, &stores)?;
            }
            let (kc, vc) = b.load_kv(&kv, &slots)?;
            [&q, &k, &v, &kc, &vc]
                .into_iter()
                .map(|t| b.download_tensor(t))
                .collect()
        };
        let (two_ops, fused) = (run(false).unwrap(), run(true).unwrap());
        for ((name, a), b) in STORED_QKV.iter().zip(&two_ops).zip(&fused) {
            same_bits(&format!("{dtype} {name}"), a, b);
        }
    }
}

/// The q|k|v projection with RoPE and the KV append in the GEMV's epilogue
/// (`rms_norm_matmul_rope`) writes the same q, k and v, and the same cache slots, bit for bit,
/// as `rms_norm_matmul` then `rope_split_store` (or `rope_split`), for every weight and KV
/// dtype, both head dims, rows normalised in the GEMV (1 and 2) and before it (5 rows, and a
/// norm weight in f32 beside f16 weights, as GGUF files hold norms), some rows not stored and
/// the stored ones in scrambled slots. The projection's own output stays poisoned where the
/// epilogue ran, not the two ops: wherever the KV it stores into is of the weight's dtype. Its
/// width (6144 columns) is the Llama-3.1-8B shape's, which the GEMV takes in slices of 4.
#[test]
fn rope_in_the_projection_epilogue_matches_the_two_ops() {
    let Some(gpu) = gpu("rope_in_the_projection_epilogue_matches_the_two_ops") else {
        return;
    };
    let mut rng = rng("rope_in_the_projection_epilogue_matches_the_two_ops");
    let (hidden, pool) = (256usize, 64usize);
    for shape in [
        AttnShape::new(32, 8, 128).unwrap(),
        AttnShape::new(64, 16, 64).unwrap(),
    ] {
        let (q_cols, kv_cols) = (shape.q_row_elems(), shape.kv_token_elems());
        let cols = q_cols + 2 * kv_cols;
        let w = values(&mut rng, cols * hidden, 0.1);
        let norm = values(&mut rng, hidden, 1.0);
        let inv_freq = rope_frequencies(shape.head_dim);
        // (weight dtype, KV dtype, norm weight dtype, rows, stored); a KV of another dtype
        // than the weight's runs the two ops.
        for (dtype, kv_dtype, norm_dtype, rows, stored) in [
            (DType::Bf16, DType::Bf16, DType::Bf16, 1, true),
            (DType::Bf16, DType::Bf16, DType::Bf16, 2, true),
            (DType::F16, DType::F16, DType::F16, 5, true),
            (DType::F16, DType::F16, DType::F32, 2, true),
            (DType::F32, DType::F32, DType::F32, 2, true),
            (DType::Bf16, DType::Bf16, DType::Bf16, 2, false),
            (DType::Bf16, DType::F32, DType::Bf16, 1, true),
        ] {
            let x = values(&mut rng, rows * hidden, 1.0);
            let (positions, stores, slots) = rope_rows(&mut rng, rows, pool);
            let run = |epilogue: bool| -> Result<Vec<Vec<f32>>> {
                let b = &gpu;
                let w = b.upload_weight(&TypedVec::from_f32(dtype, &w), cols, hidden)?;
                let norm = b.upload_weight(&TypedVec::from_f32(norm_dtype, &norm), 1, hidden)?;
                let inv_freq =
                    b.upload_weight(&TypedVec::F32(inv_freq.clone()), 1, inv_freq.len())?;
                let x = b.upload_tensor(&x, rows, hidden)?;
                let mut kv = b.alloc_kv(&shape, kv_dtype, pool)?;
                let nan = TypedVec::from_f32(kv_dtype, &vec![f32::NAN; pool * kv_cols]);
                b.write_kv(&mut kv, 0, &nan, &nan)?;
                let (mut normed, mut fused) =
                    (poisoned(b, rows, hidden)?, poisoned(b, rows, cols)?);
                let (mut q, mut k, mut v) = (
                    poisoned(b, rows, q_cols)?,
                    poisoned(b, rows, kv_cols)?,
                    poisoned(b, rows, kv_cols)?,
                );
                let outputs = (&mut q, &mut k, &mut v);
                let store = stored.then_some((&mut kv, &stores[..]));
                if epilogue {
                    let scratch = (&mut normed, &mut fused);
                    b.rms_norm_matmul_rope(
                        &x,
                        (&norm, 1e-5),
                        &w,
                        scratch,
                        &positions,
                        &inv_freq,
                        outputs,
                        store,
                    )?;
                } else {
                    b.rms_norm_matmul(&x, (&norm, 1e-5), &w, &mut normed, &mut fused)?;
                    match store {
                        Some((kv, pairs)) => {
                            b.rope_split_store(&fused, &positions, &inv_freq, outputs, kv, pairs)?
                        }
                        None => {
                            b.rope_split(&fused, &positions, &inv_freq, &mut q, &mut k, &mut v)?
                        }
                    }
                }
                let (kc, vc) = b.load_kv(&kv, &slots)?;
                [&q, &k, &v, &kc, &vc, &fused]
                    .into_iter()
                    .map(|t| b.download_tensor(t))
                    .collect()
            };
            let (two_ops, fused) = (run(false).unwrap(), run(true).unwrap());
            let case = format!(
                "{shape:?} {dtype} ({kv_dtype} KV, {norm_dtype} norm) {rows} rows, stored: {stored}"
            );
            let epilogue_ran = fused[5].iter().all(|x| x.is_nan());
            assert_eq!(
                epilogue_ran,
                dtype == kv_dtype || !stored,
                "{case}: whether the projection was left unwritten (the epilogue ran)"
            );
            for ((name, a), b) in STORED_QKV.iter().zip(&two_ops).zip(&fused) {
                if name.starts_with("stored") && !stored {
                    assert!(b.iter().all(|x| x.is_nan()), "{case} {name}: written");
                    continue;
                }
                same_bits(&format!("{case} {name}"), a, b);
            }
        }
    }
}

const PAGE: u32 = 16;
const POOL: usize = 64;
const STORED: usize = 40;

/// Stores rows of k and v into two paged pools that share one page table, as a model's layers
/// do (a shuffled table, some rows not stored, the rest in scrambled order), reads them back
/// with the decode kernels through queries made from a tensor and with the prefill's attention
/// over the cache, and returns both states and the first pool's K and V bytes (physical). The
/// second pool's decode must equal the first's, also after the first takes a table of its own.
fn kv_path<B: LayerOps>(
    b: &B,
    shape: &AttnShape,
    dtype: DType,
    (k, v, q): (&[f32], &[f32], &[f32]),
) -> Result<(AttnStates, AttnStates, Vec<u8>, Vec<u8>)>
where
    B::Kv: Sync,
{
    let width = shape.kv_token_elems();
    let table = [2u32, 0, 3, 1];
    let nan = TypedVec::from_f32(dtype, &vec![f32::NAN; POOL * width]);
    let mut kvs = vec![
        b.alloc_kv(shape, dtype, POOL)?,
        b.alloc_kv(shape, dtype, POOL)?,
    ];
    for kv in &mut kvs {
        b.write_kv(kv, 0, &nan, &nan)?;
    }
    b.set_page_tables(&mut kvs, PAGE, &table)?;
    // Row i holds logical token 7i mod 40; rows 40.. are not stored.
    let physical = |t: usize| table[t / PAGE as usize] * PAGE + (t % PAGE as usize) as u32;
    let rows: Vec<(u32, u32)> = (0..STORED)
        .map(|i| (i as u32, physical(i * 7 % STORED)))
        .collect();
    let rows_k = k.len() / width;
    let (k, v) = (
        b.upload_tensor(k, rows_k, width)?,
        b.upload_tensor(v, rows_k, width)?,
    );
    for kv in &mut kvs {
        b.store_kv(kv, &k, &v, &rows)?;
    }
    let (mut kv, twin) = (kvs.remove(0), kvs.remove(0));

    let nq = q.len() / shape.q_row_elems();
    // The decode reads queries from a tensor given up, as a decode step's are.
    let queries = b.take_queries(shape, b.upload_tensor(q, nq, shape.q_row_elems())?)?;
    let q = b.upload_tensor(q, nq, shape.q_row_elems())?;
    let plan = Plan::new(
        nq,
        vec![Group::unmasked(
            vec![0..STORED as u32],
            (0..nq as u32).collect(),
        )],
    )
    .unwrap();
    let plan = b.upload_plan(shape, &plan)?;
    let mut partials = b.alloc_partials(shape, &plan)?;
    let mut out = b.alloc_states(shape, nq)?;
    b.poison(&mut partials)?;
    b.poison(&mut out)?;
    b.step(&kv, &queries, &plan, &mut partials, &mut out)?;
    let states = b.download(&out)?;
    let mut twin_decode = |b: &B| -> Result<AttnStates> {
        let mut twin_out = b.alloc_states(shape, nq)?;
        b.poison(&mut twin_out)?;
        b.step(&twin, &queries, &plan, &mut partials, &mut twin_out)?;
        b.download(&twin_out)
    };
    let same = |a: &AttnStates, b: &AttnStates| {
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        bits(&a.o) == bits(&b.o) && bits(&a.lse) == bits(&b.lse)
    };
    assert!(
        same(&states, &twin_decode(b)?),
        "{dtype}: the pool sharing the table differs"
    );

    // The prefill's attention over the same keys where the cache keeps them (physical slots,
    // whatever the page table): the query at 13 j sees the keys at or before it.
    let slots: Vec<u32> = rows.iter().map(|&(_, slot)| slot).collect();
    let positions: Vec<u32> = (0..STORED).map(|i| (i * 7 % STORED) as u32).collect();
    let q_pos: Vec<u32> = (0..nq as u32).map(|j| 13 * j).collect();
    let mut cached = b.empty_states(shape, nq)?;
    let keys = CachedKeys {
        kv: &kv,
        slots: &slots,
        positions: &positions,
    };
    b.cached_attention(shape, &q, &q_pos, keys, &mut cached)?;
    let cached = b.download(&cached)?;

    // The pool as stored: identity pages, read by a one-rank world's send to itself.
    b.set_page_table(&mut kv, PAGE, &[0, 1, 2, 3])?;
    assert!(
        same(&states, &twin_decode(b)?),
        "{dtype}: a table set on one pool moved the other's"
    );
    let bytes = POOL * shape.kv_token_bytes(dtype);
    let read = ThreadWorld::run(1, Duration::from_secs(60), |comm| -> Result<_> {
        b.send_kv(&kv, POOL, &comm, 0)?;
        let (mut k, mut v) = (vec![0u8; bytes], vec![0u8; bytes]);
        comm.recv(&mut k, 0)?;
        comm.recv(&mut v, 0)?;
        Ok((k, v))
    });
    let (k, v) = read.into_iter().next().expect("one rank")?;
    Ok((states, cached, k, v))
}

#[test]
fn stored_kv_feeds_the_decode_kernels() {
    let Some(gpu) = gpu("stored_kv_feeds_the_decode_kernels") else {
        return;
    };
    let gpu = gpu.with_paging(PAGE).unwrap();
    let mut rng = rng("stored_kv_feeds_the_decode_kernels");
    let shape = AttnShape::new(8, 2, 128).unwrap();
    let width = shape.kv_token_elems();
    for dtype in DType::ALL {
        eprintln!("{dtype} KV:");
        let k = values(&mut rng, (STORED + 5) * width, 1.0);
        let v = values(&mut rng, (STORED + 5) * width, 1.0);
        let q = values(&mut rng, 3 * shape.q_row_elems(), 1.0);
        let (got, got_cached, got_k, got_v) = kv_path(&gpu, &shape, dtype, (&k, &v, &q)).unwrap();
        let (want, want_cached, want_k, want_v) =
            kv_path(&CpuBackend, &shape, dtype, (&k, &v, &q)).unwrap();
        // Narrowing is round-to-nearest-even on both: the pools agree bit for bit, NaN
        // poison included where no row was stored.
        assert!(got_k == want_k && got_v == want_v, "{dtype}: pools differ");
        eprintln!("  store_kv                                     pools equal bit for bit");
        // The GPU's decode kernels may read queries in the KV's dtype.
        let tolerance = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
        check(
            "store_kv + tensor_queries + decode o",
            &got.o,
            &want.o,
            tolerance,
        );
        check(
            "store_kv + tensor_queries + decode lse",
            &got.lse,
            &want.lse,
            tolerance,
        );
        check(
            "store_kv + cached_attention o",
            &got_cached.o,
            &want_cached.o,
            tolerance,
        );
        check(
            "store_kv + cached_attention lse",
            &got_cached.lse,
            &want_cached.lse,
            tolerance,
        );
    }
}

fn needs(shape: AttnShape) -> ModelNeeds {
    ModelNeeds {
        shape,
        hidden: 2048,
        intermediate: 8192,
        vocab: 128_256,
        layers: 16,
        weight_dtype: DType::Bf16,
        weight_bytes: 2_500_000_000,
        kv_dtype: DType::Bf16,
        kv_tokens: 8192,
        max_rows: 512,
        attention_rows: 512,
        attention_keys: 8192,
        logit_rows: 1,
        peer_devices: 0,
        ranks_here: 1,
    }
}

/// Every bad operand is an error naming the problem, never a panic or a kernel past a buffer.
#[test]
fn bad_operands_are_errors() {
    let Some(gpu) = gpu("bad_operands_are_errors") else {
        return;
    };
    let message = |r: Result<()>| r.expect_err("refused").to_string();
    let shape = AttnShape::new(8, 2, 64).unwrap();
    assert!(gpu.check_model(&needs(shape)).is_ok());
    let odd = AttnShape {
        head_dim: 96,
        ..shape
    };
    assert!(message(gpu.check_model(&needs(odd))).contains("head dim 96"));
    let uneven = AttnShape {
        q_heads: 6,
        kv_heads: 4,
        ..shape
    };
    assert!(message(gpu.check_model(&needs(uneven))).contains("evenly"));
    let huge = ModelNeeds {
        weight_bytes: 1 << 50,
        ..needs(shape)
    };
    assert!(message(gpu.check_model(&huge)).contains("free"));
    // NCCL's buffers are priced per peer GPU: what fits on a GPU of its own is refused beside
    // a thousand peers, and not where the ranks share the GPU.
    assert!(gpu
        .check_model(&needs(shape).on_device_holding(1, 2))
        .is_ok());
    let crowded = needs(shape).on_device_holding(1, 1001);
    assert!(message(gpu.check_model(&crowded)).contains("1000 peer GPUs"));
    assert!(gpu
        .check_model(&needs(shape).on_device_holding(2, 1001))
        .is_ok());

    let w = gpu
        .upload_weight(&TypedVec::from_f32(DType::Bf16, &[0.5; 12]), 3, 4)
        .unwrap();
    let x = gpu.upload_tensor(&[1.0; 10], 2, 5).unwrap();
    let mut out = gpu.tensor(2, 3).unwrap();
    assert!(message(gpu.matmul(&x, &w, &mut out)).contains("columns"));
    // Empty operands launch nothing; an empty sum is zero.
    let mut none = gpu.tensor(0, 3).unwrap();
    gpu.matmul(&gpu.tensor(0, 4).unwrap(), &w, &mut none)
        .unwrap();
    let w0 = gpu.upload_weight(&TypedVec::F32(Vec::new()), 3, 0).unwrap();
    let mut zeros = gpu.upload_tensor(&[f32::NAN; 6], 2, 3).unwrap();
    gpu.matmul(&gpu.tensor(2, 0).unwrap(), &w0, &mut zeros)
        .unwrap();
    assert_eq!(gpu.download_tensor(&zeros).unwrap(), [0.0; 6]);
    assert!(message(gpu.embed(&w, &[3], &mut out)).contains("output"));
    let mut row = gpu.tensor(1, 4).unwrap();
    assert!(message(gpu.embed(&w, &[3], &mut row)).contains("token id 3"));
    let (one, three) = (
        gpu.upload_weight(&TypedVec::F32(vec![1.0]), 1, 1).unwrap(),
        gpu.upload_weight(&TypedVec::F32(vec![1.0; 3]), 1, 3)
            .unwrap(),
    );
    let qkv = gpu.tensor(1, 12).unwrap();
    let (mut q, mut k, mut v) = (
        gpu.tensor(1, 4).unwrap(),
        gpu.tensor(1, 4).unwrap(),
        gpu.tensor(1, 4).unwrap(),
    );
    let mut split = |pos: &[u32], inv: &canopy_cuda::CudaWeight| {
        message(gpu.rope_split(&qkv, pos, inv, &mut q, &mut k, &mut v))
    };
    assert!(split(&[0, 1], &one).contains("positions"));
    assert!(split(&[0], &three).contains("whole heads"));
    let x4 = gpu.upload_tensor(&[1.0; 8], 2, 4).unwrap();
    assert!(message(gpu.matmul_swiglu(&x4, &w, &mut out)).contains("even number"));
    assert!(message(gpu.copy_rows(&x, 1, &mut gpu.tensor(2, 5).unwrap())).contains("rows 1..3"));
    let mut kv = gpu.alloc_kv(&shape, DType::Bf16, 4).unwrap();
    let k = gpu.tensor(1, shape.kv_token_elems()).unwrap();
    assert!(message(gpu.store_kv(&mut kv, &k, &k, &[(0, 4)])).contains("slot 4"));
    assert!(message(gpu.store_kv(&mut kv, &k, &k, &[(1, 0)])).contains("row 1"));
    let mut states = gpu.empty_states(&shape, 2).unwrap();
    let q = gpu.tensor(1, shape.q_row_elems()).unwrap();
    assert!(message(gpu.causal_attention(
        &shape,
        &q,
        &[0],
        KeyBlock {
            k: &k,
            v: &k,
            positions: &[0],
            dtype: DType::Bf16
        },
        &mut states
    ))
    .contains("states' rows"));
    // The engine's page tables (the backend's own takes no page size).
    assert!(message(Backend::set_page_table(&gpu, &mut kv, PAGE, &[0])).contains("with_paging"));
    let paged = CudaBackend::new(0).unwrap().with_paging(PAGE).unwrap();
    let mut kv = paged.alloc_kv(&shape, DType::Bf16, 32).unwrap();
    assert!(message(Backend::set_page_table(&paged, &mut kv, 32, &[0])).contains("16-token pages"));
    assert!(Backend::set_page_table(&paged, &mut kv, PAGE, &[1, 0]).is_ok());
}
