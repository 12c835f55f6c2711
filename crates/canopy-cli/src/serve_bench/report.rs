//! What a serving benchmark reports: latency statistics (mean, median, p99) of the time to
//! first token, per output token, between tokens and of whole requests; throughput in requests
//! and tokens; the prefix cache's hit rate and the decode passes' cost beside their floor, both
//! from the server's metrics over the run.
//!
//! **The floor of a decode pass** is the least time its reads can take: (the weight bytes,
//! which every pass reads once, + the distinct KV bytes the pass's attention must read, each
//! token on some row's path once) / the copy bandwidth the server measured at start. A plan
//! that reads a shared prefix once per row reads more than the floor counts; none reads less.

use super::dataset::Shape;
use super::load::{Measured, Scrape};
use crate::table::Table;
use serde::Serialize;
use std::collections::BTreeMap;

/// Mean, median and 99th percentile of a sample.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    pub mean: f64,
    pub median: f64,
    pub p99: f64,
}

impl Summary {
    /// The statistics of `values` times `scale` (`None` for no values); percentiles
    /// interpolate linearly between the closest ranks.
    pub fn of(values: &[f64], scale: f64) -> Option<Summary> {
        if values.is_empty() {
            return None;
        }
        let mut v: Vec<f64> = values.iter().map(|x| x * scale).collect();
        v.sort_by(f64::total_cmp);
        let at = |p: f64| {
            let rank = p * (v.len() - 1) as f64;
            let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
            v[lo] + (v[hi] - v[lo]) * (rank - lo as f64)
        };
        Some(Summary {
            mean: canopy_core::stats::mean(&v),
            median: at(0.5),
            p99: at(0.99),
        })
    }
}

/// The decode passes of one batch size during the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Passes {
    pub rows: usize,
    pub passes: u64,
    pub mean_ms: f64,
    /// Distinct KV bytes a pass had to read, on average.
    pub mean_kv_bytes: f64,
    pub floor_ms: Option<f64>,
    pub vs_floor: Option<f64>,
}

/// The server's decode passes during the run, by batch size (largest first).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decode {
    pub weight_bytes: u64,
    pub copy_bandwidth_gb_s: Option<f64>,
    pub passes: u64,
    pub mean_rows: f64,
    pub mean_ms: f64,
    pub by_rows: Vec<Passes>,
}

impl Decode {
    /// The passes between two scrapes of a canopy server (`None` if it ran none).
    pub fn between(before: &Scrape, after: &Scrape) -> Option<Decode> {
        let grown = |name: &str| -> BTreeMap<usize, f64> {
            let old = before.by_label(name, "rows");
            after
                .by_label(name, "rows")
                .into_iter()
                .filter_map(|(rows, v)| {
                    Some((
                        rows.parse().ok()?,
                        v - old.get(&rows).copied().unwrap_or(0.0),
                    ))
                })
                .collect()
        };
        let (passes, seconds, kv) = (
            grown("canopy_decode_passes_total"),
            grown("canopy_decode_seconds_total"),
            grown("canopy_decode_kv_bytes_total"),
        );
        let weight_bytes = after.get("canopy_weight_bytes").unwrap_or(0.0);
        let bandwidth = after.get("canopy_copy_bandwidth_bytes_per_second");
        let by_rows: Vec<Passes> = passes
            .iter()
            .rev()
            .filter(|(_, &n)| n > 0.0)
            .map(|(&rows, &n)| {
                let mean_ms = seconds.get(&rows).copied().unwrap_or(0.0) / n * 1e3;
                let mean_kv_bytes = kv.get(&rows).copied().unwrap_or(0.0) / n;
                let floor_ms = bandwidth.map(|bw| (weight_bytes + mean_kv_bytes) / bw * 1e3);
                Passes {
                    rows,
                    passes: n as u64,
                    mean_ms,
                    mean_kv_bytes,
                    floor_ms,
                    vs_floor: floor_ms.map(|f| mean_ms / f),
                }
            })
            .collect();
        let total: u64 = by_rows.iter().map(|p| p.passes).sum();
        if total == 0 {
            return None;
        }
        let weighted = |f: &dyn Fn(&Passes) -> f64| {
            by_rows.iter().map(|p| f(p) * p.passes as f64).sum::<f64>() / total as f64
        };
        Some(Decode {
            weight_bytes: weight_bytes as u64,
            copy_bandwidth_gb_s: bandwidth.map(|b| b / 1e9),
            passes: total,
            mean_rows: weighted(&|p| p.rows as f64),
            mean_ms: weighted(&|p| p.mean_ms),
            by_rows,
        })
    }
}

