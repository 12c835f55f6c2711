//! A `canopy serve` process on loopback for the server's tests, and what they ask of it.

use canopy_server::client::{Client, Reply};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A `canopy serve` process, killed when dropped.
pub struct Server {
    pub child: Child,
    pub client: Client,
}

impl Server {
    pub fn start(model: &str, extra: &[&str]) -> Server {
        Server::start_with(&[&["--model", model], extra].concat())
    }

    /// A server of SmolLM2's shape with random weights: slow enough on the CPU (tens of
    /// milliseconds a token) that a long request is surely in flight when a test acts on it.
    pub fn start_slow(extra: &[&str]) -> Server {
        let shape = [
            "--arch",
            "smollm2-135m",
            "--random-weights",
            "--max-context",
            "2048",
            "--kv-tokens",
            "4096",
        ];
        Server::start_with(&[&shape[..], extra].concat())
    }

    /// A server on the CPU, on any free port, of the model and options `args`.
    pub fn start_with(args: &[&str]) -> Server {
        let mut child = Command::new(assert_cmd::cargo::cargo_bin("canopy"))
            .args(["serve", "--port", "0", "--backend", "cpu"])
            .args(args)
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("canopy serve starts");
        let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
        let addr: SocketAddr = loop {
            let line = lines
                .next()
                .expect("the server says where it listens")
                .expect("stderr reads");
            if let Some(rest) = line.split("listening on http://").nth(1) {
                break rest.split_whitespace().next().unwrap().parse().unwrap();
            }
        };
        // Keep draining stderr so that the server never blocks on it.
        std::thread::spawn(move || lines.for_each(drop));
        Server {
            child,
            client: Client {
                timeout: Duration::from_secs(120),
                ..Client::new(addr)
            },
        }
    }

    pub fn with_key(&self, key: Option<&str>) -> Client {
        Client {
            api_key: key.map(str::to_string),
            ..self.client.clone()
        }
    }

    /// The metrics, checked to parse as Prometheus text. A scrape whose connection is cut
    /// (reset, aborted, or closed before the reply) is made again, up to three times: a scrape
    /// changes nothing, and loaded runs (two cores, every test binary at once) have cut one.
    pub fn metrics(&self) -> Vec<(String, f64)> {
        use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
        let mut cuts = 0;
        let reply = loop {
            match self.client.get("/metrics") {
                Ok(reply) => break reply,
                Err(e)
                    if matches!(
                        e.kind(),
                        ConnectionReset | ConnectionAborted | UnexpectedEof | BrokenPipe
                    ) && cuts < 3 =>
                {
                    cuts += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("metrics: {e} ({:?})", e.kind()),
            }
        };
        assert_eq!(reply.status, 200);
        parse_prometheus(&reply.body)
    }

    /// The first metrics, scraped every `every`, for which `done` holds; fails with `what`
    /// once `within` has passed.
    pub fn metrics_when(
        &self,
        done: impl Fn(&[(String, f64)]) -> bool,
        within: Duration,
        every: Duration,
        what: &str,
    ) -> Vec<(String, f64)> {
        let t0 = std::time::Instant::now();
        loop {
            let m = self.metrics();
            if done(&m) {
                return m;
            }
            assert!(t0.elapsed() < within, "{what}");
            std::thread::sleep(every);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn tiny() -> String {
    super::tiny_model("gqa-hd64")
}

/// Prompts (token ids) with their known greedy continuations' gaps: the fixture's.
pub fn tiny_prompts() -> Vec<Vec<u32>> {
    let text = std::fs::read_to_string(format!("{}/reference.json", tiny())).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| serde_json::from_value(p["token_ids"].clone()).unwrap())
        .collect()
}

/// `canopy generate` alone: the greedy text of `prompt`.
pub fn generate_alone(model: &str, prompt: &[u32], max_tokens: usize) -> String {
    generate_alone_with(model, prompt, max_tokens, &[])
}

/// `canopy generate` alone with `extra` options.
pub fn generate_alone_with(
    model: &str,
    prompt: &[u32],
    max_tokens: usize,
    extra: &[&str],
) -> String {
    let ids: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let out = Command::new(assert_cmd::cargo::cargo_bin("canopy"))
        .args(["generate", "--model", model, "--backend", "cpu", "--json"])
        .args([
            "--prompt-ids",
            &ids.join(","),
            "--max-tokens",
            &max_tokens.to_string(),
        ])
        .args(extra)
        .output()
        .expect("canopy generate runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["samples"][0]["text"].as_str().unwrap().to_string()
}

pub fn value(metrics: &[(String, f64)], name: &str) -> f64 {
    metrics
        .iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("{name} is in /metrics"))
        .1
}

/// Prometheus' text format, checked line by line: `# HELP` and `# TYPE` comments with known
/// types, samples `name{labels} value`, each sample's family declared, histogram buckets
/// cumulative up to `+Inf` equal to the count. Returns every sample.
pub fn parse_prometheus(text: &str) -> Vec<(String, f64)> {
    let mut types: Vec<(String, String)> = Vec::new();
    let mut samples = Vec::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                "{line}"
            );
            types.push((name.to_string(), kind.to_string()));
            continue;
        }
        if line.starts_with("# HELP ") {
            continue;
        }
        assert!(!line.starts_with('#'), "unknown comment {line}");
        let (key, v) = line.rsplit_once(' ').expect("a sample has a value");
        let v: f64 = v.parse().unwrap_or_else(|_| panic!("a number in {line}"));
        let name = key.split('{').next().unwrap();
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "metric name {name}"
        );
        if let Some(labels) = key.strip_prefix(name) {
            if !labels.is_empty() {
                assert!(labels.starts_with('{') && labels.ends_with('}'), "{line}");
                for pair in labels[1..labels.len() - 1].split(',') {
                    let (k, v) = pair.split_once('=').expect("label=value");
                    assert!(
                        !k.is_empty() && v.starts_with('"') && v.ends_with('"'),
                        "{line}"
                    );
                }
            }
        }
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .filter(|f| types.iter().any(|(n, k)| n == f && k == "histogram"))
            .unwrap_or(name);
        assert!(
            types.iter().any(|(n, _)| n == family),
            "{name} has no # TYPE"
        );
        samples.push((key.to_string(), v));
    }
    for (family, _) in types.iter().filter(|(_, k)| k == "histogram") {
        let buckets: Vec<f64> = samples
            .iter()
            .filter(|(k, _)| k.starts_with(&format!("{family}_bucket{{")))
            .map(|(_, v)| *v)
            .collect();
        assert!(
            buckets.windows(2).all(|w| w[0] <= w[1]),
            "{family} is cumulative"
        );
        let count = value(&samples, &format!("{family}_count"));
        assert_eq!(
            buckets.last().copied(),
            Some(count),
            "{family}: +Inf is the count"
        );
    }
    samples
}

pub fn error_of(reply: &Reply) -> Value {
    let v: Value = serde_json::from_str(&reply.body)
        .unwrap_or_else(|_| panic!("a JSON error body: {:?}", reply.body));
    assert!(v["error"]["message"].is_string(), "{v}");
    assert!(v["error"]["type"].is_string(), "{v}");
    v["error"].clone()
}
