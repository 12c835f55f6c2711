//! The server's metrics in Prometheus' text format: request outcomes, tokens, latency
//! histograms measured where the client sees them (time to first token, between tokens, whole
//! request), the engine's queue, batch, KV pages and prefix-cache hits, and its decode passes
//! by batch size beside what their floor is priced from (weight bytes, copy bandwidth).

use canopy_runtime::serving::{DecodePasses, EngineStatus};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// How a request ended, as counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Completed,
    /// Refused before it ran (bad input, a full queue, shutting down, a bad key).
    Rejected,
    /// Its client went away first, or the server stopped without waiting for it.
    Cancelled,
    Failed,
}

const OUTCOMES: [(Outcome, &str); 4] = [
    (Outcome::Completed, "completed"),
    (Outcome::Rejected, "rejected"),
    (Outcome::Cancelled, "cancelled"),
    (Outcome::Failed, "failed"),
];

/// A histogram of seconds over fixed buckets.
struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative), then the sum of observations.
    counts: Mutex<(Vec<u64>, f64)>,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: Mutex::new((vec![0; bounds.len() + 1], 0.0)),
        }
    }

    fn observe(&self, seconds: f64) {
        let at = self
            .bounds
            .iter()
            .position(|&b| seconds <= b)
            .unwrap_or(self.bounds.len());
        let mut c = self.counts.lock().expect("metrics lock");
        c.0[at] += 1;
        c.1 += seconds;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let c = self.counts.lock().expect("metrics lock");
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut total = 0;
        for (i, n) in c.0.iter().enumerate() {
            total += n;
            let le = self
                .bounds
                .get(i)
                .map_or("+Inf".to_string(), f64::to_string);
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {total}");
        }
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {total}", c.1);
    }
}

const LATENCY: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const REQUEST: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// A counter's name, help, and its value in a `T`.
type Counter<T> = (&'static str, &'static str, fn(&T) -> String);

/// What a decode pass's floor is priced from, known when the server starts.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FloorFacts {
    /// Bytes of the weights on one device: every decode pass reads each once.
    pub weight_bytes: u64,
    /// The device's copy bandwidth (bytes read and written per second), measured at start;
    /// `None` on the CPU.
    pub copy_bandwidth: Option<f64>,
}

/// Every metric the server keeps.
pub struct Metrics {
    floor: FloorFacts,
    outcomes: [AtomicU64; 4],
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
}

impl Metrics {
    pub fn new(floor: FloorFacts) -> Self {
        Metrics {
            floor,
            outcomes: Default::default(),
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            ttft: Histogram::new(LATENCY),
            itl: Histogram::new(LATENCY),
            e2e: Histogram::new(REQUEST),
        }
    }

    pub fn outcome(&self, o: Outcome) {
        let i = OUTCOMES.iter().position(|(x, _)| *x == o).expect("listed");
        self.outcomes[i].fetch_add(1, Ordering::Relaxed);
    }