/// Where the engine's busy time went during the run, on rank 0.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Steps {
    /// Steps that computed something.
    pub busy_steps: u64,
    pub mean_step_ms: f64,
    /// Shares of the busy seconds: decode passes, prompt chunks, and the rest (the books,
    /// sampling, detokenizing and sending around them).
    pub decode_share: f64,
    pub prefill_share: f64,
    pub other_share: f64,
    /// Prompt tokens computed, and how fast.
    pub prefill_tokens: u64,
    pub prefill_tokens_per_s: Option<f64>,
}

impl Steps {
    /// The steps between two scrapes of a canopy server (`None` if it computed none).
    pub fn between(before: &Scrape, after: &Scrape) -> Option<Steps> {
        let grown = |name: &str| after.since(before, name);
        let steps = grown("canopy_busy_steps_total");
        let busy = grown("canopy_busy_seconds_total");
        if steps <= 0.0 || busy <= 0.0 {
            return None;
        }
        let old = before.by_label("canopy_decode_seconds_total", "rows");
        let decode: f64 = after
            .by_label("canopy_decode_seconds_total", "rows")
            .iter()
            .map(|(rows, v)| v - old.get(rows).copied().unwrap_or(0.0))
            .sum();
        let prefill = grown("canopy_prefill_seconds_total");
        let tokens = grown("canopy_prefill_tokens_total");
        Some(Steps {
            busy_steps: steps as u64,
            mean_step_ms: busy / steps * 1e3,
            decode_share: decode / busy,
            prefill_share: prefill / busy,
            other_share: (busy - decode - prefill) / busy,
            prefill_tokens: tokens as u64,
            prefill_tokens_per_s: (prefill > 0.0).then(|| tokens / prefill),
        })
    }

    fn render(&self) -> String {
        format!(
            "\nengine: {} busy steps, {:.2} ms each: decode passes {:.0}%, prompt chunks {:.0}% \
             ({} tokens{}), the rest {:.0}% (books, sampling, text and events on rank 0)\n",
            self.busy_steps,
            self.mean_step_ms,
            self.decode_share * 100.0,
            self.prefill_share * 100.0,
            self.prefill_tokens,
            self.prefill_tokens_per_s
                .map_or(String::new(), |r| format!(" at {r:.0} tokens/s")),
            self.other_share * 100.0,
        )
    }
}

/// A benchmark run's report (`--json` prints it whole).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    #[serde(flatten)]
    pub setting: Setting,
    pub requests: usize,
    pub completed: usize,
    pub failed: usize,
    /// The first distinct errors of failed requests.
    pub errors: Vec<String>,
    /// Seconds from the first arrival to the last response's end.
    pub duration_s: f64,
    /// Tokens of completed requests.
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft_ms: Option<Summary>,
    /// (end - first token) / (output tokens - 1), per request of two tokens or more.
    pub tpot_ms: Option<Summary>,
    /// Between consecutive pieces of streamed text, over every request.
    pub itl_ms: Option<Summary>,
    pub e2e_ms: Option<Summary>,
    /// Prompt tokens found cached over those looked up, from the server's metrics during the
    /// run (`null`: a server without them).
    pub prefix_cache_hit_rate: Option<f64>,
    /// Prompt tokens the completed requests' `usage` says were cached, over their prompt
    /// tokens.
    pub cached_prompt_share: f64,
    pub decode: Option<Decode>,
    pub steps: Option<Steps>,
}

/// What a run was, besides what it measured.
#[derive(Debug, Clone, Serialize)]
pub struct Setting {
    /// The server's base URL, or `in-process`.
    pub server: String,
    pub model: String,
    pub dataset: Shape,
    /// Requests per second offered (`null`: all at once).
    pub request_rate: Option<f64>,
    pub max_concurrency: Option<usize>,
    pub seed: u64,
    pub sampling: super::load::Sampling,
}

