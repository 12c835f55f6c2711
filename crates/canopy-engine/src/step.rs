//! One rank's attention for one decode step, tree or ring: the piece every caller of the
//! engine runs (the attention benchmark's ranks, and a model's layers).
//!
//! A [`RankAttention`] is built once per layout: it uploads the rank's plans and allocates
//! every buffer a step needs, so [`RankAttention::attend`] allocates nothing on the backend.
//! The plans address KV by layout, not by contents, so one `RankAttention` serves every KV of
//! that layout — each layer of a model reads its own KV through the same plans. Every rank
//! ends a step with the same merged states, in the backend's memory:
//! - **tree**: stage 1 and the local merge over the rank's own KV, then the cross-rank merge
//!   ([`crate::merge::StatesMerge`]) over the transport;
//! - **ring**: each rank's KV travels around the ring; each rank folds every shard, planned
//!   with that shard's plan, into its own states. The hand-off of the shard a rank holds is
//!   started before the compute on it and finished after ([`Transport::start_kv_exchange`]),
//!   so a transport that moves KV on a stream of its own (NCCL) overlaps the two.

use crate::layer_ops::LayerOps;
use crate::merge::{MergeCollective, MergeOps, StatesMerge, Transport};
use crate::topology::NodeLayout;
use crate::{EngineError, Result};
use canopy_core::{AttnShape, DType, Plan, Tail};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// What one rank knows of a ring's shard: its plan (over the shard's logical addresses) and
/// how many logical tokens travel. A shard travels in logical order
/// ([`Transport::send_kv`]), so its plan reads it wherever the receiver's pages put it.
pub struct RingShard {
    pub plan: Plan,
    /// Logical K and V tokens of the shard (what travels).
    pub tokens: usize,
}

/// The uploaded plans and step buffers of one rank.
pub struct RankAttention<'a, B: MergeOps, C: Transport<B>> {
    backend: &'a B,
    comm: &'a C,
    poison: bool,
    /// Moves whenever a buffer of the step is made anew ([`RankAttention::generation`]).
    generation: u64,
    kind: Kind<B>,
}

/// The next [`RankAttention::generation`]: unique over the process, so that no two sets of
/// buffers, alive or freed, share one.
fn next_generation() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

enum Kind<B: MergeOps> {
    Tree {
        shape: AttnShape,
        how: MergeCollective,
        layout: NodeLayout,
        plan: B::Plan,
        partials: B::States,
        local: B::States,
        /// `None` for a tree whose caller merges its states ([`RankAttention::local`]).
        merge: Option<StatesMerge<B>>,
    },
    Ring {
        shards: Vec<RingShard>,
        plans: Vec<B::Plan>,
        partials: Vec<B::States>,
        /// The states of shards `1..p` (`locals[s - 1]`), folded into `acc` (shard 0's) in
        /// shard order once all have passed, so that every rank folds alike and ends with the
        /// same bits.
        locals: Vec<B::States>,
        acc: B::States,
        /// Double buffering: the shard computed on and the one received into.
        bufs: [B::Kv; 2],
    },
}

impl<'a, B: MergeOps, C: Transport<B>> RankAttention<'a, B, C> {
    /// Tree attention over `plan` (this rank's KV, its own addresses), merged by `how`
    /// (concrete: `auto` is resolved by the caller) over ranks placed by `layout`.
    pub fn tree(
        backend: &'a B,
        comm: &'a C,
        shape: AttnShape,
        plan: &Plan,
        how: MergeCollective,
        layout: NodeLayout,
    ) -> Result<Self> {
        if how == MergeCollective::Auto {
            return Err(EngineError::Config(
                "the auto collective must be resolved to a concrete one before a step".into(),
            ));
        }
        Self::tree_with(backend, comm, shape, plan, how, layout, true)
    }

    /// Tree attention over `plan` whose states its caller merges across the ranks
    /// ([`RankAttention::attend_local`]): it holds no merge buffers, and
    /// [`RankAttention::attend`] refuses on more than one rank (one has nothing to merge).
    pub fn local(backend: &'a B, comm: &'a C, shape: AttnShape, plan: &Plan) -> Result<Self> {
        let (how, layout) = (MergeCollective::Allreduce2, NodeLayout::single(comm.size()));
        Self::tree_with(backend, comm, shape, plan, how, layout, false)
    }

