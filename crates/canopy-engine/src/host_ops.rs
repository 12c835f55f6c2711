//! The model's arithmetic on the host, in f32: what the CPU backend's [`crate::LayerOps`] run.
//!
//! Matrices are row-major, a linear layer's weight `[out, in]` as transformers stores it, so
//! `y = x · Wᵀ`. Every op follows transformers' Llama in f32: RMSNorm scales by
//! `1 / sqrt(mean(x²) + eps)` before the weight, RoPE rotates the two halves of each head
//! (`rotate_half`), angles `position · inv_freq` in f32.

use rayon::prelude::*;

mod causal;
mod coded_rows;
mod few_rows;
pub(crate) mod flash;

pub use causal::causal_attention;
pub use coded_rows::CodedPanels;

/// Whether this CPU has AVX2 and FMA, which the host ops' vectorized paths are compiled for.
#[cfg(target_arch = "x86_64")]
fn has_avx2_and_fma() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

/// Output columns a thread takes at least in a product of one row.
const MIN_COLUMNS_A_THREAD: usize = 64;

/// `out[rows × n] = x[rows × k] · w[n × k]ᵀ`, or `out += x · wᵀ` when `accumulate`;
/// multi-threaded.
/// - One row (a decode step of one sequence): `gemm` runs it on one thread, so it is cut by
///   columns over the threads here. SmolLM2's 49,152 × 576 LM head took 11.5 ms at one row
///   through `gemm` on two threads, 5.4 ms cut in two. Each output element is the same
///   `gemm` dot product however the columns are cut.
/// - 2 to 32 rows (a decode step of a batch): the module `few_rows`, which reads
///   each weight row once for all of them. A row's result does not depend on the others.
/// - More (a prompt): `gemm`.
pub fn matmul(x: &[f32], rows: usize, w: &[f32], n: usize, out: &mut [f32], accumulate: bool) {
    let k = w.len() / n.max(1);
    debug_assert_eq!(x.len(), rows * k);
    debug_assert_eq!(out.len(), rows * n);
    if rows == 0 || n == 0 {
        return;
    }
    let threads = rayon::current_num_threads();
    if rows == 1 && threads > 1 && n >= 2 * MIN_COLUMNS_A_THREAD {
        let per_thread = n.div_ceil(threads).max(MIN_COLUMNS_A_THREAD);
        out.par_chunks_mut(per_thread)
            .zip(w.par_chunks(per_thread * k))
            .for_each(|(out, w)| product(x, 1, k, w, out, accumulate, gemm::Parallelism::None));
        return;
    }
    if (2..=few_rows::FEW_ROWS).contains(&rows) {
        few_rows::matmul(x, rows, w, n, out, accumulate);
        return;
    }
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    product(x, rows, k, w, out, accumulate, parallelism);
}

/// [`matmul`] with a quantized model's coded weight, in panels ([`CodedPanels`]), whose
/// values are f32 ones.
/// - Up to 32 rows (a decode step): the module `coded_rows`, each panel's codes converted
///   once for all the input rows, a group's step and offset applied to its sums: a third of
///   f32's bytes are read, a fifth for 4-bit codes. A row's result is the same bits alone
///   or in a batch.
/// - More (a prompt): each task decodes 128 weight rows into memory it keeps, and runs
///   `gemm` on them.
pub fn matmul_coded(x: &[f32], rows: usize, w: &CodedPanels, out: &mut [f32], accumulate: bool) {
    debug_assert_eq!(x.len(), rows * w.cols);
    debug_assert_eq!(out.len(), rows * w.rows);
    if rows == 0 || w.rows == 0 {
        return;
    }
    if rows <= coded_rows::FEW_ROWS {
        coded_rows::matmul(x, rows, w, out, accumulate);
        return;
    }
    let (n, k) = (w.rows, w.cols);
    let panels_a_task = PANEL_COLUMNS / coded_rows::LANES;
    let out_at = SharedOut(out.as_mut_ptr());
    (0..n.div_ceil(PANEL_COLUMNS))
        .into_par_iter()
        .for_each(|task| {
            let panels = task * panels_a_task
                ..((task + 1) * panels_a_task).min(n.div_ceil(coded_rows::LANES));
            let width = panels.len() * coded_rows::LANES;
            let columns = task * PANEL_COLUMNS..(task * PANEL_COLUMNS + width).min(n);
            PANEL_VALUES.with_borrow_mut(|values| {
                values.resize(k * width, 0.0);
                w.decode_panels(panels, values);
                // SAFETY: this task alone writes these columns of `out` (rows × n, checked
                // by the caller), which outlives it; `values` holds their weight rows, the
                // element `i` of the `j`-th at `i · width + j`.
                unsafe {
                    product_into(
                        (x, rows, k),
                        (values, width as isize, 1),
                        (out_at.column(columns.start), columns.len(), n),
                        accumulate,
                        gemm::Parallelism::None,
                    )
                };
            });
        });
}

