//! The running requests' KV bookkeeping, one copy per rank, changed only by step
//! descriptions: every rank applies the same steps in the same order, so all copies agree
//! where every token lives and which prefixes are cached, without a message.
//!
//! A request holds a lease on the longest cached prefix of its prompt (all but its last
//! token), a node of its own for the rest of the prompt (forked from the lease when its first
//! chunk is prefilled, grown by later chunks and offered to the cache once complete), and one
//! branch per sample below that node. A decode step appends one token to each row's branch
//! and marks exactly the rows' branches live, so the live KV tree's queries are the rows, in
//! branch order.

use super::step::{Admit, Chunk, Row, Step};
use crate::{Result, RuntimeError};
use canopy_core::Tail;
use canopy_kv::{KvManager, KvNode, PrefixCache, RankSnapshot, RankUpdate, StepLayout};
use std::collections::BTreeMap;
use std::ops::Range;

/// A sample's branch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Branch {
    /// Not forked yet: its first token is decoded at its first step.
    Unborn,
    At(KvNode),
    Ended,
}

/// One admitted request's KV.
#[derive(Debug)]
pub(crate) struct Seq {
    pub prompt: Vec<u32>,
    lease: Option<KvNode>,
    /// Prompt tokens found cached at admission (the path to the lease).
    pub cached: usize,
    /// Likeliest tokens reported beside each prompt token's log-probability (`None`: none).
    pub prompt_logprobs: Option<u32>,
    /// The prompt's rest, once its first chunk is placed.
    own: Option<KvNode>,
    /// Prompt tokens whose KV is stored.
    pub computed: usize,
    branches: Vec<Branch>,
}

impl Seq {
    pub fn prefilled(&self) -> bool {
        self.computed == self.prompt.len()
    }
}

/// One decode pass's rows, in query order, and where their new KV goes.
pub(crate) struct DecodeRows {
    pub rows: Vec<Row>,
    pub ids: Vec<u32>,
    pub positions: Vec<u32>,
    /// Each row's `(rank, physical slot)`.
    pub placed: Vec<(usize, u32)>,
    /// Each row's branch.
    nodes: Vec<KvNode>,
}

/// One prefill pass: prompt chunks of several requests through the layers together, each
/// chunk's rows attending causally to one another and, all of them or none, to their cached
/// contexts; the first pass may lead with a step's decode rows, which attend to their branches.
pub(crate) struct PrefillPass {
    /// Rows `0..decode_rows` are decode rows, in query order.
    pub decode_rows: usize,
    pub ids: Vec<u32>,
    pub positions: Vec<u32>,
    /// Each row's `(rank, physical slot)`; `None` for the rows of a chunk whose pages could
    /// not be placed (they run unstored, and their request fails).
    pub placed: Vec<Option<(usize, u32)>>,
    /// Every chunk's rows, in row order; `true` for the chunks whose KV is stored.
    pub chunks: Vec<(Chunk, Range<usize>, bool)>,
    /// This rank's view of the chunks' cached contexts with one query per row, in row order;
    /// `None` when the pass's chunks have none cached before them.
    pub context: Option<RankSnapshot>,
}

/// Requests that failed in the books, each with its error.
pub(crate) type Failed = Vec<(u64, RuntimeError)>;

/// How a rank's decode layout changed with a step's appends.
pub(crate) enum Layout {
    /// Plan afresh: this rank's snapshot (every rank's, for the ring).
    Fresh(Vec<RankSnapshot>),
    /// Extend the plans in place by the tails, a list for each rank whose view is planned
    /// (this rank's for the tree, every rank's for the ring); `new_pages`: install this rank's
    /// page table again (pages came into reserved room).
    Grown {
        tails: Vec<Vec<Tail>>,
        new_pages: bool,
    },
}

/// Every request's KV on one rank's copy of the books.
pub(crate) struct Books {
    cache: PrefixCache,
    steps: StepLayout,
    seqs: BTreeMap<u64, Seq>,
}

