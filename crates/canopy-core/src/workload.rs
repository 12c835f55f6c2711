//! Benchmark workloads by name (`../shared/workloads.md`), defined as TOML under
//! `configs/workloads/` and embedded in the binary, plus any TOML file a user writes.
//!
//! A workload is a tree generator (long sequences, FastTree's level arrays, DeFT's few-shot,
//! tree-of-thought and speculative token trees, or an explicit list of named nodes) and a
//! default attention shape and dtype.

use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::shape::AttnShape;
use crate::tree::{KvTree, NamedNode, NodeId, TreeBuilder};
use serde::de::{DeserializeOwned, IgnoredAny};
use serde::Deserialize;

/// The workloads shipped in `configs/workloads/`, by name.
const BUILTIN: &[(&str, &str)] = &[
    ("long", include_str!("../../../configs/workloads/long.toml")),
    (
        "fasttree-0",
        include_str!("../../../configs/workloads/fasttree-0.toml"),
    ),
    (
        "fasttree-1",
        include_str!("../../../configs/workloads/fasttree-1.toml"),
    ),
    (
        "fasttree-2",
        include_str!("../../../configs/workloads/fasttree-2.toml"),
    ),
    (
        "fasttree-3",
        include_str!("../../../configs/workloads/fasttree-3.toml"),
    ),
    (
        "fasttree-4",
        include_str!("../../../configs/workloads/fasttree-4.toml"),
    ),
    (
        "fasttree-5",
        include_str!("../../../configs/workloads/fasttree-5.toml"),
    ),
    (
        "fasttree-6",
        include_str!("../../../configs/workloads/fasttree-6.toml"),
    ),
    (
        "fasttree-7",
        include_str!("../../../configs/workloads/fasttree-7.toml"),
    ),
    (
        "fasttree-8",
        include_str!("../../../configs/workloads/fasttree-8.toml"),
    ),
    (
        "fasttree-9",
        include_str!("../../../configs/workloads/fasttree-9.toml"),
    ),
    (
        "few-shot-b20",
        include_str!("../../../configs/workloads/few-shot-b20.toml"),
    ),
    (
        "few-shot-b30",
        include_str!("../../../configs/workloads/few-shot-b30.toml"),
    ),
    (
        "few-shot-b50",
        include_str!("../../../configs/workloads/few-shot-b50.toml"),
    ),
    (
        "tot-sorting",
        include_str!("../../../configs/workloads/tot-sorting.toml"),
    ),
    (
        "tot-document",
        include_str!("../../../configs/workloads/tot-document.toml"),
    ),
    (
        "tot-keyword",
        include_str!("../../../configs/workloads/tot-keyword.toml"),
    ),
    (
        "tot-set",
        include_str!("../../../configs/workloads/tot-set.toml"),
    ),
    (
        "spec-t32",
        include_str!("../../../configs/workloads/spec-t32.toml"),
    ),
    (
        "spec-t64",
        include_str!("../../../configs/workloads/spec-t64.toml"),
    ),
    (
        "spec-t128",
        include_str!("../../../configs/workloads/spec-t128.toml"),
    ),
    (
        "spec-t256",
        include_str!("../../../configs/workloads/spec-t256.toml"),
    ),
];

/// Names of the built-in workloads.
pub fn builtin_names() -> Vec<&'static str> {
    BUILTIN.iter().map(|(n, _)| *n).collect()
}

/// How a workload's tree is generated.
#[derive(Debug, Clone, PartialEq)]
pub enum TreeSpec {
    /// `batch` independent sequences of `seq_len` tokens, one decode query each.
    Long { seq_len: u32, batch: u32 },
    /// FastTree's benchmark trees: nodes and tokens per level, children spread evenly.
    Fasttree {
        nodes_per_level: Vec<u32>,
        tokens_per_level: Vec<u32>,
    },
    /// DeFT few-shot: a prompt with `branches` children of `generated` tokens, a query on each.
    FewShot {
        prompt: u32,
        branches: u32,
        generated: u32,
    },
    /// DeFT tree-of-thought (breadth-first): at each of `depth` levels the selected node gets
    /// `width` thoughts of `thought` tokens; the last level's thoughts are live.
    Tot {
        prompt: u32,
        width: u32,
        depth: u32,
        thought: u32,
    },
    /// DeFT speculative decoding: a sequence of `prompt` tokens under a token tree of `tokens`
    /// query tokens and `depth` levels (wide at depth 1, narrowing below).
    Spec {
        prompt: u32,
        tokens: u32,
        depth: u32,
    },
    /// A user's tree of named nodes.
    Explicit { nodes: Vec<NamedNode> },
}

