//! A paged KV cache for trees that grow while they decode.
//!
//! Physical KV lives in fixed-size pages drawn from one pool. A node owns the pages holding its
//! own tokens; its context's other tokens are its ancestors' pages, which every descendant
//! shares: forking a branch allocates pages for the branch's new tokens only, and no shared
//! prefix is ever copied. Appending fills a leaf's last page before taking a new one; pruning a
//! subtree returns its pages to the pool.
//!
//! [`PagedTree::snapshot`] gives the planners an ordinary [`KvTree`] whose nodes start on page
//! boundaries (a logical address space), plus the page table from logical to physical pages
//! that the kernels read through.
//!
//! Most decode steps change no layout: every live leaf appends a token inside its last page,
//! so no node moves and no page is taken. [`PagedTree::catch_up`] recognises such steps and
//! brings a snapshot up to date in place, returning each grown node as a [`Tail`] (old end,
//! new end); a plan follows with [`canopy_core::Plan::extend_tails`] instead of being rebuilt. Any
//! other change (a fork, a prune, a query set, a new page) moves the layout's version, and
//! `catch_up` says a new snapshot is due.

use canopy_core::{CoreError, KvTree, NodeId, Result, Tail, TreeBuilder};

/// A handle to a node of a [`PagedTree`]; stable while the node lives.
pub type PagedNode = u32;

#[derive(Debug, Clone)]
struct Slot {
    parent: Option<PagedNode>,
    children: Vec<PagedNode>,
    len: u32,
    pages: Vec<u32>,
    /// Whether a decode query sits on this node.
    live: bool,
}

/// A tree of token runs in a pool of KV pages.
#[derive(Debug, Clone)]
pub struct PagedTree {
    page_size: u32,
    pool_pages: u32,
    free: Vec<u32>,
    slots: Vec<Option<Slot>>,
    roots: Vec<PagedNode>,
    /// Moves whenever a snapshot's layout would change: nodes added, pruned or marked live,
    /// or a page taken. Appends inside a node's last page leave it.
    layout_version: u64,
}

/// A [`PagedTree`] as the planners and kernels see it at one moment.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Nodes on page boundaries, one query per live node.
    pub tree: KvTree,
    /// Logical page → physical page.
    pub table: Vec<u32>,
    layout_version: u64,
    /// For each paged node: its node in `tree` and the length `tree` has for it.
    nodes: Vec<Option<(NodeId, u32)>>,
}

impl PagedTree {
    /// An empty tree over a pool of `pool_pages` pages of `page_size` tokens.
    pub fn new(page_size: u32, pool_pages: u32) -> Result<PagedTree> {
        if page_size == 0 {
            return Err(CoreError::Tree("the page size must be at least 1".into()));
        }
        Ok(PagedTree {
            page_size,
            pool_pages,
            free: (0..pool_pages).rev().collect(),
            slots: Vec::new(),
            roots: Vec::new(),
            layout_version: 0,
        })
    }

    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    pub fn pages_in_use(&self) -> usize {
        (self.pool_pages as usize) - self.free.len()
    }

    fn slot(&self, n: PagedNode) -> Result<&Slot> {
        self.slots
            .get(n as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| CoreError::Tree(format!("node {n} does not exist (or was pruned)")))
    }

    fn slot_mut(&mut self, n: PagedNode) -> Result<&mut Slot> {
        self.slots
            .get_mut(n as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| CoreError::Tree(format!("node {n} does not exist (or was pruned)")))
    }

    fn insert(&mut self, parent: Option<PagedNode>, tokens: u32) -> Result<PagedNode> {
        if tokens == 0 {
            return Err(CoreError::Tree(
                "a new node needs at least one token".into(),
            ));
        }
        let id = self.slots.len() as PagedNode;
        self.slots.push(Some(Slot {
            parent,
            children: Vec::new(),
            len: 0,
            pages: Vec::new(),
            live: false,
        }));
        if let Err(e) = self.append_unchecked(id, tokens) {
            self.slots.pop();
            return Err(e);
        }
        match parent {
            Some(p) => self.slot_mut(p)?.children.push(id),
            None => self.roots.push(id),
        }
        self.layout_version += 1;
        Ok(id)
    }

