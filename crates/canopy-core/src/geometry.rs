//! How canopy's kernels cut a plan into CTAs, and which kernel runs it. The CUDA backend
//! launches by these numbers and `auto`'s [`crate::DeviceModel`] prices plans by them, so they
//! live here, once.
//!
//! By default a plan runs on the tensor cores ([`runs_on_tensor_cores`]) when some group of it
//! has [`TENSOR_CORE_MIN_ROWS`] query rows or more ([`PER_HEAD_TENSOR_CORE_MIN_ROWS`] where the
//! KV heads come in fours), and on the CUDA cores otherwise: a CTA per group and KV head, the
//! plan split by [`cut_for_cuda_cores`] to fill one wave.
//!
//! A plan runs as one launch of CTAs of two kinds: many rows of one KV head (groups of more
//! than [`HEADS_ROWS`] rows, at most [`CTA_ROWS`]) or one warp per KV head
//! ([`HEADS_PER_CTA`] heads, groups of up to [`HEADS_ROWS`] rows). [`cut_for_gpu`] splits long
//! groups until no CTA holds more than an even share of the GPU's work, and lists the CTAs
//! longest first: the hardware starts CTAs in launch order, so the long ones run in the first
//! wave and the short ones fill in behind them instead of leaving a tail.

use crate::plan::{even_sizes, Group, Plan};
use crate::shape::AttnShape;

