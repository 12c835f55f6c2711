//! A plan as the kernels read it: group descriptors ([`GROUP_WORDS`] words each, for the
//! CUDA-core kernel), CTA descriptors ([`CTA_WORDS`] each, for the tensor-core kernel), KV
//! ranges, query lists, block masks and the CSR merge map, laid out in one u32 buffer
//! ([`WordLayout`]) so an upload is one allocation and one copy, and an in-place update
//! rewrites one prefix of it ([`write_extents`]).

use canopy_core::geometry::CtaItem;
use canopy_core::{DType, Group, Plan};
use canopy_kernels::{CTA_PER_HEAD, CTA_WORDS, GROUP_KV_STREAMED, GROUP_WORDS};
use cudarc::driver::{CudaSlice, PinnedHostSlice};
use std::ops::Range;

/// A group's descriptor carries [`GROUP_KV_STREAMED`] (the tensor-core kernel loads its KV as
/// first to leave L2) when other groups read at most 1 / this of its tokens
/// ([`Plan::kv_shared_tokens`]); those few shared tokens are then read again from DRAM.
/// FastTree joins tree 1's 8-token root to each of its four 256-token nodes (3%), and keeping
/// those groups in L2 for the root's sake cost 4% at 32/32. At 1/8, tree 7's 32-token parents,
/// joined to each of their four 256-token leaves (11%), were read again by the other three and
/// the step took 1.3% longer (BENCHMARKS, session 11).
const SHARED_TOKENS_STREAMED: u32 = 16;

/// An uploaded plan.
pub struct CudaPlan {
    pub(crate) plan: Plan,
    pub(crate) rows: usize,
    /// Run on tensor cores when the KV's dtype allows (16-bit).
    pub(crate) tensor_cores: bool,
    /// The cut's CTAs, longest first.
    pub(crate) items: Vec<CtaItem>,
    /// Every u32 array of the plan in one buffer (one allocation and one copy per upload, and
    /// one copy per in-place update), at `layout`'s offsets.
    pub(crate) words: CudaSlice<u32>,
    /// Page-locked host copy of `words` that an in-place update writes and copies from, so
    /// the copy is asynchronous (a pageable copy waits on the host).
    pub(crate) staging: PinnedHostSlice<u32>,
    /// Where the arrays lie, with room for a larger plan ([`WordLayout::with_room`]).
    pub(crate) layout: WordLayout,
    /// Partial rows its partials are made with: the plan's own, with room.
    pub(crate) partial_room: usize,
    /// The block masks, with room ([`MASK_ROOM_PIECE`]) for the masks of plans written over
    /// this one.
    pub(crate) masks: CudaSlice<u64>,
    /// Each group's tokens that others read too ([`Plan::kv_shared_tokens`]), kept up to date
    /// through in-place updates for the descriptors' flags.
    pub(crate) shared: Vec<u32>,
    /// Query `i`'s one partial row is row `i`: stage 1 writes the output and no merge runs.
    pub(crate) direct: bool,
}

/// Where each array of a plan lies in [`CudaPlan`]'s word buffer. The arrays an in-place
/// update rewrites come first, so it rewrites one prefix of the staging buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WordLayout {
    /// `decode_partial_mma`'s descriptors, [`CTA_WORDS`] per CTA.
    pub(crate) ctas: Range<usize>,
    /// [`GROUP_WORDS`] per group, for `decode_partial`.
    pub(crate) groups: Range<usize>,
    pub(crate) ranges: Range<usize>,
    pub(crate) queries: Range<usize>,
    pub(crate) query_ptr: Range<usize>,
    pub(crate) query_rows: Range<usize>,
}

impl CudaPlan {
    /// The plan as executed (after splitting for parallelism).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Whether stage 1 runs on tensor cores for KV of `dtype`.
    pub fn uses_tensor_cores(&self, dtype: DType) -> bool {
        self.tensor_cores && dtype != DType::F32
    }
}