    /// A new sequence (prompt) of `tokens` tokens.
    pub fn add_root(&mut self, tokens: u32) -> Result<PagedNode> {
        self.insert(None, tokens)
    }

    /// A new branch of `tokens` tokens under `parent`, sharing all of `parent`'s pages.
    pub fn fork(&mut self, parent: PagedNode, tokens: u32) -> Result<PagedNode> {
        self.slot(parent)?;
        self.insert(Some(parent), tokens)
    }

    /// Appends `tokens` tokens to leaf `node` (a decode step's new KV).
    pub fn append(&mut self, node: PagedNode, tokens: u32) -> Result<()> {
        if !self.slot(node)?.children.is_empty() {
            return Err(CoreError::Tree(format!(
                "node {node} has children; only leaves grow (fork a branch instead)"
            )));
        }
        self.append_unchecked(node, tokens)
    }

    fn append_unchecked(&mut self, node: PagedNode, tokens: u32) -> Result<()> {
        let page = self.page_size;
        let (len, have) = {
            let s = self.slot(node)?;
            (s.len, s.pages.len() as u32)
        };
        let need = (len + tokens).div_ceil(page).saturating_sub(have) as usize;
        if need > self.free.len() {
            return Err(CoreError::Tree(format!(
                "the KV pool is full: {need} more pages needed, {} free of {}; prune branches or \
                 give the cache more pages",
                self.free.len(),
                self.pool_pages
            )));
        }
        if need > 0 {
            self.layout_version += 1;
        }
        let fresh: Vec<u32> = (0..need).filter_map(|_| self.free.pop()).collect();
        let s = self.slot_mut(node)?;
        s.pages.extend(fresh);
        s.len += tokens;
        Ok(())
    }

    /// Marks whether a decode query sits on `node`.
    pub fn set_live(&mut self, node: PagedNode, live: bool) -> Result<()> {
        let slot = self.slot_mut(node)?;
        if slot.live != live {
            slot.live = live;
            self.layout_version += 1;
        }
        Ok(())
    }

    /// Removes `node` and its subtree, returning their pages to the pool; returns the number
    /// of pages freed. Ancestors' (shared) pages are untouched.
    pub fn prune(&mut self, node: PagedNode) -> Result<usize> {
        let parent = self.slot(node)?.parent;
        self.layout_version += 1;
        match parent {
            Some(p) => self.slot_mut(p)?.children.retain(|&c| c != node),
            None => self.roots.retain(|&r| r != node),
        }
        let mut freed = 0;
        let mut stack = vec![node];
        while let Some(n) = stack.pop() {
            let s = self.slots[n as usize].take().expect("live subtree node");
            freed += s.pages.len();
            self.free.extend(s.pages);
            stack.extend(s.children);
        }
        Ok(freed)
    }

    /// Live leaves and other nodes with a query, in node order.
    pub fn live(&self) -> Vec<PagedNode> {
        (0..self.slots.len() as PagedNode)
            .filter(|&n| self.slots[n as usize].as_ref().is_some_and(|s| s.live))
            .collect()
    }

