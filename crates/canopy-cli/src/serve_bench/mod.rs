//! `canopy bench serve`: a load generator for a canopy server, in the manner of other
//! engines' serving benchmarks.
//!
//! It talks to a server over HTTP — one at `--url`, or one it starts in this process with
//! `canopy serve`'s engine options on a free loopback port, drained when the load is done.
//! The requests come from a seeded dataset ([`dataset`]: random, or prompts that share
//! prefixes), arrive as a Poisson process or all at once, at most `--max-concurrency` in
//! flight, and stream their tokens, so that latencies are measured at the client ([`load`]).
//! The report ([`report`]) adds the server's own account of the run from its metrics: the
//! prefix cache's hit rate, and its decode passes beside their floor.
//!
//! Every request ignores end-of-sequence tokens, so each generates exactly the tokens its
//! dataset asks for, whatever the weights. Requests are greedy unless `--temperature` says
//! otherwise (with `--top-p`, `--top-k`, as OpenAI's clients send them); request `i` then
//! draws from seed `--seed + i`, so a run repeats.

mod dataset;
mod load;
mod report;

use crate::serve_cmd::{EngineArgs, HttpOptions};
use anyhow::{anyhow, Context, Result};
use clap::Args;
use load::{Offered, Server};
use report::{Report, Setting};
use std::sync::Arc;

#[derive(Args)]
pub struct ServeBenchArgs {
    /// A running canopy server's base URL (e.g. http://127.0.0.1:8000) [default: a server of
    /// the model options below, started in this process on a free loopback port].
    #[arg(long, conflicts_with_all = ["model", "arch"])]
    url: Option<String>,
    /// The bearer key of the server at --url.
    #[arg(long, requires = "url")]
    api_key: Option<String>,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    dataset: dataset::DatasetArgs,
    /// Requests sent.
    #[arg(long, default_value_t = 200, value_parser = crate::bench::at_least_one)]
    num_prompts: usize,
    /// Requests per second, arriving as a Poisson process (inf: all at once).
    #[arg(long, default_value = "inf", value_parser = rate)]
    request_rate: f64,
    /// Requests in flight at most [default: no limit].
    #[arg(long, value_parser = crate::bench::at_least_one)]
    max_concurrency: Option<usize>,
    /// Seed of the dataset, of the arrivals and of the draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    sampling: load::Sampling,
    /// Print one JSON document instead of the table.
    #[arg(long)]
    json: bool,
}

fn rate(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if r > 0.0 => Ok(r),
        Ok(_) => Err("a request rate is above 0 (inf: all at once)".into()),
        Err(e) => Err(e.to_string()),
    }
}

pub fn run(a: ServeBenchArgs) -> Result<()> {
    let report = match &a.url {
        Some(url) => bench(&a, url, url.clone())?,
        None => in_process(&a)?,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.render());
    }
    if report.completed == 0 {
        return Err(anyhow!(
            "no request completed; the first error: {}",
            report.errors.first().map_or("none", String::as_str)
        ));
    }
    Ok(())
}

/// Starts the engine here, runs the load on a thread of its own once the model is on its
/// devices, then drains the engine.
fn in_process(a: &ServeBenchArgs) -> Result<Report> {
    let served = std::thread::scope(|s| {
        let mut client = None;
        let served = crate::serve_cmd::serve(&a.engine, HttpOptions::loopback(), |addr, handle| {
            let handle = handle.clone();
            client = Some(s.spawn(move || {
                let report = bench(a, &format!("http://{addr}"), "in-process".into());
                handle.drain();
                report
            }));
        });
        let report = client.map(|c| c.join().map_err(|_| anyhow!("the load generator panicked")));
        (served, report)
    });
    match served {
        (Ok(()), Some(report)) => report?,
        (Err(e), _) => Err(e.context("the server")),
        (Ok(()), None) => Err(anyhow!("the server stopped before it was ready")),
    }
}

/// The load of `a` against the server at `url` (named `server` in the report).
fn bench(a: &ServeBenchArgs, url: &str, server: String) -> Result<Report> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("canopy-bench")
        .enable_all()
        .build()
        .context("starting the load generator's runtime")?;
    runtime.block_on(async {
        let client = Arc::new(Server::new(url, a.api_key.clone())?);
        let card = client.card().await?;
        let shape = a.dataset.shape();
        let requests = shape.draw(a.num_prompts, card.vocab_size, a.seed);
        let longest = requests
            .iter()
            .map(|r| r.prompt.len() + r.output_len)
            .max()
            .unwrap_or(0);
        anyhow::ensure!(
            longest <= card.max_model_len,
            "the dataset's longest request ({longest} tokens with its output) exceeds the server's context of {}; shorten the dataset's lengths",
            card.max_model_len
        );
        let offered = Offered {
            request_rate: a.request_rate.is_finite().then_some(a.request_rate),
            max_concurrency: a.max_concurrency,
            seed: a.seed,
            sampling: a.sampling,
        };
        let bar = canopy_model::progress_bar(requests.len() as u64, "bench serve".into());
        bar.set_message("requests");
        let before = client.metrics().await?;
        let (measured, duration) =
            load::offer(client.clone(), &card.model, requests, offered, &bar).await;
        bar.finish_and_clear();
        let after = client.metrics().await?;
        let setting = Setting {
            server,
            model: card.model,
            dataset: shape,
            request_rate: offered.request_rate,
            max_concurrency: a.max_concurrency,
            seed: a.seed,
            sampling: a.sampling,
        };
        Ok(Report::new(setting, &measured, duration, &before, &after))
    })
}
