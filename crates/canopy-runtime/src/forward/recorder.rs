//! When a decode pass is recorded, and which recordings are kept.
//!
//! A recording is made for a step shape (its rows and how its logits are narrowed) and is
//! valid for one [`PassKey`]. One is kept for each shape whose logits tensors
//! [`crate::Forward`] keeps (the last [`KEPT_PASSES`]), so a serving batch that moves between
//! a few batch sizes replays each size's recording when it comes back to it, rather than
//! recording again.
//!
//! Recording costs a few steps' host time, so a shape is recorded once [`Recorder`]'s
//! patience of like steps ran op by op in a row. A recording whose own step changed (another
//! plan's buffers, other stores) weighs in the patience: dropped before it paid for itself
//! (steps whose rows or layout keep changing), it doubles the patience; one that paid halves
//! it. Recordings dropped because the backend's buffers moved, or because their shape's
//! tensors were let go, leave it as it is.

/// Step shapes whose logits tensors and recordings [`crate::Forward`] keeps at once.
pub(crate) const KEPT_PASSES: usize = 4;

/// What a decode loop keeps for each of the last [`KEPT_PASSES`] step shapes (a pass's logits
/// tensors, a batch size's attention), the current one last: a shape that comes back finds
/// its values, and so its recording, as it left them.
pub(crate) struct Kept<K, V> {
    entries: Vec<(K, V)>,
}

impl<K: PartialEq, V> Kept<K, V> {
    pub fn new() -> Kept<K, V> {
        Kept {
            entries: Vec::new(),
        }
    }

    /// The value kept for `key`, taken out to be used and [`Kept::push`]ed back.
    pub fn take(&mut self, key: &K) -> Option<V> {
        let i = self.entries.iter().position(|(k, _)| k == key)?;
        Some(self.entries.remove(i).1)
    }

    /// Room for a new value: the least recently used entry, given back to be let go before
    /// the new one is made, where [`KEPT_PASSES`] are kept.
    pub fn make_room(&mut self) -> Option<(K, V)> {
        (self.entries.len() >= KEPT_PASSES).then(|| self.entries.remove(0))
    }

    /// `value` kept for `key`, as the current one.
    pub fn push(&mut self, key: K, value: V) {
        self.entries.push((key, value));
    }

    /// The current key and value.
    pub fn last(&self) -> Option<(&K, &V)> {
        self.entries.last().map(|(k, v)| (k, v))
    }

    pub fn last_mut(&mut self) -> Option<(&K, &mut V)> {
        self.entries.last_mut().map(|(k, v)| (&*k, v))
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }
}
/// Replays a recording must reach to pay for itself (recording one costs a few steps).
const PAYBACK_REPLAYS: usize = 4;
/// The most like steps [`Recorder`] waits for before recording.
const MOST_PATIENCE: usize = 64;

/// What a step's logits are laid out as: its rows, and the columns a row is narrowed to (twice
/// its reach; 0: whole rows). A recording writes the logits tensors of its shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PassShape {
    pub rows: usize,
    pub narrowed: usize,
}

/// What a recorded pass is valid for: every other input is staged, or is a buffer of the
/// backend's epoch or of the attention's generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PassKey {
    pub shape: PassShape,
    pub epoch: u64,
    pub attention: u64,
    pub stores: usize,
}

/// What a rank does with a step; ranks that record together do the largest of their votes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Vote {
    Replay = 0,
    Record = 1,
    Eager = 2,
}

impl Vote {
    pub fn from_u8(v: u8) -> Vote {
        match v {
            0 => Vote::Replay,
            1 => Vote::Record,
            _ => Vote::Eager,
        }
    }
}

struct Recorded<G> {
    key: PassKey,
    graph: G,
    replays: usize,
}