    /// The tree as the planners see it, nodes starting on page boundaries, with one query per
    /// live node (in the order of [`live`](Self::live)), and the page table.
    pub fn snapshot(&self) -> Result<Snapshot> {
        let mut b = TreeBuilder::new().with_alignment(self.page_size);
        let mut ids = vec![None; self.slots.len()];
        // Parents before children: walk from the roots.
        let mut stack: Vec<PagedNode> = self.roots.iter().rev().copied().collect();
        let mut order = Vec::new();
        while let Some(n) = stack.pop() {
            let s = self.slot(n)?;
            ids[n as usize] = Some(match s.parent {
                None => b.add_root(s.len),
                Some(p) => b.add_child(ids[p as usize].expect("parent first"), s.len)?,
            });
            order.push(n);
            stack.extend(s.children.iter().rev());
        }
        for n in self.live() {
            b.add_query(ids[n as usize].expect("live nodes are in the tree"))?;
        }
        let tree = b.build()?;
        let mut table = vec![0u32; tree.total_tokens().div_ceil(self.page_size) as usize];
        let mut nodes = vec![None; self.slots.len()];
        for n in order {
            let id = ids[n as usize].expect("placed");
            let node = tree.node(id);
            let first = (node.kv.start / self.page_size) as usize;
            for (i, &page) in self.slot(n)?.pages.iter().enumerate() {
                table[first + i] = page;
            }
            nodes[n as usize] = Some((id, node.len()));
        }
        Ok(Snapshot {
            tree,
            table,
            layout_version: self.layout_version,
            nodes,
        })
    }

