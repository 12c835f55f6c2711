//! `canopy plan`: planners side by side on one workload.

use crate::table::{bytes, Table};
use anyhow::Result;
use canopy_core::{
    plan, shard_tree, AttnShape, DType, IoReport, Method, Overrides, PlannerConfig, TreeView,
    WorkloadSpec,
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
    #[arg(long)]
    json: bool,
}

/// Attention shape flags shared by the commands; unset flags keep the workload's defaults.
#[derive(Args, Clone, Copy)]
pub struct ShapeArgs {
    /// Query heads.
    #[arg(long)]
    pub heads: Option<usize>,
    /// KV heads (query heads must be a multiple).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Head dimension (64, 128 or 256).
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// KV storage type: bf16, f16 or f32.
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
    #[serde(flatten)]
    io: IoReport,
    /// KV bytes relative to Q-guided's (when Q-guided was planned too).
    kv_vs_q_guided: Option<f64>,
    plan_ms: f64,
}

#[derive(Serialize)]
struct PlanOutput {
    workload: String,
    nodes: usize,
    tree_tokens: u32,
    queries: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    ranks: usize,
    methods: Vec<MethodRow>,
}

pub fn run(a: PlanArgs) -> Result<()> {
    let mut spec = WorkloadSpec::load(&a.workload)?.with_overrides(a.sizes.overrides())?;
    a.shape.apply(&mut spec)?;
    let methods = Method::parse_list(&a.method)?;
    let tree = spec.build_tree()?;
    let shards = shard_tree(&tree, a.ranks)?;
    let view = TreeView::new(&tree, &shards[0]);
    let cfg = PlannerConfig::default();
    let mut rows = Vec::new();
    for m in methods {
        let t0 = Instant::now();
        let p = plan(&view, m, &spec.shape, &cfg)?;
        let plan_ms = t0.elapsed().as_secs_f64() * 1e3;
        rows.push(MethodRow {
            method: m,
            io: p.io(&spec.shape, spec.dtype),
            kv_vs_q_guided: None,
            plan_ms,
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
        workload: spec.name.clone(),
        nodes: tree.nodes().len(),
        tree_tokens: tree.total_tokens(),
        queries: tree.num_queries(),
        q_heads: spec.shape.q_heads,
        kv_heads: spec.shape.kv_heads,
        head_dim: spec.shape.head_dim,
        dtype: spec.dtype,
        ranks: a.ranks,
        methods: rows,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "workload {}: {} nodes, {} tokens, {} queries; {}/{} heads x {}, {}{}",
        out.workload,
        out.nodes,
        out.tree_tokens,
        out.queries,
        out.q_heads,
        out.kv_heads,
        out.head_dim,
        out.dtype,
        if a.ranks > 1 {
            format!("; rank 0 of {}", a.ranks)
        } else {
            String::new()
        }
    );
    let mut t = Table::new(&[
        "method",
        "groups",
        "partials",
        "KV read",
        "KV vs q-guided",
        "Q read",
        "partials r+w",
        "masks",
        "balance",
        "plan ms",
    ]);
    for r in &out.methods {
        t.row(vec![
            r.method.to_string(),
            r.io.groups.to_string(),
            r.io.partial_rows.to_string(),
            bytes(r.io.kv_bytes),
            r.kv_vs_q_guided.map_or("-".into(), |x| format!("{x:.3}x")),
            bytes(r.io.q_bytes),
            bytes(r.io.partial_bytes),
            bytes(r.io.mask_bytes),
            format!("{:.2}", r.io.balance),
            format!("{:.2}", r.plan_ms),
        ]);
    }
    println!("{}", t.render());
    Ok(())
}