/// When to record, and what was recorded: at most one recording a kept shape.
pub(super) struct Recorder<G> {
    recorded: Vec<Recorded<G>>,
    /// The last step run op by op, and how many like it ran op by op in a row before it.
    eager: Option<(PassKey, usize)>,
    /// Like steps run op by op in a row before the next is recorded.
    patience: usize,
    replayed: usize,
}

impl<G> Recorder<G> {
    pub fn new() -> Recorder<G> {
        Recorder {
            recorded: Vec::new(),
            eager: None,
            patience: 1,
            replayed: 0,
        }
    }

    /// Steps replayed so far.
    pub fn replayed(&self) -> usize {
        self.replayed
    }

    /// The recording of `shape`, if one is kept.
    fn of(&self, shape: PassShape) -> Option<&Recorded<G>> {
        self.recorded.iter().find(|r| r.key.shape == shape)
    }

    /// The graph recorded for `key`, if it is the one kept for its shape.
    pub fn graph(&self, key: PassKey) -> Option<&G> {
        self.of(key.shape)
            .filter(|r| r.key == key)
            .map(|r| &r.graph)
    }

    /// The patience once `dropped` is dropped: doubled if it did not pay for itself, else
    /// halved.
    fn patience_after(&self, dropped: Option<&Recorded<G>>) -> usize {
        match dropped {
            Some(r) if r.replays < PAYBACK_REPLAYS => (self.patience * 2).min(MOST_PATIENCE),
            Some(_) => (self.patience / 2).max(1),
            None => self.patience,
        }
    }

    /// The recording the step of `key` drops that weighs in the patience: its shape's, if it
    /// is not the step's own and read the same epoch's buffers (buffers made anew, a pool or a
    /// page table, are no sign of steps that keep changing).
    fn weighed(&self, key: PassKey) -> Option<&Recorded<G>> {
        self.of(key.shape)
            .filter(|r| r.key != key && r.key.epoch == key.epoch)
    }

    /// Drops the recording of `shape`, whose logits tensors are no longer kept. A shape that
    /// has gone says nothing of whether recording pays: the patience stays.
    pub fn forget(&mut self, shape: PassShape) {
        self.recorded.retain(|r| r.key.shape != shape);
    }

    /// What this rank would do with the step of `key`: replay the recording made for it,
    /// record it (it has run op by op `patience` times in a row), or run it op by op.
    pub fn vote(&self, key: PassKey) -> Vote {
        let stale = self.of(key.shape);
        if stale.is_some_and(|r| r.key == key) {
            return Vote::Replay;
        }
        // Dropping its shape's recording forgets the steps run op by op before it.
        let like = match (stale, self.eager) {
            (None, Some((k, before))) if k == key => before + 1,
            _ => 0,
        };
        if like >= self.patience_after(self.weighed(key)) {
            Vote::Record
        } else {
            Vote::Eager
        }
    }

    /// Notes that the step of `key`, not a recorded one, is recorded or run op by op. Its
    /// shape's recording is stale, as is every one of another epoch: the backend's buffers
    /// they read are gone.
    fn passes(&mut self, key: PassKey) {
        if self.of(key.shape).is_some() {
            self.patience = self.patience_after(self.weighed(key));
            self.forget(key.shape);
            self.eager = None;
        }
        self.recorded.retain(|r| r.key.epoch == key.epoch);
        let like = match self.eager {
            Some((k, before)) if k == key => before + 1,
            _ => 0,
        };
        self.eager = Some((key, like));
    }

    /// Takes the step of `key` (`None`: not recordable here) the way the ranks agreed, given
    /// this rank's own vote, and says what this rank does: replay, record, or run op by op. A
    /// rank whose recording still holds keeps it through a step the others run op by op.
    pub fn follow(&mut self, key: Option<PassKey>, mine: Vote, agreed: Vote) -> Vote {
        match (key, agreed) {
            (Some(key), Vote::Replay) => {
                if let Some(r) = self.recorded.iter_mut().find(|r| r.key == key) {
                    r.replays += 1;
                    self.replayed += 1;
                }
                Vote::Replay
            }
            (Some(key), Vote::Record) => {
                self.passes(key);
                Vote::Record
            }
            (key, _) => {
                if let Some(key) = key.filter(|_| mine != Vote::Replay) {
                    self.passes(key);
                }
                Vote::Eager
            }
        }
    }

