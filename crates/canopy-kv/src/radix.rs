//! A radix prefix cache over pages: token sequences whose KV is kept after their requests end,
//! so that a later request with the same prefix (a system prompt, few-shot examples, a long
//! document, earlier turns) reads those pages instead of computing them again.
//!
//! The cache is the [`KvManager`]'s tree itself: every node it indexes is a manager node whose
//! pages hold the node's tokens, and the index maps `(parent, first page's tokens)` to the
//! child, as a radix tree keyed by pages. Sharing is page-granular: a node's tokens are whole
//! pages, so a request shares a prefix in whole pages and computes the rest (at least its last
//! token, whose logits it needs) in nodes of its own ([`PrefixCache::fork`]), forked from the
//! deepest node it matched. A match that ends inside a node splits it
//! ([`KvManager::split`]), so the shared part becomes a node of its own.
//!
//! **References.** A request holds a lease on the deepest node it matched: one reference on
//! that node and on each of its ancestors. Nodes with references are never evicted, and a
//! request's own nodes hang below its lease, so no page a request reads is freed while it
//! runs. When its prompt is computed, a request offers its node to the cache
//! ([`PrefixCache::insert`]); the lease moves down onto the indexed part.
//!
//! **Eviction.** Pages are taken from the pools as requests need them; when a pool runs out,
//! unreferenced indexed leaves are pruned least recently used first (a parent becomes a leaf
//! when its last child goes), until the request's pages fit. Every decision depends only on
//! the calls made, so ranks that make the same calls keep identical caches.

use crate::error::{KvError, Result};
use crate::paged::{KvManager, KvNode};
use crate::placement::Placement;
use std::collections::{BTreeMap, HashMap};

/// The longest cached prefix of a sequence: the deepest node matched (`None`: nothing) and how
/// many tokens the path to it holds. It is the request's lease until
/// [`PrefixCache::release`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefix {
    pub node: Option<KvNode>,
    pub tokens: usize,
}

/// Counters of the cache's work since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Tokens looked up ([`PrefixCache::acquire`]).
    pub queried_tokens: u64,
    /// Of those, tokens found cached.
    pub hit_tokens: u64,
    /// Pages freed by eviction.
    pub evicted_pages: u64,
}

impl CacheStats {
    /// Share of the looked-up tokens found cached (0 before any lookup).
    pub fn hit_rate(&self) -> f64 {
        if self.queried_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.queried_tokens as f64
        }
    }
}

/// Where a run of tokens leaves the cache ([`PrefixCache::deepest_match`]).
struct Match {
    /// The deepest node the tokens cover whole (`None`: not even the first page is cached).
    node: Option<KvNode>,
    /// Tokens from the root to the end of `node`.
    tokens: usize,
    /// The child of `node` whose first pages (at least one) the tokens repeat and then leave.
    inside: Option<(KvNode, usize)>,
}

impl Match {
    /// Tokens the match covers, on pages of `page_size` tokens.
    fn len(&self, page_size: usize) -> usize {
        self.tokens + self.inside.map_or(0, |(_, pages)| pages * page_size)
    }
}

/// One indexed node.
#[derive(Debug, Clone)]
struct Entry {
    /// The node's tokens: whole pages.
    tokens: Vec<u32>,
    /// Leases on this node or below it.
    refs: u32,
    /// The clock when a lease last touched it.
    last_use: u64,
}

/// A [`KvManager`] whose finished prefixes are kept, shared and evicted by use.
#[derive(Debug, Clone)]
pub struct PrefixCache {
    kv: KvManager,
    entries: BTreeMap<KvNode, Entry>,
    /// `(parent, tokens of the child's first page)` → the indexed child.
    index: HashMap<(Option<KvNode>, Vec<u32>), KvNode>,
    clock: u64,
    stats: CacheStats,
}

impl PrefixCache {
    /// A cache over `kv`, which should hold no nodes yet: every node is made through the cache.
    pub fn new(kv: KvManager) -> PrefixCache {
        PrefixCache {
            kv,
            entries: BTreeMap::new(),
            index: HashMap::new(),
            clock: 0,
            stats: CacheStats::default(),
        }
    }

