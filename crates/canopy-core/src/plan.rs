//! The one plan type every planner produces and every backend executes.
//!
//! A plan is a list of [`Group`]s. A group is a set of KV address ranges × a set of query rows:
//! a kernel loads the group's KV tiles once and applies them to all of its queries (all query
//! heads of each KV head: the GQA rows), writing one *partial row* per query. An optional
//! per-token bit mask says which of the group's queries may see each token (DeFT-Flatten
//! blocks span several tree nodes). Groups cover all heads; a backend parallelises over
//! groups × KV heads.
//!
//! The plan also stores, in CSR form, which partial rows each query must merge. The CSR order
//! is the group order, so the merge is deterministic (no atomics) on every backend.

use crate::error::{CoreError, Result};
use crate::shape::AttnShape;
use crate::DType;
use serde::Serialize;
use std::ops::Range;

/// One unit of work: KV ranges × query rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// KV address ranges, concatenated in order to form the group's token list.
    pub kv: Vec<Range<u32>>,
    /// Query rows (indices into the tree's queries).
    pub queries: Vec<u32>,
    /// Token-major bit mask, `mask_words()` u64 words per token; bit `j` of a token's words
    /// says whether `queries[j]` sees it. `None`: every query sees every token.
    pub mask: Option<Vec<u64>>,
}

impl Group {
    pub fn unmasked(kv: Vec<Range<u32>>, queries: Vec<u32>) -> Self {
        Group {
            kv,
            queries,
            mask: None,
        }
    }

    pub fn tokens(&self) -> u32 {
        self.kv.iter().map(|r| r.end - r.start).sum()
    }

    /// Words of mask per token.
    pub fn mask_words(&self) -> usize {
        self.queries.len().div_ceil(64)
    }

    /// The group of the same tokens seen by its queries at local indices `columns` only.
    fn columns(&self, columns: &[usize]) -> Group {
        let queries = columns.iter().map(|&c| self.queries[c]).collect::<Vec<_>>();
        let mask = self.mask.as_ref().map(|_| {
            let words = queries.len().div_ceil(64);
            let mut m = vec![0u64; self.tokens() as usize * words];
            for t in 0..self.tokens() as usize {
                for (j, &c) in columns.iter().enumerate() {
                    if self.visible(t, c) {
                        m[t * words + j / 64] |= 1 << (j % 64);
                    }
                }
            }
            m
        });
        Group {
            kv: self.kv.clone(),
            queries,
            mask,
        }
    }

    /// The group without the queries that see none of its tokens, and without its mask if
    /// the rest see them all; `None` if no query sees any token. A piece of a masked group
    /// often lies in one node: it keeps that node's queries and the unmasked kernel path.
    pub fn trimmed(self) -> Option<Group> {
        let Some(mask) = &self.mask else {
            return Some(self);
        };
        // Word by word: which queries see some token, and which see every one.
        let words = self.mask_words();
        let mut any = vec![0u64; words];
        let mut all = vec![!0u64; words];
        for token in mask.chunks(words) {
            for w in 0..words {
                any[w] |= token[w];
                all[w] &= token[w];
            }
        }
        let keep: Vec<usize> = (0..self.queries.len())
            .filter(|j| any[j / 64] >> (j % 64) & 1 == 1)
            .collect();
        if keep.is_empty() {
            return None;
        }
        if any == all {
            let queries = keep.iter().map(|&j| self.queries[j]).collect();
            return Some(Group::unmasked(self.kv, queries));
        }
        if keep.len() == self.queries.len() {
            return Some(self);
        }
        Some(self.columns(&keep))
    }

    /// Whether the group's `local_query` may see its `token`-th token.
    #[inline]
    pub fn visible(&self, token: usize, local_query: usize) -> bool {
        match &self.mask {
            None => true,
            Some(mask) => {
                mask[token * self.mask_words() + local_query / 64] >> (local_query % 64) & 1 == 1
            }
        }
    }
}

/// A node's tokens that grew at their end in place, in KV addresses: the node's tokens ended at
/// `end` and now end at `new_end`, and no other node holds addresses in between
/// (`canopy_kv`'s catch-up reports these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tail {
    pub end: u32,
    pub new_end: u32,
}