impl Books {
    /// Books over `ranks` pools of `pages_per_rank` pages; decoding leaves keep
    /// `growth_room` addresses of room ([`crate::kv::GROWTH_ROOM`]).
    pub fn new(
        ranks: usize,
        page_size: u32,
        pages_per_rank: u32,
        growth_room: u32,
    ) -> Result<Books> {
        let kv = KvManager::new(ranks, page_size, pages_per_rank)?.with_growth_room(growth_room);
        Ok(Books {
            cache: PrefixCache::new(kv),
            steps: StepLayout::new(),
            seqs: BTreeMap::new(),
        })
    }

    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }

    pub fn seq(&self, id: u64) -> Option<&Seq> {
        self.seqs.get(&id)
    }

    /// The step's ends and admissions; returns the requests that failed on the way (the same
    /// on every rank), already ended.
    pub fn begin(&mut self, step: &Step) -> Vec<(u64, RuntimeError)> {
        for &id in &step.end {
            self.end(id);
        }
        for &(id, sample) in &step.end_samples {
            if let Some(seq) = self.seqs.get_mut(&id) {
                if let Some(b) = seq.branches.get_mut(sample as usize) {
                    if let Branch::At(node) = std::mem::replace(b, Branch::Ended) {
                        let _ = self.cache.prune(node);
                    }
                }
            }
        }
        let mut failed = Vec::new();
        for a in &step.admit {
            match self
                .cache
                .acquire(Admit::reusable(&a.prompt, a.prompt_logprobs))
            {
                Ok(prefix) => {
                    self.seqs.insert(
                        a.id,
                        Seq {
                            prompt: a.prompt.clone(),
                            lease: prefix.node,
                            cached: prefix.tokens,
                            prompt_logprobs: a.prompt_logprobs,
                            own: None,
                            computed: prefix.tokens,
                            branches: vec![Branch::Unborn; a.samples as usize],
                        },
                    );
                }
                Err(e) => failed.push((a.id, e.into())),
            }
        }
        failed
    }

    /// Ends request `id`: its branches and its prompt node (unless cached) are pruned, its
    /// lease released.
    pub fn end(&mut self, id: u64) {
        let Some(seq) = self.seqs.remove(&id) else {
            return;
        };
        for b in seq.branches {
            if let Branch::At(node) = b {
                let _ = self.cache.prune(node);
            }
        }
        if let Some(own) = seq.own {
            if self.cache.refs(own).is_none() {
                let _ = self.cache.prune(own);
            }
        }
        self.cache.release(seq.lease);
    }

    /// Places the step's decode rows: one token on each row's branch (forked at its first),
    /// exactly those branches live. Returns the rows in query order, and the requests that
    /// failed (ended already).
    pub fn decode(&mut self, rows: &[Row]) -> (DecodeRows, Vec<(u64, RuntimeError)>) {
        let mut failed = Vec::new();
        let mut placed: Vec<(KvNode, Row)> = Vec::new();
        for &row in rows {
            match self.grow_branch(row) {
                Ok(node) => placed.push((node, row)),
                Err(e) => failed.push((row.id, e)),
            }
        }
        for (id, _) in &failed {
            self.end(*id);
        }
        placed.retain(|(_, r)| !failed.iter().any(|(id, _)| *id == r.id));
        // Exactly the rows' branches are live: the snapshot's queries.
        let live: Vec<KvNode> = placed.iter().map(|(n, _)| *n).collect();
        for seq in self.seqs.values() {
            for b in &seq.branches {
                if let Branch::At(node) = *b {
                    let _ = self.cache.set_live(node, live.contains(&node));
                }
            }
        }
        placed.sort_by_key(|(n, _)| *n);
        let kv = self.cache.kv();
        let mut out = DecodeRows {
            rows: Vec::new(),
            ids: Vec::new(),
            positions: Vec::new(),
            placed: Vec::new(),
            nodes: Vec::new(),
        };
        for (node, row) in placed {
            let len = kv.len(node).expect("a live branch") as usize;
            let prompt = self.seqs[&row.id].prompt.len();
            out.rows.push(row);
            out.ids.push(row.token);
            out.positions.push((prompt + len - 1) as u32);
            out.placed.push(slot(kv, node, len - 1));
            out.nodes.push(node);
        }
        (out, failed)
    }

    /// One more token on the branch of `row`.
    fn grow_branch(&mut self, row: Row) -> Result<KvNode> {
        let seq = self
            .seqs
            .get_mut(&row.id)
            .ok_or_else(|| protocol(format!("decode row of unknown request {}", row.id)))?;
        let branch = seq
            .branches
            .get_mut(row.sample as usize)
            .ok_or_else(|| protocol(format!("request {} has no sample {}", row.id, row.sample)))?;
        match *branch {
            Branch::At(node) => {
                self.cache.append(node, 1)?;
                Ok(node)
            }
            Branch::Unborn => {
                let own = seq
                    .own
                    .filter(|_| seq.computed == seq.prompt.len())
                    .ok_or_else(|| {
                        protocol(format!("request {} decodes before its prompt", row.id))
                    })?;
                let node = self.cache.fork(Some(own), 1)?;
                *branch = Branch::At(node);
                Ok(node)
            }
            Branch::Ended => Err(protocol(format!(
                "sample {} of request {} has ended",
                row.sample, row.id
            ))),
        }
    }

    /// The decode layout after [`decode`](Self::decode)'s appends, for `rank`, whose step
    /// plans `viewers`' views (its own for the tree, every rank's for the ring): extended in
    /// place only where every one of them grew in place.
    pub fn layout(&mut self, rank: usize, viewers: &[usize]) -> Result<Layout> {
        let mut tails = Vec::with_capacity(viewers.len());
        let mut new_pages = false;
        let updates = self.steps.update(self.cache.kv())?.into_iter().enumerate();
        for (r, update) in updates.filter(|(r, _)| viewers.contains(r)) {
            let RankUpdate::Grown { tails: t, table } = update else {
                let views = viewers
                    .iter()
                    .map(|&v| self.steps.rank(v).expect("updated above"));
                return Ok(Layout::Fresh(views.cloned().collect()));
            };
            new_pages |= r == rank && table.is_some();
            tails.push(t);
        }
        Ok(Layout::Grown { tails, new_pages })
    }

    /// KV tokens on some decode row's path in `ranks`' shards, as of the last
    /// [`layout`](Self::layout): what the step's attention must read there at least once.
    pub fn queried_tokens(&self, ranks: &[usize]) -> u64 {
        ranks
            .iter()
            .filter_map(|&r| self.steps.rank(r))
            .map(|s| s.tree.queried_tokens())
            .sum()
    }

    /// This rank's decode page table, as of the last [`layout`](Self::layout).
    pub fn decode_table(&self, rank: usize) -> Option<&[u32]> {
        self.steps.rank(rank).map(|s| s.table.as_slice())
    }

    /// Places the step's `chunks` after their prompts' stored KV, as at most two passes: the
    /// chunks with a cached context (a shared prefix, earlier chunks), which attend to it as
    /// `rank` holds it, led by the step's `decode` rows (placed by [`decode`](Self::decode)) if
    /// there are such chunks, so that one pass over the weights serves both; then the chunks
    /// without. Returns the passes and the requests that fail (their chunks' rows still
    /// run unstored, so a pass's context views stay whole; the caller ends those requests
    /// after the passes). If the views cannot be taken, the cached chunks fail and the decode
    /// rows lead no pass.
    pub fn prefill_passes(
        &mut self,
        chunks: &[Chunk],
        rank: usize,
        decode: Option<&DecodeRows>,
    ) -> (Vec<PrefillPass>, Failed) {
        let decode = decode.filter(|d| !d.rows.is_empty());
        let mut failed = Vec::new();
        // Each chunk's tokens and the node its context ends on.
        let mut wanted: Vec<(Chunk, Range<usize>, Option<KvNode>)> = Vec::new();
        for &chunk in chunks {
            if wanted.iter().any(|(c, _, _)| c.id == chunk.id) {
                failed.push((
                    chunk.id,
                    protocol(format!("request {} has two chunks in one step", chunk.id)),
                ));
                continue;
            }
            let Some(seq) = self.seqs.get(&chunk.id) else {
                failed.push((
                    chunk.id,
                    protocol(format!("prefill of unknown request {}", chunk.id)),
                ));
                continue;
            };
            let (start, end) = (seq.computed, (chunk.end as usize).min(seq.prompt.len()));
            if start >= end {
                failed.push((
                    chunk.id,
                    protocol(format!(
                        "request {} has {start} tokens prefilled; a chunk to {end} adds none",
                        chunk.id
                    )),
                ));
                continue;
            }
            wanted.push((chunk, start..end, seq.own.or(seq.lease)));
        }
        let mut passes = Vec::new();
        for cached in [true, false] {
            let group: Vec<_> = wanted
                .iter()
                .filter(|(_, _, at)| at.is_some() == cached)
                .cloned()
                .collect();
            let lead = decode.filter(|_| cached && !group.is_empty());
            if group.is_empty() && lead.is_none() {
                continue;
            }
            // The context views are taken before any chunk grows its prompt's node.
            let context = if cached {
                let mut queries: Vec<KvNode> = lead.map(|d| d.nodes.clone()).unwrap_or_default();
                queries.extend(group.iter().flat_map(|(_, rows, at)| {
                    std::iter::repeat_n(at.expect("cached"), rows.len())
                }));
                match self.cache.kv().snapshot_with(rank, &queries) {
                    Ok(v) => Some(v),
                    Err(e) => {
                        failed.extend(group.iter().map(|(c, _, _)| (c.id, e.clone().into())));
                        continue;
                    }
                }
            } else {
                None
            };
            let mut pass = PrefillPass {
                decode_rows: 0,
                ids: Vec::new(),
                positions: Vec::new(),
                placed: Vec::new(),
                chunks: Vec::new(),
                context,
            };
            if let Some(d) = lead {
                pass.decode_rows = d.rows.len();
                pass.ids.extend(&d.ids);
                pass.positions.extend(&d.positions);
                pass.placed.extend(d.placed.iter().copied().map(Some));
            }
            for (chunk, tokens, _) in group {
                let first = pass.ids.len();
                let seq = &self.seqs[&chunk.id];
                pass.ids.extend(&seq.prompt[tokens.clone()]);
                pass.positions
                    .extend(tokens.start as u32..tokens.end as u32);
                let stored = match self.place(chunk.id, tokens.len()) {
                    Ok(own) => {
                        let (kv, cached) = (self.cache.kv(), self.seqs[&chunk.id].cached);
                        pass.placed
                            .extend(tokens.clone().map(|i| Some(slot(kv, own, i - cached))));
                        true
                    }
                    Err(e) => {
                        failed.push((chunk.id, e));
                        pass.placed.extend(tokens.clone().map(|_| None));
                        false
                    }
                };
                pass.chunks.push((chunk, first..pass.ids.len(), stored));
            }
            passes.push(pass);
        }
        (passes, failed)
    }

    /// `n` more prompt tokens on request `id`'s own node (forked from its lease at its first
    /// chunk).
    fn place(&mut self, id: u64, n: usize) -> Result<KvNode> {
        let seq = self.seqs.get_mut(&id).expect("a request of the books");
        let own = match seq.own {
            Some(node) => {
                self.cache.append(node, n as u32)?;
                node
            }
            None => self.cache.fork(seq.lease, n as u32)?,
        };
        seq.own = Some(own);
        Ok(own)
    }

    /// `chunk`'s KV is stored: a prompt complete is offered to the prefix cache.
    pub fn chunk_done(&mut self, chunk: Chunk) -> Result<()> {
        let Some(seq) = self.seqs.get_mut(&chunk.id) else {
            return Ok(());
        };
        seq.computed = (chunk.end as usize).min(seq.prompt.len());
        if let (true, Some(own)) = (seq.prefilled(), seq.own) {
            if let Some(lease) = self.cache.insert(own, &seq.prompt[seq.cached..])? {
                seq.lease = Some(lease);
            }
        }
        Ok(())
    }
}

