//! The KV tree: a radix tree of the KV cache.
//!
//! Each node owns a run of tokens; a token's context is the tokens of every node on the path
//! from its root down to its own node. A *query* attaches to a node and attends to exactly that
//! path, itself included. One rule covers every workload: a decode query on a live leaf (the
//! leaf already holds the new token's KV), a long sequence (a single node), a batch (a forest),
//! and a speculative token tree (single-token nodes under the sequence, a query on each, which
//! gives the tree-causal mask for free).
//!
//! Nodes are laid out depth-first (pre-order, children in insertion order), so the flattened
//! token order that DeFT-Flatten and the rank sharding split is the KV address order itself.

use crate::error::{CoreError, Result};
use std::ops::Range;

pub type NodeId = u32;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub parent: Option<NodeId>,
    pub children: Vec<NodeId>,
    /// The node's tokens in the KV address space (= flattened depth-first order).
    pub kv: Range<u32>,
    pub depth: u32,
}

impl Node {
    pub fn len(&self) -> u32 {
        self.kv.end - self.kv.start
    }

    pub fn is_empty(&self) -> bool {
        self.kv.is_empty()
    }
}

/// An immutable, validated KV tree (a forest: one root per independent request or prompt).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvTree {
    nodes: Vec<Node>,
    roots: Vec<NodeId>,
    /// The node each query attaches to, indexed by query row.
    query_nodes: Vec<NodeId>,
    /// For each node, the queries whose path passes through it, ascending.
    node_queries: Vec<Vec<u32>>,
    /// Node ids in depth-first pre-order (= ascending KV address).
    dfs: Vec<NodeId>,
    /// For each node, the index (into `roots`) of the root above it.
    root_index: Vec<u32>,
    total_tokens: u32,
}

/// Builds a [`KvTree`]. Parents must exist before their children, so a builder cannot make a
/// cycle; [`KvTree::from_named`] checks user input that can.
#[derive(Debug, Default, Clone)]
pub struct TreeBuilder {
    parents: Vec<Option<NodeId>>,
    lens: Vec<u32>,
    /// Addresses kept free after each node's tokens (see [`TreeBuilder::reserve`]).
    room: Vec<u32>,
    queries: Vec<NodeId>,
    /// Every node starts at a multiple of this many addresses (1: packed).
    align: u32,
    /// Whether nodes of zero tokens are accepted.
    empty_nodes: bool,
}

