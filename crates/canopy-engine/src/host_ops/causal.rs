//! A prompt's attention on the host in blocks, as flash attention runs it: for each head and
//! block of query rows, the scores of a block of keys are one `gemm` product, their softmax
//! is kept online (a running maximum and sum per row), and the weighted values are a second
//! product added into the rows' outputs. A block of keys that no row of the block sees is
//! skipped, so a causal prompt computes about half its square.

use super::flash::{self, OnlineSoftmax, Products, Rows};
use canopy_core::{merge_state, AttnShape};
use rayon::prelude::*;

/// Query rows of one head a task takes.
const ROW_BLOCK: usize = 64;
/// Keys a product takes at once.
const KEY_BLOCK: usize = 256;

/// Attention of query rows over one block of keys, as partial states (normalised `o`,
/// natural-log `lse`) that merge exactly with the states of other blocks. `q` is `rows ×
/// q_heads × d` at positions `q_pos`, `k`/`v` are `tokens × kv_heads × d` at `k_pos`; a query
/// sees the keys at or before its own position, and with `q_from` none before `q_from[row]`.
/// Written into `o` (`rows × q_heads × d`) and `lse` (`rows × q_heads`), which start empty or
/// hold earlier blocks' states to merge with.
#[allow(clippy::too_many_arguments)]
pub fn causal_attention(
    q: &[f32],
    q_pos: &[u32],
    q_from: Option<&[u32]>,
    k: &[f32],
    v: &[f32],
    k_pos: &[u32],
    shape: &AttnShape,
    o: &mut [f32],
    lse: &mut [f32],
) {
    let (q_heads, d) = (shape.q_heads, shape.head_dim);
    let rows = q_pos.len();
    if rows == 0 || k_pos.is_empty() {
        return;
    }
    let from = |row: usize| q_from.map_or(0, |f| f[row]);
    let key_spans: Vec<(u32, u32)> = k_pos
        .chunks(KEY_BLOCK)
        .map(|p| (*p.iter().min().unwrap(), *p.iter().max().unwrap()))
        .collect();
    let row_blocks = rows.div_ceil(ROW_BLOCK);
    let blocks: Vec<HeadBlock> = (0..row_blocks * q_heads)
        .into_par_iter()
        .map(|task| {
            let (block, head) = (task / q_heads, task % q_heads);
            let first = block * ROW_BLOCK;
            let rows = first..(first + ROW_BLOCK).min(rows);
            let seen = rows.clone().map(|r| (from(r), q_pos[r]));
            let task = Task {
                q,
                k,
                v,
                k_pos,
                shape,
                head,
                rows,
                seen: seen.collect(),
            };
            task.run(&key_spans)
        })
        .collect();
    o.par_chunks_mut(d)
        .zip(lse.par_iter_mut())
        .enumerate()
        .for_each(|(cell, (o, lse))| {
            let (row, head) = (cell / q_heads, cell % q_heads);
            let block = &blocks[(row / ROW_BLOCK) * q_heads + head];
            let at = row % ROW_BLOCK;
            merge_state(o, lse, &block.o[at * d..(at + 1) * d], block.lse[at]);
        });
}

/// One head's states for one block of rows.
struct HeadBlock {
    /// `rows × d`, normalised.
    o: Vec<f32>,
    /// `rows`; [`EMPTY_LSE`] where a row saw no key.
    lse: Vec<f32>,
}

/// One head over one block of rows.
struct Task<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    k_pos: &'a [u32],
    shape: &'a AttnShape,
    head: usize,
    rows: std::ops::Range<usize>,
    /// Each row's window of key positions, both ends included.
    seen: Vec<(u32, u32)>,
}

