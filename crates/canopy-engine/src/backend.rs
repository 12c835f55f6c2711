//! The backend trait every executor implements (CPU here; CUDA in `canopy-cuda`).
//!
//! The split mirrors a GPU's: data lives in backend-owned buffers (`Kv`, `Queries`, `States`),
//! plans are uploaded once and executed many times into buffers allocated once (no allocation
//! in a decode step), and only [`Backend::download`] brings results back to the host. Stage 1
//! ([`Backend::run_plan`]) writes one partial row per (group, query) of the *uploaded* plan (a
//! backend may re-split groups to fill its processors); stage 2 ([`Backend::merge`]) folds each
//! query's rows in the plan's CSR order, deterministically.

use crate::Result;
use canopy_comm::Collective;
use canopy_core::{AttnShape, AttnStates, DType, Plan, Tail, TypedVec};

/// Untimed runs before [`Backend::time_steps`] starts timing (caches, clocks, lazy set-up).
pub const WARMUP_RUNS: usize = 3;

/// What a timed step finds in the device's caches.
///
/// Back-to-back steps over a small tree find its KV still in L2 (H100: 50 MB), which no decode
/// loop sees: between two steps of one layer run every other layer. `Cold` evicts the caches
/// before each timed step, outside the timed region, by writing over a buffer larger than L2,
/// as Triton's `do_bench` (with which the peers' numbers were taken) does: the step finds L2
/// full of dirty lines, and writes back those it evicts. `ColdClean` evicts by reading such a
/// buffer instead, so that the lines the step finds are clean: the difference between the two
/// is what a step pays (or avoids) for the write-back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Cache {
    #[default]
    Cold,
    ColdClean,
    Warm,
}

impl Cache {
    const ALL: [Cache; 3] = [Cache::Cold, Cache::ColdClean, Cache::Warm];

    /// The name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Cache::Cold => "cold",
            Cache::ColdClean => "cold-clean",
            Cache::Warm => "warm",
        }
    }
}

impl std::str::FromStr for Cache {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Cache, String> {
        Cache::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| format!("cache state {s:?}: use cold, cold-clean or warm"))
    }
}

pub trait Backend: Send + Sync {
    type Kv: Send;
    type Queries: Send;
    type Plan: Send + Sync;
    type States: Send;

