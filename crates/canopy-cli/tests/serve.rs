//! `canopy serve` end to end on loopback: concurrent streams give what `canopy generate`
//! gives each prompt alone (the tiny fixture model, and SmolLM2 when it is cached or
//! `CANOPY_TEST_FETCH=1` fetches it), every refusal gets its status and an OpenAI error body,
//! a client that disconnects (streamed or not) frees its request, seeded random bodies get
//! a 2xx or a 4xx beside a stream that ends whole, `/metrics` parses as Prometheus text,
//! SIGTERM drains, and a second SIGTERM or the drain's timeout cancels what is in flight.

mod common;

use canopy_server::client::Client;
use common::serve::{error_of, generate_alone, tiny, tiny_prompts, value, Server};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

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

/// SmolLM2's path (fetched first under `CANOPY_TEST_FETCH=1`; tests that need it are skipped
/// when it is neither cached nor fetched), and the reference's prompts, whose greedy steps all
/// have clear top-two gaps.
fn smollm2() -> Option<(String, Vec<Vec<u32>>)> {
    let path = common::smollm2_path()?;
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
    let m = server.metrics_when(
        |m| {
            let cancelled = value(m, "canopy_requests_total{outcome=\"cancelled\"}");
            let ended = cancelled + completed(m) - completed_before;
            cancelled >= 1.0 && ended == 2.0 && value(m, "canopy_running_requests") == 0.0
        },
        Duration::from_secs(60),
        Duration::from_millis(100),
        "disconnects cancel",
    );
    assert_only_cached_pages(&m);
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

/// A client that leaves a whole (not streamed) request while it decodes cancels it: the
/// server sees the connection close though it has written nothing yet, ends the request in the
/// engine and frees its pages.
#[test]
fn a_client_leaving_a_whole_request_cancels_it_and_frees_its_pages() {
    use std::io::Write;
    let server = Server::start_slow(&[]);
    let body = json!({"prompt": "hi", "max_tokens": 1000, "ignore_eos": true}).to_string();
    let mut conn = std::net::TcpStream::connect(server.client.addr).unwrap();
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // It runs (a thousand tokens take this model tens of seconds on the CPU) ...
    let t0 = Instant::now();
    while value(&server.metrics(), "canopy_running_requests") != 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(60), "the request runs");
        std::thread::sleep(Duration::from_millis(20));
    }
    // ... holding pages, until its client leaves.
    assert!(value(&server.metrics(), "canopy_kv_pages_used") > 0.0);
    drop(conn);
    let m = server.metrics_when(
        |m| {
            value(m, "canopy_requests_total{outcome=\"cancelled\"}") == 1.0
                && value(m, "canopy_running_requests") == 0.0
        },
        Duration::from_secs(10),
        Duration::from_millis(50),
        "a client that leaves cancels its whole request",
    );
    assert_eq!(
        value(&m, "canopy_requests_total{outcome=\"completed\"}"),
        0.0
    );
    assert_only_cached_pages(&m);
}

/// No request holds a page: only the prefix cache's do.
fn assert_only_cached_pages(m: &[(String, f64)]) {
    assert_eq!(
        value(m, "canopy_kv_pages_used"),
        value(m, "canopy_kv_pages_cached"),
        "only cached prefixes hold pages"
    );
}

/// Seeded random request bodies for [`random_bodies_get_2xx_or_4xx_beside_a_stream`]: objects
/// of the API's fields (and unknown ones), each a value that fits it or junk of any JSON kind
/// (nulls, wrong types, numbers past every range, unicode, nesting); sometimes not JSON at
/// all, or over the body limit.
mod fuzz {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use serde_json::{json, Map, Value};

    const FIELDS: [&str; 26] = [
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "n",
        "stream",
        "stream_options",
        "ignore_eos",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "echo",
        "tokens",
        "add_special_tokens",
        "user",
        "ünïcödé 🦀",
        "",
    ];

    const TEXTS: [&str; 8] = [
        "hi",
        "",
        "ünïcödé ✓ 🦀 中文 עברית",
        "\u{0}\u{1}\u{7f}",
        "a b c d e f g",
        "\u{fffd}\u{feff}\u{200b}",
        "tiny-gqa",
        "\n\t\r\"\\",
    ];

    pub struct Bodies(ChaCha8Rng);

    impl Bodies {
        pub fn new(seed: u64) -> Bodies {
            Bodies(ChaCha8Rng::seed_from_u64(seed))
        }

