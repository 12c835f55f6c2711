use canopy_core::CoreError;
use thiserror::Error;

/// Everything that can go wrong while keeping the cache's books.
///
/// A server or a benchmark drives the cache from requests and flags, so each message names
/// the node, rank or size at fault and what to change.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum KvError {
    #[error(
        "a KV cache needs at least one rank and pages of at least one token \
         (asked for {ranks} ranks and pages of {page_size} tokens)"
    )]
    Config { ranks: usize, page_size: u32 },
    #[error("rank {rank} does not exist: the cache has ranks 0 to {}", ranks - 1)]
    NoRank { rank: usize, ranks: usize },
    #[error("node {0} does not exist (or was pruned)")]
    NoNode(u32),
    #[error("node {0} has children; only leaves grow (fork a branch instead)")]
    NotALeaf(u32),
    #[error(
        "node {node} of {len} tokens cannot be split after {pages} pages: a split leaves \
         tokens on both sides"
    )]
    BadSplit { node: u32, pages: u32, len: u32 },
    #[error("node {0} is a cached prefix; only a request's own nodes are pruned by it")]
    Indexed(u32),
    #[error("node {node} holds {len} tokens but {tokens} were given for it")]
    TokenCount { node: u32, len: u32, tokens: usize },
    #[error("node {0} is not a child of a cached prefix; fork it from its request's lease")]
    NotUnderLease(u32),
    #[error("a new node needs at least one token")]
    EmptyNode,
    #[error(
        "rank {rank}'s KV pool is full: {need} more pages needed there, {free} free of its \
         {pages}; prune branches or give each rank more pages"
    )]
    PoolFull {
        rank: usize,
        need: usize,
        free: usize,
        pages: u32,
    },
    #[error(transparent)]
    Core(#[from] CoreError),
}

pub type Result<T, E = KvError> = std::result::Result<T, E>;