    fn tree_with(
        backend: &'a B,
        comm: &'a C,
        shape: AttnShape,
        plan: &Plan,
        how: MergeCollective,
        layout: NodeLayout,
        merged: bool,
    ) -> Result<Self> {
        let queries = plan.num_queries();
        let plan = backend.upload_plan(&shape, plan)?;
        let (partials, local, merge) = tree_buffers(backend, comm, &shape, &plan, queries, merged)?;
        Ok(RankAttention {
            backend,
            comm,
            poison: false,
            generation: next_generation(),
            kind: Kind::Tree {
                shape,
                how,
                layout,
                plan,
                partials,
                local,
                merge,
            },
        })
    }

    /// Ring attention: `shards[r]` is rank `r`'s plan and storage size; every rank plans
    /// every shard, since each shard passes through every rank. `dtype` is the KV's.
    pub fn ring(
        backend: &'a B,
        comm: &'a C,
        shape: AttnShape,
        dtype: DType,
        shards: Vec<RingShard>,
    ) -> Result<Self> {
        if shards.len() != comm.size() {
            return Err(EngineError::Config(format!(
                "a ring of {} ranks got {} shards",
                comm.size(),
                shards.len()
            )));
        }
        let queries = shards[0].plan.num_queries();
        let plans = shards
            .iter()
            .map(|s| backend.upload_plan(&shape, &s.plan))
            .collect::<Result<Vec<_>>>()?;
        let partials = plans
            .iter()
            .map(|p| backend.alloc_partials(&shape, p))
            .collect::<Result<Vec<_>>>()?;
        // One rank receives nothing: token-sized placeholders instead of receive buffers.
        let room = match comm.size() {
            1 => 1,
            _ => shards.iter().map(|s| s.tokens).max().unwrap_or(0),
        };
        let bufs = [
            backend.alloc_ring_kv(&shape, dtype, room)?,
            backend.alloc_ring_kv(&shape, dtype, room)?,
        ];
        Ok(RankAttention {
            backend,
            comm,
            poison: false,
            generation: next_generation(),
            kind: Kind::Ring {
                shards,
                plans,
                partials,
                locals: (1..comm.size())
                    .map(|_| backend.alloc_states(&shape, queries))
                    .collect::<Result<Vec<_>>>()?,
                acc: backend.alloc_states(&shape, queries)?,
                bufs,
            },
        })
    }

    /// Poisons every output buffer before each use (tests), so that a row a kernel fails to
    /// write shows as NaN.
    pub fn with_poison(mut self, poison: bool) -> Self {
        self.poison = poison;
        self
    }

    /// Which buffers a step reads: the plans, partials and states (the tree's merge's too).
    /// It moves whenever one of them is made anew, never when a plan is written over one in
    /// place, so a recorded step is valid while its generation holds; the buffers of an older
    /// one may be freed.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The ranks that attend together.
    pub fn ranks(&self) -> usize {
        self.comm.size()
    }

    /// Whether a pass that runs this step may be recorded as one graph: a step of one rank,
    /// or the tree's over a transport whose merge stays on the backend's stream. The ring's
    /// hand-offs at several ranks use a stream of their own and buffers made per hop.
    pub fn recordable(&self) -> bool {
        self.ranks() == 1
            || matches!(self.kind, Kind::Tree { .. }) && self.comm.merges_on_stream(self.backend)
    }

    /// The largest of every rank's `vote` ([`Transport::agree_max`]).
    pub fn agree_max(&self, vote: u8) -> Result<u8> {
        self.comm.agree_max(vote)
    }

    /// The merge the tree strategy runs (`None` for the ring, and for a tree whose caller
    /// merges).
    pub fn merge(&self) -> Option<MergeCollective> {
        match &self.kind {
            Kind::Tree { how, merge, .. } => merge.as_ref().map(|_| *how),
            Kind::Ring { .. } => None,
        }
    }

    /// The merged states of the last [`RankAttention::attend`].
    pub fn states(&self) -> &B::States {
        match &self.kind {
            Kind::Tree { local, .. } => local,
            Kind::Ring { acc, .. } => acc,
        }
    }