/// A plan cut for the GPU ([`cut_for_gpu`](canopy_core::geometry::cut_for_gpu) or the CUDA
/// cores' cut) and laid out, before it is uploaded or written over an uploaded one.
pub(crate) struct CutPlan {
    pub(crate) plan: Plan,
    pub(crate) items: Vec<CtaItem>,
    /// The arrays' own lengths.
    pub(crate) layout: WordLayout,
    /// The CUDA-core kernel's rows variant.
    pub(crate) rows: usize,
    pub(crate) tensor_cores: bool,
}

/// A cut plan's arrays as the kernels read them, on the host.
pub(crate) struct HostPlan {
    pub(crate) words: Vec<u32>,
    pub(crate) layout: WordLayout,
    pub(crate) masks: Vec<u64>,
    pub(crate) shared: Vec<u32>,
}

impl HostPlan {
    /// `plan` cut into `items`, at `layout`'s places (its own [`WordLayout::of`], or the room of
    /// an uploaded plan that [holds](WordLayout::holds) it). The words past each array's own
    /// length are zeros: CTA descriptors of no queries, which the kernel skips.
    pub(crate) fn lay_out(plan: &Plan, items: &[CtaItem], layout: WordLayout) -> HostPlan {
        let mut words = vec![0; layout.query_rows.end];
        let shared = plan.kv_shared_tokens();
        let masks = write_extents(plan, &shared, items, &layout, &mut words);
        let mut at = layout.queries.start;
        for g in plan.groups() {
            words[at..at + g.queries.len()].copy_from_slice(&g.queries);
            at += g.queries.len();
        }
        let (query_ptr, query_rows) = plan.csr();
        let (ptr_at, rows_at) = (layout.query_ptr.start, layout.query_rows.start);
        words[ptr_at..ptr_at + query_ptr.len()].copy_from_slice(query_ptr);
        words[rows_at..rows_at + query_rows.len()].copy_from_slice(query_rows);
        HostPlan {
            words,
            layout,
            masks,
            shared,
        }
    }
}

impl WordLayout {
    /// Each array of `plan` cut into `items`, exactly as long as it is.
    pub(crate) fn of(plan: &Plan, items: &[CtaItem]) -> WordLayout {
        let groups = plan.groups();
        let (query_ptr, query_rows) = plan.csr();
        WordLayout::packed([
            items.len() * CTA_WORDS,
            groups.len() * GROUP_WORDS,
            groups.iter().map(|g| 2 * g.kv.len()).sum(),
            groups.iter().map(|g| g.queries.len()).sum(),
            query_ptr.len(),
            query_rows.len(),
        ])
    }

    /// Arrays of the given lengths, one after another.
    fn packed(lens: [usize; 6]) -> WordLayout {
        let mut end = 0;
        let [ctas, groups, ranges, queries, query_ptr, query_rows] = lens.map(|len| {
            end += len;
            end - len..end
        });
        WordLayout {
            ctas,
            groups,
            ranges,
            queries,
            query_ptr,
            query_rows,
        }
    }

    /// Every array's place, in order.
    fn arrays(&self) -> [Range<usize>; 6] {
        [
            self.ctas.clone(),
            self.groups.clone(),
            self.ranges.clone(),
            self.queries.clone(),
            self.query_ptr.clone(),
            self.query_rows.clone(),
        ]
    }

    fn lens(&self) -> [usize; 6] {
        self.arrays().map(|a| a.len())
    }

    /// Room for the plans that follow an upload: each array of `exact` a quarter longer, in
    /// whole pieces ([`room`]). A server's plans change as requests join and leave; where the
    /// next one fits, it is written over this one and a recorded step that reads it stays
    /// valid. The CTAs and groups past a plan's own are launched too and do nothing.
    pub(crate) fn with_room(exact: &WordLayout) -> WordLayout {
        let [ctas, rest @ ..] = exact.lens();
        let ctas = room(ctas / CTA_WORDS, CTA_ROOM_PIECE) * CTA_WORDS;
        let [groups, ranges, queries, query_ptr, query_rows] =
            rest.map(|len| room(len, WORD_ROOM_PIECE));
        WordLayout::packed([ctas, groups, ranges, queries, query_ptr, query_rows])
    }