    fn name(&self) -> &'static str;
    /// Storage for `tokens` tokens of K and V (`tokens × kv_heads × head_dim` each).
    ///
    /// KV is addressed logically, as plans address it: through the storage's page table when
    /// it has one ([`Backend::set_page_table`]; a paged GPU backend installs a shuffled one at
    /// allocation, to exercise paging), else token `i` is slot `i`. [`Backend::write_kv`] and
    /// the ring's [`Transport::send_kv`](crate::Transport::send_kv) / [`Transport::recv_kv`](crate::Transport::recv_kv) move logical tokens, so a shard
    /// travels in logical order and lands in whatever pages the receiver's table names; only
    /// `LayerOps::store_kv` addresses physical slots, where the KV manager places tokens.
    fn alloc_kv(&self, shape: &AttnShape, dtype: DType, tokens: usize) -> Result<Self::Kv>;
    /// Storage the ring receives shards into and passes them on from ([`Backend::alloc_kv`]'s
    /// logical addressing). Where KV is paged, a backend may make it one contiguous piece, which
    /// a transport moves without gathering or scattering pages. Provided: [`Backend::alloc_kv`].
    fn alloc_ring_kv(&self, shape: &AttnShape, dtype: DType, tokens: usize) -> Result<Self::Kv> {
        self.alloc_kv(shape, dtype, tokens)
    }
    /// The dtype `kv` holds its keys and values in.
    fn kv_dtype(&self, kv: &Self::Kv) -> DType;
    /// Writes `k` and `v` (whole tokens, same dtype) at logical tokens `start..`.
    fn write_kv(&self, kv: &mut Self::Kv, start: usize, k: &TypedVec, v: &TypedVec) -> Result<()>;
    /// Installs a page table on `kv`: logical page `i` is then physical page `table[i]` of the
    /// storage, in pages of `page_size` tokens. A growing tree's snapshot maps its logical
    /// pages onto a pool's shared pages this way, so forks never copy a prefix.
    fn set_page_table(&self, _kv: &mut Self::Kv, _page_size: u32, _table: &[u32]) -> Result<()> {
        Err(crate::EngineError::Backend {
            backend: self.name(),
            message: "this backend does not read KV through page tables".into(),
        })
    }
    /// [`Backend::set_page_table`] of one `table` on every KV of `kvs` (a model's layers, whose
    /// pages lie alike): a backend may move the table to its device once for all of them.
    fn set_page_tables(&self, kvs: &mut [Self::Kv], page_size: u32, table: &[u32]) -> Result<()> {
        kvs.iter_mut()
            .try_for_each(|kv| self.set_page_table(kv, page_size, table))
    }
    /// Query rows, `rows × q_heads × head_dim` fp32 (kernels may read them in the KV dtype).
    fn upload_queries(&self, shape: &AttnShape, q: &[f32]) -> Result<Self::Queries>;
    fn upload_plan(&self, shape: &AttnShape, plan: &Plan) -> Result<Self::Plan>;
    /// Follows nodes that grew in place ([`Plan::extend_tails`]) in an uploaded plan. Its
    /// groups, partial rows and merge stay as they were, so buffers allocated for it stay
    /// valid: a decode step that changed no layout costs this instead of a new plan.
    fn extend_plan(&self, plan: &mut Self::Plan, tails: &[Tail]) -> Result<()>;
    /// Replaces an uploaded plan by `new`. Where `new` fits the plan's buffers and launches
    /// (the same queries, partial rows that the plan's partials hold, and on a GPU arrays and
    /// CTAs within the room its upload made), it is written into the buffers the plan has and
    /// this returns true: every buffer and launch argument a recorded decode pass holds stays
    /// valid, so a replanned step replays that recording instead of making a new one.
    /// Otherwise `new` is uploaded in its place and this returns false: buffers made for the
    /// old plan (its partials) must be made anew.
    fn replan(&self, shape: &AttnShape, plan: &mut Self::Plan, new: &Plan) -> Result<bool>;
    /// Buffers for `rows` states of `shape`.
    fn alloc_states(&self, shape: &AttnShape, rows: usize) -> Result<Self::States>;
    /// Buffers for the uploaded plan's partial rows, and for those of plans written over it
    /// in place ([`Backend::replan`]): a backend may make more rows than the plan has.
    fn alloc_partials(&self, shape: &AttnShape, plan: &Self::Plan) -> Result<Self::States>;
    /// Fills `states` with NaN so that a row a kernel fails to write is caught by a test.
    fn poison(&self, states: &mut Self::States) -> Result<()>;
    /// Stage 1: writes every partial row of the plan (`partials` may have more rows).
    fn run_plan(
        &self,
        kv: &Self::Kv,
        q: &Self::Queries,
        plan: &Self::Plan,
        partials: &mut Self::States,
    ) -> Result<()>;
    /// Stage 2: one state per query into `out` (empty where the query has no keys here).
    fn merge(
        &self,
        partials: &Self::States,
        plan: &Self::Plan,
        out: &mut Self::States,
    ) -> Result<()>;
    /// One decode step: stage 1 into `partials`, then the merge into `out`.
    fn step(
        &self,
        kv: &Self::Kv,
        q: &Self::Queries,
        plan: &Self::Plan,
        partials: &mut Self::States,
        out: &mut Self::States,
    ) -> Result<()> {
        self.run_plan(kv, q, plan, partials)?;
        self.merge(partials, plan, out)
    }
    fn download(&self, states: &Self::States) -> Result<AttnStates>;
    /// Waits until the work enqueued on this backend has run, so that the host clock can time
    /// a part of a step. Provided: nothing to wait for (every call runs to completion).
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    /// Device memory this backend holds now, where it can tell (a benchmark reports the
    /// busiest rank's while its step's buffers live). Provided: not measured.
    fn bytes_in_use(&self) -> Result<Option<u64>> {
        Ok(None)
    }
    /// Milliseconds of each of `iters` runs of `step`, after [`WARMUP_RUNS`] untimed ones. The
    /// default reads the host clock around each run and leaves the CPU's caches as they are; a
    /// device backend times with its own events, without waiting for the device between runs,
    /// and honours `cache`.
    fn time_steps(
        &self,
        iters: usize,
        _cache: Cache,
        step: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Vec<f64>> {
        for _ in 0..WARMUP_RUNS {
            step()?;
        }
        (0..iters)
            .map(|_| {
                let t0 = std::time::Instant::now();
                step()?;
                Ok(t0.elapsed().as_secs_f64() * 1e3)
            })
            .collect()
    }
    /// Sends logical tokens `0..tokens` of `kv` (K then V) to `peer`: the ring's KV hand-off.
    fn send_kv<C: Collective>(
        &self,
        kv: &Self::Kv,
        tokens: usize,
        comm: &C,
        peer: usize,
    ) -> Result<()>;
    /// Receives `tokens` tokens from `peer` into logical tokens `0..tokens` of `kv`.
    fn recv_kv<C: Collective>(
        &self,
        kv: &mut Self::Kv,
        tokens: usize,
        comm: &C,
        peer: usize,
    ) -> Result<()>;
}

/// Rounds in which [`time_round_robin`] splits its runs.
pub const TIMING_ROUNDS: usize = 4;

/// Milliseconds of `runs` runs of each of `steps`, timed round-robin: [`TIMING_ROUNDS`] rounds
/// (fewer where `runs` is smaller), each timing every step in turn for its share of the runs
/// ([`Backend::time_steps`]). A drift of the device's clocks or temperature over the timing
/// then falls on every step alike, where timing one step after another would charge it to
/// whichever came last. Gives each step's times, in the order of `steps`.
pub fn time_round_robin<B: Backend, F: FnMut() -> Result<()>>(
    backend: &B,
    runs: usize,
    cache: Cache,
    steps: &mut [F],
) -> Result<Vec<Vec<f64>>> {
    let rounds = TIMING_ROUNDS.min(runs).max(1);
    let mut times = vec![Vec::with_capacity(runs); steps.len()];
    for round in 0..rounds {
        // The runs split as evenly as they go: the first `runs % rounds` rounds take one more.
        let share = runs / rounds + usize::from(round < runs % rounds);
        for (step, t) in steps.iter_mut().zip(&mut times) {
            t.extend(backend.time_steps(share, cache, step)?);
        }
    }
    Ok(times)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;
    use std::cell::{Cell, RefCell};

    #[test]
    fn cache_states_parse_and_reject_others() {
        assert_eq!("cold".parse::<Cache>(), Ok(Cache::Cold));
        assert_eq!("warm".parse::<Cache>(), Ok(Cache::Warm));
        assert_eq!("cold-clean".parse::<Cache>(), Ok(Cache::ColdClean));
        assert!("hot"
            .parse::<Cache>()
            .unwrap_err()
            .contains("cold, cold-clean or warm"));
        assert_eq!(Cache::default(), Cache::Cold);
    }

    #[test]
    fn round_robin_times_every_step_its_runs_in_turns() {
        let order = RefCell::new(Vec::new());
        let (a, b) = (Cell::new(0), Cell::new(0));
        let mut step_a = || {
            a.set(a.get() + 1);
            order.borrow_mut().push('a');
            Ok(())
        };
        let mut step_b = || {
            b.set(b.get() + 1);
            order.borrow_mut().push('b');
            Ok(())
        };
        let mut steps: [&mut dyn FnMut() -> Result<()>; 2] = [&mut step_a, &mut step_b];
        let times = time_round_robin(&CpuBackend, 10, Cache::Warm, &mut steps).unwrap();
        assert_eq!(times.iter().map(Vec::len).collect::<Vec<_>>(), [10, 10]);
        // Each round's call also runs its warm-up.
        assert_eq!(a.get(), 10 + TIMING_ROUNDS * WARMUP_RUNS);
        assert_eq!(a.get(), b.get());
        let turns = order.borrow().windows(2).filter(|w| w[0] != w[1]).count();
        assert_eq!(turns, 2 * TIMING_ROUNDS - 1, "a then b, round after round");
        let one = time_round_robin(&CpuBackend, 1, Cache::Warm, &mut [step_a]).unwrap();
        assert_eq!(one[0].len(), 1);
    }
}