/// A validated plan for one rank's share of a tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    num_queries: u32,
    groups: Vec<Group>,
    /// First partial row of each group; a group's rows are `base..base + queries.len()`.
    partial_base: Vec<u32>,
    /// CSR offsets, `num_queries + 1` long, into `query_rows`.
    query_ptr: Vec<u32>,
    /// Partial rows of each query, in group order.
    query_rows: Vec<u32>,
}

/// The bytes a plan moves per unit, for [`Plan::io`] and for counts made without a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RowBytes {
    /// A KV token's key and value.
    pub(crate) kv_token: u64,
    /// A query row (every query head of one query).
    pub(crate) q_row: u64,
    /// A partial row: o (fp32, head_dim) and lse (fp32) per query head, written by stage 1 and
    /// read by stage 2.
    pub(crate) partial_row: u64,
}

impl RowBytes {
    pub(crate) fn of(shape: &AttnShape, dtype: DType) -> RowBytes {
        RowBytes {
            kv_token: 2 * shape.kv_token_bytes(dtype) as u64,
            q_row: shape.q_row_elems() as u64 * dtype.size_bytes() as u64,
            partial_row: shape.q_heads as u64 * (shape.head_dim as u64 + 1) * 4,
        }
    }
}

impl Plan {
    /// Validates the groups and builds the partial-row layout and the query → rows CSR map.
    pub fn new(num_queries: usize, groups: Vec<Group>) -> Result<Plan> {
        let mut partial_base = Vec::with_capacity(groups.len());
        let mut counts = vec![0u32; num_queries];
        let mut rows = 0u32;
        for (g, group) in groups.iter().enumerate() {
            if group.queries.is_empty() {
                return Err(CoreError::Plan(format!("group {g} has no queries")));
            }
            if group.kv.iter().any(|r| r.start >= r.end) {
                return Err(CoreError::Plan(format!(
                    "group {g} has an empty or reversed KV range"
                )));
            }
            for &q in &group.queries {
                if q as usize >= num_queries {
                    return Err(CoreError::Plan(format!(
                        "group {g} names query {q} of {num_queries}"
                    )));
                }
                counts[q as usize] += 1;
            }
            if let Some(mask) = &group.mask {
                let want = group.tokens() as usize * group.mask_words();
                if mask.len() != want {
                    return Err(CoreError::Plan(format!(
                        "group {g} mask has {} words, expected {want}",
                        mask.len()
                    )));
                }
            }
            partial_base.push(rows);
            rows += group.queries.len() as u32;
        }
        let mut query_ptr = Vec::with_capacity(num_queries + 1);
        query_ptr.push(0u32);
        for c in &counts {
            query_ptr.push(query_ptr.last().unwrap() + c);
        }
        let mut fill = query_ptr[..num_queries].to_vec();
        let mut query_rows = vec![0u32; rows as usize];
        for (group, &base) in groups.iter().zip(&partial_base) {
            for (j, &q) in group.queries.iter().enumerate() {
                query_rows[fill[q as usize] as usize] = base + j as u32;
                fill[q as usize] += 1;
            }
        }
        Ok(Plan {
            num_queries: num_queries as u32,
            groups,
            partial_base,
            query_ptr,
            query_rows,
        })
    }

    pub fn num_queries(&self) -> usize {
        self.num_queries as usize
    }

    /// The same plan over `num_queries` queries (at least its own): the queries past its own
    /// have no keys, so their results are empty partials. A server pads a step's rows to a
    /// few batch sizes this way, so that a recorded step outlives requests joining and leaving.
    pub fn with_queries(mut self, num_queries: usize) -> Plan {
        let rows = *self.query_ptr.last().expect("num_queries + 1 offsets");
        let queries = num_queries.max(self.num_queries());
        self.query_ptr.resize(queries + 1, rows);
        self.num_queries = queries as u32;
        self
    }

    pub fn groups(&self) -> &[Group] {
        &self.groups
    }

    pub fn partial_base(&self) -> &[u32] {
        &self.partial_base
    }

    pub fn num_partial_rows(&self) -> usize {
        self.query_rows.len()
    }

    /// The partial rows query `q` merges, in deterministic group order. Empty when the query
    /// has no keys here: its result is the empty partial.
    pub fn rows_of(&self, q: usize) -> &[u32] {
        &self.query_rows[self.query_ptr[q] as usize..self.query_ptr[q + 1] as usize]
    }

