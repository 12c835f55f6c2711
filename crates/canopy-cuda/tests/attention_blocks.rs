//! The CUDA backend's causal attention over blocks of keys against the CPU backend's, on fresh
//! random inputs: the CUDA-core kernel (f32 keys, head dims the tensor cores do not hold) and
//! the prefill's tensor-core kernel (16-bit keys), blocks merged in any order, and rows with
//! windows (the keys from a row's start to its position) as a serving pass's chunks attend;
//! and the attention outputs that the kernels finishing them write as the output projection's
//! operand, against the states' path; and states gathered by rows.
//!
//! Without a GPU (no driver, no device, no NVRTC) every test prints why and passes. The seed
//! is printed; `CANOPY_TEST_SEED` repeats a run.

mod common;
mod compare;
use common::{gpu, rng};
use compare::{check, poisoned, values};

use canopy_core::{AttnShape, AttnStates, DType, Group, Plan, TypedVec};
use canopy_cuda::CudaBackend;
use canopy_engine::{Backend, CachedKeys, CpuBackend, KeyBlock, LayerOps, Result};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// One block of keys for [`attention`]: K, V and their positions.
type Block = (Vec<f32>, Vec<f32>, Vec<u32>);

/// The states (and their output) of query rows `q` at `q_pos` (seeing keys from `q_from`, if
/// given) after every block of keys, in order, read as a cache of `dtype` holds them.
fn attention<B: LayerOps>(
    b: &B,
    shape: &AttnShape,
    q: &[f32],
    (q_pos, q_from): (&[u32], Option<&[u32]>),
    blocks: &[Block],
    dtype: DType,
) -> Result<(AttnStates, Vec<f32>)> {
    let rows = q_pos.len();
    let q = b.upload_tensor(q, rows, shape.q_row_elems())?;
    let mut states = b.empty_states(shape, rows)?;
    for (k, v, positions) in blocks {
        let k = b.upload_tensor(k, positions.len(), shape.kv_token_elems())?;
        let v = b.upload_tensor(v, positions.len(), shape.kv_token_elems())?;
        let keys = KeyBlock {
            k: &k,
            v: &v,
            positions,
            dtype,
        };
        b.causal_attention_from(shape, &q, q_pos, q_from, keys, &mut states)?;
    }
    let mut out = poisoned(b, rows, shape.q_row_elems())?;
    b.states_output(&states, &mut out)?;
    Ok((b.download(&states)?, b.download_tensor(&out)?))
}

/// Random keys and values at `positions`.
fn block(rng: &mut ChaCha8Rng, shape: &AttnShape, positions: Vec<u32>) -> Block {
    let n = positions.len() * shape.kv_token_elems();
    (values(rng, n, 1.0), values(rng, n, 1.0), positions)
}

/// The rows whose states are empty, exactly (`lse = -inf`, `o = 0`), and every other row's lse
/// finite.
fn empty_rows(states: &AttnStates, heads: usize) -> Vec<usize> {
    let row_elems = heads * states.head_dim;
    let empty: Vec<usize> = (0..states.rows)
        .filter(|&r| states.lse[r * heads] == f32::NEG_INFINITY)
        .collect();
    for r in 0..states.rows {
        let (lse, o) = (
            &states.lse[r * heads..(r + 1) * heads],
            &states.o[r * row_elems..(r + 1) * row_elems],
        );
        if empty.contains(&r) {
            assert!(
                lse.iter().all(|&l| l == f32::NEG_INFINITY),
                "row {r}: {lse:?}"
            );
            assert!(
                o.iter().all(|&x| x == 0.0),
                "row {r} is empty but has outputs"
            );
        } else {
            assert!(lse.iter().all(|l| l.is_finite()), "row {r}: {lse:?}");
        }
    }
    empty
}

