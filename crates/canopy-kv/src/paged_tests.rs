use super::*;
use canopy_core::{plan, AttnShape, Method, PlannerConfig, Shard, TreeView};
use proptest::prelude::*;

const BALANCED: Placement = Placement::Balanced;
const CONTIGUOUS: Placement = Placement::Contiguous;

#[test]
fn forks_share_the_prefix_pages_and_prunes_free_their_own() {
    let mut t = KvManager::new(1, 16, 64).unwrap();
    let root = t.add_root(40, BALANCED).unwrap(); // 3 pages
    let a = t.fork(root, 5, BALANCED).unwrap(); // 1 page
    let b = t.fork(root, 20, BALANCED).unwrap(); // 2 pages
    t.set_live(a, true).unwrap();
    t.set_live(b, true).unwrap();
    assert_eq!(t.pages_in_use(), 6);
    t.append(a, 11, BALANCED).unwrap(); // fills a's page exactly
    assert_eq!(t.pages_in_use(), 6);
    t.append(a, 1, BALANCED).unwrap();
    assert_eq!(t.pages_in_use(), 7);
    assert!(
        t.append(root, 1, BALANCED).is_err(),
        "internal nodes do not grow"
    );
    let RankSnapshot { tree, table, .. } = t.snapshot(0).unwrap();
    assert_eq!(tree.num_queries(), 2);
    // Both queries' contexts start with the root's three pages: the same physical pages.
    let root_pages: Vec<u32> = table[..3].to_vec();
    let ctx = |q: u32| {
        let mut pages = Vec::new();
        let mut n = Some(tree.query_node(q));
        while let Some(id) = n {
            let node = tree.node(id);
            pages.extend(
                node.kv
                    .clone()
                    .step_by(16)
                    .map(|a| table[(a / 16) as usize]),
            );
            n = node.parent;
        }
        pages
    };
    for q in 0..2 {
        let pages = ctx(q);
        assert!(root_pages.iter().all(|p| pages.contains(p)), "{pages:?}");
    }
    assert_eq!(t.prune(b).unwrap(), 2);
    assert_eq!(t.pages_in_use(), 5);
    assert!(t.fork(b, 1, BALANCED).is_err(), "pruned nodes are gone");
}

#[test]
fn a_full_pool_is_an_error_not_a_panic() {
    let mut t = KvManager::new(1, 8, 2).unwrap();
    let r = t.add_root(16, BALANCED).unwrap();
    let e = t.fork(r, 1, BALANCED).unwrap_err().to_string();
    assert!(e.contains("pool is full"), "{e}");
    assert_eq!(t.pages_in_use(), 2);
}

/// `catch_up`'s tails, for a cache without growth room (no page comes in place).
fn tails(t: &KvManager, snap: &mut RankSnapshot) -> Option<Vec<Tail>> {
    t.catch_up(snap).map(|c| {
        assert!(!c.new_pages, "no room, no pages in place");
        c.tails
    })
}

/// A live leaf with growth room takes pages without moving the layout: they go into the
/// table's reserved entries, the node's tail crosses into them, and every other node keeps
/// its addresses. Past the room, or for a leaf that is not live, a page moves the layout.
#[test]
fn pages_taken_into_reserved_room_are_caught_up() {
    let page = 4;
    let mut t = KvManager::new(1, page, 64).unwrap().with_growth_room(6);
    let root = t.add_root(10, BALANCED).unwrap();
    let a = t.fork(root, 3, BALANCED).unwrap();
    let idle = t.fork(root, 2, BALANCED).unwrap();
    t.set_live(a, true).unwrap();
    let mut snap = t.snapshot(0).unwrap();
    let (a_id, idle_id) = (snap.node(a).unwrap(), snap.node(idle).unwrap());
    let a_kv = snap.tree.node(a_id).kv.clone();
    let idle_kv = snap.tree.node(idle_id).kv.clone();
    // 3 tokens + 6 of room, rounded up to pages: a owns 12 addresses.
    assert_eq!(idle_kv.start, a_kv.start + 12);
    t.append(a, 6, BALANCED).unwrap(); // 9 tokens: two new pages
    let caught = t.catch_up(&mut snap).unwrap();
    assert!(caught.new_pages);
    assert_eq!(
        caught.tails,
        [Tail {
            end: a_kv.end,
            new_end: a_kv.start + 9
        }]
    );
    assert_eq!(
        snap.tree.node(idle_id).kv,
        idle_kv,
        "the other leaf stays put"
    );
    let first = (a_kv.start / page) as usize;
    let pages: Vec<u32> = t.pages(a).unwrap().iter().map(|p| p.page).collect();
    assert_eq!(snap.table[first..first + 3], pages[..]);
    t.append(a, 3, BALANCED).unwrap(); // 12: the room's last address
    assert_eq!(t.catch_up(&mut snap).map(|c| c.tails.len()), Some(1));
    t.append(a, 1, BALANCED).unwrap();
    assert_eq!(t.catch_up(&mut snap), None, "past the room");
    let mut snap = t.snapshot(0).unwrap();
    t.append(idle, 3, BALANCED).unwrap(); // not live: no room past its page
    assert_eq!(t.catch_up(&mut snap), None);
}