    /// Brings `snap` up to date when nothing but appends inside nodes' last pages happened
    /// since it was taken (or last caught up), and returns the nodes that grew, in logical
    /// addresses. `None`: the layout moved; take a new [`snapshot`](Self::snapshot).
    pub fn catch_up(&self, snap: &mut Snapshot) -> Option<Vec<Tail>> {
        if snap.layout_version != self.layout_version {
            return None;
        }
        let mut tails = Vec::new();
        for (slot, node) in self.slots.iter().zip(&mut snap.nodes) {
            let (Some(slot), Some((id, len))) = (slot, node.as_mut()) else {
                continue;
            };
            if slot.len != *len {
                let start = snap.tree.node(*id).kv.start;
                let tail = Tail {
                    end: start + *len,
                    new_end: start + slot.len,
                };
                snap.tree.extend_node(*id, tail.new_end);
                *len = slot.len;
                tails.push(tail);
            }
        }
        Some(tails)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn forks_share_the_prefix_pages_and_prunes_free_their_own() {
        let mut t = PagedTree::new(16, 64).unwrap();
        let root = t.add_root(40).unwrap(); // 3 pages
        let a = t.fork(root, 5).unwrap(); // 1 page
        let b = t.fork(root, 20).unwrap(); // 2 pages
        t.set_live(a, true).unwrap();
        t.set_live(b, true).unwrap();
        assert_eq!(t.pages_in_use(), 6);
        t.append(a, 11).unwrap(); // fills a's page exactly
        assert_eq!(t.pages_in_use(), 6);
        t.append(a, 1).unwrap();
        assert_eq!(t.pages_in_use(), 7);
        assert!(t.append(root, 1).is_err(), "internal nodes do not grow");
        let Snapshot { tree, table, .. } = t.snapshot().unwrap();
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
        assert!(t.fork(b, 1).is_err(), "pruned nodes are gone");
    }

    #[test]
    fn a_full_pool_is_an_error_not_a_panic() {
        let mut t = PagedTree::new(8, 2).unwrap();
        let r = t.add_root(16).unwrap();
        let e = t.fork(r, 1).unwrap_err().to_string();
        assert!(e.contains("pool is full"), "{e}");
        assert_eq!(t.pages_in_use(), 2);
    }

    /// Appends inside the last page keep the layout: `catch_up` extends the snapshot in place
    /// and reports the tails; a page taken, a fork or a prune needs a new snapshot.
    #[test]
    fn appends_inside_a_page_are_caught_up_and_new_pages_are_not() {
        let mut t = PagedTree::new(16, 64).unwrap();
        let root = t.add_root(40).unwrap();
        let a = t.fork(root, 5).unwrap();
        t.set_live(a, true).unwrap();
        let mut snap = t.snapshot().unwrap();
        let a_kv = snap.tree.node(1).kv.clone();
        assert_eq!(t.catch_up(&mut snap), Some(vec![]));
        t.append(a, 3).unwrap();
        let tails = t.catch_up(&mut snap).unwrap();
        assert_eq!(
            tails,
            vec![Tail {
                end: a_kv.end,
                new_end: a_kv.end + 3
            }]
        );
        assert_eq!(snap.tree.node(1).kv, a_kv.start..a_kv.end + 3);
        assert_eq!(snap.tree.total_tokens(), a_kv.end + 3);
        t.append(a, 8).unwrap(); // 16 tokens: the page is full, not exceeded
        assert_eq!(t.catch_up(&mut snap).unwrap().len(), 1);
        t.append(a, 1).unwrap(); // a second page
        assert_eq!(t.catch_up(&mut snap), None);
        let mut snap = t.snapshot().unwrap();
        t.fork(root, 1).unwrap();
        assert_eq!(t.catch_up(&mut snap), None);
    }

    proptest! {
        /// A tree grown for many decode steps, forking now and then: plans made once per layout
        /// and extended in place (`catch_up` + `Plan::extend_tails`) cover every query's
        /// context exactly, for every method, and DeFT-Node's extended plan is the plan a fresh
        /// snapshot gives.
        #[test]
        fn plans_extended_in_place_match_the_grown_tree(
            page in 1u32..20,
            leaves in 1usize..6,
            steps in proptest::collection::vec(0u8..12, 1..40),
        ) {
            use canopy_core::{plan, Method, PlannerConfig, Shard, TreeView};
            let shape = canopy_core::AttnShape::new(8, 2, 64).unwrap();
            let cfg = PlannerConfig { node_chunk: 7, flatten_block: 5, ..PlannerConfig::default() };
            let mut t = PagedTree::new(page, 1 << 14).unwrap();
            let root = t.add_root(9).unwrap();
            for i in 0..leaves {
                let leaf = t.fork(root, 1 + i as u32).unwrap();
                t.set_live(leaf, true).unwrap();
            }
            for method in Method::ALL {
                let mut t = t.clone();
                let mut snap = t.snapshot().unwrap();
                let shard = Shard::whole(&snap.tree);
                let mut p = plan(&TreeView::new(&snap.tree, &shard), method, &shape, &cfg).unwrap();
                let mut shared = p.kv_shared_tokens();
                for &step in &steps {
                    if step == 0 {
                        // Fork a new live leaf under the first live one's parent.
                        let first = t.live()[0];
                        let parent = t.slot(first).unwrap().parent.unwrap_or(first);
                        let leaf = t.fork(parent, 2).unwrap();
                        t.set_live(leaf, true).unwrap();
                    }
                    for n in t.live() {
                        t.append(n, 1).unwrap();
                    }
                    match t.catch_up(&mut snap) {
                        Some(tails) => {
                            p.extend_tails(&tails);
                            p.grow_shared_tokens(&mut shared, &tails);
                        }
                        None => {
                            snap = t.snapshot().unwrap();
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
                }
            }
        }

        /// Random forks, appends and prunes: no physical page is ever owned twice, the table
        /// covers exactly the pages in use, and every node's logical range fits its pages.
        #[test]
        fn pages_are_never_shared_between_owners(ops in proptest::collection::vec((0u8..3, 0u32..50, 1u32..40), 1..60)) {
            let mut t = PagedTree::new(16, 4096).unwrap();
            let mut nodes = vec![t.add_root(33).unwrap()];
            for (op, pick, n) in ops {
                let target = nodes[pick as usize % nodes.len()];
                match op {
                    0 => nodes.push(t.fork(target, n).unwrap()),
                    1 => { let _ = t.append(target, n); }
                    _ if nodes.len() > 1 && target != nodes[0] => {
                        t.prune(target).unwrap();
                        nodes.retain(|&x| t.slot(x).is_ok());
                    }
                    _ => {}
                }
            }
            for &n in &nodes { t.set_live(n, true).unwrap(); }
            let Snapshot { tree, table, .. } = t.snapshot().unwrap();
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
            prop_assert_eq!(used.len(), t.pages_in_use());
        }
    }
}
