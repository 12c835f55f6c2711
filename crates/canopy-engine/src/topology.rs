//! Which ranks share a node, for the hierarchical merge.
//!
//! Ranks of one node talk over NVLink; nodes talk over the (much slower) network. The
//! hierarchical merge reduces inside each node first, so that only one rank per node (its
//! *leader*, the node's lowest rank) crosses the network.
//!
//! Nodes come from the launcher (MPI's processor names, i.e. host names) or from an override
//! that cuts one host into `k` contiguous *virtual nodes*, to exercise the two-level path on a
//! single machine.

use crate::{EngineError, Result};
use serde::Serialize;

/// The node of every rank; nodes are numbered in order of their lowest rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeLayout {
    node_of: Vec<usize>,
}

impl NodeLayout {
    /// Every rank on one node.
    pub fn single(ranks: usize) -> NodeLayout {
        NodeLayout {
            node_of: vec![0; ranks],
        }
    }

    /// `ranks` cut into `nodes` contiguous virtual nodes of equal size.
    pub fn virtual_nodes(ranks: usize, nodes: usize) -> Result<NodeLayout> {
        if nodes == 0 || !ranks.is_multiple_of(nodes) {
            return Err(EngineError::Config(format!(
                "cannot split {ranks} ranks into {nodes} equal virtual nodes; pick a divisor of {ranks}"
            )));
        }
        let per = ranks / nodes;
        Ok(NodeLayout {
            node_of: (0..ranks).map(|r| r / per).collect(),
        })
    }

    /// Ranks grouped by host name (`names[r]` is rank r's host).
    pub fn from_host_names<S: AsRef<str>>(names: &[S]) -> NodeLayout {
        let mut seen: Vec<&str> = Vec::new();
        let node_of = names
            .iter()
            .map(|n| {
                let n = n.as_ref();
                seen.iter().position(|s| *s == n).unwrap_or_else(|| {
                    seen.push(n);
                    seen.len() - 1
                })
            })
            .collect();
        NodeLayout { node_of }
    }

    pub fn ranks(&self) -> usize {
        self.node_of.len()
    }

    pub fn nodes(&self) -> usize {
        self.node_of.iter().max().map_or(0, |m| m + 1)
    }

    pub fn node_of(&self, rank: usize) -> usize {
        self.node_of[rank]
    }

    /// The ranks of `node`, ascending; the first is the node's leader.
    pub fn members(&self, node: usize) -> Vec<usize> {
        (0..self.ranks())
            .filter(|&r| self.node_of[r] == node)
            .collect()
    }

    /// Every node's leader, in node order.
    pub fn leaders(&self) -> Vec<usize> {
        (0..self.nodes()).map(|n| self.members(n)[0]).collect()
    }

    /// The largest node's rank count.
    pub fn max_node_size(&self) -> usize {
        (0..self.nodes())
            .map(|n| self.members(n).len())
            .max()
            .unwrap_or(0)
    }

    /// Checks that this layout describes a world of `ranks`.
    pub fn check(&self, ranks: usize) -> Result<()> {
        if self.ranks() != ranks {
            return Err(EngineError::Config(format!(
                "the node layout covers {} ranks but the world has {ranks}",
                self.ranks()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtual_nodes_are_contiguous_blocks() {
        let l = NodeLayout::virtual_nodes(8, 2).unwrap();
        assert_eq!(l.nodes(), 2);
        assert_eq!(l.members(1), vec![4, 5, 6, 7]);
        assert_eq!(l.leaders(), vec![0, 4]);
        assert!(NodeLayout::virtual_nodes(6, 4).is_err());
        assert!(NodeLayout::virtual_nodes(6, 0).is_err());
    }

    #[test]
    fn host_names_group_interleaved_ranks() {
        let l = NodeLayout::from_host_names(&["b", "a", "b", "a", "c"]);
        assert_eq!(l.nodes(), 3);
        assert_eq!(l.members(0), vec![0, 2]);
        assert_eq!(l.members(1), vec![1, 3]);
        assert_eq!(l.leaders(), vec![0, 1, 4]);
        assert_eq!(l.max_node_size(), 2);
    }
}