    /// Whether query `q`'s one partial row is row `q`, for every query: the partials are then
    /// the merged states already (each query's whole context lies in one group).
    pub fn rows_are_queries(&self) -> bool {
        self.query_rows.len() == self.num_queries()
            && (0..self.num_queries()).all(|q| self.rows_of(q) == [q as u32])
    }

    /// CSR offsets and rows, as a device upload wants them.
    pub fn csr(&self) -> (&[u32], &[u32]) {
        (&self.query_ptr, &self.query_rows)
    }

    /// Splits groups into equal pieces so that there are about `target` groups, each group
    /// getting its share of `target` by token count (pieces keep their group's queries and
    /// their slice of its mask; none is shorter than `min_chunk` tokens). FastTree uses this for
    /// long-context splitting. A plan with `target` groups or more is returned as is.
    pub fn split_for_parallelism(&self, target: usize, min_chunk: u32) -> Plan {
        if self.groups.len() >= target || self.groups.is_empty() {
            return self.clone();
        }
        let total: u64 = self.groups.iter().map(|g| g.tokens() as u64).sum();
        self.split_groups(|g| {
            let tokens = g.tokens() as u64;
            let share = (tokens * target as u64 + total / 2) / total.max(1);
            share.min(tokens / min_chunk.max(1) as u64) as u32
        })
    }

    /// Splits each group into `pieces(group)` pieces of (nearly) equal token counts, in token
    /// order; 0 or 1 keeps the group whole, and no piece is left empty. Pieces keep their
    /// group's queries and their slice of its mask.
    pub fn split_groups(&self, pieces: impl Fn(&Group) -> u32) -> Plan {
        self.split_groups_into(|g| even_sizes(g.tokens() as u64, pieces(g) as u64))
    }

    /// Splits each group into consecutive pieces of `sizes(group)` tokens, in token order (a
    /// group's sizes sum to its tokens, none 0; one size keeps the group whole). Pieces keep
    /// their group's queries and their slice of its mask.
    pub fn split_groups_into(&self, sizes: impl Fn(&Group) -> Vec<u32>) -> Plan {
        let mut groups = Vec::with_capacity(self.groups.len());
        for g in &self.groups {
            let sizes = sizes(g);
            debug_assert_eq!(
                sizes.iter().map(|&n| n as usize).sum::<usize>(),
                g.tokens() as usize,
                "a group's pieces cover its tokens"
            );
            if sizes.len() <= 1 {
                groups.push(g.clone());
                continue;
            }
            let words = g.mask_words();
            let mut token = 0usize;
            for kv in split_ranges_into(&g.kv, &sizes) {
                let n: usize = kv.iter().map(|r| (r.end - r.start) as usize).sum();
                let piece = Group {
                    kv,
                    queries: g.queries.clone(),
                    mask: g
                        .mask
                        .as_ref()
                        .map(|m| m[token * words..(token + n) * words].to_vec()),
                };
                token += n;
                groups.extend(piece.trimmed());
            }
        }
        Plan::new(self.num_queries(), groups).expect("splitting a valid plan keeps it valid")
    }

    /// Splits every group with more than `max_queries` queries into groups of at most that
    /// many (each keeps all the group's KV and its own columns of the mask). A tensor-core
    /// kernel holds a group's rows in registers, so the backend bounds them this way; the
    /// pieces read the same KV, mostly from L2. Pieces whose queries see none of the tokens
    /// are dropped (those queries get no partial row from that group).
    pub fn split_queries(&self, max_queries: usize) -> Plan {
        let max_queries = max_queries.max(1);
        if self.groups.iter().all(|g| g.queries.len() <= max_queries) {
            return self.clone();
        }
        let mut groups = Vec::with_capacity(self.groups.len());
        for g in &self.groups {
            if g.queries.len() <= max_queries {
                groups.push(g.clone());
                continue;
            }
            for (c, queries) in g.queries.chunks(max_queries).enumerate() {
                let columns: Vec<usize> =
                    (c * max_queries..c * max_queries + queries.len()).collect();
                groups.extend(g.columns(&columns).trimmed());
            }
        }
        Plan::new(self.num_queries(), groups).expect("splitting a valid plan keeps it valid")
    }

