//! `canopy`: the command-line front of canopy.
//!
//! - `canopy generate`: text from a Llama-family model, the KV sharded over ranks.
//! - `canopy serve`: an OpenAI-compatible server, continuous batching over a prefix cache.
//! - `canopy info`: what this machine has (CPU, GPUs, driver, NVRTC, NCCL, MPI).
//! - `canopy bench attention`: sequence-sharded decode attention, tree vs ring, on p ranks.
//! - `canopy bench scaling`: the same over a sweep of p and N, with CSV, JSON and plots.
//! - `canopy bench decode`: a model's decode step at long contexts, tree vs ring, beside its floor.
//! - `canopy bench tree`: tree-structured KV (shared prefixes) with every planning method.
//! - `canopy plan`: how each planner groups a workload's tree, and what it reads.
//! - `canopy fit-model`: fits `auto`'s device model to `bench tree` measurements.
//! - `canopy selftest`: the backend conformance suite against the f64 oracle.
//!
//! Errors go to stderr with a non-zero exit; `--json` prints one JSON document instead of the
//! table, with the same fields.

mod bench;
mod decode_bench;
mod fit_cmd;
mod generate_cmd;
mod info;
mod kernel_bench;
mod launcher;
mod plan_cmd;
mod plot;
mod ranks;
mod scaling;
mod serve_bench;
mod serve_cmd;
mod sweep;
mod table;
mod tree_cmd;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// The planners build and drop thousands of small vectors for every step a server plans, on
/// the path between two passes where the GPU waits; mimalloc serves them from thread-local
/// pages.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "canopy",
    version,
    about = "Decode attention over very long and prefix-shared contexts on many GPUs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text with a Llama-family model (SmolLM2-135M-Instruct by default).
    Generate(generate_cmd::GenerateArgs),
    /// Serve a model over an OpenAI-compatible HTTP API (SmolLM2-135M-Instruct by default).
    Serve(serve_cmd::ServeArgs),
    /// Show the CPU, GPUs, driver, NVRTC, NCCL and MPI this machine has.
    Info(info::InfoArgs),
    /// Run benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Plan a workload with one or all methods and report groups, IO and balance.
    Plan(plan_cmd::PlanArgs),
    /// Fit `auto`'s device model to `bench tree --json` measurements.
    FitModel(fit_cmd::FitArgs),
    /// Run the backend conformance suite against the f64 oracle.
    Selftest(bench::SelftestArgs),
    /// Compile every CUDA kernel variant with NVRTC into the kernel cache (no GPU needed).
    CompileKernels {
        /// Target architecture.
        #[arg(long, default_value = "sm_90a")]
        arch: String,
    },
}

impl Command {
    /// Whether the command serves or loads a server over TCP (`serve`, `bench serve`): a peer
    /// that closes its connection must end that connection, not the process, so these keep
    /// Rust's ignored SIGPIPE (a vectored write to a closed socket raises it).
    fn uses_sockets(&self) -> bool {
        matches!(
            self,
            Command::Serve(_) | Command::Bench(bench::BenchCommand::Serve(_))
        )
    }

    /// The command's name if it has no MPI path: it runs whole in every process it is started
    /// in, so under mpirun or srun each process would print its own copy. `info` runs
    /// anywhere: it describes the machine each process is on.
    fn without_mpi(&self) -> Option<&'static str> {
        match self {
            Command::Info(_)
            | Command::Generate(_)
            | Command::Serve(_)
            | Command::Bench(
                bench::BenchCommand::Attention(_)
                | bench::BenchCommand::Scaling(_)
                | bench::BenchCommand::Decode(_),
            ) => None,
            Command::Bench(bench::BenchCommand::Kernel(_)) => Some("bench kernel"),
            Command::Bench(bench::BenchCommand::Tree(_)) => Some("bench tree"),
            Command::Bench(bench::BenchCommand::Serve(_)) => Some("bench serve"),
            Command::Plan(_) => Some("plan"),
            Command::FitModel(_) => Some("fit-model"),
            Command::Selftest(_) => Some("selftest"),
            Command::CompileKernels { .. } => Some("compile-kernels"),
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // A reader that stops early (`canopy plan | head`) ends the output quietly, as with other
    // Unix tools, instead of a panic in `println!` on the broken pipe. Not for the commands
    // that talk over sockets: a client that disconnects while the server writes to it must
    // cost its own request, not the process.
    #[cfg(unix)]
    if !cli.command.uses_sockets() {
        // SAFETY: restoring the default action of one signal, before any thread is started.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let allowed = match cli.command.without_mpi() {
        Some(name) => launcher::refuse_copies(name, launcher::from_env()),
        None => Ok(()),
    };
    let result = allowed.and_then(|()| match cli.command {
        Command::Generate(a) => generate_cmd::run(a),
        Command::Serve(a) => serve_cmd::run(a),
        Command::Info(a) => info::run(a),
        Command::Bench(b) => bench::run(b),
        Command::Plan(a) => plan_cmd::run(a),
        Command::FitModel(a) => fit_cmd::run(a),
        Command::Selftest(a) => bench::selftest(a),
        Command::CompileKernels { arch } => canopy_cuda::compile::compile_all(&arch)
            .map(|done| println!("compiled {} kernel variants for {arch}", done.len()))
            .map_err(Into::into),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_message(&e));
            ExitCode::FAILURE
        }
    }
}

/// `e` and its causes, joined by `: ` as `{:#}` joins them, each cause once: a library error
/// whose message ends with its cause's (`could not parse F: {source}`) still names its cause
/// as its source, which would print it twice.
fn error_message(e: &anyhow::Error) -> String {
    let mut message = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if message.is_empty() {
            message = text;
        } else if !message.ends_with(&text) {
            message = format!("{message}: {text}");
        }
    }
    message
}

#[cfg(test)]
mod tests {
    /// A cause the message before it already ends with is not repeated; others are joined.
    #[test]
    fn each_cause_is_printed_once() {
        let source = serde_json::from_str::<serde_json::Value>("xx").unwrap_err();
        let parse = canopy_model::ModelError::Json {
            path: "config.json".into(),
            source,
        };
        let e = anyhow::Error::new(parse).context("loading the model");
        assert_eq!(
            super::error_message(&e),
            "loading the model: could not parse config.json: expected value at line 1 column 1"
        );
        let e = anyhow::anyhow!("no GPU").context("running on cuda");
        assert_eq!(super::error_message(&e), "running on cuda: no GPU");
    }
}