    /// The pages and tree underneath, for snapshots, page lookups and live marks.
    pub fn kv(&self) -> &KvManager {
        &self.kv
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Marks whether a decode query sits on `node` (see [`KvManager::set_live`]).
    pub fn set_live(&mut self, node: KvNode, live: bool) -> Result<()> {
        self.kv.set_live(node, live)
    }

    /// Pages held by indexed nodes that no lease references: what eviction can free.
    pub fn evictable_pages(&self) -> usize {
        self.entries
            .iter()
            .filter(|(_, e)| e.refs == 0)
            .map(|(&n, _)| self.kv.pages(n).map_or(0, <[_]>::len))
            .sum()
    }

    /// Pages a request could take now: the free ones and the evictable ones.
    pub fn available_pages(&self) -> usize {
        self.kv.pages_free() + self.evictable_pages()
    }

    /// Indexed nodes (cached prefixes), referenced or not.
    pub fn cached_nodes(&self) -> usize {
        self.entries.len()
    }

    /// References on indexed node `node` (`None`: not indexed).
    pub fn refs(&self, node: KvNode) -> Option<u32> {
        self.entries.get(&node).map(|e| e.refs)
    }

    /// How many leading tokens of `tokens` [`acquire`](Self::acquire) would find cached now,
    /// without taking a lease: what a scheduler prices a request's pages by.
    pub fn cached_len(&self, tokens: &[u32]) -> usize {
        self.deepest_match(tokens).len(self.kv.page_size() as usize)
    }

    /// How far `tokens` runs along the cache in whole pages: the deepest node it covers
    /// whole and the tokens up to its end, and the child where the match ends inside one,
    /// with the pages of it matched. [`cached_len`](Self::cached_len) reads it and
    /// [`acquire`](Self::acquire) splits that child there.
    fn deepest_match(&self, tokens: &[u32]) -> Match {
        let ps = self.kv.page_size() as usize;
        let mut m = Match {
            node: None,
            tokens: 0,
            inside: None,
        };
        while let Some(page) = tokens.get(m.tokens..m.tokens + ps) {
            let Some(&child) = self.index.get(&(m.node, page.to_vec())) else {
                break;
            };
            let cached = &self.entries[&child].tokens;
            let same = Self::same_pages(cached, &tokens[m.tokens..], ps);
            if same * ps < cached.len() {
                m.inside = Some((child, same));
                break;
            }
            m.tokens += cached.len();
            m.node = Some(child);
        }
        m
    }

    /// Whole pages at the start of `cached` that `tokens` repeats.
    fn same_pages(cached: &[u32], tokens: &[u32], ps: usize) -> usize {
        cached
            .chunks(ps)
            .zip(tokens.chunks(ps))
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// Finds the longest prefix of `tokens` cached in whole pages, splitting the node where
    /// the match ends inside one, and takes a lease on it. Pass the tokens whose KV may be
    /// reused: a prompt without its last token, whose logits its request needs.
    pub fn acquire(&mut self, tokens: &[u32]) -> Result<Prefix> {
        let m = self.deepest_match(tokens);
        let matched = m.len(self.kv.page_size() as usize);
        let at = match m.inside {
            Some((child, pages)) => Some(self.split(child, pages)?),
            None => m.node,
        };
        self.clock += 1;
        self.walk_up(at, |e, clock| {
            e.refs += 1;
            e.last_use = clock;
        });
        self.stats.queried_tokens += tokens.len() as u64;
        self.stats.hit_tokens += matched as u64;
        Ok(Prefix {
            node: at,
            tokens: matched,
        })
    }

    /// Ends a lease taken by [`acquire`](Self::acquire) or moved by
    /// [`insert`](Self::insert).
    pub fn release(&mut self, lease: Option<KvNode>) {
        self.walk_up(lease, |e, _| e.refs = e.refs.saturating_sub(1));
    }

    /// `f` on `node` and every indexed ancestor.
    fn walk_up(&mut self, mut node: Option<KvNode>, f: impl Fn(&mut Entry, u64)) {
        while let Some(n) = node {
            let Some(e) = self.entries.get_mut(&n) else {
                break;
            };
            f(e, self.clock);
            node = self.kv.parent(n).ok().flatten();
        }
    }

    /// Splits indexed `node` after `pages` pages; the new head takes its place in the index
    /// and its references.
    fn split(&mut self, node: KvNode, pages: usize) -> Result<KvNode> {
        let ps = self.kv.page_size() as usize;
        let head = self.kv.split(node, pages as u32)?;
        let parent = self.kv.parent(head)?;
        let e = self.entries.get_mut(&node).expect("an indexed node");
        let tail = e.tokens.split_off(pages * ps);
        let head_entry = Entry {
            tokens: std::mem::replace(&mut e.tokens, tail),
            refs: e.refs,
            last_use: e.last_use,
        };
        self.index
            .insert((parent, head_entry.tokens[..ps].to_vec()), head);
        self.index
            .insert((Some(head), e.tokens[..ps].to_vec()), node);
        self.entries.insert(head, head_entry);
        Ok(head)
    }

    /// A new node of `tokens` tokens of a request under `parent` (its lease, or a node of its
    /// own), evicting cached prefixes if the pools lack room.
    pub fn fork(&mut self, parent: Option<KvNode>, tokens: u32) -> Result<KvNode> {
        let ps = self.kv.page_size();
        self.make_room(tokens.div_ceil(ps) as usize);
        match parent {
            Some(p) => self.kv.fork(p, tokens, Placement::Balanced),
            None => self.kv.add_root(tokens, Placement::Balanced),
        }
    }

    /// `tokens` more tokens on a request's leaf `node`, evicting if the pools lack room.
    pub fn append(&mut self, node: KvNode, tokens: u32) -> Result<()> {
        self.make_room(self.kv.pages_to_append(node, tokens)?);
        self.kv.append(node, tokens, Placement::Balanced)
    }

    /// Removes a request's own node (not indexed) and its subtree.
    pub fn prune(&mut self, node: KvNode) -> Result<usize> {
        if self.entries.contains_key(&node) {
            return Err(KvError::Indexed(node));
        }
        self.kv.prune(node)
    }

    /// Offers a request's node, whose KV holds `tokens` and whose parent is its lease, to the
    /// cache: its whole pages become an indexed node (split from a partial last page, which
    /// stays the request's). Returns the request's new lease, the indexed node, or `None`
    /// where nothing was indexed (no whole page, or the same prefix is cached already); the
    /// old lease's references are carried by the new one.
    pub fn insert(&mut self, node: KvNode, tokens: &[u32]) -> Result<Option<KvNode>> {
        let ps = self.kv.page_size() as usize;
        let len = self.kv.len(node)? as usize;
        if len != tokens.len() {
            return Err(KvError::TokenCount {
                node,
                len: len as u32,
                tokens: tokens.len(),
            });
        }
        let parent = self.kv.parent(node)?;
        if parent.is_some_and(|p| !self.entries.contains_key(&p)) {
            return Err(KvError::NotUnderLease(node));
        }
        let whole = len / ps;
        let key = (parent, tokens[..ps.min(len)].to_vec());
        if whole == 0 || self.index.contains_key(&key) {
            return Ok(None);
        }
        let indexed = if whole * ps < len {
            self.kv.split(node, whole as u32)?
        } else {
            node
        };
        self.clock += 1;
        self.index.insert(key, indexed);
        self.entries.insert(
            indexed,
            Entry {
                tokens: tokens[..whole * ps].to_vec(),
                refs: 1,
                last_use: self.clock,
            },
        );
        Ok(Some(indexed))
    }

    /// Evicts unreferenced cached leaves, least recently used first, until `pages` pages are
    /// free or nothing more can go.
    fn make_room(&mut self, pages: usize) {
        while self.kv.pages_free() < pages {
            let victim = self
                .entries
                .iter()
                .filter(|(&n, e)| e.refs == 0 && self.kv.is_leaf(n).unwrap_or(false))
                .min_by_key(|(&n, e)| (e.last_use, n))
                .map(|(&n, _)| n);
            let Some(node) = victim else {
                return;
            };
            let e = self.entries.remove(&node).expect("chosen above");
            let parent = self.kv.parent(node).ok().flatten();
            self.index
                .remove(&(parent, e.tokens[..self.kv.page_size() as usize].to_vec()));
            let freed = self.kv.prune(node).expect("an indexed node exists");
            self.stats.evicted_pages += freed as u64;
        }
    }
}

#[cfg(test)]
#[path = "radix_tests.rs"]
mod tests;