    /// Follows nodes that grew in place, given as the tails of every rank whose view this
    /// step plans: this rank's alone for the tree, every rank's in rank order for the ring
    /// (every shard passes every rank). The plans' groups, rows and buffers stay valid; a
    /// ring shard's logical tokens do not change (growth in place fills addresses its pages
    /// already had), so the ring's receive buffers still hold it.
    pub fn extend(&mut self, tails: &[Vec<Tail>]) -> Result<()> {
        let backend = self.backend;
        let plans: Vec<&mut B::Plan> = match &mut self.kind {
            Kind::Tree { plan, .. } => vec![plan],
            Kind::Ring { plans, .. } => plans.iter_mut().collect(),
        };
        if plans.len() != tails.len() {
            return Err(EngineError::Config(format!(
                "a step that plans {} views got the growth of {}",
                plans.len(),
                tails.len()
            )));
        }
        plans
            .into_iter()
            .zip(tails)
            .try_for_each(|(plan, t)| backend.extend_plan(plan, t))
    }

    /// Tree attention over `new` from now on, in place of the plan it had
    /// ([`Backend::replan`](crate::Backend::replan)). Where the new plan fits the old one's
    /// buffers, every buffer stays and a recorded pass of the old plan replays the new one;
    /// otherwise the step's buffers are made anew for it, in a new generation. The ring
    /// replans every rank's shard: it takes a new [`RankAttention::ring`].
    pub fn replan(&mut self, new: &Plan) -> Result<()> {
        let (backend, comm) = (self.backend, self.comm);
        let generation = &mut self.generation;
        let Kind::Tree {
            shape,
            plan,
            partials,
            local,
            merge,
            ..
        } = &mut self.kind
        else {
            return Err(EngineError::Config(
                "the ring replans with a new RankAttention, one plan per shard".into(),
            ));
        };
        if !backend.replan(shape, plan, new)? {
            let queries = new.num_queries();
            let merged = merge.is_some();
            (*partials, *local, *merge) =
                tree_buffers(backend, comm, shape, plan, queries, merged)?;
            *generation = next_generation();
        }
        Ok(())
    }

    /// Attention of `q` over `kv` (this rank's storage, laid out as the plans say), merged
    /// over every rank: each rank gets the same states, in the backend's memory.
    pub fn attend(&mut self, kv: &B::Kv, q: &B::Queries) -> Result<&B::States> {
        Ok(self.attend_with(kv, q, None)?.0)
    }

    /// [`RankAttention::attend`], with the tree's cross-rank merge timed on the host clock:
    /// once stage 1 has run on this backend, `settle` runs (the caller's barrier, so that no
    /// rank's clock counts a slower peer's earlier work), then the merge, which is complete on
    /// the backend and the transport before the clock stops. The waits take from the step the
    /// overlap of the host's launches with the device's work, so a caller times only some
    /// steps. Gives the merge's seconds; `None` for the ring, which has no merge.
    pub fn attend_timed(
        &mut self,
        kv: &B::Kv,
        q: &B::Queries,
        settle: &dyn Fn() -> Result<()>,
    ) -> Result<(&B::States, Option<f64>)> {
        self.attend_with(kv, q, Some(settle))
    }

    /// The tree's [`RankAttention::attend`] with `own` folded in and no cross-rank merge:
    /// this rank's states of `q` over its keys, `own` holding its states of the same queries
    /// over keys the plan leaves out (a prompt chunk's own keys, which each rank holds a part
    /// of). The caller merges them across the ranks as it needs them: a prefill pass's rank
    /// needs only its own rows ([`crate::StatesMerge::run_scattered`]). The ring, whose ranks
    /// each end with the whole context's states, refuses.
    pub fn attend_local(
        &mut self,
        kv: &B::Kv,
        q: &B::Queries,
        own: &B::States,
    ) -> Result<&B::States> {
        let backend = self.backend;
        let Kind::Tree {
            plan,
            partials,
            local,
            ..
        } = &mut self.kind
        else {
            return Err(EngineError::Config(
                "the ring has no rank-local states to fold a rank's own states into".into(),
            ));
        };
        stage_step(backend, self.poison, kv, q, plan, partials, local)?;
        backend.merge_into(local, own)?;
        Ok(local)
    }