/// How many distinct errors a report lists.
const ERRORS_LISTED: usize = 5;

impl Report {
    /// The report of `measured` requests that took `duration_s`, with the server's metrics
    /// `before` and `after` them.
    pub fn new(
        setting: Setting,
        measured: &[Measured],
        duration_s: f64,
        before: &Scrape,
        after: &Scrape,
    ) -> Report {
        let ok: Vec<&Measured> = measured.iter().filter(|m| m.error.is_none()).collect();
        let mut errors: Vec<String> = Vec::new();
        for e in measured.iter().filter_map(|m| m.error.clone()) {
            if errors.len() < ERRORS_LISTED && !errors.contains(&e) {
                errors.push(e);
            }
        }
        let prompt_tokens: usize = ok.iter().map(|m| m.prompt_tokens).sum();
        let output_tokens: usize = ok.iter().map(|m| m.output_tokens).sum();
        let cached: usize = ok.iter().map(|m| m.cached_tokens).sum();
        let per_s = |n: usize| n as f64 / duration_s;
        let ms = |f: &dyn Fn(&Measured) -> f64| {
            Summary::of(&ok.iter().map(|m| f(m)).collect::<Vec<_>>(), 1e3)
        };
        let tpot: Vec<f64> = ok
            .iter()
            .filter(|m| m.output_tokens > 1)
            .map(|m| (m.e2e - m.ttft) / (m.output_tokens - 1) as f64)
            .collect();
        let itl: Vec<f64> = ok.iter().flat_map(|m| m.itl.iter().copied()).collect();
        let queried = after.since(before, "canopy_prefix_cache_queried_tokens_total");
        let hits = after.since(before, "canopy_prefix_cache_hit_tokens_total");
        Report {
            setting,
            requests: measured.len(),
            completed: ok.len(),
            failed: measured.len() - ok.len(),
            errors,
            duration_s,
            prompt_tokens,
            output_tokens,
            request_throughput: per_s(ok.len()),
            output_throughput: per_s(output_tokens),
            total_token_throughput: per_s(prompt_tokens + output_tokens),
            ttft_ms: ms(&|m| m.ttft),
            tpot_ms: Summary::of(&tpot, 1e3),
            itl_ms: Summary::of(&itl, 1e3),
            e2e_ms: ms(&|m| m.e2e),
            prefix_cache_hit_rate: (queried > 0.0).then(|| hits / queried),
            cached_prompt_share: cached as f64 / prompt_tokens.max(1) as f64,
            decode: Decode::between(before, after),
            steps: Steps::between(before, after),
        }
    }

