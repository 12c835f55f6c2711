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

use super::step::{Chunk, Row, Step};
use crate::{Result, RuntimeError};
use canopy_core::Tail;
use canopy_kv::{KvManager, KvNode, PrefixCache, RankSnapshot, RankUpdate, StepLayout};
use std::collections::BTreeMap;

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
}

/// One prompt chunk's rows and the cached context they attend to.
pub(crate) struct ChunkRows {
    pub ids: Vec<u32>,
    pub positions: Vec<u32>,
    pub placed: Vec<(usize, u32)>,
    /// The ranks' views of the cached context with one query per row (this rank's alone for
    /// the tree, every rank's for the ring); `None` when nothing is cached before the chunk.
    pub context: Option<Vec<RankSnapshot>>,
}

/// How a rank's decode layout changed with a step's appends.
pub(crate) enum Layout {
    /// Plan afresh: this rank's snapshot (every rank's, for the ring).
    Fresh(Vec<RankSnapshot>),
    /// Extend the plan in place by the tails; `new_pages`: install the page table again
    /// (pages came into reserved room).
    Grown { tails: Vec<Tail>, new_pages: bool },
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
            let reusable = &a.prompt[..a.prompt.len().saturating_sub(1)];
            match self.cache.acquire(reusable) {
                Ok(prefix) => {
                    self.seqs.insert(
                        a.id,
                        Seq {
                            prompt: a.prompt.clone(),
                            lease: prefix.node,
                            cached: prefix.tokens,
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
        };
        for (node, row) in placed {
            let len = kv.len(node).expect("a live branch") as usize;
            let prompt = self.seqs[&row.id].prompt.len();
            out.rows.push(row);
            out.ids.push(row.token);
            out.positions.push((prompt + len - 1) as u32);
            out.placed.push(slot(kv, node, len - 1));
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

    /// The decode layout after [`decode`](Self::decode)'s appends, for `rank`.
    pub fn layout(&mut self, rank: usize, ring: bool) -> Result<Layout> {
        let mut updates = self.steps.update(self.cache.kv())?;
        if ring {
            let ranks = self.cache.kv().ranks();
            return Ok(Layout::Fresh(
                (0..ranks)
                    .map(|r| self.steps.rank(r).expect("updated above").clone())
                    .collect(),
            ));
        }
        Ok(match updates.swap_remove(rank) {
            RankUpdate::Fresh(snap) => Layout::Fresh(vec![snap.clone()]),
            RankUpdate::Grown { tails, table } => Layout::Grown {
                tails,
                new_pages: table.is_some(),
            },
        })
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

    /// Places `chunk`'s tokens after the prompt's stored KV and returns its rows, with the
    /// cached context they attend to seen by `ranks` (this rank's, or every rank's).
    pub fn chunk(&mut self, chunk: Chunk, ranks: &[usize]) -> Result<ChunkRows> {
        let seq = self
            .seqs
            .get(&chunk.id)
            .ok_or_else(|| protocol(format!("prefill of unknown request {}", chunk.id)))?;
        let (start, end) = (seq.computed, (chunk.end as usize).min(seq.prompt.len()));
        if start >= end {
            return Err(protocol(format!(
                "request {} has {start} tokens prefilled; a chunk to {end} adds none",
                chunk.id
            )));
        }
        let n = end - start;
        let context = match seq.own.or(seq.lease) {
            Some(at) => Some(
                ranks
                    .iter()
                    .map(|&r| self.cache.kv().snapshot_with(r, &vec![at; n]))
                    .collect::<canopy_kv::Result<Vec<_>>>()?,
            ),
            None => None,
        };
        let (own, lease, cached) = (seq.own, seq.lease, seq.cached);
        let own = match own {
            Some(node) => {
                self.cache.append(node, n as u32)?;
                node
            }
            None => self.cache.fork(lease, n as u32)?,
        };
        let seq = self.seqs.get_mut(&chunk.id).expect("looked up above");
        seq.own = Some(own);
        let kv = self.cache.kv();
        Ok(ChunkRows {
            ids: seq.prompt[start..end].to_vec(),
            positions: (start as u32..end as u32).collect(),
            placed: (start..end).map(|i| slot(kv, own, i - cached)).collect(),
            context,
        })
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