/// Query rows (queries × GQA rows) one CTA of either kernel holds; larger groups are split by
/// query (the CUDA-core kernel would otherwise loop over the KV once per 8 rows).
pub const CTA_ROWS: usize = 64;
/// Head dimensions the tensor-core kernel is built for (its accumulators for 256 would not fit
/// in registers beside the score tile).
pub const MMA_HEAD_DIMS: [usize; 2] = [64, 128];
/// The CUDA backend's default choice runs a plan on tensor cores when some group has at least
/// this many query rows; plans of smaller groups run on the CUDA cores, whose one-row kernel
/// streams at the copy bandwidth, unless the one-warp-per-head path takes them
/// ([`PER_HEAD_TENSOR_CORE_MIN_ROWS`]).
pub const TENSOR_CORE_MIN_ROWS: usize = 4;
/// Where the KV heads come in fours ([`HEADS_PER_CTA`]), so that the one-warp-per-head path
/// takes groups of a few rows, a plan runs on tensor cores from this many rows a group. Groups
/// of two or three rows ran faster there (H200, bf16, cold L2, session 82): one query at 24/8
/// heads x 128 (Llama-3.2-3B) took 20.4 µs at 8K against 26.7 on the CUDA cores' GQA kernel,
/// 48.8 against 62.2 at 32K and 152.0 against 185.4 at 128K; at 16/8 x 128, 20.0, 48.9 and
/// 161.6 against 24.0, 55.6 and 166.4; at 12/4 x 64, 12.3 against 14.3 at 8K; three queries
/// over an 8K prompt at 32/32 x 128, 50.4 against 62.2. Where the heads do not come in fours,
/// such groups take the many-row CTAs, which lost at short contexts: one query at 9/3 x 64
/// (SmolLM2) took 14.4 µs at 8K against 13.4, and SmolLM2-135M's decode step 3-6% longer.
pub const PER_HEAD_TENSOR_CORE_MIN_ROWS: usize = 2;
/// Shortest piece the CUDA-core kernel's plans are split into to fill the GPU: below this,
/// partials and launch costs dominate. At 128 tokens, one query at 9 q / 3 kv heads x 64 and
/// 8K took 11.8 µs (64 pieces) against 12.9 at 256 (32 pieces) and 12.2 at 64 (128 pieces);
/// longer contexts fill the GPU before the pieces get this short (H100, session 15).
pub const CUDA_CORE_MIN_PIECE_TOKENS: u32 = 128;
/// Resident decode CTAs per SM the CUDA backend allows by default, of either kernel. The
/// one-row CUDA-core kernel fits 5 at 96 registers, but 4 was faster at every length on H200
/// (128K: 0.263 vs 0.277 ms; 512K: 0.992 vs 1.023; 1M: 1.967 vs 2.017; twice each,
/// docs/BENCHMARKS.md); the GQA kernels fit 4 (48 KB of shared memory each).
pub const MAX_CTAS_PER_SM: usize = 4;
/// Resident CUDA-core CTAs per SM a plan of GQA groups (the pipelined kernel, more than one
/// row) is split for. One bf16 query at 9 q / 3 kv heads x 64 took 157 µs at 512K on three per
/// SM against 175 on four, 47.3 against 49.9 at 128K, and the same or less at 8K and 32K (H100,
/// docs/BENCHMARKS.md, session 15).
pub const CUDA_CORE_GQA_CTAS_PER_SM: usize = 3;
/// Groups of at most this many rows run one warp per KV head (one m16 tile per warp).
pub const HEADS_ROWS: usize = 16;
/// KV heads per CTA on the one-warp-per-head path (one per warp).
pub const HEADS_PER_CTA: usize = 4;
/// Tokens per KV tile of the one-warp-per-head path (one k-chunk of P V): the shortest tile
/// any tensor-core CTA streams, so the grain [`cut_for_gpu`] keeps its pieces' tile counts by.
pub const HEADS_TILE: usize = 16;
/// Tokens by which [`cut_for_gpu`] leaves each cut group's last piece short, where every other
/// piece stays within the [`HEADS_TILE`]-token tiles of the even cut's longest, and at most
/// half a share. Decode extends a plan in place between replans, and a leaf's new tokens land
/// in the last piece of its group: left short by the room a leaf grows into before its rank
/// replans (the runtime's `SEQUENCE_GROWTH_ROOM` is this), that piece reaches its share when
/// the room runs out instead of outrunning every other CTA.
pub const CUT_TAIL_ROOM: u32 = 32;
/// Shortest piece a long group is cut into: one 32-token tile of the many-row kernel.
pub const MIN_PIECE_TOKENS: u32 = 32;
/// Tokens a piece must have per query row it holds. Each piece costs its queries a partial
/// row (written and merged, fp32) and their Q (read again): at 12 bytes per query-row element
/// against 4 per KV-head element of a 16-bit token, a piece of 3 tokens per row moves as many
/// partial and query bytes as KV bytes.
pub const PIECE_TOKENS_PER_ROW: u32 = 3;
/// A CTA's fixed cost in work units (KV head-tokens): its descriptor, range and query loads
/// before the first tile, and its partial writes after the last.
pub const CTA_FIXED_WORK: u64 = 32;
/// Resident CTAs per SM a plan is cut for when every CTA runs one warp per KV head (one or a
/// few queries per group: decoding independent sequences). Such CTAs stream KV at the copy
/// bandwidth from one per SM on; a third per SM only added pieces, each a partial row to write,
/// Q to read again and a row to merge: one bf16 query at 32 q / 8 kv heads x 128 took 51.5 µs
/// at 32K cut for two per SM against 55.9 for three, 18.8 against 20.7 at 8K and 187.1 against
/// 189.8 at 128K; one per SM was within 0.8 µs of two (H100, docs/BENCHMARKS.md, session 15).
pub const HEADS_ONLY_CTAS_PER_SM: usize = 2;

/// Output elements per CTA of the wide merge (`merge_partials_wide`: a head's dims are split
/// over `head_dim / WIDE_MERGE_DIMS` CTAs; every supported head dim is a multiple of it).
pub const WIDE_MERGE_DIMS: usize = 32;
/// Resident CTAs per SM the wide merge's registers are budgeted for (its launch bounds).
pub const WIDE_MERGE_CTAS: usize = 4;