/// Makes the calling thread the first worker of a rayon pool of its own, for as long as the
/// thread lives, with a `1 / sharers` share of the global pool's threads (at least one:
/// `sharers` threads of the process each make one); returns whether it is one now. The host ops
/// this thread then calls split their work over that pool as a worker does: the thread takes
/// a part itself and the others steal the rest. From a thread outside any pool, each
/// parallel op is handed to the global pool's workers while the thread sleeps until they
/// end: a SmolLM2 decode step makes about 125 such hand-offs, and a one-row step on two
/// cores took 14-16% longer for them.
///
/// A thread already in a pool keeps it (and so does one whose pool's threads could not be
/// started: a warning says so), and a second call changes nothing. A thread whose work
/// waits on other threads' host ops (ranks as threads exchanging partial results) needs a
/// pool of its own for this: their work then never waits in its pool's queue.
pub fn work_in_own_pool(sharers: usize) -> bool {
    OWN_POOL.with(|own| {
        own.get_or_init(|| {
            if rayon::current_thread_index().is_some() {
                return None;
            }
            rayon::ThreadPoolBuilder::new()
                .num_threads((rayon::current_num_threads() / sharers.max(1)).max(1))
                .use_current_thread()
                .build()
                .inspect_err(|e| {
                    tracing::warn!(
                        "host ops run on the shared pool: this thread's own could not start: {e}"
                    )
                })
                .ok()
        })
        .is_some()
    })
}

thread_local! {
    /// The pool this thread is the first worker of ([`work_in_own_pool`]); when the thread
    /// ends, the pool's other threads end.
    static OWN_POOL: std::cell::OnceCell<Option<rayon::ThreadPool>> = const { std::cell::OnceCell::new() };
}

/// Output columns of a coded weight that a prompt's product decodes at once, one task's:
/// fixed, so that a result does not depend on the thread count. A whole number of panels.
const PANEL_COLUMNS: usize = 128;

thread_local! {
    /// A thread's decoded panels (a prompt's) or converted codes (`coded_rows`' blocks for
    /// more than three rows), kept between products: a fresh buffer each time would have the
    /// kernel clear its pages.
    static PANEL_VALUES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A product's output, whose columns tasks write apart: every multi-threaded product here
/// hands each task its own columns.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: each task writes only its own columns (`matmul_coded`, `few_rows::matmul`,
// `coded_rows::matmul`).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// Where column `c` of row 0 is.
    ///
    /// # Safety
    /// `c` is inside the output's first row.
    unsafe fn column(self, c: usize) -> *mut f32 {
        unsafe { self.0.add(c) }
    }
}

/// `out[rows × n] = x · wᵀ`, or += when `accumulate`, n being `w`'s rows (k each).
fn product(
    x: &[f32],
    rows: usize,
    k: usize,
    w: &[f32],
    out: &mut [f32],
    accumulate: bool,
    parallelism: gemm::Parallelism,
) {
    let n = out.len() / rows;
    assert!(x.len() == rows * k && w.len() == n * k && out.len() == rows * n);
    // SAFETY: `out` is rows × n, row-major, as the lengths checked above say.
    unsafe {
        product_into(
            (x, rows, k),
            (w, 1, k as isize),
            (out.as_mut_ptr(), n, n),
            accumulate,
            parallelism,
        )
    }
}

