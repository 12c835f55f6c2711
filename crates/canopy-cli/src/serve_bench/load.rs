//! The load: requests sent to a server over HTTP as they arrive (Poisson, or all at once), at
//! most `--max-concurrency` in flight, each streamed so that its first token and the gaps
//! between tokens are timed where a client sees them. Also the server's own account: its
//! model card and its Prometheus metrics, read before and after the load.

use super::dataset::Request;
use anyhow::{bail, ensure, Context, Result};
use canopy_server::client::EventLines;
use indicatif::ProgressBar;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::Instant;

/// How the load is offered.
#[derive(Debug, Clone, Copy)]
pub struct Offered {
    /// Requests per second, arrivals Poisson (`None`: all at once).
    pub request_rate: Option<f64>,
    /// Requests in flight at most (`None`: no limit).
    pub max_concurrency: Option<usize>,
    pub seed: u64,
    pub sampling: Sampling,
}

/// How one request draws its tokens: the run's sampling, from its own seed.
#[derive(Debug, Clone, Copy)]
struct Draws {
    sampling: Sampling,
    seed: u64,
}

/// How every request draws its tokens.
#[derive(clap::Args, Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Sampling {
    /// Each request's sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0, value_parser = crate::bench::api_temperature, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Each request's `top_p`: the most likely tokens whose probability reaches P (0 < P <=
    /// 1).
    #[arg(long, default_value_t = 1.0, value_parser = crate::bench::probability_mass, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Each request's `top_k`: the K most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
}

/// What a canopy server says of its model (`GET /v1/models`).
#[derive(Debug, Clone)]
pub struct Card {
    pub model: String,
    pub max_model_len: usize,
    pub vocab_size: u32,
}

/// One request as its client saw it.
#[derive(Debug, Clone, Default)]
pub struct Measured {
    pub prompt_tokens: usize,
    /// Tokens generated, as the server counted them (its `usage`).
    pub output_tokens: usize,
    /// Prompt tokens the server found in its prefix cache.
    pub cached_tokens: usize,
    /// Seconds from sending the request to its first piece of text (or its end, if it has
    /// none).
    pub ttft: f64,
    /// Seconds between consecutive pieces of text.
    pub itl: Vec<f64>,
    /// Seconds from sending the request to the end of its stream.
    pub e2e: f64,
    /// Why it failed; its times then mean nothing.
    pub error: Option<String>,
}

/// A server at a base URL.
pub struct Server {
    http: reqwest::Client,
    base: String,
    api_key: Option<String>,
}

impl Server {
    pub fn new(base: &str, api_key: Option<String>) -> Result<Server> {
        Ok(Server {
            http: reqwest::Client::builder()
                .build()
                .context("building the HTTP client")?,
            base: base.trim_end_matches('/').to_string(),
            api_key,
        })
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.request(method, format!("{}{path}", self.base));
        match &self.api_key {
            Some(key) => r.bearer_auth(key),
            None => r,
        }
    }

    async fn get(&self, path: &str) -> Result<String> {
        let reply = self
            .request(reqwest::Method::GET, path)
            .send()
            .await
            .with_context(|| format!("GET {}{path}", self.base))?;
        let status = reply.status();
        let body = reply.text().await?;
        ensure!(status.is_success(), "GET {path}: {status}: {body}");
        Ok(body)
    }

    /// The served model, its context and vocabulary.
    pub async fn card(&self) -> Result<Card> {
        let v: Value = serde_json::from_str(&self.get("/v1/models").await?)?;
        let m = &v["data"][0];
        let field = |name: &str| {
            m[name].as_u64().with_context(|| {
                format!("the server's /v1/models has no {name}: canopy bench serve sends token ids and needs a canopy server")
            })
        };
        Ok(Card {
            model: m["id"].as_str().unwrap_or_default().to_string(),
            max_model_len: field("max_model_len")? as usize,
            vocab_size: field("vocab_size")? as u32,
        })
    }