    /// Follows nodes that grew in place: every KV range ending at a tail's old end now ends at
    /// its new end, and a masked group's new tokens get the mask of the token before them (the
    /// same node's, so the same queries see them). The range holding a node's last token is in
    /// the one group per query that covers it, so each query sees the new tokens exactly once:
    /// the plan covers the grown tree as a fresh plan would, with the same groups, partial rows
    /// and merge. The cut into pieces is kept, so balance drifts slowly; a caller replans when
    /// the layout moves anyway. O(ranges × log tails).
    pub fn extend_tails(&mut self, tails: &[Tail]) {
        if tails.is_empty() {
            return;
        }
        let mut by_end: Vec<Tail> = tails.to_vec();
        by_end.sort_unstable_by_key(|t| t.end);
        for g in &mut self.groups {
            let words = g.mask_words();
            let mut token = 0usize; // tokens of the group before this range
            for r in &mut g.kv {
                token += (r.end - r.start) as usize;
                let Ok(i) = by_end.binary_search_by_key(&r.end, |t| t.end) else {
                    continue;
                };
                let grown = (by_end[i].new_end - r.end) as usize;
                r.end = by_end[i].new_end;
                if let Some(mask) = &mut g.mask {
                    let last = mask[(token - 1) * words..token * words].to_vec();
                    let at = token * words;
                    mask.splice(at..at, last.iter().copied().cycle().take(grown * words));
                }
                token += grown;
            }
        }
    }

    /// Brings `shared`, this plan's [`kv_shared_tokens`](Self::kv_shared_tokens) before
    /// [`extend_tails`](Self::extend_tails)`(tails)`, up to date with the extended plan. A
    /// tail's new tokens lie where no range reached before, so exactly the ranges that were
    /// extended read them: they are shared where two or more were. O(ranges × log tails), where
    /// counting afresh sorts every range's ends (about 10 µs for few-shot b = 50's cut plan on
    /// the build host, on every decode step that updates a plan in place).
    pub fn grow_shared_tokens(&self, shared: &mut [u32], tails: &[Tail]) {
        // (new end, tokens grown, ranges extended), by new end: after the extension, the
        // ranges ending at a tail's new end are the extended ones.
        let mut by_end: Vec<(u32, u32, u32)> = tails
            .iter()
            .map(|t| (t.new_end, t.new_end - t.end, 0))
            .collect();
        by_end.sort_unstable();
        let tail_of = |r: &Range<u32>| by_end.binary_search_by_key(&r.end, |t| t.0).ok();
        let ranges = || {
            self.groups
                .iter()
                .enumerate()
                .flat_map(|(g, gr)| gr.kv.iter().map(move |r| (g, r)))
        };
        let extended: Vec<(usize, usize)> = ranges()
            .filter_map(|(g, r)| tail_of(r).map(|i| (g, i)))
            .collect();
        for &(_, i) in &extended {
            by_end[i].2 += 1;
        }
        for (g, i) in extended {
            if by_end[i].2 >= 2 {
                shared[g] += by_end[i].1;
            }
        }
    }

    /// For each group, how many of its KV tokens the step reads more than once (another group,
    /// or another of its own ranges, reads them too). A backend streams KV that is read once
    /// past its cache; KV that several groups read (a shared prefix under Q-guided plans, a
    /// root split over many query tiles) is worth keeping.
    pub fn kv_shared_tokens(&self) -> Vec<u32> {
        // Every range's ends; at one position an end sorts before a start, so ranges that only
        // touch do not overlap. Between two consecutive positions, `depth` ranges read.
        let mut ends: Vec<(u32, i32)> = self
            .groups
            .iter()
            .flat_map(|g| g.kv.iter().flat_map(|r| [(r.start, 1), (r.end, -1)]))
            .collect();
        ends.sort_unstable();
        let mut shared: Vec<Range<u32>> = Vec::new();
        let mut depth = 0;
        for (i, &(at, step)) in ends.iter().enumerate() {
            depth += step;
            let next = ends.get(i + 1).map_or(at, |e| e.0);
            if depth >= 2 && next > at {
                match shared.last_mut() {
                    Some(last) if last.end == at => last.end = next,
                    _ => shared.push(at..next),
                }
            }
        }
        let shared_in = |r: &Range<u32>| -> u32 {
            let first = shared.partition_point(|s| s.end <= r.start);
            shared[first..]
                .iter()
                .take_while(|s| s.start < r.end)
                .map(|s| s.end.min(r.end) - s.start.max(r.start))
                .sum()
        };
        self.groups
            .iter()
            .map(|g| g.kv.iter().map(shared_in).sum())
            .collect()
    }

