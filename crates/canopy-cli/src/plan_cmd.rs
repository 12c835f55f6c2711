//! `canopy plan`: planners side by side on one workload.

use crate::table::{bytes, Table};
use anyhow::{bail, Result};
use canopy_core::{
    choose, plan, shard_tree, AttnShape, DType, DeviceModel, IoReport, KvTree, Method, Overrides,
    PlanCost, PlannerConfig, TreeView, WorkloadSpec,
};
use clap::Args;
use serde::Serialize;
use std::time::Instant;

#[derive(Args)]
pub struct PlanArgs {
    /// A built-in workload (fasttree-0 … fasttree-9, few-shot-b20/-b30/-b50, tot-sorting,
    /// tot-document, tot-keyword, tot-set, spec-t32 … spec-t256, long) or a TOML file.
    #[arg(long)]
    workload: String,
    /// q-guided, deft-node, deft-node-chunk, deft-flatten, fasttree, a comma list, or all.
    #[arg(long, default_value = "all")]
    method: String,
    #[command(flatten)]
    shape: ShapeArgs,
    /// Plan rank 0's shard of an even split over this many ranks.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    #[command(flatten)]
    sizes: SizeArgs,
    /// The device model (TOML, as `canopy fit-model --out` writes) that prices each plan and
    /// that `auto` chooses by, instead of the built-in H100 fit.
    #[arg(long)]
    device_model: Option<std::path::PathBuf>,
    #[arg(long)]
    json: bool,
}

/// Attention shape flags shared by the commands; unset flags keep the workload's defaults.
#[derive(Args, Clone, Copy)]
pub struct ShapeArgs {
    /// Query heads [default: the workload's; `long`, which `bench attention` and `bench
    /// scaling` run: 16].
    #[arg(long)]
    pub heads: Option<usize>,
    /// KV heads; the query heads must be a multiple [default: the workload's; `long`: 16].
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Head dimension: 64, 128 or 256 [default: the workload's; `long`: 128].
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// KV storage type: bf16, f16 or f32 [default: the workload's; `long`: bf16].
    #[arg(long)]
    pub dtype: Option<DType>,
}

impl ShapeArgs {
    pub fn apply(&self, spec: &mut WorkloadSpec) -> Result<()> {
        let s = AttnShape {
            q_heads: self.heads.unwrap_or(spec.shape.q_heads),
            kv_heads: self.kv_heads.unwrap_or(spec.shape.kv_heads),
            head_dim: self.head_dim.unwrap_or(spec.shape.head_dim),
            scale: spec.shape.scale,
        };
        s.validate()?;
        spec.shape = s;
        spec.dtype = self.dtype.unwrap_or(spec.dtype);
        Ok(())
    }
}

/// Size overrides for generated workloads.
#[derive(Args, Clone, Copy)]
pub struct SizeArgs {
    /// Sequence length of the `long` workload.
    #[arg(long)]
    pub seq_len: Option<u32>,
    /// Independent requests of the `long` workload.
    #[arg(long)]
    pub batch: Option<u32>,
    /// Prompt length of few-shot, tot and spec workloads.
    #[arg(long)]
    pub prompt_len: Option<u32>,
}

impl SizeArgs {
    pub fn overrides(&self) -> Overrides {
        Overrides {
            seq_len: self.seq_len,
            batch: self.batch,
            prompt_len: self.prompt_len,
        }
    }
}

#[derive(Serialize)]
struct MethodRow {
    method: Method,
    /// The method `auto` picked (its row only).
    chosen: Option<Method>,
    #[serde(flatten)]
    io: IoReport,
    /// KV bytes relative to Q-guided's (when Q-guided was planned too).
    kv_vs_q_guided: Option<f64>,
    plan_ms: f64,
    /// What `auto`'s device model counts and predicts for this plan.
    cost: PlanCost,
}

/// A workload's tree and attention shape: the head of every tree command's output.
#[derive(Serialize)]
pub struct TreeSummary {
    pub workload: String,
    pub nodes: usize,
    pub tree_tokens: u32,
    pub queries: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub dtype: DType,
}

impl TreeSummary {
    pub fn new(spec: &WorkloadSpec, tree: &KvTree) -> TreeSummary {
        TreeSummary {
            workload: spec.name.clone(),
            nodes: tree.nodes().len(),
            tree_tokens: tree.total_tokens(),
            queries: tree.num_queries(),
            q_heads: spec.shape.q_heads,
            kv_heads: spec.shape.kv_heads,
            head_dim: spec.shape.head_dim,
            dtype: spec.dtype,
        }
    }
}

impl std::fmt::Display for TreeSummary {
    /// Everything but the workload's name, which each command places itself.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} nodes, {} tokens, {} queries; {}/{} heads x {}, {}",
            self.nodes,
            self.tree_tokens,
            self.queries,
            self.q_heads,
            self.kv_heads,
            self.head_dim,
            self.dtype
        )
    }
}