/// Appends inside the last page keep the layout: `catch_up` extends the snapshot in place
/// and reports the tails; a page taken, a fork or a prune needs a new snapshot.
#[test]
fn appends_inside_a_page_are_caught_up_and_new_pages_are_not() {
    let mut t = KvManager::new(1, 16, 64).unwrap();
    let root = t.add_root(40, BALANCED).unwrap();
    let a = t.fork(root, 5, BALANCED).unwrap();
    t.set_live(a, true).unwrap();
    let mut snap = t.snapshot(0).unwrap();
    let a_kv = snap.tree.node(1).kv.clone();
    assert_eq!(tails(&t, &mut snap), Some(vec![]));
    t.append(a, 3, BALANCED).unwrap();
    let grown = tails(&t, &mut snap).unwrap();
    assert_eq!(
        grown,
        vec![Tail {
            end: a_kv.end,
            new_end: a_kv.end + 3
        }]
    );
    assert_eq!(snap.tree.node(1).kv, a_kv.start..a_kv.end + 3);
    // The address space runs to the end of a's page, where a may grow in place.
    assert_eq!(snap.tree.total_tokens(), a_kv.start + 16);
    t.append(a, 8, BALANCED).unwrap(); // 16 tokens: the page is full, not exceeded
    assert_eq!(tails(&t, &mut snap).unwrap().len(), 1);
    t.append(a, 1, BALANCED).unwrap(); // a second page
    assert_eq!(tails(&t, &mut snap), None);
    let mut snap = t.snapshot(0).unwrap();
    t.fork(root, 1, BALANCED).unwrap();
    assert_eq!(tails(&t, &mut snap), None);
}

/// Decode growth goes where the fewest pages are, ties to the lowest rank; a leaf's last
/// page fills before a new one is taken, wherever that page is.
#[test]
fn balanced_growth_takes_the_emptiest_rank() {
    let mut t = KvManager::new(3, 4, 16).unwrap();
    let root = t.add_root(10, CONTIGUOUS).unwrap(); // 3 pages: one per rank
    assert_eq!(t.held(root).unwrap(), [4, 4, 2]);
    let a = t.fork(root, 4, BALANCED).unwrap(); // all tie at one page: rank 0
    let b = t.fork(root, 4, BALANCED).unwrap(); // ranks 1 and 2 tie: rank 1
    assert_eq!(t.pages(a).unwrap()[0].rank, 0);
    assert_eq!(t.pages(b).unwrap()[0].rank, 1);
    t.append(b, 9, BALANCED).unwrap(); // ranks 2, 0, 1: one page each, 1 token in the last
    let ranks: Vec<usize> = t.pages(b).unwrap().iter().map(|p| p.rank).collect();
    assert_eq!(ranks, [1, 2, 0, 1]);
    assert_eq!(t.held(b).unwrap(), [4, 5, 4]);
    t.append(b, 3, BALANCED).unwrap(); // fills b's last page on rank 1, takes none
    assert_eq!(t.pages(b).unwrap().len(), 4);
    assert_eq!(t.held(b).unwrap(), [4, 8, 4]);
    assert_eq!(
        (0..3)
            .map(|r| t.pages_in_use_on(r).unwrap())
            .collect::<Vec<_>>(),
        [3, 3, 2]
    );
}

