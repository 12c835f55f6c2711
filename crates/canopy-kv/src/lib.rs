//! # canopy-kv
//!
//! The logical bookkeeping of a paged KV cache, apart from the device memory that holds it and
//! from the attention that reads it.

pub mod paged;

pub use paged::{PagedNode, PagedTree, Snapshot};