impl TreeBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts every node's addresses at a multiple of `align` (a KV page), so that each node
    /// owns whole logical pages and a page table can map them to shared physical pages. The
    /// gaps hold no tokens; [`KvTree::total_tokens`] then counts the address space.
    pub fn with_alignment(mut self, align: u32) -> Self {
        self.align = align.max(1);
        self
    }

    /// Accepts nodes of zero tokens. One rank's part of a sequence-sharded tree keeps every
    /// node, so that all ranks' trees have one topology and one query order, and a node of
    /// which the rank holds no token is empty there. Planners skip empty nodes, as they skip
    /// the nodes outside a shard's windows.
    pub fn with_empty_nodes(mut self) -> Self {
        self.empty_nodes = true;
        self
    }

    pub fn add_root(&mut self, tokens: u32) -> NodeId {
        self.parents.push(None);
        self.lens.push(tokens);
        self.room.push(0);
        (self.lens.len() - 1) as NodeId
    }

    /// Adds a child of `parent`; `parent` must be an id this builder returned.
    pub fn add_child(&mut self, parent: NodeId, tokens: u32) -> Result<NodeId> {
        if parent as usize >= self.lens.len() {
            return Err(CoreError::Tree(format!(
                "parent node {parent} does not exist"
            )));
        }
        self.parents.push(Some(parent));
        self.lens.push(tokens);
        self.room.push(0);
        Ok((self.lens.len() - 1) as NodeId)
    }

    /// Keeps `tokens` addresses after `node`'s tokens free of other nodes: room for a leaf
    /// that decodes to grow into ([`KvTree::extend_node`]) while every other node keeps its
    /// addresses, so plans of the tree stay valid as it grows.
    pub fn reserve(&mut self, node: NodeId, tokens: u32) -> Result<()> {
        let room = self
            .room
            .get_mut(node as usize)
            .ok_or_else(|| CoreError::Tree(format!("room reserved for missing node {node}")))?;
        *room = tokens;
        Ok(())
    }

    /// Attaches one query (a decode or token-tree query row) to `node`.
    pub fn add_query(&mut self, node: NodeId) -> Result<u32> {
        if node as usize >= self.lens.len() {
            return Err(CoreError::Tree(format!(
                "query attached to missing node {node}"
            )));
        }
        self.queries.push(node);
        Ok((self.queries.len() - 1) as u32)
    }

    pub fn num_nodes(&self) -> usize {
        self.lens.len()
    }

    pub fn build(self) -> Result<KvTree> {
        let n = self.lens.len();
        if n == 0 {
            return Err(CoreError::Tree("the tree has no nodes".into()));
        }
        if let Some(i) = self.lens.iter().position(|&l| l == 0 && !self.empty_nodes) {
            return Err(CoreError::Tree(format!(
                "node {i} has zero tokens; every node needs at least one"
            )));
        }
        let total: u64 = self.lens.iter().chain(&self.room).map(|&l| l as u64).sum();
        if total > u32::MAX as u64 / 2 {
            return Err(CoreError::Tree(format!(
                "{total} tokens exceed the 2^31 token address space"
            )));
        }
        let mut children = vec![Vec::new(); n];
        let mut roots = Vec::new();
        for (i, p) in self.parents.iter().enumerate() {
            match p {
                Some(p) => children[*p as usize].push(i as NodeId),
                None => roots.push(i as NodeId),
            }
        }
        // Depth-first pre-order layout with an explicit stack (trees can be deep chains).
        let mut nodes: Vec<Node> = (0..n)
            .map(|i| Node {
                parent: self.parents[i],
                children: children[i].clone(),
                kv: 0..0,
                depth: 0,
            })
            .collect();
        let mut dfs = Vec::with_capacity(n);
        let mut next = 0u32;
        let mut stack: Vec<NodeId> = roots.iter().rev().copied().collect();
        while let Some(id) = stack.pop() {
            let depth = nodes[id as usize]
                .parent
                .map_or(0, |p| nodes[p as usize].depth + 1);
            let len = self.lens[id as usize];
            next = next.next_multiple_of(self.align.max(1));
            let node = &mut nodes[id as usize];
            node.depth = depth;
            node.kv = next..next + len;
            next += len + self.room[id as usize];
            dfs.push(id);
            stack.extend(children[id as usize].iter().rev());
        }
        debug_assert_eq!(dfs.len(), n, "builder parents always precede children");
        let mut node_queries = vec![Vec::new(); n];
        for (q, &attach) in self.queries.iter().enumerate() {
            let mut cur = Some(attach);
            while let Some(id) = cur {
                node_queries[id as usize].push(q as u32);
                cur = nodes[id as usize].parent;
            }
        }
        let mut root_index = vec![0u32; n];
        for &id in &dfs {
            root_index[id as usize] = match nodes[id as usize].parent {
                Some(p) => root_index[p as usize],
                None => roots.iter().position(|&r| r == id).unwrap_or(0) as u32,
            };
        }
        Ok(KvTree {
            nodes,
            roots,
            query_nodes: self.queries,
            node_queries,
            dfs,
            root_index,
            total_tokens: next,
        })
    }
}

/// A root of `root` tokens with `leaves` children of `leaf` tokens, one query each: the
/// shared-prefix shape the planner and model tests use.
#[cfg(test)]
pub(crate) fn fan(root: u32, leaves: usize, leaf: u32) -> KvTree {
    let mut b = TreeBuilder::new();
    let r = b.add_root(root);
    for _ in 0..leaves {
        let c = b.add_child(r, leaf).unwrap();
        b.add_query(c).unwrap();
    }
    b.build().unwrap()
}

/// A node of a user-written tree: named, with its parent by name. A key it does not have is
/// refused, so a misspelt one (`querys`) is not read as its default.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct NamedNode {
    pub id: String,
    #[serde(default)]
    pub parent: Option<String>,
    pub tokens: u32,
    /// Query rows attached to this node (decode queries on a leaf, usually 1).
    #[serde(default)]
    pub queries: u32,
}