/// The `kind` of a workload file's `[tree]`, read on its own first.
///
/// The tree's table is then read straight into its kind's own struct (`LongTree`, ...). An
/// internally tagged enum would buffer the table to find the tag, and toml's errors would
/// point at the `[tree]` header instead of the offending key.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum TreeKind {
    Long,
    Fasttree,
    FewShot,
    Tot,
    Spec,
    Explicit,
}

/// A workload file read for its tree's kind alone; every other key is skipped.
#[derive(Deserialize)]
struct KindProbe {
    tree: KindTable,
}

#[derive(Deserialize)]
struct KindTable {
    kind: Option<TreeKind>,
}

/// `[tree]` of kind `long`: [`TreeSpec::Long`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LongTree {
    /// Read by [`KindProbe`]; a field so that `deny_unknown_fields` accepts it.
    #[serde(rename = "kind")]
    _kind: IgnoredAny,
    seq_len: u32,
    #[serde(default = "one")]
    batch: u32,
}

/// `[tree]` of kind `fasttree`: [`TreeSpec::Fasttree`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FasttreeTree {
    #[serde(rename = "kind")]
    _kind: IgnoredAny,
    nodes_per_level: Vec<u32>,
    tokens_per_level: Vec<u32>,
}

/// `[tree]` of kind `few-shot`: [`TreeSpec::FewShot`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FewShotTree {
    #[serde(rename = "kind")]
    _kind: IgnoredAny,
    prompt: u32,
    branches: u32,
    generated: u32,
}

/// `[tree]` of kind `tot`: [`TreeSpec::Tot`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TotTree {
    #[serde(rename = "kind")]
    _kind: IgnoredAny,
    prompt: u32,
    width: u32,
    depth: u32,
    thought: u32,
}

/// `[tree]` of kind `spec`: [`TreeSpec::Spec`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SpecTree {
    #[serde(rename = "kind")]
    _kind: IgnoredAny,
    prompt: u32,
    tokens: u32,
    depth: u32,
}

/// `[tree]` of kind `explicit`: [`TreeSpec::Explicit`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExplicitTree {
    #[serde(rename = "kind")]
    _kind: IgnoredAny,
    nodes: Vec<NamedNode>,
}

impl From<LongTree> for TreeSpec {
    fn from(t: LongTree) -> Self {
        TreeSpec::Long {
            seq_len: t.seq_len,
            batch: t.batch,
        }
    }
}

impl From<FasttreeTree> for TreeSpec {
    fn from(t: FasttreeTree) -> Self {
        TreeSpec::Fasttree {
            nodes_per_level: t.nodes_per_level,
            tokens_per_level: t.tokens_per_level,
        }
    }
}

impl From<FewShotTree> for TreeSpec {
    fn from(t: FewShotTree) -> Self {
        TreeSpec::FewShot {
            prompt: t.prompt,
            branches: t.branches,
            generated: t.generated,
        }
    }
}

impl From<TotTree> for TreeSpec {
    fn from(t: TotTree) -> Self {
        TreeSpec::Tot {
            prompt: t.prompt,
            width: t.width,
            depth: t.depth,
            thought: t.thought,
        }
    }
}

impl From<SpecTree> for TreeSpec {
    fn from(t: SpecTree) -> Self {
        TreeSpec::Spec {
            prompt: t.prompt,
            tokens: t.tokens,
            depth: t.depth,
        }
    }
}

impl From<ExplicitTree> for TreeSpec {
    fn from(t: ExplicitTree) -> Self {
        TreeSpec::Explicit { nodes: t.nodes }
    }
}

fn one() -> u32 {
    1
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct ShapeSpec {
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    #[serde(default)]
    scale: Option<f32>,
    #[serde(default)]
    dtype: Option<DType>,
}

/// A workload file whose `[tree]` is read as `T`, one kind's struct.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkloadFile<T> {
    #[serde(default)]
    description: String,
    shape: ShapeSpec,
    tree: T,
}