    /// Whether a plan laid out as `exact` fits in this layout's arrays.
    pub(crate) fn holds(&self, exact: &WordLayout) -> bool {
        self.lens()
            .iter()
            .zip(exact.lens())
            .all(|(&room, len)| len <= room)
    }

    /// CTAs the tensor-core kernel launches: every descriptor's place, used or not.
    pub(crate) fn ctas(&self) -> usize {
        self.ctas.len() / CTA_WORDS
    }

    /// Groups the CUDA-core kernel launches (each over every KV head): every descriptor's
    /// place, used or not.
    pub(crate) fn groups(&self) -> usize {
        self.groups.len() / GROUP_WORDS
    }
}

/// CTAs of room are added in pieces of this many (a few SMs' worth).
const CTA_ROOM_PIECE: usize = 32;
/// Words of room are added to an array in pieces of this many (whole group descriptors).
const WORD_ROOM_PIECE: usize = 64;
const _: () = assert!(WORD_ROOM_PIECE.is_multiple_of(GROUP_WORDS));
/// Partial rows of room are added in pieces of this many.
pub(crate) const PARTIAL_ROOM_PIECE: usize = 64;
/// Mask words of room are added in pieces of this many (2 KB). A plan without masks gets one
/// piece too: its leaves' growth under a mask is what fills it.
pub(crate) const MASK_ROOM_PIECE: usize = 256;

/// `len` and a quarter more, rounded up to whole `piece`s (0 stays 0).
pub(crate) fn room(len: usize, piece: usize) -> usize {
    (len + len / 4).next_multiple_of(piece)
}

/// Writes the arrays that an in-place update changes (CTA descriptors, group descriptors and
/// KV ranges) at `layout`'s places in `words`, and returns the masks that the descriptors point
/// into; `shared` is the plan's [`Plan::kv_shared_tokens`]. An update calls it on the staging
/// buffer directly. On the build host, for few-shot b = 50's 380 CTAs, it takes 2 µs; the
/// previous lay-out, which built every array again and copied them into place, took 31 µs.
pub(crate) fn write_extents(
    plan: &Plan,
    shared: &[u32],
    items: &[CtaItem],
    layout: &WordLayout,
    words: &mut [u32],
) -> Vec<u64> {
    let mut masks = Vec::new();
    let (mut range_at, mut query_at) = (0, 0);
    for (i, (g, &base)) in plan.groups().iter().zip(plan.partial_base()).enumerate() {
        let mask = match &g.mask {
            Some(_) => {
                let at = masks.len();
                masks.extend(block_mask(g));
                (at + 1) as u32
            }
            None => 0,
        };
        let d = layout.groups.start + i * GROUP_WORDS;
        words[d..d + GROUP_WORDS].copy_from_slice(&[
            range_at as u32,
            g.kv.len() as u32,
            query_at as u32,
            g.queries.len() as u32,
            base,
            mask,
            g.tokens(),
            if shared[i] * SHARED_TOKENS_STREAMED <= g.tokens() {
                GROUP_KV_STREAMED
            } else {
                0
            },
        ]);
        let r = layout.ranges.start + 2 * range_at;
        for (j, kv) in g.kv.iter().enumerate() {
            words[r + 2 * j] = kv.start;
            words[r + 2 * j + 1] = kv.end;
        }
        range_at += g.kv.len();
        query_at += g.queries.len();
    }
    // The CUDA-core kernel runs one CTA per group × KV head (its grid's y; it also runs
    // tensor-core plans when their KV is f32); the tensor-core kernel one per CTA descriptor,
    // in the cut's order: the group's descriptor, then its head and first KV range.
    for (i, c) in items.iter().enumerate() {
        let g = c.group as usize;
        let d = layout.groups.start + g * GROUP_WORDS;
        let at = layout.ctas.start + i * CTA_WORDS;
        words.copy_within(d..d + GROUP_WORDS, at);
        let first = &plan.groups()[g].kv[0];
        let head = c.kv_head | if c.per_head { CTA_PER_HEAD } else { 0 };
        words[at + GROUP_WORDS..at + CTA_WORDS].copy_from_slice(&[head, first.start, first.end, 0]);
    }
    masks
}