    /// A request ended after `e2e` seconds with these token counts.
    pub fn finished(&self, prompt: usize, completion: usize, e2e: f64) {
        self.prompt_tokens
            .fetch_add(prompt as u64, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(completion as u64, Ordering::Relaxed);
        self.e2e.observe(e2e);
    }

    pub fn first_token(&self, seconds: f64) {
        self.ttft.observe(seconds);
    }

    pub fn between_tokens(&self, seconds: f64) {
        self.itl.observe(seconds);
    }

    /// Everything, with the engine's `status`, as Prometheus text.
    pub fn render(&self, status: &EngineStatus) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP canopy_requests_total Requests by how they ended.\n\
             # TYPE canopy_requests_total counter"
        );
        for ((_, name), n) in OUTCOMES.iter().zip(&self.outcomes) {
            let _ = writeln!(
                out,
                "canopy_requests_total{{outcome=\"{name}\"}} {}",
                n.load(Ordering::Relaxed)
            );
        }
        let counter = |out: &mut String, name: &str, help: &str, v: &dyn std::fmt::Display| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        counter(
            &mut out,
            "canopy_prompt_tokens_total",
            "Prompt tokens of finished requests.",
            &self.prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "canopy_generation_tokens_total",
            "Tokens generated for finished requests.",
            &self.completion_tokens.load(Ordering::Relaxed),
        );
        self.ttft.render(
            &mut out,
            "canopy_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token.",
        );
        self.itl.render(
            &mut out,
            "canopy_inter_token_latency_seconds",
            "Seconds between a sample's consecutive tokens.",
        );
        self.e2e.render(
            &mut out,
            "canopy_e2e_request_latency_seconds",
            "Seconds from a request's arrival to its end.",
        );
        let s = status;
        gauge(
            &mut out,
            "canopy_queue_depth",
            "Requests waiting for admission.",
            s.waiting as f64,
        );
        gauge(
            &mut out,
            "canopy_running_requests",
            "Requests admitted whose pages are not yet released.",
            s.running as f64,
        );
        gauge(
            &mut out,
            "canopy_batch_rows",
            "Sample rows decoded in the last step.",
            s.batch as f64,
        );
        gauge(
            &mut out,
            "canopy_kv_pages_used",
            "KV pages in use, all ranks.",
            s.pages_used as f64,
        );
        gauge(
            &mut out,
            "canopy_kv_pages_free",
            "KV pages free, all ranks.",
            s.pages_free as f64,
        );
        gauge(
            &mut out,
            "canopy_kv_pages_cached",
            "KV pages of cached prefixes no request references (evictable).",
            s.pages_cached as f64,
        );
        counter(
            &mut out,
            "canopy_prefix_cache_queried_tokens_total",
            "Prompt tokens looked up in the prefix cache.",
            &s.prefix_queried_tokens,
        );
        counter(
            &mut out,
            "canopy_prefix_cache_hit_tokens_total",
            "Prompt tokens found in the prefix cache.",
            &s.prefix_hit_tokens,
        );
        let rate = if s.prefix_queried_tokens == 0 {
            0.0
        } else {
            s.prefix_hit_tokens as f64 / s.prefix_queried_tokens as f64
        };
        gauge(
            &mut out,
            "canopy_prefix_cache_hit_rate",
            "Share of looked-up prompt tokens found cached.",
            rate,
        );
        counter(
            &mut out,
            "canopy_engine_steps_total",
            "Engine steps run.",
            &s.steps,
        );
        counter(
            &mut out,
            "canopy_busy_steps_total",
            "Engine steps that computed something.",
            &s.busy_steps,
        );
        counter(
            &mut out,
            "canopy_busy_seconds_total",
            "Seconds of the steps that computed something, on rank 0 from the step's description to its tokens sent.",
            &s.busy_seconds,
        );
        counter(
            &mut out,
            "canopy_rows_read_whole_total",
            "Decode rows whose whole logits came to the host for their draws (the others read their likeliest tokens).",
            &s.rows_read_whole,
        );
        counter(
            &mut out,
            "canopy_rows_tail_walked_total",
            "Decode rows whose draws landed past their likeliest tokens and went on over the rest of the row on the device, not read whole.",
            &s.rows_tail_walked,
        );
        counter(
            &mut out,
            "canopy_prefill_tokens_total",
            "Prompt tokens computed (not found in the prefix cache).",
            &s.prefill_tokens,
        );
        counter(
            &mut out,
            "canopy_prefill_seconds_total",
            "Seconds of the prompt chunks' passes on rank 0.",
            &s.prefill_seconds,
        );
        self.render_decode(&mut out, s);
        out
    }

    /// The decode passes by their rows, and the facts their floor is priced from.
    fn render_decode(&self, out: &mut String, s: &EngineStatus) {
        let by_rows: [Counter<DecodePasses>; 3] = [
            (
                "canopy_decode_passes_total",
                "Decode passes, by their rows.",
                |d| d.passes.to_string(),
            ),
            (
                "canopy_decode_seconds_total",
                "Seconds of decode passes on rank 0, from the layout to the logits on the host (prompt chunks excluded), by their rows.",
                |d| d.seconds.to_string(),
            ),
            (
                "canopy_decode_kv_bytes_total",
                "Distinct KV bytes the decode passes' attention had to read on rank 0 (each token on some row's path once, every layer's K and V), by their rows.",
                |d| d.kv_bytes.to_string(),
            ),
        ];
        for (name, help, value) in by_rows {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (rows, d) in &s.decode {
                let _ = writeln!(out, "{name}{{rows=\"{rows}\"}} {}", value(d));
            }
        }
        let _ = writeln!(
            out,
            "# HELP canopy_weight_bytes Bytes of the weights on one device, which every decode pass reads.\n\
             # TYPE canopy_weight_bytes gauge\ncanopy_weight_bytes {}",
            self.floor.weight_bytes
        );
        if let Some(bw) = self.floor.copy_bandwidth {
            let _ = writeln!(
                out,
                "# HELP canopy_copy_bandwidth_bytes_per_second The device's copy bandwidth (bytes read and written per second), measured when the server started.\n\
                 # TYPE canopy_copy_bandwidth_bytes_per_second gauge\n\
                 canopy_copy_bandwidth_bytes_per_second {bw}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_passes_are_labelled_by_rows_beside_the_floors_facts() {
        let m = Metrics::new(FloorFacts {
            weight_bytes: 1000,
            copy_bandwidth: Some(2e12),
        });
        let mut st = EngineStatus::default();
        st.decode.entry(64).or_default().add(0.25, 300);
        st.decode.entry(64).or_default().add(0.5, 300);
        st.decode.entry(3).or_default().add(0.125, 7);
        let text = m.render(&st);
        assert!(text.contains("canopy_decode_passes_total{rows=\"64\"} 2\n"));
        assert!(text.contains("canopy_decode_seconds_total{rows=\"64\"} 0.75\n"));
        assert!(text.contains("canopy_decode_kv_bytes_total{rows=\"3\"} 7\n"));
        assert!(text.contains("canopy_weight_bytes 1000\n"));
        assert!(text.contains("canopy_copy_bandwidth_bytes_per_second 2000000000000\n"));
        let cpu = Metrics::new(FloorFacts::default()).render(&EngineStatus::default());
        assert!(!cpu.contains("canopy_copy_bandwidth"));
    }

    #[test]
    fn histograms_are_cumulative_and_end_at_the_count() {
        let m = Metrics::new(FloorFacts::default());
        for s in [0.001, 0.02, 0.02, 100.0] {
            m.first_token(s);
        }
        let text = m.render(&EngineStatus::default());
        assert!(text.contains("canopy_time_to_first_token_seconds_bucket{le=\"0.005\"} 1"));
        assert!(text.contains("canopy_time_to_first_token_seconds_bucket{le=\"0.025\"} 3"));
        assert!(text.contains("canopy_time_to_first_token_seconds_bucket{le=\"60\"} 3"));
        assert!(text.contains("canopy_time_to_first_token_seconds_bucket{le=\"+Inf\"} 4"));
        assert!(text.contains("canopy_time_to_first_token_seconds_count 4"));
    }
}