/// Attention of 7 query rows over two blocks of keys, the later block first (as a prompt's
/// chunks arrive from other ranks), on the CUDA cores (f32 keys, and head dims the tensor-core
/// path does not hold): one row sees no key of either block, one sees only the earlier block's
/// first key.
#[test]
fn attention_blocks_merge_like_the_cpu() {
    let Some(gpu) = gpu("attention_blocks_merge_like_the_cpu") else {
        return;
    };
    let mut rng = rng("attention_blocks_merge_like_the_cpu");
    let q_pos = [1, 2, 9, 17, 30, 45, 57];
    for (q_heads, kv_heads, head_dim, dtype) in [
        (8, 2, 64, DType::F32),
        (8, 2, 128, DType::F32),
        (4, 4, 128, DType::F32),
        (6, 1, 256, DType::F32),
        (6, 1, 256, DType::Bf16),
    ] {
        let shape = AttnShape::new(q_heads, kv_heads, head_dim).unwrap();
        eprintln!("{q_heads}/{kv_heads} heads × {head_dim}, {dtype:?} keys:");
        let q = values(&mut rng, q_pos.len() * shape.q_row_elems(), 1.0);
        let blocks = [
            block(&mut rng, &shape, (20..58).collect()),
            block(&mut rng, &shape, (2..20).collect()),
        ];
        let (got, got_out) = attention(&gpu, &shape, &q, (&q_pos, None), &blocks, dtype).unwrap();
        let (want, want_out) =
            attention(&CpuBackend, &shape, &q, (&q_pos, None), &blocks, dtype).unwrap();
        check("causal_attention o vs cpu", &got.o, &want.o, 1e-5);
        check("causal_attention lse vs cpu", &got.lse, &want.lse, 1e-5);
        check("states_output", &got_out, &got.o, 0.0);
        check("states_output vs cpu", &got_out, &want_out, 1e-5);
        // Row 0 (position 1) sees no key.
        assert_eq!(empty_rows(&got, q_heads), [0]);
        // With windows, rows 1 and 6 (starts past their positions) see none either.
        let rows = (&q_pos[..], Some(&[0, 3, 2, 10, 20, 44, 58][..]));
        let (got, _) = attention(&gpu, &shape, &q, rows, &blocks, dtype).unwrap();
        let (want, _) = attention(&CpuBackend, &shape, &q, rows, &blocks, dtype).unwrap();
        check("windowed attention o vs cpu", &got.o, &want.o, 1e-5);
        check("windowed attention lse vs cpu", &got.lse, &want.lse, 1e-5);
        assert_eq!(empty_rows(&got, q_heads), [0, 1, 6]);
    }
}

/// Causal attention as a prefill runs it with 16-bit KV, on tensor cores, against the CPU
/// reading the same rounded keys: a chunk of a prompt over itself, then a block of later
/// positions (which the chunk's first rows do not see) and the earlier context in shuffled
/// order, none of them whole tiles, for GQA groups of 1, 3, 4, 7 and 8 heads and both head
/// dims (groups of 3 and 7 leave a CTA's 128 rows short of full on the warpgroup MMA).
/// The GPU also rounds the queries and the softmax's weights to the dtype, hence the tolerances.
#[test]
fn prefill_attention_on_tensor_cores_matches_the_cpu() {
    let test = "prefill_attention_on_tensor_cores_matches_the_cpu";
    let Some(gpu) = gpu(test) else {
        return;
    };
    let mut rng = rng(test);
    for dtype in [DType::Bf16, DType::F16] {
        let shapes = [
            (32, 8, 128),
            (24, 8, 128),
            (28, 4, 128),
            (9, 3, 64),
            (4, 4, 128),
            (8, 1, 64),
        ];
        for (q_heads, kv_heads, head_dim) in shapes {
            let shape = AttnShape::new(q_heads, kv_heads, head_dim).unwrap();
            eprintln!("{q_heads}/{kv_heads} heads × {head_dim}, {dtype:?} keys:");
            let first = rng.gen_range(100..400u32);
            let rows = rng.gen_range(150..350u32);
            let q_pos: Vec<u32> = (first..first + rows).collect();
            let q = values(&mut rng, q_pos.len() * shape.q_row_elems(), 1.0);
            let mut earlier: Vec<u32> = (0..first).collect();
            for i in (1..earlier.len()).rev() {
                earlier.swap(i, rng.gen_range(0..=i));
            }
            let later = first + rows / 2;
            let blocks = [
                block(&mut rng, &shape, q_pos.clone()),
                block(&mut rng, &shape, (later..later + 97).collect()),
                block(&mut rng, &shape, earlier),
            ];
            // After the later block alone, the rows before it have seen nothing.
            let (alone, _) =
                attention(&gpu, &shape, &q, (&q_pos, None), &blocks[1..2], dtype).unwrap();
            let unseen: Vec<usize> = (0..(later - first) as usize).collect();
            assert_eq!(empty_rows(&alone, q_heads), unseen);
            let (got, got_out) =
                attention(&gpu, &shape, &q, (&q_pos, None), &blocks, dtype).unwrap();
            let (want, _) =
                attention(&CpuBackend, &shape, &q, (&q_pos, None), &blocks, dtype).unwrap();
            let (o_tol, lse_tol) = if dtype == DType::Bf16 {
                (1e-2, 2e-3)
            } else {
                (2e-3, 5e-4)
            };
            check("prefill attention o vs cpu", &got.o, &want.o, o_tol);
            check("prefill attention lse vs cpu", &got.lse, &want.lse, lse_tol);
            check("states_output", &got_out, &got.o, 0.0);
            assert!(empty_rows(&got, q_heads).is_empty());
            // A serving pass's chunks as one block: rows numbered from 1, each seeing the keys
            // from its chunk's first row, led by three rows that see none.
            let mut from = vec![u32::MAX; 3];
            while from.len() < rows as usize {
                let (start, left) = (from.len() as u32 + 1, rows - from.len() as u32);
                from.extend(std::iter::repeat_n(
                    start,
                    rng.gen_range(1..80).min(left) as usize,
                ));
            }
            let numbered: Vec<u32> = (0..rows).map(|r| if r < 3 { 0 } else { r + 1 }).collect();
            let own = [block(&mut rng, &shape, (1..=rows).collect())];
            let pass = (&numbered[..], Some(&from[..]));
            let (got, _) = attention(&gpu, &shape, &q, pass, &own, dtype).unwrap();
            let (want, _) = attention(&CpuBackend, &shape, &q, pass, &own, dtype).unwrap();
            check(
                "windowed prefill attention o vs cpu",
                &got.o,
                &want.o,
                o_tol,
            );
            check(
                "windowed prefill attention lse vs cpu",
                &got.lse,
                &want.lse,
                lse_tol,
            );
            assert_eq!(empty_rows(&got, q_heads), [0, 1, 2]);
        }
    }
}