    /// The report as text: the run, its results, and the decode passes beside their floor.
    pub fn render(&self) -> String {
        let (run, d) = (&self.setting, &self.setting.dataset);
        let levels: Vec<String> = d
            .levels
            .iter()
            .map(|(n, len)| format!("{n} x {len}"))
            .collect();
        let mut out = String::new();
        let mut row = |k: &str, v: String| out.push_str(&format!("{k:<32} {v}\n"));
        row("server", format!("{} ({})", run.server, run.model));
        row(
            "dataset",
            format!(
                "{}: {} shared ([{}] branches x tokens) + {} own tokens, {} out (± {:.0}%)",
                d.dataset.name(),
                d.shared_len(),
                levels.join(", "),
                d.own_len,
                d.output_len,
                d.range_ratio * 100.0
            ),
        );
        row(
            "offered",
            format!(
                "{} requests, {} req/s, concurrency {}, seed {}",
                self.requests,
                run.request_rate.map_or("inf".into(), |r| format!("{r}")),
                run.max_concurrency
                    .map_or("unlimited".into(), |c| c.to_string()),
                run.seed
            ),
        );
        let s = run.sampling;
        row(
            "sampling",
            match s.temperature > 0.0 {
                false => "greedy".into(),
                true => format!(
                    "temperature {}, top_p {}, top_k {} (request i seeded seed + i)",
                    s.temperature,
                    s.top_p,
                    match s.top_k {
                        0 => "all".into(),
                        k => k.to_string(),
                    }
                ),
            },
        );
        row(
            "completed / failed",
            format!("{} / {}", self.completed, self.failed),
        );
        row("duration s", format!("{:.2}", self.duration_s));
        row(
            "prompt / output tokens",
            format!("{} / {}", self.prompt_tokens, self.output_tokens),
        );
        row("requests/s", format!("{:.2}", self.request_throughput));
        row("output tokens/s", format!("{:.1}", self.output_throughput));
        row(
            "total tokens/s",
            format!("{:.1}", self.total_token_throughput),
        );
        for (name, s) in [
            ("TTFT ms", self.ttft_ms),
            ("TPOT ms", self.tpot_ms),
            ("ITL ms", self.itl_ms),
            ("E2E ms", self.e2e_ms),
        ] {
            row(
                &format!("{name} mean / median / p99"),
                s.map_or("-".into(), |s| {
                    format!("{:.2} / {:.2} / {:.2}", s.mean, s.median, s.p99)
                }),
            );
        }
        row(
            "prefix cache hit rate",
            self.prefix_cache_hit_rate
                .map_or("-".into(), |r| format!("{:.1}%", r * 100.0)),
        );
        row(
            "cached prompt tokens",
            format!("{:.1}%", self.cached_prompt_share * 100.0),
        );
        if let Some(steps) = &self.steps {
            out.push_str(&steps.render());
        }
        if let Some(dec) = &self.decode {
            out.push_str(&dec.render());
        }
        for e in &self.errors {
            out.push_str(&format!("error: {e}\n"));
        }
        out
    }
}

/// How many batch sizes the text report lists (the JSON has all).
const ROWS_LISTED: usize = 4;