        /// The next body for `route`: JSON text, mostly an object of fields, most often with
        /// the field the route needs, and junk in none, a few or half of its fields.
        pub fn next(&mut self, route: &str) -> String {
            let r = &mut self.0;
            let needs = match route {
                "/v1/completions" | "/tokenize" => "prompt",
                "/v1/chat/completions" => "messages",
                _ => "tokens",
            };
            let junk_rate = [0.0, 0.05, 0.5][r.gen_range(0..3)];
            match r.gen_range(0..40) {
                0 => String::new(),
                1 => r#"{"prompt": "hi", "max_tokens": 2"#.into(),
                2 => r#"{"prompt": "\ud800"}"#.into(),
                3 => r#"{"prompt": "hi", "max_tokens": 1e400}"#.into(),
                4 => format!(r#"{{"prompt": "{}"}}"#, "é".repeat(40_000)),
                5 => "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]".into(),
                6 => json!([{"prompt": "hi"}]).to_string(),
                _ => {
                    let mut body = Map::new();
                    for field in FIELDS {
                        if r.gen_bool(if field == needs { 0.9 } else { 0.25 }) {
                            let value = if r.gen_bool(junk_rate) {
                                junk(r, 3)
                            } else {
                                fitting(r, field)
                            };
                            body.insert(field.to_string(), value);
                        }
                    }
                    Value::Object(body).to_string()
                }
            }
        }
    }

    /// A value of the kind `field` takes, in range or near it.
    fn fitting(r: &mut ChaCha8Rng, field: &str) -> Value {
        let text = TEXTS[r.gen_range(0..TEXTS.len())];
        match field {
            "prompt" => match r.gen_range(0..4) {
                0 => json!(text),
                1 => json!([1, 2, r.gen_range(0..300)]),
                2 => json!([text, "hi"]),
                _ => json!([[5, 6], [r.gen_range(0..300)]]),
            },
            "messages" => match r.gen_range(0..3) {
                0 => json!([{"role": "user", "content": text}]),
                1 => json!([{"role": "user", "content": [{"type": "text", "text": text}]}]),
                _ => json!([{"role": "system", "content": null}, {"role": "user"}]),
            },
            "tokens" => json!([r.gen_range(0..300), 1, 2]),
            "max_tokens" | "max_completion_tokens" => json!(r.gen_range(0..6)),
            "temperature" => json!(r.gen_range(-0.5..2.5)),
            "top_p" => json!(r.gen_range(-0.1..1.1)),
            "top_k" => json!(r.gen_range(-2..50)),
            "seed" => json!(r.gen::<u64>()),
            "stop" => match r.gen_bool(0.5) {
                true => json!(text),
                false => json!(["a", text]),
            },
            "n" => json!(r.gen_range(0..4)),
            "stream_options" => json!({"include_usage": r.gen_bool(0.5)}),
            "frequency_penalty" | "presence_penalty" => json!(r.gen_range(-3.0..3.0)),
            "repetition_penalty" => json!(r.gen_range(-0.5..2.0)),
            "logit_bias" => {
                json!({r.gen_range(0..300).to_string(): r.gen_range(-150..150), text: 1})
            }
            "logprobs" => match r.gen_bool(0.5) {
                true => json!(r.gen_range(0..25)),
                false => json!(r.gen_bool(0.5)),
            },
            "top_logprobs" => json!(r.gen_range(0..25)),
            "model" => match r.gen_bool(0.5) {
                true => json!("gqa-hd64"),
                false => json!(text),
            },
            "stream" | "echo" | "ignore_eos" | "add_special_tokens" => json!(r.gen_bool(0.5)),
            _ => json!(text),
        }
    }

    /// Any JSON value, nested up to `depth` deep.
    fn junk(r: &mut ChaCha8Rng, depth: u32) -> Value {
        match r.gen_range(0..if depth == 0 { 9 } else { 11 }) {
            0 => Value::Null,
            1 => json!(r.gen_bool(0.5)),
            2 => json!(r.gen_range(-5..5)),
            3 => [
                json!(u64::MAX),
                json!(i64::MIN),
                json!(1e300),
                json!(-1e300),
                json!(4_294_967_296u64),
            ][r.gen_range(0..5)]
            .clone(),
            4 => json!(r.gen::<f64>() * 1e10 - 5e9),
            5 => json!(TEXTS[r.gen_range(0..TEXTS.len())]),
            6 => json!(f64::MIN_POSITIVE),
            7 => json!(""),
            8 => json!({}),
            9 => Value::Array((0..r.gen_range(0..4)).map(|_| junk(r, depth - 1)).collect()),
            _ => {
                let mut m = Map::new();
                for _ in 0..r.gen_range(0..4) {
                    let key = FIELDS[r.gen_range(0..FIELDS.len())];
                    m.insert(key.into(), junk(r, depth - 1));
                }
                Value::Object(m)
            }
        }
    }
}

/// While a stream is held open, seeded random bodies to every POST route each get a 2xx or a
/// 4xx with an OpenAI error body (never a 5xx or a dropped connection); the stream then ends
/// whole (the text `canopy generate` gives alone, then `[DONE]`), no request keeps its pages,
/// and the server is healthy.
#[test]
fn random_bodies_get_2xx_or_4xx_beside_a_stream() {
    const ROUTES: [&str; 4] = [
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/detokenize",
    ];
    let model = tiny();
    let server = Server::start(&model, &["--max-batch", "4", "--max-body", "65536"]);
    let prompt = &tiny_prompts()[0];
    let alone = generate_alone(&model, prompt, 24);
    let held = json!({"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": true});
    let mut held = server
        .client
        .stream("/v1/completions", &held.to_string())
        .unwrap();
    assert_eq!(held.status, 200);
    let mut events = vec![held.next_event().unwrap().expect("the stream runs")];
    let mut bodies = fuzz::Bodies::new(0x5eed);
    let mut statuses = std::collections::BTreeMap::new();
    let t0 = Instant::now();
    for i in 0..400 {
        let route = ROUTES[i % ROUTES.len()];
        let body = bodies.next(route);
        let r = server
            .client
            .post(route, &body)
            .unwrap_or_else(|e| panic!("{route} {body}: the connection failed: {e}"));
        assert!(
            (200..300).contains(&r.status) || (400..500).contains(&r.status),
            "{route} {body}: {} {}",
            r.status,
            r.body
        );
        if r.status >= 400 {
            error_of(&r);
        }
        *statuses.entry(r.status).or_insert(0) += 1;
        // The held stream is read a little at a time, beside the others.
        if i % 10 == 0 && events.last().is_some_and(|e| e != "[DONE]") {
            events.extend(held.next_event().unwrap());
        }
    }
    eprintln!("400 random bodies in {:?}: {statuses:?}", t0.elapsed());
    let served: usize = (statuses.range(200..300)).map(|(_, n)| n).sum();
    assert!(
        served >= 50,
        "the bodies reach the engine too: {statuses:?}"
    );
    while let Some(data) = held.next_event().unwrap() {
        events.push(data);
    }
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let mut text = String::new();
    for data in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(data).unwrap();
        assert!(chunk.get("error").is_none(), "{chunk}");
        text.push_str(chunk["choices"][0]["text"].as_str().unwrap());
    }
    assert_eq!(text, alone, "the held stream's text is whole");
    assert_eq!(server.client.get("/health").unwrap().status, 200);
    let m = server.metrics_when(
        |m| value(m, "canopy_running_requests") == 0.0,
        Duration::from_secs(10),
        Duration::from_millis(50),
        "every request ends",
    );
    assert_only_cached_pages(&m);
}

