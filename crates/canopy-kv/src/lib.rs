//! # canopy-kv
//!
//! The logical bookkeeping of KV across ranks: which tokens exist, in which pages, on which
//! rank, shared by whom. It is apart from the device memory that holds the pages (a backend
//! allocates each rank's pool and reads it through the page tables given here) and from the
//! attention that reads them (the planners and the engine see ordinary [`canopy_core::KvTree`]s).
//!
//! - [`KvManager`] keeps one pool of pages per rank and a tree of token runs over them: every
//!   page belongs to one rank, a node's tokens are a sequence of pages, possibly on several
//!   ranks, forks share their ancestors' pages, and a [`Placement`] says where new pages go.
//! - A [`RankSnapshot`] is what one rank reads in a step: the whole tree's topology and query
//!   order, each node as long as this rank's share of it (possibly empty), on page boundaries,
//!   and the rank's page table. Each rank plans its snapshot with the ordinary planners
//!   (through [`canopy_core::Shard::whole`]); the ranks' partial states merge exactly, since
//!   they attend to disjoint tokens.
//! - [`StepLayout`] is the decode loop's part: after a step's appends it tells each rank
//!   whether its layout moved (plan the new snapshot, install its page table) or only grew in
//!   place (extend the plan by the [`canopy_core::Tail`]s). `canopy bench tree --grow` runs on
//!   it, as a model runtime or a server would.
//! - [`PrefixCache`] keeps finished prefixes in the same tree, a radix tree keyed by pages:
//!   requests that share a prefix share its pages, referenced by leases, and unreferenced
//!   prefixes are evicted least recently used first when the pools run out.

pub mod error;
pub mod paged;
pub mod placement;
pub mod radix;
pub mod step;

pub use error::{KvError, Result};
pub use paged::{CaughtUp, KvManager, KvNode, PageRef, RankSnapshot};
pub use placement::Placement;
pub use radix::{CacheStats, Prefix, PrefixCache};
pub use step::{RankUpdate, StepLayout};