/// Whether the merge of `cells` (query, head) cells of `head_dim` elements runs wide on a GPU
/// of `multiprocessors` SMs: a CTA per cell and block of [`WIDE_MERGE_DIMS`] elements, which
/// walks the cell's partial rows with all its threads, where those CTAs fit in one wave. Else
/// one warp walks each cell's rows, a chain of memory latencies as long as the query's rows.
pub fn merge_is_wide(cells: usize, head_dim: usize, multiprocessors: usize) -> bool {
    cells * (head_dim / WIDE_MERGE_DIMS) <= multiprocessors * WIDE_MERGE_CTAS
}

/// The query rows of `plan`'s largest group once groups are split to [`CTA_ROWS`]: what the
/// kernel choice goes by.
pub fn max_cta_rows(plan: &Plan, shape: &AttnShape) -> usize {
    let gqa = shape.group_size();
    let queries = plan.groups().iter().map(|g| g.queries.len()).max();
    queries.unwrap_or(1).min((CTA_ROWS / gqa).max(1)) * gqa
}

/// Whether the tensor-core kernel is built for `shape`: its head dim, and GQA rows that fit
/// one CTA.
pub fn tensor_cores_fit(shape: &AttnShape) -> bool {
    MMA_HEAD_DIMS.contains(&shape.head_dim) && shape.group_size() <= CTA_ROWS
}

/// Whether the CUDA backend's default choice runs a plan of 16-bit KV whose largest group has
/// `max_rows` query rows ([`max_cta_rows`]) on tensor cores.
pub fn runs_on_tensor_cores(shape: &AttnShape, max_rows: usize) -> bool {
    let min_rows = if shape.kv_heads.is_multiple_of(HEADS_PER_CTA) {
        PER_HEAD_TENSOR_CORE_MIN_ROWS
    } else {
        TENSOR_CORE_MIN_ROWS
    };
    tensor_cores_fit(shape) && max_rows >= min_rows
}

/// The CTA slots the CUDA-core kernel's plans are cut for on `multiprocessors` SMs that hold
/// `ctas_per_sm` of its CTAs each: fewer per SM ([`CUDA_CORE_GQA_CTAS_PER_SM`]) where a group
/// has more than one row.
pub fn cuda_core_slots(max_rows: usize, multiprocessors: usize, ctas_per_sm: usize) -> usize {
    let per_sm = if max_rows > 1 {
        ctas_per_sm.min(CUDA_CORE_GQA_CTAS_PER_SM)
    } else {
        ctas_per_sm
    };
    multiprocessors * per_sm.max(1)
}

/// `plan` as the CUDA-core kernel runs it on a GPU with `slots` resident CTAs (one per group
/// and KV head): groups split by query to [`CTA_ROWS`] rows, then long groups cut until there
/// are about a wave's worth, rounded down (one CTA past the resident capacity costs a whole
/// second wave), none shorter than [`CUDA_CORE_MIN_PIECE_TOKENS`].
pub fn cut_for_cuda_cores(plan: &Plan, shape: &AttnShape, slots: usize) -> Plan {
    let target = (slots / shape.kv_heads).max(1);
    plan.split_queries((CTA_ROWS / shape.group_size()).max(1))
        .split_for_parallelism(target, CUDA_CORE_MIN_PIECE_TOKENS)
}

/// Whether a group of `rows` query rows runs on the one-warp-per-head path.
pub fn runs_per_head(rows: usize, kv_heads: usize) -> bool {
    kv_heads.is_multiple_of(HEADS_PER_CTA) && rows <= HEADS_ROWS
}

/// The CTA slots [`cut_for_gpu`] fills with `plan` on a GPU of `multiprocessors` SMs that hold
/// `ctas_per_sm` CTAs each: all of them, or [`HEADS_ONLY_CTAS_PER_SM`] per SM when every group
/// runs one warp per KV head.
pub fn cut_slots(
    plan: &Plan,
    shape: &AttnShape,
    multiprocessors: usize,
    ctas_per_sm: usize,
) -> usize {
    let heads_only = plan
        .groups()
        .iter()
        .all(|g| runs_per_head(g.queries.len() * shape.group_size(), shape.kv_heads));
    let per_sm = if heads_only {
        ctas_per_sm.min(HEADS_ONLY_CTAS_PER_SM)
    } else {
        ctas_per_sm
    };
    multiprocessors * per_sm.max(1)
}