    fn attend_with(
        &mut self,
        kv: &B::Kv,
        q: &B::Queries,
        settle: Option<&dyn Fn() -> Result<()>>,
    ) -> Result<(&B::States, Option<f64>)> {
        let (backend, comm, poison) = (self.backend, self.comm, self.poison);
        let run = |kv: &B::Kv, plan: &B::Plan, partials: &mut B::States, out: &mut B::States| {
            stage_step(backend, poison, kv, q, plan, partials, out)
        };
        match &mut self.kind {
            Kind::Tree {
                how,
                layout,
                plan,
                partials,
                local,
                merge,
                ..
            } => {
                if merge.is_none() && comm.size() > 1 {
                    return Err(EngineError::Config(
                        "this tree attention leaves its merge to its caller: use attend_local"
                            .into(),
                    ));
                }
                run(kv, plan, partials, local)?;
                // One rank has nothing to merge.
                let Some(merge) = merge.as_mut() else {
                    return Ok((local, settle.map(|_| 0.0)));
                };
                let Some(settle) = settle else {
                    merge.run(backend, comm, local, *how, layout)?;
                    return Ok((local, None));
                };
                backend.synchronize()?;
                settle()?;
                let t0 = Instant::now();
                merge.run(backend, comm, local, *how, layout)?;
                comm.wait(backend)?;
                backend.synchronize()?;
                Ok((local, Some(t0.elapsed().as_secs_f64())))
            }
            Kind::Ring {
                shards,
                plans,
                partials,
                locals,
                acc,
                bufs,
            } => {
                let (rank, p) = (comm.rank(), comm.size());
                for s in 0..p {
                    let src = (rank + p - s) % p; // whose shard this rank holds at step s
                    let from = (src + p - 1) % p; // and receives for the next
                    let (cur, spare) = ring_buffers(s, kv, bufs);
                    let last = s + 1 == p;
                    if !last {
                        let (out_tokens, in_tokens) = (shards[src].tokens, shards[from].tokens);
                        comm.start_kv_exchange(backend, cur, out_tokens, spare, in_tokens)?;
                    }
                    let out = match src {
                        0 => &mut *acc,
                        _ => &mut locals[src - 1],
                    };
                    run(cur, &plans[src], &mut partials[src], out)?;
                    if !last {
                        comm.finish_kv_exchange(backend, spare, shards[from].tokens)?;
                    }
                }
                for local in locals.iter() {
                    backend.merge_into(acc, local)?;
                }
                Ok((acc, None))
            }
        }
    }
}

impl<B: LayerOps, C: Transport<B>> RankAttention<'_, B, C> {
    /// [`RankAttention::attend`], whose last kernel also writes the attention's output into
    /// `out` where the backend can ([`LayerOps::step_output`]): one rank's tree, whose step
    /// ends with this rank's merge. Returns the states and whether `out` was written (if not,
    /// the caller converts the states).
    pub fn attend_output(
        &mut self,
        kv: &B::Kv,
        q: &B::Queries,
        out: &mut B::Tensor,
    ) -> Result<(&B::States, bool)> {
        let (backend, poison) = (self.backend, self.poison);
        let written = match &mut self.kind {
            Kind::Tree {
                plan,
                partials,
                local,
                ..
            } if self.comm.size() == 1 => {
                if poison {
                    backend.poison(partials)?;
                    backend.poison(local)?;
                }
                Some(backend.step_output(kv, q, plan, partials, local, out)?)
            }
            _ => None,
        };
        match written {
            Some(written) => Ok((self.states(), written)),
            None => Ok((self.attend(kv, q)?, false)),
        }
    }
}

/// A rank's stages 1 and 2 of `q` over `kv` by `plan` into `out`, its partials and output
/// poisoned first where asked (so that a value no stage wrote shows).
fn stage_step<B: MergeOps>(
    backend: &B,
    poison: bool,
    kv: &B::Kv,
    q: &B::Queries,
    plan: &B::Plan,
    partials: &mut B::States,
    out: &mut B::States,
) -> Result<()> {
    if poison {
        backend.poison(partials)?;
        backend.poison(out)?;
    }
    backend.step(kv, q, plan, partials, out)
}

/// A tree's partials, its rank's states and its merge's buffers (if it merges).
type TreeBuffers<B> = (
    <B as crate::Backend>::States,
    <B as crate::Backend>::States,
    Option<StatesMerge<B>>,
);