impl WorkloadFile<TreeSpec> {
    /// Reads `text` with its tree as `T`, which toml's errors then locate key by key.
    fn read<T>(text: &str) -> Result<Self, toml::de::Error>
    where
        T: DeserializeOwned + Into<TreeSpec>,
    {
        let file: WorkloadFile<T> = toml::from_str(text)?;
        Ok(WorkloadFile {
            description: file.description,
            shape: file.shape,
            tree: file.tree.into(),
        })
    }
}

/// A workload definition before generation (overrides still apply).
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadSpec {
    pub name: String,
    pub description: String,
    pub shape: AttnShape,
    pub dtype: DType,
    pub tree: TreeSpec,
}

/// Command-line overrides of a workload's sizes.
#[derive(Debug, Clone, Copy, Default)]
pub struct Overrides {
    pub seq_len: Option<u32>,
    pub batch: Option<u32>,
    pub prompt_len: Option<u32>,
}

impl WorkloadSpec {
    /// A built-in workload by name, or a TOML file by path.
    pub fn load(name_or_path: &str) -> Result<WorkloadSpec> {
        if let Some((name, text)) = BUILTIN.iter().find(|(n, _)| *n == name_or_path) {
            return Self::parse(name, text);
        }
        let path = std::path::Path::new(name_or_path);
        if path.extension().is_some_and(|e| e == "toml") || path.exists() {
            let text = std::fs::read_to_string(path).map_err(|e| CoreError::WorkloadFile {
                path: name_or_path.into(),
                reason: e.to_string(),
            })?;
            let name = path.file_stem().map_or(name_or_path.to_string(), |s| {
                s.to_string_lossy().into_owned()
            });
            return Self::parse(&name, &text);
        }
        Err(CoreError::UnknownWorkload {
            name: name_or_path.into(),
            known: builtin_names().join(", "),
        })
    }

    /// Parses a workload TOML document.
    pub fn parse(name: &str, text: &str) -> Result<WorkloadSpec> {
        let toml_error = |e: toml::de::Error| CoreError::Workload(format!("{name}: {e}"));
        let probe: KindProbe = toml::from_str(text).map_err(toml_error)?;
        let file = match probe.tree.kind {
            Some(TreeKind::Long) => WorkloadFile::read::<LongTree>(text),
            Some(TreeKind::Fasttree) => WorkloadFile::read::<FasttreeTree>(text),
            Some(TreeKind::FewShot) => WorkloadFile::read::<FewShotTree>(text),
            Some(TreeKind::Tot) => WorkloadFile::read::<TotTree>(text),
            Some(TreeKind::Spec) => WorkloadFile::read::<SpecTree>(text),
            Some(TreeKind::Explicit) => WorkloadFile::read::<ExplicitTree>(text),
            None => {
                return Err(CoreError::Workload(format!(
                    "{name}: [tree] has no `kind`; set it to long, fasttree, few-shot, tot, \
                     spec or explicit"
                )))
            }
        }
        .map_err(toml_error)?;
        let shape = AttnShape {
            q_heads: file.shape.q_heads,
            kv_heads: file.shape.kv_heads,
            head_dim: file.shape.head_dim,
            scale: file.shape.scale,
        };
        shape
            .validate()
            .map_err(|e| CoreError::Workload(format!("{name}: [shape] {e}")))?;
        Ok(WorkloadSpec {
            name: name.to_string(),
            description: file.description,
            shape,
            dtype: file.shape.dtype.unwrap_or(DType::F16),
            tree: file.tree,
        })
    }

    /// Applies size overrides (`--seq-len`, `--batch`, `--prompt-len`) where they make sense.
    pub fn with_overrides(mut self, o: Overrides) -> Result<WorkloadSpec> {
        match &mut self.tree {
            TreeSpec::Long { seq_len, batch } => {
                *seq_len = o.seq_len.unwrap_or(*seq_len);
                *batch = o.batch.unwrap_or(*batch);
            }
            TreeSpec::FewShot { prompt, .. }
            | TreeSpec::Tot { prompt, .. }
            | TreeSpec::Spec { prompt, .. } => {
                *prompt = o.prompt_len.unwrap_or(*prompt);
            }
            _ => {}
        }
        let applies_seq = matches!(self.tree, TreeSpec::Long { .. });
        if !applies_seq && (o.seq_len.is_some() || o.batch.is_some()) {
            return Err(CoreError::Workload(format!(
                "--seq-len and --batch apply to the `long` workload, not `{}`",
                self.name
            )));
        }
        let has_prompt = matches!(
            self.tree,
            TreeSpec::FewShot { .. } | TreeSpec::Tot { .. } | TreeSpec::Spec { .. }
        );
        if !has_prompt && o.prompt_len.is_some() {
            return Err(CoreError::Workload(format!(
                "--prompt-len applies to few-shot, tot and spec workloads, not `{}`",
                self.name
            )));
        }
        Ok(self)
    }