/// One CTA of a cut plan: a group of it and the first of the KV heads the CTA takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CtaItem {
    pub group: u32,
    pub kv_head: u32,
    /// One warp per KV head, [`HEADS_PER_CTA`] heads; else many rows of one head.
    pub per_head: bool,
    /// Estimated work, in KV head-tokens (the order key).
    pub work: u64,
}

/// A group's CTAs: whether they run one warp per head, how many there are, and each one's
/// work per token. A many-row CTA streams one head but does its rows' tensor-core work on
/// every token: a token of 64 rows is counted as two head-tokens.
fn cta_shape(g: &Group, shape: &AttnShape) -> (bool, u64, u64) {
    queries_cta_shape(g.queries.len(), shape)
}

/// [`cta_shape`] of a group of `queries` queries.
fn queries_cta_shape(queries: usize, shape: &AttnShape) -> (bool, u64, u64) {
    let rows = queries * shape.group_size();
    if runs_per_head(rows, shape.kv_heads) {
        let ctas = (shape.kv_heads / HEADS_PER_CTA) as u64;
        (true, ctas, 64 * HEADS_PER_CTA as u64)
    } else {
        (false, shape.kv_heads as u64, 64 + rows.min(CTA_ROWS) as u64)
    }
}

fn cta_work(tokens: u64, per_token_64ths: u64) -> u64 {
    CTA_FIXED_WORK + tokens * per_token_64ths / 64
}

/// `plan` as the tensor-core kernels run it on a GPU with `slots` resident CTAs: groups split
/// by query to [`CTA_ROWS`] rows, then each group whose CTAs hold at least two of a slot's
/// even shares of the whole step's work cut into pieces of at least one share (rounding down
/// keeps the CTAs within one wave of `slots`: rounding up measured slower, e.g. FastTree's tree
/// 8 at 32/32 ran 440 CTAs on 396 slots, 78 µs against 72), none shorter than
/// [`MIN_PIECE_TOKENS`] or [`PIECE_TOKENS_PER_ROW`] per row. A caller that counts `slots` as
/// several waves of resident CTAs gets shorter pieces. Returns the cut
/// plan and its CTAs in launch order: longest first, ties in group order.
///
/// Groups too short to cut take their CTAs whole. Where those push the cut past `slots` while
/// the plan uncut would fit, the long groups are cut for the slots the others leave them, so
/// the step stays one wave instead of ending with a few CTAs run after the rest.
pub fn cut_for_gpu(plan: &Plan, shape: &AttnShape, slots: usize) -> (Plan, Vec<CtaItem>) {
    let plan = plan.split_queries((CTA_ROWS / shape.group_size()).max(1));
    let total = plan_work(&plan, shape);
    let uncut: usize = plan
        .groups()
        .iter()
        .map(|g| cta_shape(g, shape).1 as usize)
        .sum();
    let mut shares = slots.max(1);
    loop {
        let over = ctas_in_shares(&plan, shape, total, shares).saturating_sub(slots);
        if over == 0 || uncut > slots || shares == 1 {
            return cut_into_shares(&plan, shape, total, shares);
        }
        shares = shares.saturating_sub(over).max(1);
    }
}

/// The work of all CTAs of `plan` (split by query already), which [`cut_into_shares`] shares.
fn plan_work(plan: &Plan, shape: &AttnShape) -> u64 {
    plan.groups()
        .iter()
        .map(|g| {
            let (_, ctas, per_token) = cta_shape(g, shape);
            ctas * cta_work(g.tokens() as u64, per_token)
        })
        .sum()
}