    /// Moves every KV address by `-offset`, for a rank that stores only its own shard.
    pub fn relocated(&self, map: impl Fn(Range<u32>) -> Range<u32>) -> Plan {
        let mut plan = self.clone();
        for g in &mut plan.groups {
            for r in &mut g.kv {
                *r = map(r.clone());
            }
        }
        plan
    }

    /// The analytic IO of executing this plan (DeFT's IO table), for `shape` and `dtype`.
    pub fn io(&self, shape: &AttnShape, dtype: DType) -> IoReport {
        let RowBytes {
            kv_token: kv_token_bytes,
            q_row: q_row_bytes,
            partial_row: partial_row_bytes,
        } = RowBytes::of(shape, dtype);
        let tokens: Vec<u64> = self.groups.iter().map(|g| g.tokens() as u64).collect();
        let kv_tokens: u64 = tokens.iter().sum();
        let max = tokens.iter().copied().max().unwrap_or(0);
        let mean = if tokens.is_empty() {
            0.0
        } else {
            kv_tokens as f64 / tokens.len() as f64
        };
        let mut ranges: Vec<Range<u32>> = self.groups.iter().flat_map(|g| g.kv.clone()).collect();
        ranges.sort_unstable_by_key(|r| r.start);
        let (mut unique, mut covered_to) = (0u64, 0u32);
        for r in &ranges {
            let start = r.start.max(covered_to);
            if r.end > start {
                unique += (r.end - start) as u64;
                covered_to = r.end;
            }
        }
        IoReport {
            groups: self.groups.len(),
            partial_rows: self.num_partial_rows(),
            kv_tokens_read: kv_tokens,
            kv_unique_tokens: unique,
            kv_bytes: kv_tokens * kv_token_bytes,
            q_bytes: self.num_partial_rows() as u64 * q_row_bytes,
            partial_bytes: 2 * self.num_partial_rows() as u64 * partial_row_bytes,
            mask_bytes: self
                .groups
                .iter()
                .filter_map(|g| g.mask.as_ref())
                .map(|m| m.len() as u64 * 8)
                .sum(),
            max_group_tokens: max,
            balance: if mean > 0.0 { max as f64 / mean } else { 1.0 },
        }
    }

    /// Checks that every query sees exactly its context (within `expected`) once: no token
    /// missing, none twice. Independent of any arithmetic, so planners are tested on it alone.
    pub fn check_coverage(&self, expected: impl Fn(u32) -> Vec<Range<u32>>) -> Result<()> {
        let mut seen: Vec<Vec<Range<u32>>> = vec![Vec::new(); self.num_queries()];
        for group in &self.groups {
            let mut token = 0usize;
            for r in &group.kv {
                for (j, &q) in group.queries.iter().enumerate() {
                    let mut run: Option<u32> = None;
                    for (i, addr) in (r.start..r.end).enumerate() {
                        let vis = group.visible(token + i, j);
                        match (vis, run) {
                            (true, None) => run = Some(addr),
                            (false, Some(s)) => {
                                seen[q as usize].push(s..addr);
                                run = None;
                            }
                            _ => {}
                        }
                    }
                    if let Some(s) = run {
                        seen[q as usize].push(s..r.end);
                    }
                }
                token += (r.end - r.start) as usize;
            }
        }
        for (q, mut got) in seen.into_iter().enumerate() {
            got.sort_by_key(|r| r.start);
            let merged = coalesce(&got).map_err(|addr| {
                CoreError::Plan(format!("query {q} sees token {addr} more than once"))
            })?;
            let mut want: Vec<Range<u32>> = expected(q as u32)
                .into_iter()
                .filter(|r| !r.is_empty())
                .collect();
            want.sort_by_key(|r| r.start);
            let want = coalesce(&want)
                .map_err(|a| CoreError::Plan(format!("expected context overlaps at {a}")))?;
            if merged != want {
                return Err(CoreError::Plan(format!(
                    "query {q} sees {merged:?} but its context is {want:?}"
                )));
            }
        }
        Ok(())
    }
}

/// Merges sorted, touching ranges; `Err(addr)` at the first overlap.
fn coalesce(sorted: &[Range<u32>]) -> std::result::Result<Vec<Range<u32>>, u32> {
    let mut out: Vec<Range<u32>> = Vec::new();
    for r in sorted {
        match out.last_mut() {
            Some(last) if r.start < last.end => return Err(r.start),
            Some(last) if r.start == last.end => last.end = r.end,
            _ => out.push(r.clone()),
        }
    }
    Ok(out)
}