/// Refuses rank counts that leave a rank without tokens of `tree` to plan: a shard is an even
/// split of each root's span, so every rank holds some KV while the longest span has at least
/// one token per rank.
pub fn check_ranks(ranks: usize, tree: &KvTree) -> Result<()> {
    let longest = tree
        .root_spans()
        .iter()
        .map(|s| s.end - s.start)
        .max()
        .unwrap_or(0);
    if ranks == 0 {
        bail!("--ranks must be at least 1");
    }
    if ranks as u64 > u64::from(longest) {
        bail!("--ranks {ranks} leaves ranks with no KV: the longest sequence in this tree has {longest} tokens, so use at most {longest} ranks");
    }
    Ok(())
}

/// Header cells of a plan's analytic IO, as [`io_cells`] fills them.
pub const IO_HEADER: [&str; 6] = [
    "groups",
    "partials",
    "KV read",
    "KV vs q-guided",
    "Q read",
    "partials r+w",
];

/// A plan's analytic IO as table cells, with its KV bytes over Q-guided's when known.
pub fn io_cells(io: &IoReport, kv_vs_q_guided: Option<f64>) -> [String; 6] {
    [
        io.groups.to_string(),
        io.partial_rows.to_string(),
        bytes(io.kv_bytes),
        kv_vs_q_guided.map_or("-".into(), |x| format!("{x:.3}x")),
        bytes(io.q_bytes),
        bytes(io.partial_bytes),
    ]
}

#[derive(Serialize)]
struct PlanOutput {
    #[serde(flatten)]
    tree: TreeSummary,
    ranks: usize,
    methods: Vec<MethodRow>,
}

pub fn run(a: PlanArgs) -> Result<()> {
    let mut spec = WorkloadSpec::load(&a.workload)?.with_overrides(a.sizes.overrides())?;
    a.shape.apply(&mut spec)?;
    let methods = Method::parse_list(&a.method)?;
    let tree = spec.build_tree()?;
    check_ranks(a.ranks, &tree)?;
    let shards = shard_tree(&tree, a.ranks)?;
    let view = TreeView::new(&tree, &shards[0]);
    let cfg = PlannerConfig::default();
    let model = DeviceModel::load_or_default(a.device_model.as_deref())?;
    let mut rows = Vec::new();
    for m in methods {
        let t0 = Instant::now();
        let (p, chosen) = if m == Method::Auto {
            let c = choose(&view, &spec.shape, &cfg, &model)?;
            (c.plan, Some(c.method))
        } else {
            (plan(&view, m, &spec.shape, &cfg)?, None)
        };
        let plan_ms = t0.elapsed().as_secs_f64() * 1e3;
        rows.push(MethodRow {
            method: m,
            chosen,
            io: p.io(&spec.shape, spec.dtype),
            kv_vs_q_guided: None,
            plan_ms,
            cost: model.cost(&p, &spec.shape),
        });
    }
    if let Some(base) = rows
        .iter()
        .find(|r| r.method == Method::QGuided)
        .map(|r| r.io.kv_bytes)
    {
        for r in &mut rows {
            r.kv_vs_q_guided = Some(r.io.kv_bytes as f64 / base.max(1) as f64);
        }
    }
    let out = PlanOutput {
        tree: TreeSummary::new(&spec, &tree),
        ranks: a.ranks,
        methods: rows,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "workload {}: {}{}",
        out.tree.workload,
        out.tree,
        if a.ranks > 1 {
            format!("; rank 0 of {}", a.ranks)
        } else {
            String::new()
        }
    );
    let mut t = Table::new(
        &[
            &["method"][..],
            &IO_HEADER,
            &["masks", "balance", "plan ms", "model µs"],
        ]
        .concat(),
    );
    for r in &out.methods {
        let mut cells = vec![match r.chosen {
            Some(c) => format!("{} ({c})", r.method),
            None => r.method.to_string(),
        }];
        cells.extend(io_cells(&r.io, r.kv_vs_q_guided));
        cells.extend([
            bytes(r.io.mask_bytes),
            format!("{:.2}", r.io.balance),
            format!("{:.2}", r.plan_ms),
            format!("{:.1}", r.cost.predicted_us),
        ]);
        t.row(cells);
    }
    println!("{}", t.render());
    Ok(())
}