impl Task<'_> {
    fn run(&self, key_spans: &[(u32, u32)]) -> HeadBlock {
        let (q_heads, kv_heads, d) = (self.shape.q_heads, self.shape.kv_heads, self.shape.head_dim);
        let kv_head = self.head / (q_heads / kv_heads);
        let n = self.rows.len();
        let lowest = self.seen.iter().map(|s| s.0).min().unwrap_or(0);
        let highest = self.seen.iter().map(|s| s.1).max().unwrap_or(0);
        let mut state = OnlineSoftmax::new(n, d);
        let mut scores = vec![0.0f32; n * KEY_BLOCK];
        let q = Rows::at(
            self.q,
            (self.rows.start * q_heads + self.head) * d,
            q_heads * d,
        );
        for (block, &(low, high)) in key_spans.iter().enumerate() {
            if low > highest || high < lowest {
                continue;
            }
            let first = block * KEY_BLOCK;
            let keys = KEY_BLOCK.min(self.k_pos.len() - first);
            let kv_at = (first * kv_heads + kv_head) * d;
            let scores = &mut scores[..n * keys];
            let shape = (n, keys, d);
            let scale = self.shape.softmax_scale();
            flash::scores(
                q,
                Rows::at(self.k, kv_at, kv_heads * d),
                shape,
                scale,
                Products::Gemm,
                scores,
            );
            let positions = &self.k_pos[first..first + keys];
            for (row, &(from, to)) in scores.chunks_mut(keys).zip(&self.seen) {
                for (s, p) in row.iter_mut().zip(positions) {
                    if !(from..=to).contains(p) {
                        *s = f32::NEG_INFINITY;
                    }
                }
            }
            state.absorb(
                scores,
                keys,
                Rows::at(self.v, kv_at, kv_heads * d),
                Products::Gemm,
            );
        }
        let (o, lse) = state.finish();
        HeadBlock { o, lse }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use canopy_core::EMPTY_LSE;

    /// Rows across several row blocks over keys across several key blocks, GQA 3, each row's
    /// window cut from below (`q_from`) or not, and rows that see no key: every state equals
    /// the f64 softmax over the keys the row sees, and unseen rows keep their empty state.
    #[test]
    fn blocks_of_rows_and_keys_equal_the_f64_softmax() {
        let shape = AttnShape {
            q_heads: 6,
            kv_heads: 2,
            head_dim: 16,
            scale: None,
        };
        let (h, hk, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
        let (rows, tokens) = (2 * ROW_BLOCK + 7, 2 * KEY_BLOCK + 41);
        let val = |i: usize, s: f32| (((i * 7919) % 1009) as f32 / 1009.0 - 0.5) * s;
        let q: Vec<f32> = (0..rows * h * d).map(|i| val(i + 5, 4.0)).collect();
        let k: Vec<f32> = (0..tokens * hk * d).map(|i| val(3 * i + 1, 2.0)).collect();
        let v: Vec<f32> = (0..tokens * hk * d).map(|i| val(5 * i + 2, 1.0)).collect();
        // Keys at positions 10.., the rows the prompt's last ones; the first rows sit before
        // every key.
        let k_pos: Vec<u32> = (0..tokens as u32).map(|t| t + 10).collect();
        let q_pos: Vec<u32> = (0..rows as u32).map(|r| r * 4).collect();
        let q_from: Vec<u32> = (0..rows as u32).map(|r| (r * 37) % 300).collect();
        for from in [None, Some(&q_from[..])] {
            let mut o = vec![0.0f32; rows * h * d];
            let mut lse = vec![EMPTY_LSE; rows * h];
            causal_attention(&q, &q_pos, from, &k, &v, &k_pos, &shape, &mut o, &mut lse);
            for (row, head) in (0..rows).flat_map(|r| (0..h).map(move |hd| (r, hd))) {
                let cell = row * h + head;
                let kvh = head / (h / hk);
                let low = from.map_or(0, |f| f[row]);
                let seen: Vec<usize> = (0..tokens)
                    .filter(|&t| (low..=q_pos[row]).contains(&k_pos[t]))
                    .collect();
                if seen.is_empty() {
                    assert_eq!(lse[cell], EMPTY_LSE, "row {row} sees no key");
                    assert!(o[cell * d..(cell + 1) * d].iter().all(|&x| x == 0.0));
                    continue;
                }
                let key = |t: usize, m: &[f32], i: usize| m[(t * hk + kvh) * d + i] as f64;
                let scale = shape.softmax_scale() as f64;
                let scores: Vec<f64> = seen
                    .iter()
                    .map(|&t| {
                        scale
                            * (0..d)
                                .map(|i| q[cell * d + i] as f64 * key(t, &k, i))
                                .sum::<f64>()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                let want_lse = max + total.ln();
                assert!(
                    (lse[cell] as f64 - want_lse).abs() < 1e-4,
                    "row {row} head {head} lse"
                );
                for i in 0..d {
                    let want: f64 = seen
                        .iter()
                        .zip(&scores)
                        .map(|(&t, s)| (s - max).exp() / total * key(t, &v, i))
                        .sum();
                    let got = o[cell * d + i] as f64;
                    assert!(
                        (got - want).abs() < 1e-5,
                        "row {row} head {head} [{i}]: {got} against {want}"
                    );
                }
            }
        }
    }
}