/// The tree's step buffers for an uploaded `plan` of `queries` queries: its partials, the
/// rank's merged states and, where it `merged` them itself, the cross-rank merge's.
fn tree_buffers<B: MergeOps, C: Transport<B>>(
    backend: &B,
    comm: &C,
    shape: &AttnShape,
    plan: &B::Plan,
    queries: usize,
    merged: bool,
) -> Result<TreeBuffers<B>> {
    let (cells, d, ranks) = (queries * shape.q_heads, shape.head_dim, comm.size());
    Ok((
        backend.alloc_partials(shape, plan)?,
        backend.alloc_states(shape, queries)?,
        merged
            .then(|| StatesMerge::new(backend, cells, d, ranks))
            .transpose()?,
    ))
}

/// The ring's double buffering at step `s`: the shard computed on (`own` at step 0, then the
/// buffer received into at the previous step) and the buffer the next shard is received into.
pub fn ring_buffers<'a, K>(s: usize, own: &'a K, bufs: &'a mut [K; 2]) -> (&'a K, &'a mut K) {
    let [a, b] = bufs;
    match s {
        0 => (own, a),
        _ if s % 2 == 1 => (&*a, b),
        _ => (&*b, a),
    }
}

#[cfg(test)]
mod tests {
    use super::{RankAttention, RingShard};
    use crate::strategy::{rank_main, Problem, RunConfig, Strategy};
    use crate::{CpuBackend, MergeCollective, NodeLayout};
    use canopy_comm::ThreadWorld;
    use canopy_core::{
        plan, random_tree, AttnShape, DType, KvTree, Method, Plan, PlannerConfig, Shard, TreeView,
    };
    use std::time::Duration;

    /// `method`'s plan of the whole of `tree`.
    fn whole_plan(tree: &KvTree, method: Method, shape: &AttnShape) -> Plan {
        let shard = Shard::whole(tree);
        let view = TreeView::new(tree, &shard);
        plan(&view, method, shape, &PlannerConfig::default()).unwrap()
    }

    /// A step runs inside a recorded graph only where nothing in it leaves the backend's
    /// stream: one rank's step, never the tree's merge over a host transport nor the ring's
    /// hand-offs at several ranks.
    #[test]
    fn only_steps_that_stay_on_the_stream_are_recordable() {
        let shape = AttnShape::new(4, 2, 64).unwrap();
        let tree = random_tree(5, 6, 30);
        let host_plan = whole_plan(&tree, Method::QGuided, &shape);
        let tokens = tree.total_tokens() as usize;
        for ranks in [1, 2] {
            let recordable = ThreadWorld::run(ranks, Duration::from_secs(60), |comm| {
                let b = &CpuBackend;
                let tree = RankAttention::tree(
                    b,
                    &comm,
                    shape,
                    &host_plan,
                    MergeCollective::Allgather,
                    NodeLayout::single(ranks),
                )?;
                let shards = (0..ranks)
                    .map(|_| RingShard {
                        plan: host_plan.clone(),
                        tokens,
                    })
                    .collect();
                let ring = RankAttention::ring(b, &comm, shape, DType::F32, shards)?;
                Ok::<_, crate::EngineError>((tree.recordable(), ring.recordable()))
            });
            for r in recordable {
                assert_eq!(r.unwrap(), (ranks == 1, ranks == 1), "{ranks} rank(s)");
            }
        }
    }

    /// A tree left to its caller's merge attends alone on one rank, and on two gives the
    /// rank-local states (with the own states folded in) but refuses to attend merged.
    #[test]
    fn a_local_tree_leaves_its_merge_to_its_caller() {
        use crate::backend::Backend;
        let shape = AttnShape::new(4, 2, 64).unwrap();
        let tree = random_tree(3, 5, 30);
        let planned = whole_plan(&tree, Method::Auto, &shape);
        let problem = Problem::random(tree.clone(), shape, DType::F32, 4);
        let queries = planned.num_queries();
        for ranks in [1, 2] {
            let out = ThreadWorld::run(ranks, Duration::from_secs(60), |comm| {
                let b = &CpuBackend;
                let mut kv = b.alloc_kv(&shape, DType::F32, tree.total_tokens() as usize)?;
                b.write_kv(&mut kv, 0, &problem.data.k, &problem.data.v)?;
                let q = b.upload_queries(&shape, &problem.data.q)?;
                let mut local = RankAttention::local(b, &comm, shape, &planned)?;
                assert_eq!(local.merge(), None);
                let attended = local.attend(&kv, &q).cloned();
                let empty = b.alloc_states(&shape, queries)?;
                let folded = local.attend_local(&kv, &q, &empty)?.clone();
                Ok::<_, crate::EngineError>((attended, folded))
            });
            for r in out {
                let (attended, folded) = r.unwrap();
                match ranks {
                    1 => assert_eq!(attended.unwrap(), folded),
                    _ => assert!(attended.is_err(), "{ranks} ranks attended merged"),
                }
            }
        }
    }