    /// The server's metrics now.
    pub async fn metrics(&self) -> Result<Scrape> {
        Ok(Scrape::parse(&self.get("/metrics").await?))
    }

    /// Sends `r` as a streamed completion of `model`, drawn as `draws` says, and times it.
    async fn complete(&self, model: &str, r: &Request, draws: Draws) -> Measured {
        let started = Instant::now();
        let mut m = Measured {
            prompt_tokens: r.prompt.len(),
            ..Measured::default()
        };
        if let Err(e) = self.stream(model, r, draws, started, &mut m).await {
            m.error = Some(format!("{e:#}"));
        }
        m.e2e = started.elapsed().as_secs_f64();
        m
    }

    async fn stream(
        &self,
        model: &str,
        r: &Request,
        draws: Draws,
        started: Instant,
        m: &mut Measured,
    ) -> Result<()> {
        let Sampling {
            temperature,
            top_p,
            top_k,
        } = draws.sampling;
        let mut body = json!({
            "model": model,
            "prompt": r.prompt,
            "max_tokens": r.output_len,
            "temperature": temperature,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if temperature > 0.0 {
            body["seed"] = json!(draws.seed);
            body["top_p"] = json!(top_p);
            if top_k > 0 {
                body["top_k"] = json!(top_k);
            }
        }
        let mut reply = self
            .request(reqwest::Method::POST, "/v1/completions")
            .json(&body)
            .send()
            .await?;
        let status = reply.status();
        if !status.is_success() {
            bail!("{status}: {}", reply.text().await.unwrap_or_default());
        }
        let (mut events, mut pending) = (EventLines::default(), Vec::new());
        let (mut last, mut done) = (None::<Instant>, false);
        while let Some(bytes) = reply.chunk().await? {
            let now = Instant::now();
            pending.extend_from_slice(&bytes);
            while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                let Some(data) = events.line(std::str::from_utf8(&line)?) else {
                    continue;
                };
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: Value = serde_json::from_str(&data)?;
                if let Some(e) = v.get("error") {
                    bail!("the server failed the request: {e}");
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    let count = |x: &Value| x.as_u64().unwrap_or(0) as usize;
                    m.prompt_tokens = count(&u["prompt_tokens"]);
                    m.output_tokens = count(&u["completion_tokens"]);
                    m.cached_tokens = count(&u["prompt_tokens_details"]["cached_tokens"]);
                }
                // Tokens reach the client as pieces of text: one without text of its own (a
                // special token, part of a character) comes with the next piece, or with the
                // end, which stands for the first token of a request that had no text.
                let choice = &v["choices"][0];
                let text = choice["text"].as_str().is_some_and(|t| !t.is_empty());
                if text || (last.is_none() && !choice["finish_reason"].is_null()) {
                    match last {
                        None => m.ttft = (now - started).as_secs_f64(),
                        Some(t) => m.itl.push((now - t).as_secs_f64()),
                    }
                    last = Some(now);
                }
            }
        }
        ensure!(done, "the stream ended before [DONE]");
        ensure!(last.is_some(), "the stream ended without a token");
        Ok(())
    }
}

/// Sends `requests` to `server` as `offered` says, ticking `bar` as each ends. Returns each
/// request's measurements, in order, and the seconds from the first arrival to the last end.
pub async fn offer(
    server: Arc<Server>,
    model: &str,
    requests: Vec<Request>,
    offered: Offered,
    bar: &ProgressBar,
) -> (Vec<Measured>, f64) {
    let at = arrivals(requests.len(), offered.request_rate, offered.seed);
    let limit = offered.max_concurrency.map(|n| Arc::new(Semaphore::new(n)));
    let start = Instant::now();
    let tasks: Vec<_> = (requests.into_iter().zip(at).enumerate())
        .map(|(i, (r, at))| {
            let (server, limit, bar) = (server.clone(), limit.clone(), bar.clone());
            let model = model.to_string();
            let draws = Draws {
                sampling: offered.sampling,
                seed: offered.seed.wrapping_add(i as u64),
            };
            tokio::spawn(async move {
                tokio::time::sleep_until(start + Duration::from_secs_f64(at)).await;
                let _permit = match limit {
                    Some(s) => Some(s.acquire_owned().await.expect("the semaphore stays open")),
                    None => None,
                };
                let m = server.complete(&model, &r, draws).await;
                bar.inc(1);
                m
            })
        })
        .collect();
    let mut measured = Vec::with_capacity(tasks.len());
    for t in tasks {
        measured.push(t.await.unwrap_or_else(|e| Measured {
            error: Some(format!("the request's task failed: {e}")),
            ..Measured::default()
        }));
    }
    (measured, start.elapsed().as_secs_f64())
}

/// Each request's arrival, in seconds from the first: gaps drawn from the exponential
/// distribution of mean `1 / rate` (a Poisson process), or all at 0 without a rate.
pub fn arrivals(n: usize, rate: Option<f64>, seed: u64) -> Vec<f64> {
    let Some(rate) = rate else {
        return vec![0.0; n];
    };
    // A stream of its own: the arrivals do not move when the dataset's draws change.
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(1);
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                t += -(1.0 - rng.gen::<f64>()).ln() / rate;
            }
            t
        })
        .collect()
}