/// Sends `signal` to the server's process.
#[cfg(unix)]
fn signal(server: &Server, signal: i32) {
    // SAFETY: a signal to the child this test started.
    unsafe { libc::kill(server.child.id() as i32, signal) };
}

/// Reads a stream to its end: its events, checked to end with an error (code
/// `shutting_down`) and then `[DONE]`.
fn ends_cancelled(stream: &mut canopy_server::client::Streamed) {
    let mut events = Vec::new();
    while let Some(data) = stream.next_event().unwrap() {
        events.push(data);
    }
    let n = events.len();
    assert!(n >= 2, "{events:?}");
    assert_eq!(events[n - 1], "[DONE]");
    let error: Value = serde_json::from_str(&events[n - 2]).unwrap();
    assert_eq!(error["error"]["code"], "shutting_down", "{error}");
}

/// A stop that cannot wait: a second SIGTERM during a drain cancels the requests in flight (a
/// stream ends with an error event and `[DONE]`, a whole request gets a 503) and the server
/// exits at once with a failure; with `--drain-timeout 1`, one SIGTERM does the same a second
/// later.
#[cfg(unix)]
#[test]
fn a_second_sigterm_or_the_drain_timeout_cancels_the_requests_in_flight() {
    let long = |stream: bool| {
        json!({"prompt": "hi", "max_tokens": 2000, "ignore_eos": true, "stream": stream})
            .to_string()
    };
    let running = |server: &Server, n: f64| {
        let t0 = Instant::now();
        while value(&server.metrics(), "canopy_running_requests") != n {
            assert!(t0.elapsed() < Duration::from_secs(60), "{n} requests run");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let mut server = Server::start_slow(&[]);
    let mut stream = server
        .client
        .stream("/v1/completions", &long(true))
        .unwrap();
    let client = server.client.clone();
    let whole = std::thread::spawn(move || client.post("/v1/completions", &long(false)));
    running(&server, 2.0);
    signal(&server, libc::SIGTERM);
    let t0 = Instant::now();
    while server.client.get("/health").unwrap().status != 503 {
        assert!(t0.elapsed() < Duration::from_secs(10), "SIGTERM drains");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Two thousand tokens take this model minutes on the CPU: both still run.
    assert_eq!(
        value(&server.metrics(), "canopy_running_requests"),
        2.0,
        "the drain waits for the requests in flight"
    );
    let t0 = Instant::now();
    signal(&server, libc::SIGTERM);
    ends_cancelled(&mut stream);
    let reply = whole.join().unwrap().unwrap();
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert_eq!(error_of(&reply)["code"], "shutting_down");
    let status = server.child.wait().unwrap();
    assert!(!status.success(), "{status:?}");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    drop(server);

    let mut server = Server::start_slow(&["--drain-timeout", "1"]);
    let mut stream = server
        .client
        .stream("/v1/completions", &long(true))
        .unwrap();
    running(&server, 1.0);
    let t0 = Instant::now();
    signal(&server, libc::SIGTERM);
    ends_cancelled(&mut stream);
    let waited = t0.elapsed();
    assert!(waited >= Duration::from_millis(900), "{waited:?}");
    let status = server.child.wait().unwrap();
    assert!(!status.success(), "{status:?}");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}