/// A masked group's mask as the kernels read it (`mask_word` in `common.cuh`): per
/// 64-token block of its tokens, one word per query, bit `t` for the block's token `t`. A
/// thread that tests one query's scores over a tile then loads one word, where the plan's
/// token-major mask would need one per token. The plan's set bits are visited, not every
/// (token, query) pair: a growing masked plan is laid out again on every update.
fn block_mask(g: &Group) -> Vec<u64> {
    let Some(mask) = &g.mask else {
        return Vec::new();
    };
    let queries = g.queries.len();
    let mut words = vec![0u64; (g.tokens() as usize).div_ceil(64) * queries];
    for (t, token_words) in mask.chunks(g.mask_words()).enumerate() {
        for (w, &bits) in token_words.iter().enumerate() {
            let mut rest = bits;
            while rest != 0 {
                let j = 64 * w + rest.trailing_zeros() as usize;
                words[t / 64 * queries + j] |= 1 << (t % 64);
                rest &= rest - 1;
            }
        }
    }
    words
}

#[cfg(test)]
mod tests {
    use super::*;
    use canopy_core::geometry::cut_for_gpu;
    use canopy_core::{AttnShape, Tail};

    /// An in-place update writes exactly what laying the extended plan out afresh writes, masks
    /// included.
    #[test]
    fn extents_written_in_place_match_a_fresh_lay_out() {
        let mask = [vec![0b11u64; 8], vec![0b01; 4]].concat();
        let groups = vec![
            Group::unmasked(vec![0..8], vec![0, 1, 2]),
            Group {
                kv: vec![0..8, 20..24],
                queries: vec![0, 1],
                mask: Some(mask),
            },
            Group::unmasked(vec![8..16], vec![2]),
        ];
        let plan = Plan::new(3, groups).unwrap();
        let shape = AttnShape::new(32, 8, 128).unwrap();
        let (mut plan, items) = cut_for_gpu(&plan, &shape, 8);
        let before = HostPlan::lay_out(&plan, &items, WordLayout::of(&plan, &items));
        let tails = [
            Tail {
                end: 24,
                new_end: 26,
            },
            Tail {
                end: 16,
                new_end: 19,
            },
        ];
        plan.extend_tails(&tails);
        let fresh = HostPlan::lay_out(&plan, &items, WordLayout::of(&plan, &items));
        assert_ne!(before.words, fresh.words, "the tails change the words");
        let mut words = before.words.clone();
        let mut shared = before.shared.clone();
        plan.grow_shared_tokens(&mut shared, &tails);
        let masks = write_extents(&plan, &shared, &items, &before.layout, &mut words);
        assert_eq!(words, fresh.words);
        assert_eq!(masks, fresh.masks);
        assert_ne!(masks, before.masks, "the masked group grew");
    }