impl KvTree {
    /// Builds a tree from named nodes in any order, rejecting duplicate names, orphans (a parent
    /// name nobody defines) and cycles with messages that name the nodes involved.
    pub fn from_named(nodes: &[NamedNode]) -> Result<KvTree> {
        use std::collections::HashMap;
        let mut index: HashMap<&str, usize> = HashMap::new();
        for (i, n) in nodes.iter().enumerate() {
            if index.insert(n.id.as_str(), i).is_some() {
                return Err(CoreError::Tree(format!(
                    "node id `{}` is defined twice",
                    n.id
                )));
            }
        }
        let mut children: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
        let mut roots = Vec::new();
        for (i, n) in nodes.iter().enumerate() {
            match &n.parent {
                None => roots.push(i),
                Some(p) => match index.get(p.as_str()) {
                    Some(&pi) => children[pi].push(i),
                    None => {
                        return Err(CoreError::Tree(format!(
                            "node `{}` names parent `{p}`, which is not defined (orphan node)",
                            n.id
                        )))
                    }
                },
            }
        }
        let mut b = TreeBuilder::new();
        let mut new_id = vec![None; nodes.len()];
        let mut stack: Vec<(usize, Option<NodeId>)> =
            roots.iter().rev().map(|&r| (r, None)).collect();
        while let Some((i, parent)) = stack.pop() {
            let id = match parent {
                None => b.add_root(nodes[i].tokens),
                Some(p) => b.add_child(p, nodes[i].tokens)?,
            };
            new_id[i] = Some(id);
            for _ in 0..nodes[i].queries {
                b.add_query(id)?;
            }
            stack.extend(children[i].iter().rev().map(|&c| (c, Some(id))));
        }
        if let Some(i) = new_id.iter().position(Option::is_none) {
            return Err(CoreError::Tree(format!(
                "node `{}` is on a cycle of parents and never reaches a root",
                nodes[i].id
            )));
        }
        if let Some(n) = nodes.iter().find(|n| n.tokens == 0) {
            return Err(CoreError::Tree(format!(
                "node `{}` has zero tokens; every node needs at least one",
                n.id
            )));
        }
        b.build()
    }