/// The token counts a group of `plan` (split by query already) is cut into, pieces of at least
/// `piece` work (one group: not cut).
fn group_pieces(g: &Group, shape: &AttnShape, piece: u64) -> Vec<u32> {
    piece_sizes(g.tokens() as u64, pieces_wanted(g, shape, piece))
}

/// The pieces [`group_pieces`] asks [`piece_sizes`] for.
fn pieces_wanted(g: &Group, shape: &AttnShape, piece: u64) -> u64 {
    let (_, _, per_token) = cta_shape(g, shape);
    let tokens = g.tokens() as u64;
    let rows = (g.queries.len() * shape.group_size()) as u64;
    let shortest = (PIECE_TOKENS_PER_ROW as u64 * rows).max(MIN_PIECE_TOKENS as u64);
    let want = cta_work(tokens, per_token) / piece;
    want.min(tokens / shortest)
}

/// How many CTAs [`cut_into_shares`] makes, counted without making the cut: a masked piece
/// keeps only the queries that see some of its tokens ([`Group::trimmed`]), and none, no CTA.
fn ctas_in_shares(plan: &Plan, shape: &AttnShape, total: u64, shares: usize) -> usize {
    let piece = (total / shares as u64).max(1);
    let ctas = |queries: usize| queries_cta_shape(queries, shape).1 as usize;
    let mut count = 0;
    for g in plan.groups() {
        let (tokens, wanted) = (g.tokens() as u64, pieces_wanted(g, shape, piece));
        let pieces = piece_count(tokens, wanted);
        let Some(mask) = g.mask.as_ref().filter(|_| pieces > 1) else {
            count += pieces as usize * ctas(g.queries.len());
            continue;
        };
        let words = g.mask_words();
        let (mut token, mut seen) = (0, vec![0u64; words]);
        // `group_pieces`' sizes, from the pieces wanted counted above.
        for n in piece_sizes(tokens, wanted).into_iter().map(|n| n as usize) {
            seen.fill(0);
            for row in mask[token * words..(token + n) * words].chunks(words) {
                seen.iter_mut().zip(row).for_each(|(s, w)| *s |= w);
            }
            token += n;
            let kept = (0..g.queries.len())
                .filter(|j| seen[j / 64] >> (j % 64) & 1 == 1)
                .count();
            if kept > 0 {
                count += ctas(kept);
            }
        }
    }
    count
}

/// [`cut_for_gpu`]'s cut of `plan` (split by query already) into pieces of at least one of
/// `shares` even shares of its `total` work, and the CTAs of the cut, longest first.
fn cut_into_shares(
    plan: &Plan,
    shape: &AttnShape,
    total: u64,
    shares: usize,
) -> (Plan, Vec<CtaItem>) {
    let piece = (total / shares as u64).max(1);
    let plan = plan.split_groups_into(|g| group_pieces(g, shape, piece));
    let mut items = Vec::new();
    for (i, g) in plan.groups().iter().enumerate() {
        let (per_head, ctas, per_token) = cta_shape(g, shape);
        let step = shape.kv_heads as u64 / ctas;
        let work = cta_work(g.tokens() as u64, per_token);
        items.extend((0..ctas).map(|c| CtaItem {
            group: i as u32,
            kv_head: (c * step) as u32,
            per_head,
            work,
        }));
    }
    // Longest first. (Interleaving the two kinds in proportion to their work, so that
    // tensor-core-bound and DRAM-bound CTAs share SMs, measured slower overall on FastTree's
    // trees: geomean 1.22-1.25 against 1.27 over FastTree's kernel. docs/BENCHMARKS.md,
    // session 7.)
    items.sort_by_key(|c| std::cmp::Reverse(c.work));
    (plan, items)
}

/// The pieces [`piece_sizes`] cuts `tokens` into when asked for `pieces`: at least 1, at most
/// one a token, none empty.
fn piece_count(tokens: u64, pieces: u64) -> u64 {
    pieces.clamp(1, tokens.max(1))
}