/// A prompt placed contiguously is one block of pages per rank, in rank order: the chunks
/// of a sequence-parallel prefill.
#[test]
fn a_contiguous_prompt_is_one_block_per_rank() {
    let mut t = KvManager::new(4, 16, 64).unwrap();
    let prompt = t.add_root(16 * 10 - 3, CONTIGUOUS).unwrap(); // 10 pages: 2, 3, 2, 3
    let runs = t.runs(prompt).unwrap();
    assert_eq!(runs, [(0, 0..32), (1, 32..80), (2, 80..112), (3, 112..157)]);
    assert_eq!(t.held(prompt).unwrap(), [32, 48, 32, 45]);
    // A continuation of the prompt fills its last page (rank 3) first, then is split again.
    t.append(prompt, 3 + 64, CONTIGUOUS).unwrap();
    let runs = t.runs(prompt).unwrap();
    assert_eq!(
        runs[3..],
        [
            (3, 112..160),
            (0, 160..176),
            (1, 176..192),
            (2, 192..208),
            (3, 208..224)
        ]
    );
}

/// A fork spread over ranks shares its root's pages on every rank: each rank's tree holds
/// the root's tokens it owns once, in the context of both leaves.
#[test]
fn forks_share_pages_across_ranks() {
    let mut t = KvManager::new(2, 8, 16).unwrap();
    let root = t.add_root(32, CONTIGUOUS).unwrap();
    let a = t.fork(root, 3, BALANCED).unwrap();
    let b = t.fork(root, 12, CONTIGUOUS).unwrap();
    t.set_live(a, true).unwrap();
    t.set_live(b, true).unwrap();
    assert_eq!(t.pages_in_use_on(0).unwrap(), 4);
    assert_eq!(t.pages_in_use_on(1).unwrap(), 3);
    for rank in 0..2 {
        let s = t.snapshot(rank).unwrap();
        assert_eq!(s.tree.node(0).len(), 16, "half the root on each rank");
        let root_pages = &s.table[..2];
        let mut own = root_pages.to_vec();
        for &p in t.pages(root).unwrap().iter().filter(|p| p.rank == rank) {
            assert!(own.contains(&p.page));
            own.retain(|&x| x != p.page);
        }
        assert!(own.is_empty(), "rank {rank}'s root pages are its own");
        for q in 0..2 {
            assert_eq!(s.tree.query_context(q)[0], s.tree.node(0).kv);
        }
    }
    assert_eq!(t.snapshot(0).unwrap().tree.node(1).len(), 3);
    assert_eq!(t.snapshot(1).unwrap().tree.node(1).len(), 0);
    assert_eq!(t.prune(root).unwrap(), 7);
    assert_eq!(t.pages_in_use(), 0);
}

/// A rank without room is named, with its pool's size, and the call takes nothing.
#[test]
fn a_full_rank_is_named_and_nothing_is_taken() {
    let mut t = KvManager::new(2, 4, 2).unwrap();
    let e = t.add_root(20, CONTIGUOUS).unwrap_err(); // 5 pages: 2 on rank 0, 3 on rank 1
    assert_eq!(
        e,
        KvError::PoolFull {
            rank: 1,
            need: 3,
            free: 2,
            pages: 2
        }
    );
    let msg = e.to_string();
    assert!(
        msg.contains("rank 1's KV pool is full") && msg.contains("of its 2"),
        "{msg}"
    );
    assert_eq!(t.pages_in_use(), 0);
    let r = t.add_root(16, CONTIGUOUS).unwrap();
    let e = t.append(r, 1, BALANCED).unwrap_err().to_string();
    assert!(e.contains("rank 0's KV pool is full"), "{e}");
    assert_eq!(t.len(r).unwrap(), 16);
    assert!(matches!(
        t.snapshot(2),
        Err(KvError::NoRank { rank: 2, ranks: 2 })
    ));
    assert!(KvManager::new(0, 16, 1).is_err() && KvManager::new(1, 0, 1).is_err());
}