    /// A smaller plan laid out in a larger one's room lies where the larger one did: each of
    /// its arrays at the room's place, its own words where a layout of its own puts them, and
    /// the CTA places past its own zeros (no queries: the kernel returns at once).
    #[test]
    fn a_plan_in_anothers_room_keeps_its_words_and_empties_the_rest() {
        let shape = AttnShape::new(32, 8, 128).unwrap();
        let cut = |leaves: u32| {
            let mut groups = vec![Group::unmasked(vec![0..512], (0..leaves).collect())];
            groups.extend(
                (0..leaves).map(|q| Group::unmasked(vec![600 + 20 * q..610 + 20 * q], vec![q])),
            );
            cut_for_gpu(&Plan::new(leaves as usize, groups).unwrap(), &shape, 24)
        };
        let (big, big_items) = cut(6);
        let room = WordLayout::with_room(&WordLayout::of(&big, &big_items));
        assert!(room.ctas() >= big_items.len() + big_items.len() / 4);
        let (small, items) = cut(5);
        let small = small.with_queries(6);
        let own = WordLayout::of(&small, &items);
        assert!(room.holds(&own) && !own.holds(&room));
        let check = |plan: &Plan, items: &[CtaItem]| {
            let own = HostPlan::lay_out(plan, items, WordLayout::of(plan, items));
            let placed = HostPlan::lay_out(plan, items, room.clone());
            assert_eq!(placed.layout, room);
            assert_eq!(placed.masks, own.masks);
            for (i, (mine, theirs)) in own
                .layout
                .arrays()
                .into_iter()
                .zip(room.arrays())
                .enumerate()
            {
                let (at, len) = (theirs.start, mine.len());
                assert!(len <= theirs.len());
                assert_eq!(own.words[mine], placed.words[at..at + len]);
                if i == 0 {
                    assert!(placed.words[at + len..theirs.end].iter().all(|&w| w == 0));
                }
            }
        };
        check(&small, &items);
        check(&big, &big_items);
    }

    /// Every CTA's descriptor carries its group's flag: set where other groups read at most
    /// 1 / SHARED_TOKENS_STREAMED of the group's tokens, clear where they read more.
    #[test]
    fn descriptors_carry_the_streaming_flag() {
        let groups = vec![
            Group::unmasked(vec![0..64], (0..20).collect()),
            Group::unmasked(vec![32..96], vec![20]),
            Group::unmasked(vec![92..160], vec![21]),
        ];
        let plan = Plan::new(22, groups).unwrap();
        let shape = AttnShape::new(32, 8, 128).unwrap();
        let (plan, items) = cut_for_gpu(&plan, &shape, 4);
        let host = HostPlan::lay_out(&plan, &items, WordLayout::of(&plan, &items));
        let expected: Vec<u32> = plan
            .groups()
            .iter()
            .zip(plan.kv_shared_tokens())
            .map(|(g, shared)| match g.kv[0].start {
                92 => {
                    assert_eq!(shared, 4, "the last group shares 4 of 68 tokens");
                    GROUP_KV_STREAMED
                }
                _ => {
                    assert!(shared * SHARED_TOKENS_STREAMED > g.tokens());
                    0
                }
            })
            .collect();
        for (i, item) in items.iter().enumerate() {
            let flags = host.words[host.layout.ctas.start + i * CTA_WORDS + GROUP_WORDS - 1];
            assert_eq!(
                flags, expected[item.group as usize],
                "CTA {i} of group {}",
                item.group
            );
        }
    }

    /// The kernels' block layout says what the plan's mask says, token by token, across
    /// block boundaries.
    #[test]
    fn block_masks_agree_with_the_plan() {
        let (tokens, queries) = (150usize, 5usize);
        let mask: Vec<u64> = (0..tokens)
            .map(|t| (t as u64 * 2654435761) >> 7 & 0b11111)
            .collect();
        let g = Group {
            kv: vec![0..100, 300..350],
            queries: (0..queries as u32).collect(),
            mask: Some(mask),
        };
        let words = block_mask(&g);
        assert_eq!(words.len(), 3 * queries);
        for t in 0..tokens {
            for j in 0..queries {
                let bit = words[t / 64 * queries + j] >> (t % 64) & 1 == 1;
                assert_eq!(bit, g.visible(t, j), "token {t} query {j}");
            }
        }
    }
}