    /// Generates the tree.
    pub fn build_tree(&self) -> Result<KvTree> {
        build_tree(&self.tree)
    }
}

fn positive(name: &str, v: u32) -> Result<u32> {
    if v == 0 {
        Err(CoreError::Workload(format!("`{name}` must be at least 1")))
    } else {
        Ok(v)
    }
}

/// Hangs `count` children under `parents`, child `j` under `parents[j * len / count]`.
fn spread_level(
    b: &mut TreeBuilder,
    parents: &[NodeId],
    count: u32,
    tokens: u32,
) -> Result<Vec<NodeId>> {
    (0..count as usize)
        .map(|j| match parents {
            [] => Ok(b.add_root(tokens)),
            _ => b.add_child(parents[j * parents.len() / count as usize], tokens),
        })
        .collect()
}

pub fn build_tree(spec: &TreeSpec) -> Result<KvTree> {
    let mut b = TreeBuilder::new();
    match spec {
        TreeSpec::Long { seq_len, batch } => {
            let len = positive("seq_len", *seq_len)?;
            for _ in 0..positive("batch", *batch)? {
                let r = b.add_root(len);
                b.add_query(r)?;
            }
        }
        TreeSpec::Fasttree {
            nodes_per_level,
            tokens_per_level,
        } => {
            if nodes_per_level.len() != tokens_per_level.len() || nodes_per_level.is_empty() {
                return Err(CoreError::Workload(
                    "nodes_per_level and tokens_per_level must be non-empty and of equal length"
                        .into(),
                ));
            }
            let mut level = Vec::new();
            for (&n, &c) in nodes_per_level.iter().zip(tokens_per_level) {
                level = spread_level(
                    &mut b,
                    &level,
                    positive("nodes_per_level", n)?,
                    positive("tokens_per_level", c)?,
                )?;
            }
            for &leaf in &level {
                b.add_query(leaf)?;
            }
        }
        TreeSpec::FewShot {
            prompt,
            branches,
            generated,
        } => {
            let root = b.add_root(positive("prompt", *prompt)?);
            for _ in 0..positive("branches", *branches)? {
                let c = b.add_child(root, positive("generated", *generated)?)?;
                b.add_query(c)?;
            }
        }
        TreeSpec::Tot {
            prompt,
            width,
            depth,
            thought,
        } => {
            let mut selected = b.add_root(positive("prompt", *prompt)?);
            let mut live = Vec::new();
            for _ in 0..positive("depth", *depth)? {
                live = (0..positive("width", *width)?)
                    .map(|_| b.add_child(selected, positive("thought", *thought)?))
                    .collect::<Result<_>>()?;
                selected = live[0];
            }
            for &n in &live {
                b.add_query(n)?;
            }
        }
        TreeSpec::Spec {
            prompt,
            tokens,
            depth,
        } => {
            let root = b.add_root(positive("prompt", *prompt)?);
            let depth = positive("depth", *depth)?;
            if *tokens < depth {
                return Err(CoreError::Workload(format!(
                    "a token tree of depth {depth} needs at least {depth} tokens"
                )));
            }
            // Level i gets weight depth - i: wide at depth 1, narrowing below.
            let weights: Vec<u32> = (0..depth).map(|i| depth - i).collect();
            let total: u32 = weights.iter().sum();
            let mut sizes: Vec<u32> = weights
                .iter()
                .map(|w| (tokens * w / total).max(1))
                .collect();
            let assigned: u32 = sizes.iter().sum();
            sizes[0] = (sizes[0] + tokens).saturating_sub(assigned).max(1);
            let mut level = vec![root];
            for &count in &sizes {
                level = spread_level(&mut b, &level, count, 1)?;
                for &n in &level {
                    b.add_query(n)?;
                }
            }
        }
        TreeSpec::Explicit { nodes } => {
            let tree = KvTree::from_named(nodes)?;
            if tree.num_queries() == 0 {
                return Err(CoreError::Workload(
                    "the tree has no queries; set `queries = 1` on live leaves".into(),
                ));
            }
            return Ok(tree);
        }
    }
    b.build()
}

