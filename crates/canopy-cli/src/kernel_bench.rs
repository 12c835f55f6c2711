//! `canopy bench kernel`: the CUDA decode kernels on one GPU, swept over context length.

use crate::plan_cmd::ShapeArgs;
use crate::table::{bytes, Table};
use anyhow::Result;
use canopy_core::{AttnShape, DType};
use canopy_cuda::bench::{bench_point, measure_copy_bandwidth, KernelPoint};
use canopy_cuda::{CudaBackend, KernelResources};
use clap::Args;
use serde::Serialize;

#[derive(Args)]
pub struct KernelArgs {
    /// GPU to run on.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Context lengths to sweep.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "131072,524288,1048576,2097152,4194304",
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    seq_lens: Vec<u32>,
    /// Requests per step, each of the full context length.
    #[arg(long, default_value_t = 1)]
    batch: u32,
    #[command(flatten)]
    shape: ShapeArgs,
    /// Timed runs per context length; the median and p10/p90 are reported.
    #[arg(long, default_value_t = 50, value_parser = crate::bench::at_least_one)]
    iters: usize,
    /// Check each point against the f64 oracle (regenerated on the CPU).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    check: bool,
    /// Seed of the random queries, K and V.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Waves of resident CTAs each step is split into.
    #[arg(long, default_value_t = 1)]
    waves: u32,
    /// Plan for at most this many resident CTAs per SM.
    #[arg(long, default_value_t = 4)]
    ctas_per_sm: u32,
    /// Print one JSON document instead of the table.
    #[arg(long)]
    json: bool,
    /// Also write the JSON document to this file.
    #[arg(long)]
    json_out: Option<std::path::PathBuf>,
}

#[derive(Serialize)]
struct Output {
    gpu: String,
    waves: u32,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    /// Device-to-device copy bandwidth, bytes read + written per second.
    copy_gbps: f64,
    decode_kernel: KernelResources,
    points: Vec<KernelPoint>,
}

pub fn run(a: KernelArgs) -> Result<()> {
    let shape = AttnShape::new(
        a.shape.heads.unwrap_or(16),
        a.shape.kv_heads.unwrap_or(16),
        a.shape.head_dim.unwrap_or(128),
    )?;
    let dtype = a.shape.dtype.unwrap_or(DType::Bf16);
    let backend = CudaBackend::new(a.gpu)?
        .with_waves(a.waves)
        .with_ctas_per_sm(Some(a.ctas_per_sm));
    let copy = measure_copy_bandwidth(&backend)?;
    let resources = backend.decode_resources(dtype, shape.head_dim, shape.group_size())?;
    let mut points = Vec::new();
    for &n in &a.seq_lens {
        points.push(bench_point(
            &backend, &shape, dtype, n, a.batch, a.iters, copy, a.check, a.seed,
        )?);
    }
    let out = Output {
        gpu: backend.gpu().name.clone(),
        waves: a.waves,
        q_heads: shape.q_heads,
        kv_heads: shape.kv_heads,
        head_dim: shape.head_dim,
        dtype,
        copy_gbps: copy / 1e9,
        decode_kernel: resources,
        points,
    };
    let doc = serde_json::to_string_pretty(&out)?;
    if let Some(path) = &a.json_out {
        std::fs::write(path, &doc)
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    }
    if a.json {
        println!("{doc}");
        return Ok(());
    }
    let r = &out.decode_kernel;
    println!(
        "{}: {}/{} heads x {}, {}; copy bandwidth {:.0} GB/s (read + write); decode kernel {} regs, {} B local, {} B shared, {} CTAs/SM",
        out.gpu, out.q_heads, out.kv_heads, out.head_dim, out.dtype, out.copy_gbps, r.registers, r.local_bytes, r.shared_bytes, r.ctas_per_sm
    );
    let mut t = Table::new(&[
        "N",
        "batch",
        "groups",
        "median ms",
        "stage 1 ms",
        "p10 ms",
        "p90 ms",
        "KV",
        "bytes",
        "GB/s",
        "% of copy",
        "floor ms",
        "rel err vs f64",
    ]);
    for p in &out.points {
        t.row(vec![
            p.seq_len.to_string(),
            p.batch.to_string(),
            p.groups.to_string(),
            format!("{:.4}", p.median_ms),
            format!("{:.4}", p.stage1_ms),
            format!("{:.4}", p.p10_ms),
            format!("{:.4}", p.p90_ms),
            bytes(p.kv_bytes),
            bytes(p.bytes),
            format!("{:.0}", p.achieved_gbps),
            format!("{:.1}", 100.0 * p.fraction_of_copy),
            format!("{:.4}", p.floor_ms),
            p.rel_error.map_or("-".into(), |e| format!("{e:.2e}")),
        ]);
    }
    println!("{}", t.render());
    Ok(())
}