impl Decode {
    fn render(&self) -> String {
        let mut t = Table::new(&["rows", "passes", "ms/pass", "KV MB", "floor ms", "x floor"]);
        let mut listed: Vec<&Passes> = self.by_rows.iter().collect();
        listed.sort_by_key(|p| std::cmp::Reverse(p.passes));
        listed.truncate(ROWS_LISTED);
        listed.sort_by_key(|p| std::cmp::Reverse(p.rows));
        for p in listed {
            let opt = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:.2}"));
            t.row(vec![
                p.rows.to_string(),
                p.passes.to_string(),
                format!("{:.2}", p.mean_ms),
                format!("{:.1}", p.mean_kv_bytes / 1e6),
                opt(p.floor_ms),
                opt(p.vs_floor),
            ]);
        }
        format!(
            "\ndecode passes: {} (mean {:.1} rows, {:.2} ms); the most frequent batch sizes:\n{}\n\
             floor = (weights {} + the distinct KV bytes a pass must read) / copy bandwidth{}\n",
            self.passes,
            self.mean_rows,
            self.mean_ms,
            t.render(),
            crate::table::bytes(self.weight_bytes),
            self.copy_bandwidth_gb_s
                .map_or(" (not measured on the CPU: no floor)".into(), |b| format!(
                    " {b:.0} GB/s, measured by the server at start"
                )),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summaries_interpolate_percentiles() {
        assert_eq!(Summary::of(&[], 1.0), None);
        let s = Summary::of(&[3.0], 1e3).unwrap();
        assert_eq!((s.mean, s.median, s.p99), (3000.0, 3000.0, 3000.0));
        let v: Vec<f64> = (1..=101).rev().map(f64::from).collect();
        let s = Summary::of(&v, 1.0).unwrap();
        assert_eq!((s.mean, s.median, s.p99), (51.0, 51.0, 100.0));
        let s = Summary::of(&[1.0, 2.0, 3.0, 10.0], 1.0).unwrap();
        assert_eq!(s.median, 2.5);
        assert!((s.p99 - 9.79).abs() < 1e-9, "{}", s.p99);
    }

    fn measured(ttft: f64, e2e: f64, tokens: usize) -> Measured {
        Measured {
            prompt_tokens: 100,
            output_tokens: tokens,
            cached_tokens: 50,
            ttft,
            itl: vec![(e2e - ttft) / (tokens - 1) as f64; tokens - 1],
            e2e,
            error: None,
        }
    }

    #[test]
    fn reports_count_completed_requests_and_read_the_servers_growth() {
        let before = Scrape::parse(
            "canopy_prefix_cache_queried_tokens_total 100\ncanopy_prefix_cache_hit_tokens_total 10\n\
             canopy_decode_passes_total{rows=\"2\"} 5\ncanopy_decode_seconds_total{rows=\"2\"} 1\n",
        );
        let after = Scrape::parse(
            "canopy_prefix_cache_queried_tokens_total 300\ncanopy_prefix_cache_hit_tokens_total 160\n\
             canopy_decode_passes_total{rows=\"2\"} 15\ncanopy_decode_seconds_total{rows=\"2\"} 1.5\n\
             canopy_decode_kv_bytes_total{rows=\"2\"} 2000\n\
             canopy_decode_passes_total{rows=\"1\"} 30\ncanopy_decode_seconds_total{rows=\"1\"} 0.6\n\
             canopy_decode_kv_bytes_total{rows=\"1\"} 3000\n\
             canopy_weight_bytes 1000\ncanopy_copy_bandwidth_bytes_per_second 100000\n\
             canopy_busy_steps_total 50\ncanopy_busy_seconds_total 2.5\n\
             canopy_prefill_seconds_total 0.5\ncanopy_prefill_tokens_total 1000\n",
        );
        let failed = Measured {
            error: Some("503".into()),
            ..Measured::default()
        };
        let setting = Setting {
            server: "in-process".into(),
            model: "m".into(),
            dataset: Shape {
                dataset: super::super::dataset::DatasetKind::FewShot,
                levels: vec![(1, 50)],
                own_len: 50,
                output_len: 11,
                range_ratio: 0.0,
            },
            request_rate: None,
            max_concurrency: Some(2),
            seed: 0,
            sampling: super::super::load::Sampling {
                temperature: 0.0,
                top_p: 1.0,
                top_k: 0,
            },
        };
        let m = [
            measured(0.1, 1.1, 11),
            failed.clone(),
            measured(0.3, 0.5, 3),
            failed,
        ];
        let r = Report::new(setting, &m, 2.0, &before, &after);
        assert_eq!((r.requests, r.completed, r.failed), (4, 2, 2));
        assert_eq!(r.errors, ["503"]);
        assert_eq!((r.prompt_tokens, r.output_tokens), (200, 14));
        assert_eq!(r.request_throughput, 1.0);
        assert_eq!(r.output_throughput, 7.0);
        assert_eq!(r.total_token_throughput, 107.0);
        let tpot = r.tpot_ms.unwrap();
        assert!((tpot.mean - 100.0).abs() < 1e-9, "{tpot:?}");
        assert!(r.e2e_ms.unwrap().median >= r.ttft_ms.unwrap().median);
        assert_eq!(r.prefix_cache_hit_rate, Some(0.75));
        assert_eq!(r.cached_prompt_share, 0.5);
        let d = r.decode.clone().unwrap();
        assert_eq!(d.passes, 40);
        assert_eq!(d.by_rows.iter().map(|p| p.rows).collect::<Vec<_>>(), [2, 1]);
        let two = &d.by_rows[0];
        assert_eq!(two.passes, 10);
        assert!((two.mean_ms - 50.0).abs() < 1e-9);
        assert_eq!(two.mean_kv_bytes, 200.0);
        // (1000 weight bytes + 200 KV bytes) at 100 000 bytes/s.
        assert!((two.floor_ms.unwrap() - 12.0).abs() < 1e-9);
        assert!((d.mean_rows - 1.25).abs() < 1e-9);
        // 2.5 busy seconds over 50 steps: 1.1 of decode passes, 0.5 of prompt chunks.
        let steps = r.steps.clone().unwrap();
        assert_eq!(steps.busy_steps, 50);
        assert!((steps.mean_step_ms - 50.0).abs() < 1e-9);
        assert!((steps.decode_share - 0.44).abs() < 1e-9);
        assert!((steps.prefill_share - 0.2).abs() < 1e-9);
        assert!((steps.other_share - 0.36).abs() < 1e-9);
        assert_eq!(steps.prefill_tokens_per_s, Some(2000.0));
        let text = r.render();
        assert!(text.contains("floor = (weights") && text.contains("50 busy steps"));
    }
}
