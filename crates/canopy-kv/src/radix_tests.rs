use super::*;
use crate::PageRef;
use proptest::prelude::*;
use std::collections::HashMap;

const PS: usize = 4;

fn cache(ranks: usize, pages_per_rank: u32) -> PrefixCache {
    PrefixCache::new(KvManager::new(ranks, PS as u32, pages_per_rank).unwrap())
}

/// What the pools hold: each physical page's tokens, as a backend's KV would be written.
#[derive(Default)]
struct Pages(HashMap<PageRef, [Option<u32>; PS]>);

impl Pages {
    /// Writes `tokens` as `node`'s tokens from `from` on.
    fn write(&mut self, kv: &KvManager, node: KvNode, from: usize, tokens: &[u32]) {
        let pages = kv.pages(node).unwrap();
        for (i, &t) in tokens.iter().enumerate() {
            let at = from + i;
            self.0.entry(pages[at / PS]).or_insert([None; PS])[at % PS] = Some(t);
        }
    }

    /// The tokens of the path from the root to `node`, read from the pages.
    fn read_path(&self, kv: &KvManager, node: Option<KvNode>) -> Vec<Option<u32>> {
        let mut path = Vec::new();
        let mut at = node;
        while let Some(n) = at {
            path.push(n);
            at = kv.parent(n).unwrap();
        }
        let mut out = Vec::new();
        for n in path.into_iter().rev() {
            let len = kv.len(n).unwrap() as usize;
            let pages = kv.pages(n).unwrap();
            out.extend((0..len).map(|i| self.0.get(&pages[i / PS]).and_then(|p| p[i % PS])));
        }
        out
    }
}

/// A request as a server runs it: a lease on its cached prefix and a node of its own for the
/// rest of its tokens.
struct Request {
    tokens: Vec<u32>,
    lease: Option<KvNode>,
    own: Option<KvNode>,
}

/// Starts a request for `tokens`: the cached prefix (not the last token), then a node for the
/// rest, written.
fn start(c: &mut PrefixCache, pages: &mut Pages, tokens: &[u32]) -> Result<Request> {
    let peek = c.cached_len(&tokens[..tokens.len() - 1]);
    let prefix = c.acquire(&tokens[..tokens.len() - 1])?;
    assert_eq!(peek, prefix.tokens, "a peek finds what a lease takes");
    let rest = &tokens[prefix.tokens..];
    match c.fork(prefix.node, rest.len() as u32) {
        Ok(own) => {
            pages.write(c.kv(), own, 0, rest);
            Ok(Request {
                tokens: tokens.to_vec(),
                lease: prefix.node,
                own: Some(own),
            })
        }
        Err(e) => {
            c.release(prefix.node);
            Err(e)
        }
    }
}

/// Ends a request, offering its node to the cache when `keep`.
fn finish(c: &mut PrefixCache, r: Request, keep: bool) {
    let mut lease = r.lease;
    if let Some(own) = r.own {
        let cached = lease.map_or(0, |n| path_len(c.kv(), n));
        if keep {
            if let Some(indexed) = c.insert(own, &r.tokens[cached..]).unwrap() {
                lease = Some(indexed);
            }
        }
        // A node indexed whole is the cache's now; a private one (or the partial page split
        // from the indexed part) goes.
        if c.refs(own).is_none() {
            c.prune(own).unwrap();
        }
    }
    c.release(lease);
}

fn path_len(kv: &KvManager, node: KvNode) -> usize {
    let mut n = Some(node);
    let mut len = 0;
    while let Some(x) = n {
        len += kv.len(x).unwrap() as usize;
        n = kv.parent(x).unwrap();
    }
    len
}