/// Splits a token list (given as ranges) into consecutive chunks of at most `chunk` tokens.
pub fn split_ranges(ranges: &[Range<u32>], chunk: u32) -> Vec<Vec<Range<u32>>> {
    let chunk = chunk.max(1);
    let total: u32 = ranges.iter().map(|r| r.end - r.start).sum();
    let sizes: Vec<u32> = (0..total.div_ceil(chunk))
        .map(|i| chunk.min(total - i * chunk))
        .collect();
    split_ranges_into(ranges, &sizes)
}

/// Splits a token list (given as ranges) into consecutive pieces of the given sizes (which add
/// up to the list's length).
pub fn split_ranges_into(ranges: &[Range<u32>], sizes: &[u32]) -> Vec<Vec<Range<u32>>> {
    let mut out = Vec::with_capacity(sizes.len());
    let mut pieces = sizes.iter().copied().filter(|&s| s > 0);
    let mut cur: Vec<Range<u32>> = Vec::new();
    let mut room = pieces.next().unwrap_or(0);
    for r in ranges {
        let mut start = r.start;
        while start < r.end && room > 0 {
            let take = room.min(r.end - start);
            cur.push(start..start + take);
            start += take;
            room -= take;
            if room == 0 {
                out.push(std::mem::take(&mut cur));
                room = pieces.next().unwrap_or(0);
            }
        }
    }
    debug_assert!(
        cur.is_empty() && room == 0,
        "sizes must add up to the ranges' length"
    );
    out
}

/// Analytic IO of a plan: the quantities of DeFT's IO table plus balance.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IoReport {
    pub groups: usize,
    pub partial_rows: usize,
    /// KV tokens loaded, summed over groups (per KV head).
    pub kv_tokens_read: u64,
    /// K and V bytes loaded over all KV heads.
    pub kv_bytes: u64,
    /// Distinct KV tokens loaded (per KV head): what must come from HBM at least once; the
    /// rest of `kv_tokens_read` are re-reads that a GPU's L2 can serve.
    pub kv_unique_tokens: u64,
    /// Query bytes loaded (a query is reloaded by every group it is in).
    pub q_bytes: u64,
    /// Partial (o, lse) bytes written by stage 1 and read back by stage 2.
    pub partial_bytes: u64,
    pub mask_bytes: u64,
    pub max_group_tokens: u64,
    /// Max over mean KV tokens per group (1.0 is perfectly even).
    pub balance: f64,
}