    /// A tree's replan, to a tree of other rows or the same, attends as attention built on the
    /// new plan does; the ring's replan is refused.
    #[test]
    fn a_replan_attends_as_a_fresh_plan_does() {
        use crate::backend::Backend;
        let shape = AttnShape::new(4, 2, 64).unwrap();
        let b = &CpuBackend;
        let planned = |tree: &KvTree| whole_plan(tree, Method::Auto, &shape);
        let (before, after) = (random_tree(7, 5, 30), random_tree(8, 5, 30));
        let more_rows = random_tree(9, 7, 30);
        let attended = ThreadWorld::run(1, Duration::from_secs(60), |comm| {
            let mut outs = Vec::new();
            for tree in [&after, &more_rows] {
                let problem = Problem::random(tree.clone(), shape, DType::F32, 5);
                let mut kv = b.alloc_kv(&shape, DType::F32, tree.total_tokens() as usize)?;
                b.write_kv(&mut kv, 0, &problem.data.k, &problem.data.v)?;
                let q = b.upload_queries(&shape, &problem.data.q)?;
                let tree_of = |p: &canopy_core::Plan| {
                    let single = NodeLayout::single(1);
                    RankAttention::tree(b, &comm, shape, p, MergeCollective::Allgather, single)
                };
                let mut replanned = tree_of(&planned(&before))?.with_poison(true);
                replanned.replan(&planned(tree))?;
                let mut fresh = tree_of(&planned(tree))?;
                let got = b.download(replanned.attend(&kv, &q)?)?;
                outs.push((got, b.download(fresh.attend(&kv, &q)?)?));
            }
            let shards = vec![RingShard {
                plan: planned(&before),
                tokens: before.total_tokens() as usize,
            }];
            let mut ring = RankAttention::ring(b, &comm, shape, DType::F32, shards)?;
            let refused = ring.replan(&planned(&after)).is_err();
            Ok::<_, crate::EngineError>((outs, refused))
        });
        let (outs, refused) = attended.into_iter().next().unwrap().unwrap();
        assert!(refused, "the ring's replan must be refused");
        for (got, want) in outs {
            assert_eq!(got.o, want.o);
            assert_eq!(got.lse, want.lse);
        }
    }

    /// Every rank ends a step with the same bits, whichever order the shards pass it in.
    #[test]
    fn every_rank_ends_with_the_same_bits() {
        let shape = AttnShape::new(4, 2, 64).unwrap();
        let problem = Problem::random(random_tree(3, 9, 40), shape, DType::F32, 3);
        let ranks = 4;
        for strategy in [
            Strategy::Ring,
            Strategy::Tree(MergeCollective::Allreduce3),
            Strategy::Tree(MergeCollective::Hierarchical),
        ] {
            let cfg = RunConfig {
                ranks,
                strategy,
                method: Method::Auto,
                planner: PlannerConfig::default(),
                warmup: 0,
                iters: 1,
                cache: crate::Cache::Warm,
                timeout: Duration::from_secs(60),
                poison: true,
                virtual_nodes: Some(2),
                stall_rank: None,
            };
            let outs: Vec<_> = ThreadWorld::run(ranks, cfg.timeout, |comm| {
                rank_main(&problem, &cfg, &CpuBackend, &comm)
            })
            .into_iter()
            .map(|r| r.expect("the rank ran").output)
            .collect();
            for out in &outs[1..] {
                assert_eq!(out.o, outs[0].o, "{strategy:?}");
                assert_eq!(out.lse, outs[0].lse, "{strategy:?}");
            }
        }
    }
}