/// A rank that holds nothing of some nodes, or of the whole tree, still gets the whole
/// topology: empty nodes, an empty page table, and plans of no groups from every planner.
#[test]
fn empty_shards_are_trees_every_planner_accepts() {
    let mut t = KvManager::new(3, 16, 8).unwrap();
    let root = t.add_root(20, BALANCED).unwrap(); // ranks 0, 1
    let leaf = t.fork(root, 5, BALANCED).unwrap(); // rank 2
    t.set_live(leaf, true).unwrap();
    t.set_live(root, true).unwrap();
    let shape = AttnShape::new(4, 2, 64).unwrap();
    let cfg = PlannerConfig::default();
    let empty = KvManager::new(2, 16, 8).map(|mut e| {
        let r = e.add_root(3, BALANCED).unwrap();
        e.set_live(r, true).unwrap();
        e.snapshot(1).unwrap()
    });
    let mut snaps = t.snapshots().unwrap();
    snaps.push(empty.unwrap());
    for s in &snaps {
        assert_eq!(s.tree.nodes().len(), s.tree.dfs_order().len());
        let shard = Shard::whole(&s.tree);
        let view = TreeView::new(&s.tree, &shard);
        for m in Method::ALL.into_iter().chain([Method::Auto]) {
            let p = plan(&view, m, &shape, &cfg).unwrap();
            p.check_coverage(|q| view.query_context(q))
                .unwrap_or_else(|e| panic!("rank {} {m}: {e}", s.rank));
        }
    }
    assert_eq!(snaps[2].tree.node(0).len(), 0);
    assert_eq!(snaps[2].tree.node(1).len(), 5);
    assert_eq!(snaps[2].table.len(), 1);
    let nothing = &snaps[3];
    assert_eq!((nothing.tree.total_tokens(), nothing.table.len()), (0, 0));
    let shard = Shard::whole(&nothing.tree);
    let view = TreeView::new(&nothing.tree, &shard);
    assert!(view.query_context(0).is_empty());
    assert!(plan(&view, Method::FastTree, &shape, &cfg)
        .unwrap()
        .groups()
        .is_empty());
}

/// Catch-up is rank by rank: a page taken on one rank replans that rank only; appends
/// inside a page give tails on the page's rank and none elsewhere.
#[test]
fn catch_up_is_per_rank() {
    let mut t = KvManager::new(2, 4, 16).unwrap();
    let root = t.add_root(8, CONTIGUOUS).unwrap();
    let a = t.fork(root, 2, BALANCED).unwrap(); // rank 0 (1 + 1 pages: ranks tie)
    let b = t.fork(root, 2, BALANCED).unwrap(); // rank 1
    t.set_live(a, true).unwrap();
    t.set_live(b, true).unwrap();
    let mut snaps = t.snapshots().unwrap();
    t.append(b, 1, BALANCED).unwrap();
    assert_eq!(tails(&t, &mut snaps[0]), Some(vec![]));
    let b_end = snaps[1].tree.node(2).kv.end;
    assert_eq!(
        tails(&t, &mut snaps[1]),
        Some(vec![Tail {
            end: b_end,
            new_end: b_end + 1
        }])
    );
    // a fills its page on rank 0 and takes one on rank 1 (one page over two ranks).
    t.append(a, 3, CONTIGUOUS).unwrap();
    let grown = tails(&t, &mut snaps[0]).unwrap();
    assert_eq!(grown.len(), 1, "a's page on rank 0 filled in place");
    assert_eq!(tails(&t, &mut snaps[1]), None, "rank 1 took a page");
    snaps[1] = t.snapshot(1).unwrap();
    for (r, s) in snaps.iter().enumerate() {
        let fresh = t.snapshot(r).unwrap();
        assert_eq!((&s.tree, &s.table), (&fresh.tree, &fresh.table));
    }
    t.set_live(a, false).unwrap();
    assert!(
        snaps.iter_mut().all(|s| t.catch_up(s).is_none()),
        "queries moved"
    );
}

