//! `canopy serve` end to end on loopback: concurrent streams give what `canopy generate`
//! gives each prompt alone (the tiny fixture model, and SmolLM2 when it is cached), every
//! refusal gets its status and an OpenAI error body, a client that disconnects frees its
//! request, `/metrics` parses as Prometheus text, and SIGTERM drains.

mod common;

use canopy_server::client::{Client, Reply};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `canopy serve` process, killed when dropped.
struct Server {
    child: Child,
    client: Client,
}

impl Server {
    fn start(model: &str, extra: &[&str]) -> Server {
        let mut child = Command::new(assert_cmd::cargo::cargo_bin("canopy"))
            .args(["serve", "--model", model, "--port", "0", "--backend", "cpu"])
            .args(extra)
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

    fn with_key(&self, key: Option<&str>) -> Client {
        Client {
            api_key: key.map(str::to_string),
            ..self.client.clone()
        }
    }

    /// The metrics, checked to parse as Prometheus text. A scrape whose connection is cut
    /// (reset, aborted, or closed before the reply) is made again, up to three times: a scrape
    /// changes nothing, and loaded runs (two cores, every test binary at once) have cut one.
    fn metrics(&self) -> Vec<(String, f64)> {
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
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tiny() -> String {
    common::tiny_model("gqa-hd64")
}

/// Prompts (token ids) with their known greedy continuations' gaps: the fixture's.
fn tiny_prompts() -> Vec<Vec<u32>> {
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
fn generate_alone(model: &str, prompt: &[u32], max_tokens: usize) -> String {
    generate_alone_with(model, prompt, max_tokens, &[])
}

/// `canopy generate` alone with `extra` options.
fn generate_alone_with(model: &str, prompt: &[u32], max_tokens: usize, extra: &[&str]) -> String {
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

/// A streamed completion: its text, finish reason, usage, and whether `[DONE]` ended it.
fn stream_completion(client: &Client, body: Value) -> (String, String, Value) {
    let mut s = client
        .stream("/v1/completions", &body.to_string())
        .expect("the request is sent");
    assert_eq!(s.status, 200);
    let (mut text, mut reason, mut usage) = (String::new(), String::new(), Value::Null);
    loop {
        let data = s
            .next_event()
            .unwrap()
            .expect("the stream ends with [DONE]");
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(&data).unwrap();
        assert!(chunk.get("error").is_none(), "{chunk}");
        if let Some(c) = chunk["choices"].get(0) {
            text.push_str(c["text"].as_str().unwrap());
            if let Some(r) = c["finish_reason"].as_str() {
                reason = r.to_string();
            }
        }
        if !chunk["usage"].is_null() {
            usage = chunk["usage"].clone();
        }
    }
    assert!(s.next_event().unwrap().is_none(), "nothing after [DONE]");
    (text, reason, usage)
}

/// Thirty-two streams at once, more than the batch holds, over prompts that share prefixes:
/// each greedy text equals `canopy generate` alone.
fn concurrent_streams_equal_generate(model: &str, prompts: &[Vec<u32>], max_tokens: usize) {
    let server = Server::start(model, &["--max-batch", "12", "--prefill-chunk", "64"]);
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| generate_alone(model, p, max_tokens))
        .collect();
    let results: Vec<(usize, (String, String, Value))> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..32)
            .map(|i| {
                let (client, prompt) = (&server.client, &prompts[i % prompts.len()]);
                s.spawn(move || {
                    let body = json!({
                        "prompt": prompt,
                        "max_tokens": max_tokens,
                        "temperature": 0,
                        "stream": true,
                        "stream_options": {"include_usage": true},
                    });
                    (i, stream_completion(client, body))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut cached = 0;
    for (i, (text, reason, usage)) in results {
        let p = i % prompts.len();
        assert_eq!(text, alone[p], "request {i} (prompt {p})");
        assert!(reason == "length" || reason == "stop", "{reason}");
        assert_eq!(usage["prompt_tokens"], prompts[p].len());
        cached += usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
    }
    assert!(cached > 0, "repeated prompts find their prefixes cached");
    let m = server.metrics();
    assert_eq!(
        value(&m, "canopy_requests_total{outcome=\"completed\"}"),
        32.0
    );
    assert!(value(&m, "canopy_prefix_cache_hit_rate") > 0.0);
    assert_eq!(value(&m, "canopy_time_to_first_token_seconds_count"), 32.0);
    // A request's pages are released at the engine's step after its stream's last event, so
    // the running count reaches 0 shortly after the clients have read every stream.
    let t0 = Instant::now();
    while value(&server.metrics(), "canopy_running_requests") != 0.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "every finished request releases its pages"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn thirty_two_streams_on_the_tiny_model_equal_generate_alone() {
    concurrent_streams_equal_generate(&tiny(), &tiny_prompts(), 16);
}

/// SmolLM2's path when it is cached (tests that need it are skipped otherwise), and the
/// reference's prompts, whose greedy steps all have clear top-two gaps.
fn smollm2() -> Option<(String, Vec<Vec<u32>>)> {
    let path = canopy_model::cache_dir()
        .ok()?
        .join(canopy_model::DEFAULT_MODEL_FILE);
    if !path.is_file() {
        eprintln!(
            "note: {} is not cached; skipping (run `canopy generate` once)",
            path.display()
        );
        return None;
    }
    let text = include_str!("../../../tests/fixtures/smollm2/reference.json");
    let v: Value = serde_json::from_str(text).unwrap();
    let prompts = v["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| serde_json::from_value(p["token_ids"].clone()).unwrap())
        .collect();
    Some((path.to_str().unwrap().to_string(), prompts))
}

#[test]
fn thirty_two_streams_on_smollm2_equal_generate_alone() {
    if let Some((path, prompts)) = smollm2() {
        concurrent_streams_equal_generate(&path, &prompts, 24);
    }
}

#[test]
fn ignore_eos_runs_past_the_end_of_sequence_on_smollm2() {
    let Some((path, prompts)) = smollm2() else {
        return;
    };
    let server = Server::start(&path, &[]);
    // The reference's chat prompt whose greedy answer is seven tokens, then EOS.
    let prompt = &prompts[4];
    for (ignore_eos, reason, tokens) in [(false, "stop", 8), (true, "length", 16)] {
        let (_, got, usage) = stream_completion(
            &server.client,
            json!({
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": ignore_eos,
                "stream": true,
                "stream_options": {"include_usage": true},
            }),
        );
        assert_eq!(got, reason, "ignore_eos {ignore_eos}");
        assert_eq!(
            usage["completion_tokens"], tokens,
            "ignore_eos {ignore_eos}"
        );
    }
}

/// A choice's `logprobs` gathered over a stream's chunks of one choice.
fn streamed_logprobs(client: &Client, path: &str, body: Value) -> Vec<Value> {
    let mut s = client.stream(path, &body.to_string()).unwrap();
    assert_eq!(s.status, 200);
    let mut parts = Vec::new();
    while let Some(data) = s.next_event().unwrap() {
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(&data).unwrap();
        if let Some(lp) = chunk["choices"].get(0).map(|c| &c["logprobs"]) {
            parts.push(lp.clone());
        }
    }
    parts
}

/// Concatenates each list field of `parts` (JSON objects of lists).
fn joined(parts: &[Value], fields: &[&str]) -> Value {
    let mut out = serde_json::Map::new();
    for f in fields {
        let all: Vec<Value> = parts
            .iter()
            .filter(|p| !p.is_null())
            .flat_map(|p| p[*f].as_array().unwrap().clone())
            .collect();
        out.insert(f.to_string(), Value::Array(all));
    }
    Value::Object(out)
}

/// `a` and `b` alike, their numbers within 1e-4: a request that finds its prompt cached
/// computes its logits in another order than one that prefills it.
fn assert_close(a: &Value, b: &Value) {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            assert!((x - y).abs() <= 1e-4, "{x} against {y}");
        }
        (Value::Array(x), Value::Array(y)) => {
            assert_eq!(x.len(), y.len(), "{a} against {b}");
            x.iter().zip(y).for_each(|(x, y)| assert_close(x, y));
        }
        (Value::Object(x), Value::Object(y)) => {
            assert!(x.keys().eq(y.keys()), "{a} against {b}");
            x.values()
                .zip(y.values())
                .for_each(|(x, y)| assert_close(x, y));
        }
        _ => assert_eq!(a, b),
    }
}

#[test]
fn penalties_draw_what_generate_draws_with_them() {
    let server = Server::start(&tiny(), &[]);
    let (model, prompt) = (tiny(), tiny_prompts()[3].clone());
    let complete = |penalties: Value| {
        let mut body = json!({"prompt": prompt, "max_tokens": 24, "temperature": 0});
        body.as_object_mut()
            .unwrap()
            .extend(penalties.as_object().unwrap().clone());
        let r = server
            .client
            .post("/v1/completions", &body.to_string())
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let v: Value = serde_json::from_str(&r.body).unwrap();
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let plain = complete(json!({}));
    let options = [
        "--frequency-penalty",
        "0.5",
        "--presence-penalty",
        "-0.25",
        "--repetition-penalty",
        "1.3",
    ];
    let penalised = complete(json!({
        "frequency_penalty": 0.5, "presence_penalty": -0.25, "repetition_penalty": 1.3,
    }));
    assert_eq!(
        penalised,
        generate_alone_with(&model, &prompt, 24, &options)
    );
    assert_ne!(penalised, plain, "the penalties change what is drawn");
    for (body, param) in [
        (
            r#"{"prompt": "a", "frequency_penalty": 2.5}"#,
            "frequency_penalty",
        ),
        (
            r#"{"prompt": "a", "presence_penalty": -3}"#,
            "presence_penalty",
        ),
        (
            r#"{"prompt": "a", "repetition_penalty": 0}"#,
            "repetition_penalty",
        ),
    ] {
        let r = server.client.post("/v1/completions", body).unwrap();
        assert_eq!(r.status, 400, "{body}");
        assert_eq!(error_of(&r)["param"], param, "{body}");
    }
}

#[test]
fn log_probabilities_and_echo_answer_as_openai_does() {
    let server = Server::start(&tiny(), &[]);
    let c = &server.client;
    let prompt = &tiny_prompts()[2];
    // A completion: each token's text, log-probability, its 3 most likely and offset.
    let body = json!({"prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 3});
    let r = c.post("/v1/completions", &body.to_string()).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    let choice = &v["choices"][0];
    let lp = &choice["logprobs"];
    let n = v["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    let text = choice["text"].as_str().unwrap();
    for f in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(lp[f].as_array().unwrap().len(), n, "{f}");
    }
    let mut offset = 0;
    for i in 0..n {
        let (token, x) = (lp["tokens"][i].as_str().unwrap(), &lp["token_logprobs"][i]);
        let top = lp["top_logprobs"][i].as_object().unwrap();
        // Greedy: the drawn token is the likeliest of the three.
        assert_eq!(top.len(), 3, "{top:?}");
        assert_eq!(&top[token], x);
        let best = top
            .values()
            .map(|y| y.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert_eq!(x.as_f64().unwrap(), best);
        assert!(best <= 0.0);
        let at = lp["text_offset"][i].as_u64().unwrap() as usize;
        assert!(at >= offset && at <= text.chars().count());
        offset = at;
    }
    // Streamed, the chunks carry the same tokens in pieces.
    let streamed = streamed_logprobs(
        c,
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 3, "stream": true}),
    );
    let fields = ["tokens", "token_logprobs", "top_logprobs", "text_offset"];
    assert_close(
        &joined(&streamed, &fields),
        &joined(std::slice::from_ref(lp), &fields),
    );
    // A chat: each token's bytes spell the answer.
    let chat = json!({
        "messages": [{"role": "user", "content": "Hi there"}],
        "max_tokens": 8, "temperature": 0, "logprobs": true, "top_logprobs": 2,
    });
    let r = c.post("/v1/chat/completions", &chat.to_string()).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    let bytes: Vec<u8> = content
        .iter()
        .flat_map(|t| serde_json::from_value::<Vec<u8>>(t["bytes"].clone()).unwrap())
        .collect();
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
    // The answer leaves out a last character its tokens did not finish.
    let spelled = String::from_utf8_lossy(&bytes);
    let unfinished = spelled
        .strip_prefix(answer)
        .expect("the bytes spell the answer");
    assert!(unfinished.chars().all(|c| c == '\u{FFFD}'), "{spelled:?}");
    for t in content {
        assert_eq!(t["top_logprobs"].as_array().unwrap().len(), 2);
        assert_eq!(t["top_logprobs"][0]["logprob"], t["logprob"]);
    }
    let mut streamed_chat = chat.clone();
    streamed_chat["stream"] = json!(true);
    let streamed = streamed_logprobs(c, "/v1/chat/completions", streamed_chat);
    assert_close(
        &joined(&streamed, &["content"]),
        &json!({"content": content}),
    );
    // Echo repeats the prompt; with logprobs it would need the prompt's, and is refused.
    let r = c
        .post(
            "/v1/completions",
            r#"{"prompt": "Once upon", "max_tokens": 2, "echo": true}"#,
        )
        .unwrap();
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert!(
        v["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with("Once upon"),
        "{v}"
    );
    for (path, body, param) in [
        (
            "/v1/completions",
            r#"{"prompt": "a", "echo": true, "logprobs": 1}"#,
            "echo",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "a", "logprobs": 21}"#,
            "logprobs",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "a", "logprobs": true}"#,
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}"#,
            "top_logprobs",
        ),
    ] {
        let r = c.post(path, body).unwrap();
        assert_eq!(r.status, 400, "{body}");
        assert_eq!(error_of(&r)["param"], param, "{body}");
    }
}

fn value(metrics: &[(String, f64)], name: &str) -> f64 {
    metrics
        .iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("{name} is in /metrics"))
        .1
}

/// Prometheus' text format, checked line by line: `# HELP` and `# TYPE` comments with known
/// types, samples `name{labels} value`, each sample's family declared, histogram buckets
/// cumulative up to `+Inf` equal to the count. Returns every sample.
fn parse_prometheus(text: &str) -> Vec<(String, f64)> {
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

fn error_of(reply: &Reply) -> Value {
    let v: Value = serde_json::from_str(&reply.body)
        .unwrap_or_else(|_| panic!("a JSON error body: {:?}", reply.body));
    assert!(v["error"]["message"].is_string(), "{v}");
    assert!(v["error"]["type"].is_string(), "{v}");
    v["error"].clone()
}

#[test]
fn every_refusal_gets_its_answer_and_sigterm_drains() {
    let mut server = Server::start(
        &tiny(),
        &[
            "--api-key",
            "sk-test",
            "--max-batch",
            "1",
            "--max-queue",
            "1",
            "--max-body",
            "4096",
        ],
    );
    server.client.api_key = Some("sk-test".into());
    let ok = server.with_key(Some("sk-test"));
    // Keys: every route but /health needs one.
    assert_eq!(server.with_key(None).get("/health").unwrap().status, 200);
    for client in [server.with_key(None), server.with_key(Some("sk-wrong"))] {
        let r = client
            .post("/v1/completions", r#"{"prompt": "hi"}"#)
            .unwrap();
        assert_eq!(r.status, 401);
        assert_eq!(error_of(&r)["code"], "invalid_api_key");
        assert_eq!(client.get("/metrics").unwrap().status, 401);
    }
    assert_eq!(ok.get("/v1/models").unwrap().status, 200);
    // Malformed JSON, wrong types, a prompt too long, an unknown model, a huge body.
    for (body, status, needle) in [
        (r#"{"prompt": "hi", "max_tokens": 4"#, 400, "not valid JSON"),
        (
            r#"{"prompt": "hi", "max_tokens": "four"}"#,
            400,
            "invalid type",
        ),
        (r#"{"prompt": 7}"#, 400, "does not match"),
        (r#"{"messages": "hi"}"#, 400, "does not match"),
        (
            r#"{"prompt": "hi", "max_tokens": 300}"#,
            400,
            "maximum context length is 256 tokens",
        ),
        (r#"{"prompt": [999999]}"#, 400, "vocabulary"),
        (r#"{"prompt": "hi", "temperature": -1}"#, 400, "temperature"),
        (
            r#"{"prompt": "hi", "model": "gpt-9"}"#,
            404,
            "does not exist",
        ),
    ] {
        let path = if body.contains("messages") {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let r = ok.post(path, body).unwrap();
        assert_eq!(r.status, status, "{body}: {}", r.body);
        let e = error_of(&r);
        assert!(
            e["message"].as_str().unwrap().contains(needle),
            "{body}: {e}"
        );
    }
    let huge = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(10_000));
    let r = ok.post("/v1/completions", &huge).unwrap();
    assert_eq!(r.status, 413);
    let message = error_of(&r)["message"].as_str().unwrap().to_owned();
    assert!(
        message.contains("4096 bytes") && message.contains("--max-body"),
        "{message}"
    );
    // Unknown fields are ignored.
    let r = ok
        .post(
            "/v1/completions",
            r#"{"prompt": "hi", "max_tokens": 2, "logit_bias": {"1": 2}, "user": "u"}"#,
        )
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);

    // A full queue: one request runs (the batch is one row), one waits, the next is refused.
    let long = json!({"prompt": "hi", "max_tokens": 200, "temperature": 0, "stream": true});
    let mut running = ok.stream("/v1/completions", &long.to_string()).unwrap();
    running
        .next_event()
        .unwrap()
        .expect("the first request runs");
    let waiting = ok.stream("/v1/completions", &long.to_string()).unwrap();
    let refused = ok.post("/v1/completions", &long.to_string()).unwrap();
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(error_of(&refused)["code"], "queue_full");
    // Both disconnect: the running request is cancelled, and both end with their pages freed.
    // The waiting one may instead finish: a client's leaving shows only when the server
    // writes to it, and a loaded machine can write the whole answer before it notices.
    let completed = |m: &[(String, f64)]| value(m, "canopy_requests_total{outcome=\"completed\"}");
    let completed_before = completed(&server.metrics());
    drop(running);
    drop(waiting);
    let t0 = Instant::now();
    loop {
        let m = server.metrics();
        let cancelled = value(&m, "canopy_requests_total{outcome=\"cancelled\"}");
        let ended = cancelled + completed(&m) - completed_before;
        if cancelled >= 1.0 && ended == 2.0 && value(&m, "canopy_running_requests") == 0.0 {
            assert_eq!(
                value(&m, "canopy_kv_pages_used"),
                value(&m, "canopy_kv_pages_cached"),
                "only cached prefixes hold pages"
            );
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "disconnects cancel");
        std::thread::sleep(Duration::from_millis(100));
    }
    // SIGTERM: the request in flight finishes, a new one gets 503, the server exits cleanly.
    // A release build may finish the request and exit before the first poll: then the drain
    // is seen in the stream's end and the exit status alone.
    let body = json!({"prompt": "hi", "max_tokens": 200, "temperature": 0, "stream": true});
    let mut in_flight = ok.stream("/v1/completions", &body.to_string()).unwrap();
    in_flight.next_event().unwrap().expect("it runs");
    // SAFETY: a signal to the child this test started.
    unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) };
    let t0 = Instant::now();
    loop {
        match ok.get("/health") {
            Ok(r) if r.status == 503 => {
                let r = ok.post("/v1/completions", r#"{"prompt": "hi"}"#);
                if let Ok(r) = r {
                    assert_eq!(r.status, 503, "{}", r.body);
                    assert_eq!(error_of(&r)["code"], "shutting_down");
                }
                break;
            }
            Ok(_) => {}
            Err(_) => break, // already drained and gone
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "SIGTERM starts a drain"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut last = String::new();
    while let Some(data) = in_flight.next_event().unwrap() {
        last = data;
    }
    assert_eq!(last, "[DONE]", "the request in flight ends whole");
    let status = server.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
}