/// A split puts a new node of the first pages in the node's place; the node keeps its
/// handle, its children and the rest of its tokens, on whichever ranks they were.
#[test]
fn a_split_shares_the_head_and_keeps_the_tail() {
    let mut t = KvManager::new(2, 4, 16).unwrap();
    let root = t.add_root(18, Placement::Contiguous).unwrap(); // pages on ranks 0, 0, 1, 1, 1
    let leaf = t.fork(root, 3, Placement::Balanced).unwrap();
    t.set_live(leaf, true).unwrap();
    let before = t.snapshot(0).unwrap().tree.query_context_len(0)
        + t.snapshot(1).unwrap().tree.query_context_len(0);
    let head = t.split(root, 3).unwrap();
    assert_eq!((t.len(head).unwrap(), t.len(root).unwrap()), (12, 6));
    assert_eq!(t.held(head).unwrap(), [8, 4]);
    assert_eq!(t.held(root).unwrap(), [0, 6]);
    assert_eq!(t.parent(root).unwrap(), Some(head));
    assert_eq!(t.parent(leaf).unwrap(), Some(root));
    let after = t.snapshot(0).unwrap().tree.query_context_len(0)
        + t.snapshot(1).unwrap().tree.query_context_len(0);
    assert_eq!(before, after, "the leaf sees the same tokens");
    assert!(matches!(t.split(root, 2), Err(KvError::BadSplit { .. })));
    assert!(matches!(t.split(head, 0), Err(KvError::BadSplit { .. })));
    assert_eq!(t.prune(head).unwrap(), 6);
    assert_eq!(t.pages_free(), t.pages_total());
}

#[test]
fn a_shared_prefix_is_matched_in_whole_pages_and_split_where_it_ends() {
    let mut c = cache(1, 64);
    let mut pages = Pages::default();
    let a: Vec<u32> = (0..14).collect(); // 3 whole pages and 2 tokens
    let r = start(&mut c, &mut pages, &a).unwrap();
    assert_eq!(r.lease, None, "an empty cache matches nothing");
    finish(&mut c, r, true);
    assert_eq!(c.cached_nodes(), 1);
    assert_eq!(c.kv().pages_in_use(), 3, "the partial page is freed");
    // Shares two pages with a, then differs.
    let b: Vec<u32> = (0..8).chain([99, 98, 97]).collect();
    let r = start(&mut c, &mut pages, &b).unwrap();
    let lease = r.lease.unwrap();
    assert_eq!(
        c.kv().len(lease).unwrap(),
        8,
        "a's node is split after two pages"
    );
    assert_eq!(c.cached_nodes(), 2);
    assert_eq!(c.refs(lease), Some(1));
    assert_eq!(
        pages.read_path(c.kv(), r.own),
        b.iter().map(|&t| Some(t)).collect::<Vec<_>>()
    );
    let stats = c.stats();
    assert_eq!((stats.queried_tokens, stats.hit_tokens), (13 + 10, 8));
    finish(&mut c, r, false);
    assert_eq!(c.refs(lease), Some(0));
}

#[test]
fn a_prompt_of_whole_pages_keeps_its_last_token_to_compute() {
    let mut c = cache(1, 64);
    let mut pages = Pages::default();
    let a: Vec<u32> = (0..8).collect();
    let r = start(&mut c, &mut pages, &a).unwrap();
    finish(&mut c, r, true);
    let r = start(&mut c, &mut pages, &a).unwrap();
    assert_eq!(c.kv().len(r.lease.unwrap()).unwrap(), 4, "one page matched");
    assert_eq!(c.kv().len(r.own.unwrap()).unwrap(), 4);
    finish(&mut c, r, true);
    assert_eq!(
        c.cached_nodes(),
        2,
        "the second page is cached below the first"
    );
}

#[test]
fn referenced_prefixes_survive_pressure_and_unreferenced_ones_go_lru() {
    let mut c = cache(2, 4); // 8 pages
    let mut pages = Pages::default();
    for first in [10u32, 20] {
        let t: Vec<u32> = (first..first + 9).collect(); // 2 whole pages + 1
        let r = start(&mut c, &mut pages, &t).unwrap();
        finish(&mut c, r, true);
    }
    assert_eq!((c.kv().pages_in_use(), c.evictable_pages()), (4, 4));
    // Touch the prefix starting at 10: the one at 20 is now the least recently used.
    let t: Vec<u32> = (10..19).collect();
    let held = start(&mut c, &mut pages, &t).unwrap();
    assert_eq!(c.available_pages(), 8 - 4 - 1 + 2);
    // 6 pages: needs the free 3, then evicts the prefix at 20 (2 pages) and still lacks one.
    let big: Vec<u32> = (100..124).collect();
    assert!(start(&mut c, &mut pages, &big).is_err());
    assert_eq!(c.stats().evicted_pages, 2);
    assert_eq!(
        c.refs(held.lease.unwrap()),
        Some(1),
        "the referenced prefix stays"
    );
    assert_eq!(
        pages.read_path(c.kv(), held.own),
        t.iter().map(|&x| Some(x)).collect::<Vec<_>>()
    );
    finish(&mut c, held, false);
    let r = start(&mut c, &mut pages, &big).unwrap();
    assert_eq!(
        c.kv().pages_in_use(),
        8,
        "the free pages were enough: nothing evicted"
    );
    finish(&mut c, r, false);
}