/// The output of `cached_attention_output` (on tensor cores, stored by the attention kernel
/// itself, rounded for the output projection) read through a product, against
/// `cached_attention` into empty states then `states_output`, on the GPU (bit for bit) and on
/// the CPU: keys in scrambled cache slots, and rows that see no key (their output is zero).
#[test]
fn attention_output_stored_by_the_kernel_equals_the_states_path() {
    let test = "attention_output_stored_by_the_kernel_equals_the_states_path";
    each_output_case(test, |gpu, rng, dtype, shape| {
        let tokens = rng.gen_range(200..400usize);
        let pool = tokens + 37;
        let width = shape.kv_token_elems();
        let (k, v) = (
            values(rng, pool * width, 1.0),
            values(rng, pool * width, 1.0),
        );
        let mut slots: Vec<u32> = (0..pool as u32).collect();
        for i in (1..slots.len()).rev() {
            slots.swap(i, rng.gen_range(0..=i));
        }
        slots.truncate(tokens);
        // Keys from position 10: the rows before it see none.
        let positions: Vec<u32> = (10..10 + tokens as u32).collect();
        let rows = rng.gen_range(100..250usize);
        let q_pos: Vec<u32> = (0..rows as u32).map(|r| r * 2).collect();
        let q = values(rng, rows * shape.q_row_elems(), 1.0);
        let cols = shape.q_row_elems();
        let eye = identity(cols);
        let case = OutputCase {
            shape,
            dtype,
            kvq: (&k, &v, &q),
            keys: (&slots, &positions, &q_pos),
            eye: &eye,
        };
        let run = |fused| {
            let gpu = output_path(gpu, &case, fused).unwrap();
            (gpu, output_path(&CpuBackend, &case, fused).unwrap())
        };
        let ((through_states, cpu_states), (stored, cpu_stored)) = (run(false), run(true));
        check(
            "stored output vs states_output",
            &stored,
            &through_states,
            0.0,
        );
        check(
            "cpu: stored output vs states_output",
            &cpu_stored,
            &cpu_states,
            0.0,
        );
        let tolerance = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
        check("stored output vs cpu", &stored, &cpu_stored, tolerance);
        let unseen = (0..rows).filter(|&r| q_pos[r] < 10).count();
        assert!(
            stored[..unseen * cols].iter().all(|&x| x == 0.0),
            "rows that see no key"
        );
        // (An element may round to zero in f16; a row that sees keys is not all zero.)
        assert!(stored[unseen * cols..]
            .chunks(cols)
            .all(|row| row.iter().all(|x| x.is_finite()) && row.iter().any(|&x| x != 0.0)));
    });
}