/// A scrape of Prometheus text: each sample's value by its name and labels, as written.
#[derive(Debug, Clone, Default)]
pub struct Scrape(BTreeMap<String, f64>);

impl Scrape {
    pub fn parse(text: &str) -> Scrape {
        Scrape(
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .filter_map(|l| {
                    let (key, value) = l.rsplit_once(' ')?;
                    Some((key.to_string(), value.parse().ok()?))
                })
                .collect(),
        )
    }

    pub fn get(&self, key: &str) -> Option<f64> {
        self.0.get(key).copied()
    }

    /// How much counter `key` grew since `before` (0 where it is absent).
    pub fn since(&self, before: &Scrape, key: &str) -> f64 {
        self.get(key).unwrap_or(0.0) - before.get(key).unwrap_or(0.0)
    }

    /// The values of the samples of `name` labelled `label`, by the label's value.
    pub fn by_label(&self, name: &str, label: &str) -> BTreeMap<String, f64> {
        let prefix = format!("{name}{{{label}=\"");
        self.0
            .iter()
            .filter_map(|(k, &v)| {
                let value = k.strip_prefix(&prefix)?.strip_suffix("\"}")?;
                Some((value.to_string(), v))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_arrivals_have_the_rate_and_follow_the_seed() {
        assert_eq!(arrivals(3, None, 0), [0.0; 3]);
        let at = arrivals(20_001, Some(4.0), 7);
        assert_eq!(at[0], 0.0);
        assert!(at.windows(2).all(|w| w[1] >= w[0]));
        let mean_gap = at[20_000] / 20_000.0;
        assert!((mean_gap - 0.25).abs() < 0.01, "{mean_gap}");
        assert_eq!(at, arrivals(20_001, Some(4.0), 7));
        assert_ne!(at, arrivals(20_001, Some(4.0), 8));
    }

    #[test]
    fn scrapes_read_samples_labels_and_growth() {
        let before = Scrape::parse("# HELP x y\n# TYPE x counter\nx 2\n");
        let after =
            Scrape::parse("x 5\nd_total{rows=\"64\"} 3\nd_total{rows=\"7\"} 1.5\ng 1e9\nbroken\n");
        assert_eq!(after.since(&before, "x"), 3.0);
        assert_eq!(after.since(&before, "absent"), 0.0);
        assert_eq!(after.get("g"), Some(1e9));
        let rows = after.by_label("d_total", "rows");
        assert_eq!(rows.get("64"), Some(&3.0));
        assert_eq!(rows.get("7"), Some(&1.5));
        assert_eq!(rows.len(), 2);
    }
}