#[test]
fn bad_calls_are_errors() {
    let mut c = cache(1, 8);
    let mut pages = Pages::default();
    let r = start(&mut c, &mut pages, &[1, 2, 3, 4, 5]).unwrap();
    let own = r.own.unwrap();
    assert!(matches!(
        c.insert(own, &[1, 2]),
        Err(KvError::TokenCount { .. })
    ));
    finish(&mut c, r, true);
    let cached = c.acquire(&[1, 2, 3, 4]).unwrap().node.unwrap();
    assert_eq!(c.prune(cached), Err(KvError::Indexed(cached)));
}

proptest! {
    /// Requests over prompts with shared prefixes start, finish (kept or not) and are
    /// cancelled in random order in small pools: every running request's path holds exactly
    /// its tokens (so no page it reads was freed and reused), every cached node's references
    /// are the leases below it, and the counters add up.
    #[test]
    fn every_running_request_reads_its_own_tokens(
        ranks in 1usize..=3,
        pages_per_rank in 4u32..12,
        ops in proptest::collection::vec((0u8..4, 0usize..8, 1usize..4, 1usize..14), 1..80),
    ) {
        let mut c = cache(ranks, pages_per_rank);
        let mut pages = Pages::default();
        let mut running: Vec<Request> = Vec::new();
        let mut queried = 0u64;
        for (op, pick, stem, len) in ops {
            match op {
                0 | 1 => {
                    // A prompt from one of three stems, so that prefixes recur.
                    let tokens: Vec<u32> = (0..len)
                        .map(|i| if i < 6 { (stem * 100 + i) as u32 } else { (pick * 1000 + i) as u32 })
                        .collect();
                    queried += tokens.len() as u64 - 1;
                    if let Ok(r) = start(&mut c, &mut pages, &tokens) {
                        running.push(r);
                    }
                }
                2 if !running.is_empty() => {
                    let r = running.swap_remove(pick % running.len());
                    finish(&mut c, r, true);
                }
                3 if !running.is_empty() => {
                    let r = running.swap_remove(pick % running.len());
                    finish(&mut c, r, false);
                }
                _ => {}
            }
            for r in &running {
                let want: Vec<Option<u32>> = r.tokens.iter().map(|&t| Some(t)).collect();
                prop_assert_eq!(pages.read_path(c.kv(), r.own), want);
            }
            for (&node, e) in &c.entries {
                let leases = running
                    .iter()
                    .filter(|r| {
                        let mut at = r.lease;
                        while let Some(n) = at {
                            if n == node {
                                return true;
                            }
                            at = c.kv().parent(n).unwrap();
                        }
                        false
                    })
                    .count();
                prop_assert_eq!(e.refs as usize, leases, "node {}", node);
                let held = pages.read_path(c.kv(), Some(node));
                let tail: Vec<Option<u32>> = e.tokens.iter().map(|&t| Some(t)).collect();
                prop_assert_eq!(&held[held.len() - tail.len()..], &tail[..]);
            }
            let s = c.stats();
            prop_assert_eq!(s.queried_tokens, queried);
            prop_assert!(s.hit_tokens <= s.queried_tokens);
            prop_assert!(c.available_pages() <= c.kv().pages_total());
        }
        for r in running.drain(..) {
            finish(&mut c, r, true);
        }
        prop_assert_eq!(c.evictable_pages(), c.kv().pages_in_use(), "everything left is evictable");
    }
}