    /// Keeps `graph`, recorded for the step of `key` (which [`Recorder::follow`] said to
    /// record).
    pub fn keep(&mut self, key: PassKey, graph: G) {
        self.recorded.push(Recorded {
            key,
            graph,
            replays: 0,
        });
    }

    /// Whether the step of `key`, not a recorded one, is to be recorded (else run op by op).
    #[cfg(test)]
    fn records(&mut self, key: PassKey) -> bool {
        let vote = self.vote(key);
        self.passes(key);
        vote == Vote::Record
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The least recently used entry makes room; one taken and pushed back is the newest.
    #[test]
    fn kept_values_make_room_least_recently_used_first() {
        let mut kept = Kept::new();
        for size in 1..=KEPT_PASSES {
            assert!(kept.make_room().is_none(), "{size} fits");
            kept.push(size, size * 10);
        }
        let first = kept.take(&1).expect("kept");
        kept.push(1, first);
        assert_eq!(kept.last(), Some((&1, &10)));
        assert_eq!(kept.make_room(), Some((2, 20)), "size 2 is now the oldest");
        assert!(kept.take(&2).is_none());
        kept.clear();
        assert!(kept.last().is_none());
    }

    fn shaped(rows: usize, epoch: u64) -> PassKey {
        PassKey {
            shape: PassShape { rows, narrowed: 0 },
            epoch,
            attention: rows as u64,
            stores: rows,
        }
    }

    /// A one-row step of the attention of `generation`.
    fn key(generation: u64) -> PassKey {
        PassKey {
            attention: generation,
            ..shaped(1, 0)
        }
    }

    /// Runs `steps` like steps of `key`: each replays its recording, or records, or runs op by
    /// op. Returns how many were recorded.
    fn steps(r: &mut Recorder<()>, key: PassKey, steps: usize) -> usize {
        let mut recorded = 0;
        for _ in 0..steps {
            if let Some(rec) = r.recorded.iter_mut().find(|rec| rec.key == key) {
                rec.replays += 1;
            } else if r.records(key) {
                r.keep(key, ());
                recorded += 1;
            }
        }
        recorded
    }

    #[test]
    fn a_step_seen_twice_is_recorded_then_replayed() {
        let mut r = Recorder::<()>::new();
        assert!(!r.records(key(0)), "a first sighting runs op by op");
        assert!(r.records(key(0)), "a second is recorded");
        assert!(!r.records(key(1)), "another plan's buffers start over");
        assert!(r.records(key(1)));
        assert!(!r.records(shaped(1, 1)), "so does a new epoch");
    }

    /// Steps that move between batch sizes replay each size's recording when they come back
    /// to it; a new epoch leaves none.
    #[test]
    fn each_shape_keeps_its_recording() {
        let mut r = Recorder::<()>::new();
        for rows in [56, 64] {
            assert_eq!(steps(&mut r, shaped(rows, 0), 2), 1);
        }
        for rows in [56, 64, 56, 64] {
            assert_eq!(r.vote(shaped(rows, 0)), Vote::Replay, "{rows} rows");
            r.follow(Some(shaped(rows, 0)), Vote::Replay, Vote::Replay);
        }
        assert_eq!(r.replayed(), 4);
        assert!(r.graph(shaped(56, 0)).is_some());
        // 56 rows of another attention: 56's recording is stale, 64's holds.
        let other = PassKey {
            attention: 7,
            ..shaped(56, 0)
        };
        assert_eq!(
            r.vote(other),
            Vote::Eager,
            "its shape's recording is dropped first"
        );
        r.follow(Some(other), Vote::Eager, Vote::Eager);
        assert!(r.graph(shaped(56, 0)).is_none());
        assert!(r.graph(shaped(64, 0)).is_some());
        assert_eq!(r.patience, 2, "56's recording did not pay");
        r.forget(shaped(64, 0).shape);
        assert!(r.graph(shaped(64, 0)).is_none(), "its tensors were let go");
        assert_eq!(r.patience, 2, "a shape let go weighs nothing");
        assert_eq!(steps(&mut r, shaped(64, 0), 3), 1);
        steps(&mut r, shaped(8, 1), 1);
        assert_eq!(r.patience, 2, "nor does a new epoch");
        assert!(
            r.recorded.is_empty(),
            "every recording read the old epoch's buffers"
        );
    }

    #[test]
    fn a_rank_keeps_its_recording_through_a_step_the_others_run_op_by_op() {
        let mut r = Recorder::<()>::new();
        assert_eq!(
            r.follow(Some(key(0)), Vote::Eager, Vote::Eager),
            Vote::Eager
        );
        assert_eq!(r.vote(key(0)), Vote::Record, "seen once: recorded next");
        // Another rank is not ready: every rank runs the step op by op.
        assert_eq!(
            r.follow(Some(key(0)), Vote::Record, Vote::Eager),
            Vote::Eager
        );
        assert_eq!(
            r.follow(Some(key(0)), Vote::Record, Vote::Record),
            Vote::Record
        );
        r.keep(key(0), ());
        assert_eq!(r.vote(key(0)), Vote::Replay);
        // Another rank's step changed: this one keeps its recording, and replays next time.
        assert_eq!(
            r.follow(Some(key(0)), Vote::Replay, Vote::Eager),
            Vote::Eager
        );
        assert_eq!(r.vote(key(0)), Vote::Replay);
        assert_eq!(
            r.follow(Some(key(0)), Vote::Replay, Vote::Replay),
            Vote::Replay
        );
        assert_eq!(r.replayed(), 1);
        // Another rank records anew: so does this one, dropping its recording.
        assert_eq!(
            r.follow(Some(key(0)), Vote::Replay, Vote::Record),
            Vote::Record
        );
        assert!(r.recorded.is_empty());
        // A rank with nothing to record runs op by op whatever the others vote.
        assert_eq!(r.follow(None, Vote::Eager, Vote::Eager), Vote::Eager);
    }

    #[test]
    fn the_largest_vote_is_the_most_cautious() {
        assert!(Vote::Replay < Vote::Record && Vote::Record < Vote::Eager);
        for v in [Vote::Replay, Vote::Record, Vote::Eager] {
            assert_eq!(Vote::from_u8(v as u8), v);
        }
    }

    #[test]
    fn patience_doubles_when_recordings_do_not_pay_and_halves_when_they_do() {
        let mut r = Recorder::<()>::new();
        // Steps that change every third step: each recording replays once, never paying.
        for generation in 0..3 {
            steps(&mut r, key(generation), 3);
        }
        assert_eq!(r.patience, 4, "two unpaid recordings: 1 → 2 → 4");
        assert_eq!(
            steps(&mut r, key(3), 4),
            0,
            "four like steps are not enough now"
        );
        assert_eq!(steps(&mut r, key(3), 1), 1, "the fifth is recorded");
        // A long run pays: the patience halves when it ends.
        steps(&mut r, key(3), PAYBACK_REPLAYS);
        steps(&mut r, key(4), 1);
        assert_eq!(r.patience, 2);
        // Unpaid recordings double it up to its bound: each run records, then replays once.
        for generation in 5..20 {
            // The first step drops the last generation's recording, which replayed once.
            let n = (r.patience * 2).min(MOST_PATIENCE) + 2;
            assert_eq!(
                steps(&mut r, key(generation), n),
                1,
                "generation {generation}, patience {}",
                r.patience
            );
        }
        assert_eq!(r.patience, MOST_PATIENCE);
    }
}