/// `tokens` in `pieces` (nearly) equal counts, in order (`pieces` clamped to 1..=`tokens`, so
/// that none is empty).
pub fn even_sizes(tokens: u64, pieces: u64) -> Vec<u32> {
    let pieces = pieces.clamp(1, tokens.max(1));
    (0..pieces)
        .map(|i| ((i + 1) * tokens / pieces - i * tokens / pieces) as u32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One group per query, in query order, makes the partials the merged states; any other
    /// order or a second group does not.
    #[test]
    fn rows_are_queries_only_for_one_group_per_query_in_order() {
        let one = |q: u32| Group::unmasked(vec![q * 10..q * 10 + 5], vec![q]);
        let plan = |groups| Plan::new(3, groups).unwrap();
        assert!(plan(vec![one(0), one(1), one(2)]).rows_are_queries());
        assert!(!plan(vec![one(1), one(0), one(2)]).rows_are_queries());
        assert!(!plan(vec![one(0), one(1), one(2), one(2)]).rows_are_queries());
    }

    /// Padding a plan with queries adds no partial rows, leaves every group and row as they
    /// were, and is the plan `Plan::new` builds over as many queries.
    #[test]
    fn queries_padded_have_no_keys() {
        let groups = vec![
            Group::unmasked(vec![0..4], vec![0, 1]),
            Group::unmasked(vec![4..9], vec![1]),
        ];
        let plan = Plan::new(2, groups.clone()).unwrap();
        let padded = plan.clone().with_queries(5);
        assert_eq!(padded, Plan::new(5, groups).unwrap());
        assert_eq!(padded.num_partial_rows(), plan.num_partial_rows());
        assert_eq!(padded.rows_of(1), plan.rows_of(1));
        assert!((2..5).all(|q| padded.rows_of(q).is_empty()));
        assert_eq!(plan.clone().with_queries(1), plan);
    }

    /// A group's shared tokens are those another range overlaps; ranges that only touch do not
    /// overlap.
    #[test]
    fn kv_shared_tokens_counts_the_overlaps() {
        let groups = vec![
            Group::unmasked(vec![0..4, 10..12], vec![0]),
            Group::unmasked(vec![4..8], vec![1]),
            Group::unmasked(vec![11..20], vec![2]),
            Group::unmasked(vec![18..30], vec![0]),
            Group::unmasked(vec![30..31, 40..41], vec![1]),
        ];
        let plan = Plan::new(3, groups).unwrap();
        assert_eq!(plan.kv_shared_tokens(), [1, 0, 3, 2, 0]);
    }

    /// Grown tokens that two ranges read are shared, those that one reads are not, as counting
    /// afresh says.
    #[test]
    fn shared_tokens_grow_with_the_tails() {
        let groups = vec![
            Group::unmasked(vec![0..10], vec![0]),
            Group::unmasked(vec![4..10], vec![1]),
            Group::unmasked(vec![20..30], vec![2]),
        ];
        let mut plan = Plan::new(3, groups).unwrap();
        let mut shared = plan.kv_shared_tokens();
        let tails = [
            Tail {
                end: 10,
                new_end: 13,
            },
            Tail {
                end: 30,
                new_end: 31,
            },
        ];
        plan.extend_tails(&tails);
        plan.grow_shared_tokens(&mut shared, &tails);
        assert_eq!(shared, [9, 9, 0]);
        assert_eq!(shared, plan.kv_shared_tokens());
    }

    proptest::proptest! {
        /// Against a count of reads per token.
        #[test]
        fn kv_shared_tokens_match_a_count_per_token(
            ranges in proptest::collection::vec(
                proptest::collection::vec((0u32..60, 1u32..12), 1..4), 1..8)
        ) {
            let groups: Vec<Group> = ranges
                .iter()
                .map(|rs| Group::unmasked(rs.iter().map(|&(s, n)| s..s + n).collect(), vec![0]))
                .collect();
            let mut reads = [0u32; 72];
            for g in &groups {
                g.kv.iter().flat_map(|r| r.clone()).for_each(|t| reads[t as usize] += 1);
            }
            let expected: Vec<u32> = groups
                .iter()
                .map(|g| g.kv.iter().flat_map(|r| r.clone()).filter(|&t| reads[t as usize] > 1).count() as u32)
                .collect();
            proptest::prop_assert_eq!(Plan::new(1, groups).unwrap().kv_shared_tokens(), expected);
        }
    }

    #[test]
    fn csr_lists_rows_in_group_order() {
        let groups = vec![
            Group::unmasked(vec![0..4], vec![0, 1]),
            Group::unmasked(vec![4..6], vec![1]),
            Group::unmasked(vec![6..8], vec![0]),
        ];
        let plan = Plan::new(3, groups).unwrap();
        assert_eq!(plan.partial_base(), &[0, 2, 3]);
        assert_eq!(plan.rows_of(0), &[0, 3]);
        assert_eq!(plan.rows_of(1), &[1, 2]);
        assert!(plan.rows_of(2).is_empty());
    }

    #[test]
    fn split_queries_keeps_coverage_and_mask_columns() {
        let mask: Vec<u64> = (0..4u64)
            .map(|t| if t < 2 { 0b111 } else { 0b100 })
            .collect();
        let g = Group {
            kv: vec![0..4],
            queries: vec![0, 1, 2],
            mask: Some(mask),
        };
        let plan = Plan::new(3, vec![g]).unwrap();
        let split = plan.split_queries(2);
        assert_eq!(split.groups().len(), 2);
        // Queries 0 and 1 see tokens 0..2 (mask kept); query 2 sees all four (mask dropped).
        assert!(split.groups()[0].mask.is_some());
        assert!(split.groups()[1].mask.is_none());
        split
            .check_coverage(|q| if q < 2 { vec![0..2] } else { vec![0..4] })
            .unwrap();
    }

    /// Pieces of a masked group keep only the queries that see some token, and no mask when
    /// those see every token; a piece no query sees is dropped.
    #[test]
    fn pieces_of_a_masked_group_are_trimmed() {
        // Tokens 0..2 seen by queries 0 and 1 (a shared part), 2..4 by query 1 alone (a leaf),
        // 4..6 by nobody.
        let mask: Vec<u64> = [0b11u64, 0b11, 0b10, 0b10, 0, 0].to_vec();
        let g = Group {
            kv: vec![0..6],
            queries: vec![0, 1],
            mask: Some(mask),
        };
        let plan = Plan::new(2, vec![g]).unwrap();
        let split = plan.split_groups(|_| 3);
        let groups = split.groups();
        assert_eq!(groups.len(), 2, "{groups:?}");
        assert_eq!(groups[0], Group::unmasked(vec![0..2], vec![0, 1]));
        assert_eq!(groups[1], Group::unmasked(vec![2..4], vec![1]));
        split
            .check_coverage(|q| if q == 0 { vec![0..2] } else { vec![0..4] })
            .unwrap();
    }

    #[test]
    fn rejects_malformed_groups() {
        assert!(Plan::new(1, vec![Group::unmasked(vec![0..1], vec![])]).is_err());
        assert!(Plan::new(1, vec![Group::unmasked(vec![0..1], vec![3])]).is_err());
        assert!(Plan::new(1, vec![Group::unmasked(vec![2..2], vec![0])]).is_err());
        let bad_mask = Group {
            kv: vec![0..3],
            queries: vec![0],
            mask: Some(vec![1]),
        };
        assert!(Plan::new(1, vec![bad_mask]).is_err());
    }

    #[test]
    fn coverage_catches_duplicates_and_gaps() {
        let ctx = |_q: u32| vec![0..8];
        let ok = Plan::new(1, vec![Group::unmasked(vec![0..3, 3..8], vec![0])]).unwrap();
        ok.check_coverage(ctx).unwrap();
        let dup = Plan::new(
            1,
            vec![
                Group::unmasked(vec![0..5], vec![0]),
                Group::unmasked(vec![4..8], vec![0]),
            ],
        )
        .unwrap();
        assert!(dup
            .check_coverage(ctx)
            .unwrap_err()
            .to_string()
            .contains("more than once"));
        let gap = Plan::new(1, vec![Group::unmasked(vec![0..5], vec![0])]).unwrap();
        assert!(gap.check_coverage(ctx).is_err());
        // A mask that hides token 1 from the query leaves a gap.
        let masked = Group {
            kv: vec![0..8],
            queries: vec![0],
            mask: Some(vec![1, 0, 1, 1, 1, 1, 1, 1]),
        };
        assert!(Plan::new(1, vec![masked])
            .unwrap()
            .check_coverage(ctx)
            .is_err());
    }

    #[test]
    fn splitting_keeps_coverage_and_slices_masks() {
        // One masked group of 10 tokens: query 0 sees the first 6, query 1 the last 4.
        let mask: Vec<u64> = (0..10).map(|t| if t < 6 { 0b01 } else { 0b10 }).collect();
        let g = Group {
            kv: vec![0..4, 20..26],
            queries: vec![0, 1],
            mask: Some(mask),
        };
        let plan = Plan::new(2, vec![g]).unwrap();
        let split = plan.split_for_parallelism(4, 1);
        assert_eq!(split.groups().len(), 4);
        assert!(
            split.groups().iter().all(|g| g.tokens() >= 2),
            "equal pieces"
        );
        // A batch of 16 requests asked for 50 groups gets 3 equal pieces each (48 <= 50).
        let batch: Vec<Group> = (0..16)
            .map(|i| Group::unmasked(vec![i * 100..(i + 1) * 100], vec![i]))
            .collect();
        let batch_split = Plan::new(16, batch).unwrap().split_for_parallelism(50, 8);
        assert_eq!(batch_split.groups().len(), 48);
        assert_eq!(
            plan.split_for_parallelism(4, 5).groups().len(),
            2,
            "min_chunk bounds the pieces"
        );
        split
            .check_coverage(|q| {
                if q == 0 {
                    vec![0..4, 20..22]
                } else {
                    vec![22..26]
                }
            })
            .unwrap();
        assert_eq!(plan.split_for_parallelism(1, 1), plan);
    }

    #[test]
    fn split_ranges_crosses_range_boundaries() {
        let chunks = split_ranges(&[0..5, 10..13], 3);
        assert_eq!(chunks, vec![vec![0..3], vec![3..5, 10..11], vec![11..13]]);
    }
}