/// The rank and physical slot of token `i` of `node`.
fn slot(kv: &KvManager, node: KvNode, i: usize) -> (usize, u32) {
    let ps = kv.page_size();
    let page = kv.pages(node).expect("a node of the books")[i / ps as usize];
    (page.rank, page.page * ps + i as u32 % ps)
}

fn protocol(message: String) -> RuntimeError {
    RuntimeError::Protocol(format!(
        "a step description disagrees with the books: {message}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serving::step::{Admit, Row};

    fn admit(id: u64, prompt: Vec<u32>) -> Admit {
        Admit {
            id,
            prompt,
            samples: 1,
            prompt_logprobs: None,
        }
    }

    /// A step's chunks make one pass of those with a cached context, led by the step's decode
    /// rows, its queries one per row in row order, then one of the rest; a chunk that finds no
    /// pages runs unstored and its request fails.
    #[test]
    fn chunks_with_a_cached_context_make_one_pass_and_the_rest_another() {
        // 8 pages of 4 tokens on one rank.
        let mut books = Books::new(1, 4, 8, 0).unwrap();
        let shared: Vec<u32> = (0..9).collect();
        let step = Step {
            admit: vec![admit(1, shared.clone())],
            ..Step::default()
        };
        assert!(books.begin(&step).is_empty());
        let (passes, failed) = books.prefill_passes(&[Chunk { id: 1, end: 9 }], 0, None);
        assert!(failed.is_empty());
        assert_eq!(passes.len(), 1);
        assert!(passes[0].context.is_none());
        books.chunk_done(Chunk { id: 1, end: 9 }).unwrap();

        // Request 2 shares request 1's first 8 tokens (two whole pages); 3 shares nothing;
        // 4 asks for more pages than are free.
        let mut second = shared[..8].to_vec();
        second.extend([50, 51, 52]);
        let step = Step {
            admit: vec![
                admit(2, second),
                admit(3, vec![70, 71, 72]),
                admit(4, (100..120).collect()),
            ],
            ..Step::default()
        };
        assert!(books.begin(&step).is_empty());
        assert_eq!(books.seq(2).unwrap().cached, 8);
        let chunks = [
            Chunk { id: 3, end: 3 },
            Chunk { id: 4, end: 20 },
            Chunk { id: 2, end: 11 },
        ];
        // Request 1 decodes its first token in the same step: its row leads the cached pass.
        let row = Row {
            id: 1,
            sample: 0,
            token: 5,
        };
        let (rows, failed) = books.decode(&[row]);
        assert!(failed.is_empty());
        let (passes, failed) = books.prefill_passes(&chunks, 0, Some(&rows));
        assert_eq!(passes.len(), 2);
        let (cached, fresh) = (&passes[0], &passes[1]);
        assert_eq!(cached.decode_rows, 1);
        assert_eq!(cached.ids, [5, 50, 51, 52]);
        assert_eq!(cached.positions, [9, 8, 9, 10]);
        assert_eq!(cached.placed[0], Some(rows.placed[0]));
        let view = cached.context.as_ref().expect("a cached context");
        assert_eq!(view.tree.num_queries(), 4);
        assert_eq!(cached.chunks, [(chunks[2], 1..4, true)]);
        assert!(cached.placed.iter().all(Option::is_some));

        assert!(fresh.context.is_none());
        assert_eq!(fresh.decode_rows, 0);
        assert_eq!(fresh.positions[..3], [0, 1, 2]);
        assert_eq!(
            fresh.chunks,
            [(chunks[0], 0..3, true), (chunks[1], 3..23, false)]
        );
        assert_eq!(fresh.placed.iter().filter(|p| p.is_none()).count(), 20);
        let ids: Vec<u64> = failed.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, [4]);
        // Every stored row has a slot of its own.
        let mut slots: Vec<(usize, u32)> = passes
            .iter()
            .flat_map(|p| p.placed.iter().flatten().copied())
            .collect();
        let n = slots.len();
        slots.sort();
        slots.dedup();
        assert_eq!(slots.len(), n);
    }

    /// The ring's layout extends every rank's plan while every rank's view grows inside its
    /// pages, and is planned afresh, every rank's view, when a page is taken.
    #[test]
    fn the_ring_grows_in_place_only_where_every_rank_does() {
        // 2 ranks of 8 pages of 4 tokens; no growth room, as the ring's engine keeps.
        let mut books = Books::new(2, 4, 8, 0).unwrap();
        let prompt: Vec<u32> = (0..8).collect();
        let step = Step {
            admit: vec![admit(1, prompt)],
            ..Step::default()
        };
        assert!(books.begin(&step).is_empty());
        let (_, failed) = books.prefill_passes(&[Chunk { id: 1, end: 8 }], 0, None);
        assert!(failed.is_empty());
        books.chunk_done(Chunk { id: 1, end: 8 }).unwrap();
        let mut kinds = Vec::new();
        for token in 0..6 {
            let row = Row {
                id: 1,
                sample: 0,
                token,
            };
            let (_, failed) = books.decode(&[row]);
            assert!(failed.is_empty());
            kinds.push(match books.layout(0, &[0, 1]).unwrap() {
                Layout::Fresh(views) => {
                    assert_eq!(views.len(), 2, "every rank's view");
                    'F'
                }
                Layout::Grown { tails, new_pages } => {
                    assert_eq!(tails.len(), 2, "every rank's tails");
                    assert!(!new_pages);
                    'G'
                }
            });
        }
        // The branch's first token takes a page; the next three fill it; the fifth takes
        // another.
        assert_eq!(kinds.iter().collect::<String>(), "FGGGFG");
    }
}