/// An attention output's inputs: K and V written to a whole pool of the dtype, the queries,
/// the keys' slots and positions, the queries' positions, and the identity weight that reads
/// the output.
struct OutputCase<'a> {
    shape: &'a AttnShape,
    dtype: DType,
    kvq: (&'a [f32], &'a [f32], &'a [f32]),
    keys: (&'a [u32], &'a [u32], &'a [u32]),
    eye: &'a [f32],
}

/// The attention output of `c`'s queries over the keys at its slots, as an operand of a weight
/// of its dtype, read by a product with the identity: by `cached_attention_output` (`fused`),
/// or through states.
fn output_path<B: LayerOps>(b: &B, c: &OutputCase, fused: bool) -> Result<Vec<f32>> {
    let ((k, v, q), (slots, positions, q_pos)) = (c.kvq, c.keys);
    let (shape, dtype) = (c.shape, c.dtype);
    let (cols, rows) = (shape.q_row_elems(), q_pos.len());
    let pool = k.len() / shape.kv_token_elems();
    let mut kv = b.alloc_kv(shape, dtype, pool)?;
    let typed = |x: &[f32]| TypedVec::from_f32(dtype, x);
    b.write_kv(&mut kv, 0, &typed(k), &typed(v))?;
    let q = b.upload_tensor(q, rows, cols)?;
    let w = b.upload_weight(&typed(c.eye), cols, cols)?;
    let mut out = b.gemm_operand(rows, cols, &w)?;
    // Poisoned first: an operand's rounded copy is kept for the op that writes it next.
    let mut poison = b.empty_states(shape, rows)?;
    b.poison(&mut poison)?;
    b.states_output(&poison, &mut out)?;
    let keys = CachedKeys {
        kv: &kv,
        slots,
        positions,
    };
    if fused {
        b.cached_attention_output(shape, &q, q_pos, keys, &mut out)?;
    } else {
        let mut states = b.empty_states(shape, rows)?;
        b.cached_attention(shape, &q, q_pos, keys, &mut states)?;
        b.states_output(&states, &mut out)?;
    }
    let mut product = poisoned(b, rows, cols)?;
    b.matmul(&out, &w, &mut product)?;
    b.download_tensor(&product)
}

/// The output of a decode step's merge (`step_output`) and of a prompt chunk's merge of two
/// blocks (`merge_into_output`), written by those kernels as the output projection's operand
/// and read through a product with the identity, against `step` or `merge_into` then
/// `states_output`: bit for bit on the GPU (which writes the operand for 16-bit weights), and
/// within rounding of the CPU (which never does). The step's plan is a shared prefix under a
/// leaf per query, so every query's partial rows are merged.
#[test]
fn outputs_written_by_the_merges_equal_the_states_path() {
    let test = "outputs_written_by_the_merges_equal_the_states_path";
    each_output_case(test, |gpu, rng, dtype, shape| {
        let queries = rng.gen_range(40..90usize);
        let prefix = rng.gen_range(300..700u32);
        let leaf = rng.gen_range(1..20u32);
        let pool = prefix as usize + queries * leaf as usize;
        let width = shape.kv_token_elems();
        let case = MergeCase {
            shape,
            dtype,
            kv: (
                &values(rng, pool * width, 1.0),
                &values(rng, pool * width, 1.0),
            ),
            q: &values(rng, queries * shape.q_row_elems(), 1.0),
            block: block(rng, shape, (0..queries as u32).collect()),
            tree: (prefix, leaf),
        };
        let run = |b: &dyn Fn(bool) -> Result<MergeOutputs>| (b(false).unwrap(), b(true).unwrap());
        let (gpu_states, gpu_written) = run(&|w| merge_outputs(gpu, &case, w));
        let (cpu_states, cpu_written) = run(&|w| merge_outputs(&CpuBackend, &case, w));
        let operand = dtype != DType::F32;
        assert_eq!(
            gpu_written.written,
            (operand, operand),
            "the GPU writes 16-bit operands"
        );
        assert_eq!(
            cpu_written.written,
            (false, false),
            "the CPU leaves them to states_output"
        );
        for (what, got, want) in [
            ("step_output", &gpu_written.step, &gpu_states.step),
            ("merge_into_output", &gpu_written.pair, &gpu_states.pair),
            ("cpu: step_output", &cpu_written.step, &cpu_states.step),
            (
                "cpu: merge_into_output",
                &cpu_written.pair,
                &cpu_states.pair,
            ),
        ] {
            check(&format!("{what} vs the states' path"), got, want, 0.0);
        }
        let tolerance = if operand { 1e-2 } else { 1e-5 };
        check(
            "step_output vs cpu",
            &gpu_written.step,
            &cpu_states.step,
            tolerance,
        );
        check(
            "merge_into_output vs cpu",
            &gpu_written.pair,
            &cpu_states.pair,
            tolerance,
        );
    });
}

/// A decode step's inputs: K and V of a pool of the dtype, the queries, a block of keys whose
/// states the step's merge with (a chunk's own keys), and the tree's prefix and leaf tokens.
struct MergeCase<'a> {
    shape: &'a AttnShape,
    dtype: DType,
    kv: (&'a [f32], &'a [f32]),
    q: &'a [f32],
    block: Block,
    tree: (u32, u32),
}