/// `out[rows × n] = x · wᵀ`, or += when `accumulate`, into `out`'s rows `stride` elements
/// apart. `w` is `n × k`, element `(j, i)` at `i · i_stride + j · j_stride`: row-major
/// weight rows (`(1, k)`), or panels decoded for a prompt.
///
/// # Safety
/// `out` points at `rows` rows of `n` elements, `stride` apart, that nothing else touches
/// meanwhile.
unsafe fn product_into(
    (x, rows, k): (&[f32], usize, usize),
    (w, i_stride, j_stride): (&[f32], isize, isize),
    (out, n, stride): (*mut f32, usize, usize),
    accumulate: bool,
    parallelism: gemm::Parallelism,
) {
    let last = if n == 0 || k == 0 {
        0
    } else {
        (k - 1) as isize * i_stride + (n - 1) as isize * j_stride + 1
    };
    assert!(x.len() == rows * k && w.len() as isize >= last && n <= stride);
    // SAFETY: the pointers and strides describe the operands (dst rows × n, rows `stride`
    // apart, as the caller promises; lhs rows × k row-major; rhs k × n read from w at its
    // strides, inside it as checked above), and none overlap.
    unsafe {
        gemm::gemm(
            rows,
            n,
            k,
            out,
            1,
            stride as isize,
            accumulate,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            j_stride,
            i_stride,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// RMSNorm of each row of `x` into `out`: `x / sqrt(mean(x²) + eps) * weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    out.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .for_each(|(o, x)| {
            let mean = x.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let inv = 1.0 / (mean + eps).sqrt();
            o.iter_mut()
                .zip(x)
                .zip(weight)
                .for_each(|((o, &x), &w)| *o = w * (x * inv));
        });
}

/// `out = silu(gate) * up` row by row, `gate` and `up` the two halves of each row of
/// `gate_up` (`cols` values each): the SwiGLU MLP's activation.
pub fn swiglu(gate_up: &[f32], cols: usize, out: &mut [f32]) {
    if cols == 0 {
        return;
    }
    out.par_chunks_mut(cols)
        .zip(gate_up.par_chunks(2 * cols))
        .for_each(|(o, gu)| {
            let (gate, up) = gu.split_at(cols);
            for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                *o = g / (1.0 + (-g).exp()) * u;
            }
        });
}