/// `tokens` cut into `pieces` (at least 1, at most one a token): evenly, but for the last piece,
/// short by up to [`CUT_TAIL_ROOM`] tokens, and at most half a share. It is short only as far
/// as no other piece passes the even cut's longest, rounded up to whole [`HEADS_TILE`] tiles.
pub fn piece_sizes(tokens: u64, pieces: u64) -> Vec<u32> {
    let pieces = piece_count(tokens, pieces);
    if pieces < 2 {
        return even_sizes(tokens, pieces);
    }
    let share = tokens / pieces;
    let longest = tokens.div_ceil(pieces).next_multiple_of(HEADS_TILE as u64);
    let last_at_least = tokens.saturating_sub(longest * (pieces - 1));
    let short = (CUT_TAIL_ROOM as u64)
        .min(share / 2)
        .min(share.saturating_sub(last_at_least));
    let last = share - short;
    let mut sizes = even_sizes(tokens - last, pieces - 1);
    sizes.push(last as u32);
    sizes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Group;

    fn shape(q: usize, kv: usize) -> AttnShape {
        AttnShape::new(q, kv, 128).unwrap()
    }

    /// One long shared group and many one-query leaves: the long group is cut, its pieces are
    /// listed before the leaves, the list is longest first, and every (group, head) is covered
    /// exactly once.
    #[test]
    fn long_groups_are_cut_and_run_first() {
        let mut groups = vec![Group::unmasked(vec![0..4096], (0..8).collect())];
        groups.extend(
            (0..256u32).map(|i| Group::unmasked(vec![4096 + 32 * i..4128 + 32 * i], vec![i % 8])),
        );
        let plan = Plan::new(8, groups).unwrap();
        let (cut, items) = cut_for_gpu(&plan, &shape(32, 8), 132 * 3);
        let rows_of = |c: &CtaItem| cut.groups()[c.group as usize].queries.len();
        let long = cut.groups().iter().filter(|g| g.queries.len() == 8).count();
        assert!(long > 1, "the 4096-token group is cut ({long} pieces)");
        assert!(cut
            .groups()
            .iter()
            .all(|g| g.queries.len() != 8 || g.tokens() >= 96));
        // Leaves (4 rows at GQA 4) run one warp per head; the long group (32 rows) does not.
        assert!(items.iter().all(|c| c.per_head == (rows_of(c) == 1)));
        let first_leaf = items.iter().position(|c| c.per_head).unwrap();
        assert!(items[first_leaf..].iter().all(|c| c.per_head));
        assert!(items.windows(2).all(|w| w[0].work >= w[1].work));
        let mut seen = std::collections::HashSet::new();
        for c in &items {
            let heads = if c.per_head { HEADS_PER_CTA } else { 1 } as u32;
            for h in c.kv_head..c.kv_head + heads {
                assert!(
                    seen.insert((c.group, h)),
                    "(group {}, head {h}) twice",
                    c.group
                );
            }
        }
        assert_eq!(seen.len(), cut.groups().len() * 8);
    }

    /// A shared prefix over 64 one-query leaves (`configs/workloads/serve-few-shot.toml`):
    /// the leaves' 128 CTAs cannot be cut, so the prefix is cut for the slots they leave, and
    /// the whole step is one wave of 396 slots, the prefix still in pieces.
    #[test]
    fn uncut_groups_keep_the_cut_within_one_wave() {
        let mut groups = vec![Group::unmasked(vec![0..4096], (0..64).collect())];
        groups.extend(
            (0..64u32).map(|i| Group::unmasked(vec![4096 + 128 * i..4224 + 128 * i], vec![i])),
        );
        let plan = Plan::new(64, groups).unwrap();
        let (cut, items) = cut_for_gpu(&plan, &shape(32, 8), 396);
        assert!(items.len() <= 396, "{} CTAs on 396 slots", items.len());
        let prefix_pieces = cut
            .groups()
            .iter()
            .filter(|g| g.queries.len() == 16)
            .count();
        assert!(
            prefix_pieces >= 4 * 8,
            "the prefix is cut ({prefix_pieces} pieces)"
        );
        assert_eq!(items.iter().filter(|c| c.per_head).count(), 128);
    }

    /// Plans of one-warp-per-head CTAs alone are cut for fewer slots; a plan with one group of
    /// many rows, or a GQA shape whose KV heads do not make whole CTAs of heads, for all.
    #[test]
    fn heads_only_plans_are_cut_for_fewer_slots() {
        let one_query = Plan::new(1, vec![Group::unmasked(vec![0..32768], vec![0])]).unwrap();
        assert_eq!(cut_slots(&one_query, &shape(32, 8), 132, 3), 132 * 2);
        assert_eq!(cut_slots(&one_query, &shape(32, 8), 132, 1), 132);
        assert_eq!(cut_slots(&one_query, &shape(9, 3), 132, 3), 132 * 3);
        let mut groups = vec![Group::unmasked(vec![0..4096], (0..8).collect())];
        groups.push(Group::unmasked(vec![4096..4128], vec![0]));
        let shared = Plan::new(8, groups).unwrap();
        assert_eq!(cut_slots(&shared, &shape(32, 8), 132, 3), 132 * 3);
        let (cut, items) = cut_for_gpu(
            &one_query,
            &shape(32, 8),
            cut_slots(&one_query, &shape(32, 8), 132, 3),
        );
        assert_eq!(
            cut.groups().len(),
            132,
            "two head CTAs per piece fill 264 slots"
        );
        assert_eq!(items.len(), 264);
    }

    /// The kernel choice goes by the largest group's rows, split to a CTA's 64; the CUDA-core
    /// kernel's plans are cut to about one wave of its slots, fewer per SM with GQA rows.
    #[test]
    fn the_kernel_choice_and_the_cuda_core_cut() {
        let mha = shape(32, 32);
        let paths: Vec<Group> = (0..3u32)
            .map(|i| Group::unmasked(vec![0..4096], vec![i]))
            .collect();
        let one_row = Plan::new(3, paths).unwrap();
        assert_eq!(max_cta_rows(&one_row, &mha), 1);
        assert!(!runs_on_tensor_cores(&mha, 1));
        assert!(runs_on_tensor_cores(&mha, 2));
        // Three rows: Llama-3.2-3B's one query (24/8 heads) on the one-warp-per-head path;
        // SmolLM2's (9/3), whose heads do not come in fours, on the CUDA cores.
        assert!(runs_on_tensor_cores(
            &AttnShape::new(24, 8, 128).unwrap(),
            3
        ));
        let smollm2 = AttnShape::new(9, 3, 64).unwrap();
        assert!(!runs_on_tensor_cores(&smollm2, 3));
        assert!(runs_on_tensor_cores(&smollm2, TENSOR_CORE_MIN_ROWS));
        assert!(!runs_on_tensor_cores(
            &AttnShape::new(32, 32, 256).unwrap(),
            64
        ));
        let wide = Plan::new(200, vec![Group::unmasked(vec![0..64], (0..200).collect())]).unwrap();
        assert_eq!(max_cta_rows(&wide, &shape(32, 8)), CTA_ROWS);

        assert_eq!(cuda_core_slots(1, 132, 4), 528);
        assert_eq!(cuda_core_slots(2, 132, 4), 132 * CUDA_CORE_GQA_CTAS_PER_SM);
        // 528 slots over 32 KV heads: 16 groups' worth, a third of it (5) per path.
        let cut = cut_for_cuda_cores(&one_row, &mha, 528);
        assert_eq!(cut.groups().len(), 15);
        assert!(cut
            .groups()
            .iter()
            .all(|g| g.tokens() >= CUDA_CORE_MIN_PIECE_TOKENS));
    }

    /// A plan that already fills the GPU evenly is not cut.
    #[test]
    fn even_plans_stay_whole() {
        let groups: Vec<Group> = (0..1024u32)
            .map(|i| Group::unmasked(vec![64 * i..64 * i + 64], vec![i]))
            .collect();
        let plan = Plan::new(1024, groups).unwrap();
        let (cut, items) = cut_for_gpu(&plan, &shape(32, 32), 132 * 3);
        assert_eq!(cut, plan);
        assert_eq!(items.len(), 1024 * 8);
    }

    /// A batch-1 decode step at 8K on an H100: 132 pieces of one group. The last piece, which
    /// the step's new tokens extend in place, is left 31 tokens short (half a share), and no
    /// other piece takes a fifth 16-token tile.
    #[test]
    fn the_last_piece_is_left_room_to_grow() {
        let sizes = piece_sizes(8193, 132);
        assert_eq!(sizes.len(), 132);
        assert_eq!(sizes.iter().map(|&n| n as u64).sum::<u64>(), 8193);
        assert_eq!(*sizes.last().unwrap(), 31);
        assert!(
            sizes[..131].iter().all(|&n| (62..=63).contains(&n)),
            "{sizes:?}"
        );
        // At 32K the whole room fits: 248 - 32.
        assert_eq!(*piece_sizes(32769, 132).last().unwrap(), 216);
        // One piece, or a share too short to spare tokens without another tile, stays even.
        assert_eq!(piece_sizes(100, 1), vec![100]);
        assert_eq!(piece_sizes(64, 4), even_sizes(64, 4));
    }

    proptest::proptest! {
        /// The cut covers the group, leaves no piece empty, keeps the even cut's longest
        /// piece's tile count, and leaves only the last piece short.
        #[test]
        fn piece_sizes_keep_the_longest_tiles(tokens in 1u64..200_000, pieces in 0u64..1_000) {
            let sizes = piece_sizes(tokens, pieces);
            let even = even_sizes(tokens, pieces);
            proptest::prop_assert_eq!(sizes.len(), even.len());
            proptest::prop_assert_eq!(sizes.iter().map(|&n| n as u64).sum::<u64>(), tokens);
            proptest::prop_assert!(sizes.iter().all(|&n| n >= 1));
            let tiles = |s: &[u32]| s.iter().max().unwrap().div_ceil(HEADS_TILE as u32);
            proptest::prop_assert_eq!(tiles(&sizes), tiles(&even));
            let share = tokens / even.len() as u64;
            let last = *sizes.last().unwrap() as u64;
            proptest::prop_assert!(last <= share);
            proptest::prop_assert!(last + (CUT_TAIL_ROOM as u64).min(share / 2) >= share);
            proptest::prop_assert!(sizes.iter().all(|&n| n as u64 >= last));
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// The CTAs counted without cutting are the cut's, for every planner's plans of drawn
        /// trees (masked groups among them) and any number of shares.
        #[test]
        fn ctas_counted_are_the_cuts(seed in proptest::prelude::any::<u64>(), shares in 1usize..2_000) {
            use crate::planner::{plan, Method, PlannerConfig};
            use crate::shard::{Shard, TreeView};
            for d in crate::random_trees::draws(seed, 6) {
                let tree = d.build().unwrap();
                let shard = Shard::whole(&tree);
                let view = TreeView::new(&tree, &shard);
                for shape in [shape(32, 8), shape(32, 32), AttnShape::new(9, 3, 64).unwrap()] {
                    for m in Method::ALL {
                        let p = plan(&view, m, &shape, &PlannerConfig::default()).unwrap();
                        let p = p.split_queries((CTA_ROWS / shape.group_size()).max(1));
                        let total = plan_work(&p, &shape);
                        let want = cut_into_shares(&p, &shape, total, shares).1.len();
                        let got = ctas_in_shares(&p, &shape, total, shares);
                        proptest::prop_assert_eq!(got, want, "{} {}", d.name, m);
                    }
                }
            }
        }
    }
}