/// The products of [`merge_outputs`] and whether each output was written by its merge.
struct MergeOutputs {
    step: Vec<f32>,
    pair: Vec<f32>,
    written: (bool, bool),
}

/// `c`'s step, then its states merged into those of the queries over `c`'s block, each output
/// read through a product with the identity: written by the merges where the backend can
/// (`written`), or through `states_output`.
fn merge_outputs<B: LayerOps>(b: &B, c: &MergeCase, written: bool) -> Result<MergeOutputs> {
    let (shape, dtype) = (c.shape, c.dtype);
    let (cols, rows) = (shape.q_row_elems(), c.q.len() / shape.q_row_elems());
    let (prefix, leaf) = c.tree;
    let typed = |x: &[f32]| TypedVec::from_f32(dtype, x);
    let mut kv = b.alloc_kv(shape, dtype, c.kv.0.len() / shape.kv_token_elems())?;
    b.write_kv(&mut kv, 0, &typed(c.kv.0), &typed(c.kv.1))?;
    let mut groups = vec![Group::unmasked(vec![0..prefix], (0..rows as u32).collect())];
    groups.extend((0..rows as u32).map(|j| {
        let from = prefix + j * leaf;
        Group::unmasked(vec![from..from + leaf], vec![j])
    }));
    let plan = b.upload_plan(shape, &Plan::new(rows, groups).unwrap())?;
    let queries = b.upload_queries(shape, c.q)?;
    let w = b.upload_weight(&typed(&identity(cols)), cols, cols)?;
    let operand = || -> Result<B::Tensor> {
        // Poisoned first: an operand's rounded copy is kept for the op that writes it next.
        let mut out = b.gemm_operand(rows, cols, &w)?;
        let mut poison = b.empty_states(shape, rows)?;
        b.poison(&mut poison)?;
        b.states_output(&poison, &mut out)?;
        Ok(out)
    };
    let read = |out: &B::Tensor| -> Result<Vec<f32>> {
        let mut product = poisoned(b, rows, cols)?;
        b.matmul(out, &w, &mut product)?;
        b.download_tensor(&product)
    };
    let mut partials = b.alloc_partials(shape, &plan)?;
    let mut states = b.alloc_states(shape, rows)?;
    b.poison(&mut partials)?;
    b.poison(&mut states)?;
    let mut step_out = operand()?;
    let step_written = match written {
        true => b.step_output(
            &kv,
            &queries,
            &plan,
            &mut partials,
            &mut states,
            &mut step_out,
        )?,
        false => {
            b.step(&kv, &queries, &plan, &mut partials, &mut states)?;
            false
        }
    };
    if !step_written {
        b.states_output(&states, &mut step_out)?;
    }

    let (k, v, positions) = &c.block;
    let (k, v) = (
        b.upload_tensor(k, positions.len(), shape.kv_token_elems())?,
        b.upload_tensor(v, positions.len(), shape.kv_token_elems())?,
    );
    let own = KeyBlock {
        k: &k,
        v: &v,
        positions,
        dtype,
    };
    let q = b.upload_tensor(c.q, rows, cols)?;
    let q_pos: Vec<u32> = (0..rows as u32).collect();
    let mut acc = b.empty_states(shape, rows)?;
    b.causal_attention_from(shape, &q, &q_pos, None, own, &mut acc)?;
    let mut pair_out = operand()?;
    let pair_written = match written {
        true => b.merge_into_output(&mut acc, &states, &mut pair_out)?,
        false => {
            b.merge_into(&mut acc, &states)?;
            false
        }
    };
    if !pair_written {
        b.states_output(&acc, &mut pair_out)?;
    }
    Ok(MergeOutputs {
        step: read(&step_out)?,
        pair: read(&pair_out)?,
        written: (step_written, pair_written),
    })
}