/// Rotates every head of each row in place: row `r` sits at `positions[r]`; a row is `heads`
/// heads of `inv_freq.len() * 2` values.
pub fn rope_in_place(x: &mut [f32], positions: &[u32], inv_freq: &[f32]) {
    if positions.is_empty() {
        return;
    }
    let half = inv_freq.len();
    let d = 2 * half;
    let row = x.len() / positions.len();
    x.par_chunks_mut(row)
        .zip(positions)
        .for_each(|(row, &pos)| {
            let (sin, cos): (Vec<f32>, Vec<f32>) =
                inv_freq.iter().map(|&f| (pos as f32 * f).sin_cos()).unzip();
            for head in row.chunks_mut(d) {
                let (a, b) = head.split_at_mut(half);
                for i in 0..half {
                    let (x1, x2) = (a[i], b[i]);
                    a[i] = x1 * cos[i] - x2 * sin[i];
                    b[i] = x2 * cos[i] + x1 * sin[i];
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use canopy_core::{AttnShape, EMPTY_LSE};

    #[test]
    fn matmul_is_x_times_w_transposed() {
        // x: 2 × 3, w: 4 × 3.
        let x = [1.0, 2.0, 3.0, -1.0, 0.5, 2.0];
        let w: Vec<f32> = (0..12).map(|i| i as f32 * 0.25 - 1.0).collect();
        let mut out = vec![0.0; 8];
        matmul(&x, 2, &w, 4, &mut out, false);
        for r in 0..2 {
            for n in 0..4 {
                let want: f32 = (0..3).map(|k| x[r * 3 + k] * w[n * 3 + k]).sum();
                assert!((out[r * 4 + n] - want).abs() < 1e-5, "{r} {n}");
            }
        }
    }

    #[test]
    fn a_thread_works_in_a_pool_of_its_own_and_its_products_do_not_change() {
        let global = rayon::current_num_threads();
        let (k, n) = (96, 300);
        let x: Vec<f32> = (0..3 * k)
            .map(|i| (i * 37 % 101) as f32 / 50.0 - 1.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| (i * 53 % 89) as f32 / 40.0 - 1.1)
            .collect();
        let products = || {
            [1, 3].map(|rows| {
                let mut out = vec![f32::NAN; rows * n];
                matmul(&x[..rows * k], rows, &w, n, &mut out, false);
                out
            })
        };
        let outside = products();
        let on_a_thread = |work: &(dyn Fn() -> [Vec<f32>; 2] + Sync)| {
            std::thread::scope(|s| s.spawn(work).join().unwrap())
        };
        let inside = on_a_thread(&|| {
            assert_eq!(rayon::current_thread_index(), None);
            assert!(work_in_own_pool(1));
            assert_eq!(rayon::current_thread_index(), Some(0));
            assert_eq!(rayon::current_num_threads(), global);
            // A second call keeps the pool.
            assert!(work_in_own_pool(global + 1));
            assert_eq!(rayon::current_num_threads(), global);
            products()
        });
        for (a, b) in outside.iter().zip(&inside) {
            assert_eq!(
                a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
        // More sharers than threads leave each one thread, its own.
        let alone = std::thread::spawn(move || {
            assert!(work_in_own_pool(global + 1));
            rayon::current_num_threads()
        });
        assert_eq!(alone.join().unwrap(), 1);
        // A worker of another pool keeps it.
        rayon::scope(|_| assert!(!work_in_own_pool(1)));
    }

    #[test]
    fn matmul_accumulates_into_what_out_holds() {
        let x = [1.0, 2.0, -1.0, 0.5];
        let w = [0.5, -1.0, 2.0, 0.25, 1.0, 1.0];
        let mut fresh = vec![0.0; 6];
        matmul(&x, 2, &w, 3, &mut fresh, false);
        let mut acc = vec![10.0, 20.0, 30.0, 40.0, 50.0, 60.0];
        let before = acc.clone();
        matmul(&x, 2, &w, 3, &mut acc, true);
        for i in 0..6 {
            assert!((acc[i] - (before[i] + fresh[i])).abs() < 1e-5, "{i}");
        }
    }

    /// A product of one row cut over threads by columns gives each element the bits one
    /// `gemm` call on one thread gives it, added or not, at column counts that cut unevenly.
    #[test]
    fn one_row_cut_by_columns_equals_one_thread_bit_for_bit() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let k = 301;
        let value = |i: usize, scale: f32| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * scale;
        let x: Vec<f32> = (0..k).map(|i| value(i, 2.0)).collect();
        for n in [2 * MIN_COLUMNS_A_THREAD, 1000, 4099] {
            let w: Vec<f32> = (0..n * k).map(|i| value(i + 17, 0.1)).collect();
            let start: Vec<f32> = (0..n).map(|i| value(i + 3, 1.0)).collect();
            for accumulate in [false, true] {
                let mut cut = start.clone();
                pool.install(|| matmul(&x, 1, &w, n, &mut cut, accumulate));
                let mut whole = start.clone();
                product(
                    &x,
                    1,
                    k,
                    &w,
                    &mut whole,
                    accumulate,
                    gemm::Parallelism::None,
                );
                let same = cut
                    .iter()
                    .zip(&whole)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{n} columns, accumulate {accumulate}");
            }
        }
    }

    /// Each of `matmul`'s three paths equals the f64 product, added or not: many rows
    /// (`gemm`), a few ([`few_rows`]) and one (`gemm`'s one-row kernel cut by columns).
    #[test]
    fn every_row_count_agrees_with_f64() {
        let (rows, k, n) = (few_rows::FEW_ROWS + 3, 301, 197);
        let value = |i: usize, scale: f32| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * scale;
        let x: Vec<f32> = (0..rows * k).map(|i| value(i, 2.0)).collect();
        let w: Vec<f32> = (0..n * k).map(|i| value(i + 17, 0.1)).collect();
        let start: Vec<f32> = (0..rows * n).map(|i| value(i + 3, 1.0)).collect();
        for accumulate in [false, true] {
            // The rows as one product, then the first few as one, then the rest one by one.
            let mut many = start.clone();
            matmul(&x, rows, &w, n, &mut many, accumulate);
            let few = few_rows::FEW_ROWS;
            let mut parts = start.clone();
            matmul(&x[..few * k], few, &w, n, &mut parts[..few * n], accumulate);
            for r in few..rows {
                let row = &mut parts[r * n..(r + 1) * n];
                matmul(&x[r * k..(r + 1) * k], 1, &w, n, row, accumulate);
            }
            for (r, c) in (0..rows).flat_map(|r| (0..n).map(move |c| (r, c))) {
                let dot: f64 = (0..k)
                    .map(|i| x[r * k + i] as f64 * w[c * k + i] as f64)
                    .sum();
                let added = if accumulate {
                    start[r * n + c] as f64
                } else {
                    0.0
                };
                for (path, got) in [("many", many[r * n + c]), ("parts", parts[r * n + c])] {
                    let err = (got as f64 - (dot + added)).abs();
                    assert!(
                        err < 1e-5,
                        "{path}: row {r} column {c}: {got} against {}",
                        dot + added
                    );
                }
            }
        }
    }

    #[test]
    fn swiglu_gates_the_second_half_by_the_first() {
        // One row of gate | up, two columns each.
        let gate_up = [0.0, 2.0, 3.0, -1.0];
        let mut out = vec![0.0; 2];
        swiglu(&gate_up, 2, &mut out);
        assert_eq!(out[0], 0.0);
        let silu2 = 2.0 / (1.0 + (-2.0f32).exp());
        assert!((out[1] + silu2).abs() < 1e-6);
    }

    #[test]
    fn rope_rotates_halves_and_keeps_norms() {
        let inv = [1.0f32, 0.1];
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        rope_in_place(&mut x, &[3], &inv);
        let (s0, c0) = 3.0f32.sin_cos();
        assert!((x[0] - (1.0 * c0 - 3.0 * s0)).abs() < 1e-6);
        assert!((x[2] - (3.0 * c0 + 1.0 * s0)).abs() < 1e-6);
        let norm: f32 = x.iter().map(|v| v * v).sum();
        assert!((norm - 30.0).abs() < 1e-4);
    }

    /// Three query rows of 4 heads over 9 keys of 2 KV heads (positions 0-8), head dim 8 (one
    /// no backend kernel holds: the host op takes any): the shape, q, k and v.
    fn three_rows_nine_keys() -> (AttnShape, Vec<f32>, Vec<f32>, Vec<f32>) {
        let (h, hk, d) = (4, 2, 8);
        let shape = AttnShape {
            q_heads: h,
            kv_heads: hk,
            head_dim: d,
            scale: None,
        };
        let val = |i: usize| ((i * 7919 % 97) as f32 / 97.0) - 0.5;
        let q: Vec<f32> = (0..3 * h * d).map(|i| val(i + 5)).collect();
        let k: Vec<f32> = (0..9 * hk * d).map(|i| val(i * 3 + 1)).collect();
        let v: Vec<f32> = (0..9 * hk * d).map(|i| val(i * 5 + 2)).collect();
        (shape, q, k, v)
    }

    #[test]
    fn causal_attention_in_blocks_equals_one_block() {
        let (shape, q, k, v) = three_rows_nine_keys();
        let (h, hk, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
        let (q_pos, k_pos): (Vec<u32>, Vec<u32>) = ([2, 6, 8].to_vec(), (0..9).collect());
        let empty = || (vec![0.0; 3 * h * d], vec![EMPTY_LSE; 3 * h]);
        let (mut o1, mut l1) = empty();
        causal_attention(&q, &q_pos, None, &k, &v, &k_pos, &shape, &mut o1, &mut l1);
        let (mut o2, mut l2) = empty();
        let split = 4 * hk * d;
        causal_attention(
            &q,
            &q_pos,
            None,
            &k[split..],
            &v[split..],
            &k_pos[4..],
            &shape,
            &mut o2,
            &mut l2,
        );
        causal_attention(
            &q,
            &q_pos,
            None,
            &k[..split],
            &v[..split],
            &k_pos[..4],
            &shape,
            &mut o2,
            &mut l2,
        );
        for (a, b) in o1.iter().zip(&o2) {
            assert!((a - b).abs() < 1e-5);
        }
        for (a, b) in l1.iter().zip(&l2) {
            assert!((a - b).abs() < 1e-5);
        }
    }

    #[test]
    fn a_row_from_a_position_sees_only_the_keys_from_it() {
        let (shape, q, k, v) = three_rows_nine_keys();
        let (h, hk, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
        let k_pos: Vec<u32> = (0..9).collect();
        let (q_pos, q_from) = ([2u32, 6, 8], [1u32, 3, 8]);
        let (mut o, mut lse) = (vec![0.0; 3 * h * d], vec![EMPTY_LSE; 3 * h]);
        causal_attention(
            &q,
            &q_pos,
            Some(&q_from),
            &k,
            &v,
            &k_pos,
            &shape,
            &mut o,
            &mut lse,
        );
        // Each row alone over the keys from its start: the same state.
        for row in 0..3 {
            let from = q_from[row] as usize;
            let (mut want_o, mut want_lse) = (vec![0.0; h * d], vec![EMPTY_LSE; h]);
            causal_attention(
                &q[row * h * d..(row + 1) * h * d],
                &q_pos[row..=row],
                None,
                &k[from * hk * d..],
                &v[from * hk * d..],
                &k_pos[from..],
                &shape,
                &mut want_o,
                &mut want_lse,
            );
            for (a, b) in o[row * h * d..(row + 1) * h * d].iter().zip(&want_o) {
                assert!((a - b).abs() < 1e-6, "row {row}");
            }
            assert_eq!(&lse[row * h..(row + 1) * h], &want_lse[..], "row {row}");
        }
    }
}