/// A random tree for property and conformance tests: forests, deep chains, single-token
/// nodes, wide fans, queries on internal nodes (token trees) and dead leaves (pruned branches
/// still in the cache) all occur. Always has at least one query.
pub fn random_tree(seed: u64, max_nodes: usize, max_tokens: u32) -> KvTree {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let nodes = rng.gen_range(1..=max_nodes.max(1));
    let chain = rng.gen_bool(0.2);
    let mut b = TreeBuilder::new();
    let mut ids: Vec<NodeId> = Vec::new();
    for i in 0..nodes {
        let tokens = if rng.gen_bool(0.3) {
            1
        } else {
            rng.gen_range(1..=max_tokens.max(1))
        };
        let id = if i == 0 || rng.gen_bool(0.05) {
            b.add_root(tokens)
        } else {
            let parent = if chain {
                ids[i - 1]
            } else {
                ids[rng.gen_range(0..ids.len())]
            };
            b.add_child(parent, tokens).expect("parent exists")
        };
        ids.push(id);
    }
    let tree = b.clone().build().expect("valid by construction");
    for &id in &ids {
        let leaf = tree.node(id).children.is_empty();
        // Most leaves are live; a few internal nodes carry token-tree queries.
        if (leaf && rng.gen_bool(0.85)) || (!leaf && rng.gen_bool(0.15)) {
            b.add_query(id).expect("node exists");
        }
    }
    if b.clone().build().map_or(true, |t| t.num_queries() == 0) {
        b.add_query(*ids.last().expect("one node"))
            .expect("node exists");
    }
    b.build().expect("valid by construction")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_parses_and_builds() {
        for name in builtin_names() {
            let spec = WorkloadSpec::load(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            let tree = spec.build_tree().unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(tree.num_queries() > 0, "{name}");
        }
    }

    #[test]
    fn fasttree_sizes_match_the_peer_table() {
        // Tree tokens as listed in shared/peers.md.
        for (name, tokens, requests) in [
            ("fasttree-0", 2568, 64),
            ("fasttree-4", 34816, 1024),
            ("fasttree-7", 278816, 1024),
            ("fasttree-9", 20464, 1024),
        ] {
            let t = WorkloadSpec::load(name).unwrap().build_tree().unwrap();
            assert_eq!(
                (t.total_tokens(), t.num_queries()),
                (tokens, requests),
                "{name}"
            );
        }
    }

    #[test]
    fn spec_tree_has_requested_tokens_and_depth() {
        let spec = WorkloadSpec::load("spec-t64")
            .unwrap()
            .with_overrides(Overrides {
                prompt_len: Some(100),
                ..Default::default()
            })
            .unwrap();
        let t = spec.build_tree().unwrap();
        assert_eq!(t.num_queries(), 64);
        assert_eq!(t.total_tokens(), 164);
        assert!(t.nodes().iter().all(|n| n.depth <= 4));
    }

    /// A misspelt key of a hand-written node is refused, not read as its default.
    #[test]
    fn unknown_node_keys_are_refused() {
        let text = |extra: &str| {
            format!(
                "[shape]\nq_heads = 4\nkv_heads = 2\nhead_dim = 64\n[tree]\nkind = \"explicit\"\n\
                 [[tree.nodes]]\nid = \"a\"\ntokens = 64\n{extra}\n"
            )
        };
        let spec = WorkloadSpec::parse("mine", &text("queries = 1")).unwrap();
        assert_eq!(spec.build_tree().unwrap().num_queries(), 1);
        let e = WorkloadSpec::parse("mine", &text("querys = 1")).unwrap_err();
        assert!(e.to_string().contains("querys"), "{e}");
    }

    #[test]
    fn unknown_names_and_misapplied_overrides_are_clear() {
        let e = WorkloadSpec::load("fasttree-99").unwrap_err().to_string();
        assert!(
            e.contains("unknown workload") && e.contains("fasttree-4"),
            "{e}"
        );
        let e = WorkloadSpec::load("fasttree-1")
            .unwrap()
            .with_overrides(Overrides {
                seq_len: Some(5),
                ..Default::default()
            });
        assert!(e.unwrap_err().to_string().contains("--seq-len"));
    }

    /// `[shape]` and a `[tree]` of `kind`, its lines numbered from 1 as toml numbers them.
    fn workload(kind: &str, tree: &str) -> String {
        format!(
            "[shape]\nq_heads = 4\nkv_heads = 2\nhead_dim = 64\n[tree]\nkind = \"{kind}\"\n{tree}"
        )
    }

    /// Parses a workload that must fail and returns its error's text.
    fn parse_error(text: &str) -> String {
        WorkloadSpec::parse("mine", text).unwrap_err().to_string()
    }

    /// toml's error names the line and shows it with the bad value marked.
    fn assert_points_at(e: &str, line: usize, text: &str) {
        assert!(
            e.contains(&format!("line {line},")) && e.contains(&format!("{line} | {text}")),
            "expected line {line} (`{text}`) in:\n{e}"
        );
    }

    /// A bad value or key in `[tree]` is reported at its own line, not at the table's header.
    #[test]
    fn tree_errors_point_at_the_offending_key() {
        let e = parse_error(&workload("long", "seq_len = \"abc\"\n"));
        assert_points_at(&e, 7, "seq_len = \"abc\"");
        assert!(e.contains("mine") && e.contains("invalid type"), "{e}");

        let e = parse_error(&workload(
            "fasttree",
            "nodes_per_level = 3\ntokens_per_level = [8, 32]\n",
        ));
        assert_points_at(&e, 7, "nodes_per_level = 3");

        let e = parse_error(&workload(
            "few-shot",
            "prompt = 8\nbranchs = 2\ngenerated = 4\n",
        ));
        assert_points_at(&e, 8, "branchs = 2");
        assert!(e.contains("unknown field `branchs`"), "{e}");

        let e = parse_error(&workload("spec", "prompt = 8\ntokens = -4\ndepth = 2\n"));
        assert_points_at(&e, 8, "tokens = -4");
    }

    /// A missing key names itself and the table it is missing from.
    #[test]
    fn a_missing_tree_key_is_named() {
        let e = parse_error(&workload("tot", "prompt = 8\nwidth = 2\ndepth = 2\n"));
        assert!(e.contains("missing field `thought`"), "{e}");
        assert_points_at(&e, 5, "[tree]");
    }

    /// A hand-written node's bad value or key is reported at its line.
    #[test]
    fn explicit_node_errors_point_at_the_node() {
        let nodes = |second: &str| {
            workload(
                "explicit",
                &format!("[[tree.nodes]]\nid = \"a\"\ntokens = 64\n[[tree.nodes]]\nid = \"b\"\nparent = \"a\"\n{second}\n"),
            )
        };
        let e = parse_error(&nodes("tokens = \"many\""));
        assert_points_at(&e, 13, "tokens = \"many\"");
        let e = parse_error(&nodes("tokens = 4\nquerys = 1"));
        assert_points_at(&e, 14, "querys = 1");
    }

    /// An unknown or absent kind is refused with the kinds there are.
    #[test]
    fn tree_kinds_are_listed() {
        let e = parse_error(&workload("forest", ""));
        assert_points_at(&e, 6, "kind = \"forest\"");
        assert!(e.contains("fasttree") && e.contains("explicit"), "{e}");
        let e =
            parse_error("[shape]\nq_heads = 4\nkv_heads = 2\nhead_dim = 64\n[tree]\nseq_len = 4\n");
        assert!(e.contains("kind") && e.contains("few-shot"), "{e}");
    }

    /// `[shape]`'s bad values are reported at their line too.
    #[test]
    fn shape_errors_point_at_the_offending_key() {
        let text = workload("long", "seq_len = 4\n").replace("head_dim = 64", "head_dim = \"64\"");
        assert_points_at(&parse_error(&text), 4, "head_dim = \"64\"");
        let text = workload("long", "seq_len = 4\n").replace("[shape]", "[shape]\ndtype = \"f8\"");
        let e = parse_error(&text);
        assert_points_at(&e, 2, "dtype = \"f8\"");
    }

    #[test]
    fn bad_toml_is_reported_with_its_name() {
        let e = WorkloadSpec::parse("mine", "[shape]\nq_heads = 30\nkv_heads = 8\nhead_dim = 128\n[tree]\nkind = \"long\"\nseq_len = 4\n");
        assert!(e.unwrap_err().to_string().contains("multiple"));
        let e = WorkloadSpec::parse(
            "mine",
            "[shape]\nq_heads = 8\nkv_heads = 8\nhead_dim = 128\n[tree]\nkind = \"forest\"\n",
        );
        assert!(e.unwrap_err().to_string().contains("mine"));
    }
}
