//! `canopy info`: what this machine offers canopy. Never panics on a machine without GPUs.

use anyhow::Result;
use clap::Args;
use serde::Serialize;
use std::process::Command;

#[derive(Args)]
pub struct InfoArgs {
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Info {
    canopy_version: &'static str,
    cpu_cores: usize,
    os: &'static str,
    arch: &'static str,
    /// CUDA driver, NVRTC, NCCL and GPUs: `null` where there are none, and `cuda_missing`
    /// says why.
    cuda: Option<canopy_cuda::CudaInfo>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cuda_missing: Option<String>,
    mpi: Option<String>,
}

/// `mpirun --version`'s first line, if MPI is installed.
fn mpi_version() -> Option<String> {
    let out = Command::new("mpirun").arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().next().map(|l| l.trim().to_string())
}

pub fn run(a: InfoArgs) -> Result<()> {
    let (cuda, cuda_missing) = match canopy_cuda::probe() {
        Ok(cuda) => (Some(cuda), None),
        Err(e) => (None, Some(e.to_string())),
    };
    let info = Info {
        canopy_version: env!("CARGO_PKG_VERSION"),
        cpu_cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        os: std::env::consts::OS,
        arch: std::env::consts::ARCH,
        cuda,
        cuda_missing,
        mpi: mpi_version(),
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&info)?);
        return Ok(());
    }
    println!("canopy {}", info.canopy_version);
    println!("cpu:  {} cores ({} {})", info.cpu_cores, info.os, info.arch);
    match &info.cuda {
        Some(c) => {
            println!(
                "cuda: driver {}, NVRTC {}, NCCL {}",
                c.driver_version,
                c.nvrtc_version.as_deref().unwrap_or("not found"),
                c.nccl_version.as_deref().unwrap_or("not found")
            );
            for g in &c.gpus {
                println!(
                    "gpu {}: {}, {:.1} GiB, {} SMs, compute capability {}.{}",
                    g.ordinal,
                    g.name,
                    g.memory_bytes as f64 / (1u64 << 30) as f64,
                    g.multiprocessors,
                    g.compute_capability.0,
                    g.compute_capability.1
                );
            }
        }
        None => println!(
            "gpu:  none usable: {}",
            info.cuda_missing.as_deref().unwrap_or_default()
        ),
    }
    println!(
        "mpi:  {}",
        info.mpi
            .as_deref()
            .unwrap_or("not found (mpirun is not on PATH)")
    );
    Ok(())
}