/// Runs `case` on the GPU, where there is one, for every dtype and the two shapes the output
/// tests cover (32/8 heads × 128 and 9/3 × 64), with the test's seeded generator.
fn each_output_case(
    test: &str,
    mut case: impl FnMut(&CudaBackend, &mut ChaCha8Rng, DType, &AttnShape),
) {
    let Some(gpu) = gpu(test) else {
        return;
    };
    let mut rng = rng(test);
    for dtype in DType::ALL {
        for (q_heads, kv_heads, head_dim) in [(32, 8, 128), (9, 3, 64)] {
            let shape = AttnShape::new(q_heads, kv_heads, head_dim).unwrap();
            eprintln!("{q_heads}/{kv_heads} heads × {head_dim}, {dtype:?}:");
            case(&gpu, &mut rng, dtype, &shape);
        }
    }
}

/// The `cols × cols` identity: the weight whose product reads an output as it is.
fn identity(cols: usize) -> Vec<f32> {
    (0..cols * cols)
        .map(|i| if i / cols == i % cols { 1.0 } else { 0.0 })
        .collect()
}

/// `gather_states` puts states' rows in a new order, exactly: rows in a few runs (one copy a
/// run) and in many (one launch), alone and repeated, every head's output and lse.
#[test]
fn gathered_states_are_the_rows_asked_for() {
    const TEST: &str = "gathered_states_are_the_rows_asked_for";
    let Some(gpu) = gpu(TEST) else {
        return;
    };
    let mut rng = rng(TEST);
    let shape = AttnShape::new(8, 2, 64).unwrap();
    let q_pos: Vec<u32> = (1..=9).collect();
    let q = values(&mut rng, q_pos.len() * shape.q_row_elems(), 1.0);
    let (k, v, positions) = block(&mut rng, &shape, (0..10).collect());
    let run = |b: &CudaBackend, rows: &[usize]| -> Result<(AttnStates, AttnStates)> {
        let q = b.upload_tensor(&q, q_pos.len(), shape.q_row_elems())?;
        let (k, v) = (
            b.upload_tensor(&k, positions.len(), shape.kv_token_elems())?,
            b.upload_tensor(&v, positions.len(), shape.kv_token_elems())?,
        );
        let keys = KeyBlock {
            k: &k,
            v: &v,
            positions: &positions,
            dtype: DType::F32,
        };
        let mut states = b.empty_states(&shape, q_pos.len())?;
        b.causal_attention_from(&shape, &q, &q_pos, None, keys, &mut states)?;
        let mut out = b.empty_states(&shape, rows.len())?;
        b.poison(&mut out)?;
        b.gather_states(&states, rows, &mut out)?;
        Ok((b.download(&states)?, b.download(&out)?))
    };
    let (heads, row) = (shape.q_heads, shape.q_row_elems());
    for rows in [&[2, 3, 4, 7][..], &[3, 4, 5, 0, 8, 8, 1, 2, 6, 6, 0]] {
        let (all, got) = run(&gpu, rows).unwrap();
        for (i, &r) in rows.iter().enumerate() {
            assert_eq!(
                got.lse[i * heads..(i + 1) * heads],
                all.lse[r * heads..(r + 1) * heads],
                "row {i} of {rows:?}: lse"
            );
            assert_eq!(
                got.o[i * row..(i + 1) * row],
                all.o[r * row..(r + 1) * row],
                "row {i} of {rows:?}: output"
            );
        }
    }
}