proptest! {
    /// A tree grown for many decode steps, forking now and then: plans made once per layout
    /// and extended in place (`catch_up` + `Plan::extend_tails`) cover every query's
    /// context exactly, for every method, DeFT-Node's extended plan is the plan of the grown
    /// tree, and with growth room the table maps every node to its pages.
    #[test]
    fn plans_extended_in_place_match_the_grown_tree(
        page in 1u32..20,
        leaves in 1usize..6,
        steps in proptest::collection::vec(0u8..12, 1..40),
        room in prop_oneof![Just(0u32), 1u32..40],
    ) {
        let shape = AttnShape::new(8, 2, 64).unwrap();
        let cfg = PlannerConfig { node_chunk: 7, flatten_block: 5, ..PlannerConfig::default() };
        let mut t = KvManager::new(1, page, 1 << 14).unwrap().with_growth_room(room);
        let root = t.add_root(9, BALANCED).unwrap();
        for i in 0..leaves {
            let leaf = t.fork(root, 1 + i as u32, BALANCED).unwrap();
            t.set_live(leaf, true).unwrap();
        }
        for method in Method::ALL {
            let mut t = t.clone();
            let mut snap = t.snapshot(0).unwrap();
            let shard = Shard::whole(&snap.tree);
            let mut p = plan(&TreeView::new(&snap.tree, &shard), method, &shape, &cfg).unwrap();
            let mut shared = p.kv_shared_tokens();
            for &step in &steps {
                if step == 0 {
                    // Fork a new live leaf under the first live one's parent.
                    let first = t.live()[0];
                    let parent = t.parent(first).unwrap().unwrap_or(first);
                    let leaf = t.fork(parent, 2, BALANCED).unwrap();
                    t.set_live(leaf, true).unwrap();
                }
                for n in t.live() {
                    t.append(n, 1, BALANCED).unwrap();
                }
                match t.catch_up(&mut snap) {
                    Some(CaughtUp { tails, .. }) => {
                        p.extend_tails(&tails);
                        p.grow_shared_tokens(&mut shared, &tails);
                    }
                    None => {
                        snap = t.snapshot(0).unwrap();
                        let shard = Shard::whole(&snap.tree);
                        p = plan(&TreeView::new(&snap.tree, &shard), method, &shape, &cfg).unwrap();
                        shared = p.kv_shared_tokens();
                    }
                }
                prop_assert_eq!(&shared, &p.kv_shared_tokens(), "{}: shared tokens grown in place", method);
                let shard = Shard::whole(&snap.tree);
                let view = TreeView::new(&snap.tree, &shard);
                p.check_coverage(|q| view.query_context(q))
                    .map_err(|e| TestCaseError::fail(format!("{method}: {e}")))?;
                if method == Method::DeftNode {
                    prop_assert_eq!(&p, &plan(&view, method, &shape, &cfg).unwrap());
                }
                for n in t.live() {
                    let kv = snap.tree.node(snap.node(n).unwrap()).kv.clone();
                    prop_assert_eq!(kv.len() as u32, t.len(n).unwrap());
                    let first = (kv.start / page) as usize;
                    let logical = &snap.table[first..first + kv.len().div_ceil(page as usize)];
                    let physical: Vec<u32> = t.pages(n).unwrap().iter().map(|p| p.page).collect();
                    prop_assert_eq!(logical, &physical[..]);
                }
            }
        }
    }

    /// Random forks, appends and prunes over 1 to 3 ranks: no physical page is ever owned
    /// twice, each rank's table covers exactly its pages in use, and every node's logical
    /// range fits its pages.
    #[test]
    fn pages_are_never_shared_between_owners(
        ranks in 1usize..=3,
        ops in proptest::collection::vec((0u8..3, 0u32..50, 1u32..40, any::<bool>()), 1..60),
    ) {
        let mut t = KvManager::new(ranks, 16, 4096).unwrap();
        let mut nodes = vec![t.add_root(33, CONTIGUOUS).unwrap()];
        for (op, pick, n, contiguous) in ops {
            let target = nodes[pick as usize % nodes.len()];
            let placement = if contiguous { CONTIGUOUS } else { BALANCED };
            match op {
                0 => nodes.push(t.fork(target, n, placement).unwrap()),
                1 => { let _ = t.append(target, n, placement); }
                _ if nodes.len() > 1 && target != nodes[0] => {
                    t.prune(target).unwrap();
                    nodes.retain(|&x| t.slot(x).is_ok());
                }
                _ => {}
            }
        }
        for &n in &nodes { t.set_live(n, true).unwrap(); }
        for RankSnapshot { rank, tree, table, .. } in t.snapshots().unwrap() {
            let mut used: Vec<u32> = Vec::new();
            for node in tree.nodes() {
                let first = (node.kv.start / 16) as usize;
                let pages = node.len().div_ceil(16) as usize;
                used.extend(&table[first..first + pages]);
            }
            used.sort_unstable();
            let before = used.len();
            used.dedup();
            prop_assert_eq!(before, used.len());
            prop_assert_eq!(used.len(), t.pages_in_use_on(rank).unwrap());
        }
    }
}