    /// Moves the end of `id`'s tokens to `new_end`, for a node that grew into addresses no
    /// other node holds (its last page's free part, or room [`TreeBuilder::reserve`] kept for
    /// it): a paged cache's catch-up (`canopy_kv`)
    /// grows a snapshot's tree in place this way instead of building it again.
    pub fn extend_node(&mut self, id: NodeId, new_end: u32) {
        let node = &mut self.nodes[id as usize];
        debug_assert!(new_end >= node.kv.end);
        node.kv.end = new_end;
        self.total_tokens = self.total_tokens.max(new_end);
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    pub fn roots(&self) -> &[NodeId] {
        &self.roots
    }

    pub fn num_queries(&self) -> usize {
        self.query_nodes.len()
    }

    pub fn query_node(&self, q: u32) -> NodeId {
        self.query_nodes[q as usize]
    }

    /// Queries whose context includes `node` (those attached in its subtree), ascending.
    pub fn queries_through(&self, node: NodeId) -> &[u32] {
        &self.node_queries[node as usize]
    }

    /// Node ids in depth-first pre-order, i.e. by ascending KV address.
    pub fn dfs_order(&self) -> &[NodeId] {
        &self.dfs
    }

    /// Tokens in the address space: every node's tokens, plus alignment gaps if any.
    pub fn total_tokens(&self) -> u32 {
        self.total_tokens
    }

    /// The root-to-node path, root first.
    pub fn path(&self, node: NodeId) -> Vec<NodeId> {
        let mut path = Vec::with_capacity(self.nodes[node as usize].depth as usize + 1);
        let mut cur = Some(node);
        while let Some(id) = cur {
            path.push(id);
            cur = self.nodes[id as usize].parent;
        }
        path.reverse();
        path
    }

    /// The KV address ranges query `q` attends to, root first.
    pub fn query_context(&self, q: u32) -> Vec<Range<u32>> {
        self.path(self.query_node(q))
            .into_iter()
            .map(|n| self.nodes[n as usize].kv.clone())
            .collect()
    }

    pub fn query_context_len(&self, q: u32) -> u64 {
        self.query_context(q)
            .iter()
            .map(|r| (r.end - r.start) as u64)
            .sum()
    }

    /// Tokens on at least one query's path: what attention over the tree must read at least
    /// once, however it is planned (a node below no query is not read).
    pub fn queried_tokens(&self) -> u64 {
        self.nodes
            .iter()
            .zip(&self.node_queries)
            .filter(|(_, q)| !q.is_empty())
            .map(|(n, _)| n.len() as u64)
            .sum()
    }

    /// Index (into [`KvTree::roots`]) of the root whose subtree holds `node`.
    pub fn root_index(&self, node: NodeId) -> usize {
        self.root_index[node as usize] as usize
    }

    /// Tokens in the subtree of each root, in root order (each root's subtree is one contiguous
    /// address range because of the depth-first layout).
    pub fn root_spans(&self) -> Vec<Range<u32>> {
        let mut ends = vec![0u32; self.nodes.len()];
        for &id in self.dfs.iter().rev() {
            let node = &self.nodes[id as usize];
            ends[id as usize] = node
                .children
                .iter()
                .map(|&c| ends[c as usize])
                .max()
                .unwrap_or(node.kv.end);
        }
        self.roots
            .iter()
            .map(|&r| self.nodes[r as usize].kv.start..ends[r as usize])
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> KvTree {
        // root(10) -> a(5) -> a1(2) [q0]
        //          -> b(3) [q1], and q2 on the root itself
        let mut b = TreeBuilder::new();
        let root = b.add_root(10);
        let a = b.add_child(root, 5).unwrap();
        let a1 = b.add_child(a, 2).unwrap();
        let bb = b.add_child(root, 3).unwrap();
        b.add_query(a1).unwrap();
        b.add_query(bb).unwrap();
        b.add_query(root).unwrap();
        b.build().unwrap()
    }

    #[test]
    fn queried_tokens_count_each_node_on_a_query_path_once() {
        // root, a, a1 and b are on query paths; a sibling with no query below it is not.
        let mut b = TreeBuilder::new();
        let root = b.add_root(10);
        let a = b.add_child(root, 5).unwrap();
        let a1 = b.add_child(a, 2).unwrap();
        let bb = b.add_child(root, 3).unwrap();
        b.add_child(root, 7).unwrap();
        b.add_query(a1).unwrap();
        b.add_query(a1).unwrap();
        b.add_query(bb).unwrap();
        assert_eq!(b.build().unwrap().queried_tokens(), 20);
        assert_eq!(small().queried_tokens(), 20);
    }

    #[test]
    fn reserved_room_keeps_the_next_nodes_away() {
        let mut b = TreeBuilder::new().with_alignment(4);
        let root = b.add_root(6);
        let leaf = b.add_child(root, 3).unwrap();
        b.reserve(leaf, 9).unwrap();
        let other = b.add_child(root, 2).unwrap();
        assert!(b.reserve(7, 1).is_err(), "no node 7");
        let mut t = b.build().unwrap();
        assert_eq!(t.node(leaf).kv, 8..11);
        // 11 + 9 = 20: the sibling starts on the next boundary past the room.
        assert_eq!(t.node(other).kv, 20..22);
        t.extend_node(leaf, 20);
        assert_eq!(t.node(leaf).kv, 8..20);
        assert_eq!(t.node(other).kv, 20..22);
    }

    #[test]
    fn depth_first_layout() {
        let t = small();
        assert_eq!(t.node(0).kv, 0..10);
        assert_eq!(t.node(1).kv, 10..15);
        assert_eq!(t.node(2).kv, 15..17);
        assert_eq!(t.node(3).kv, 17..20);
        assert_eq!(t.total_tokens(), 20);
        assert_eq!(t.dfs_order(), &[0, 1, 2, 3]);
        assert_eq!(t.root_spans(), vec![0..20]);
    }

    #[test]
    fn contexts_follow_paths() {
        let t = small();
        assert_eq!(t.query_context(0), vec![0..10, 10..15, 15..17]);
        assert_eq!(t.query_context(1), vec![0..10, 17..20]);
        assert_eq!(t.query_context(2), vec![0..10]);
        assert_eq!(t.queries_through(0), &[0, 1, 2]);
        assert_eq!(t.queries_through(1), &[0]);
    }

    #[test]
    fn named_trees_reject_orphans_cycles_and_duplicates() {
        let n = |id: &str, parent: Option<&str>| NamedNode {
            id: id.into(),
            parent: parent.map(Into::into),
            tokens: 4,
            queries: 1,
        };
        assert!(KvTree::from_named(&[n("b", Some("a")), n("a", None)]).is_ok());
        let orphan = KvTree::from_named(&[n("a", None), n("b", Some("zz"))]).unwrap_err();
        assert!(orphan.to_string().contains("orphan"), "{orphan}");
        let cycle =
            KvTree::from_named(&[n("r", None), n("a", Some("b")), n("b", Some("a"))]).unwrap_err();
        assert!(cycle.to_string().contains("cycle"), "{cycle}");
        let dup = KvTree::from_named(&[n("a", None), n("a", None)]).unwrap_err();
        assert!(dup.to_string().contains("twice"), "{dup}");
        let mut zero = n("a", None);
        zero.tokens = 0;
        assert!(KvTree::from_named(&[zero])
            .unwrap_err()
            .to_string()
            .contains("zero tokens"));
    }

    #[test]
    fn forests_have_one_span_per_root() {
        let mut b = TreeBuilder::new();
        let r0 = b.add_root(7);
        b.add_child(r0, 2).unwrap();
        b.add_root(5);
        let t = b.build().unwrap();
        assert_eq!(t.root_spans(), vec![0..9, 9..14]);
    }
}
