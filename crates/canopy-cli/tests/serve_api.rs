//! `canopy serve`'s OpenAI request fields beyond plain generation, end to end on the tiny
//! fixture model: the model card by its id, tokenizing, several prompts in one request, the
//! penalties and biases, tokens' log-probabilities and `echo`.

mod common;

use canopy_server::client::Client;
use common::serve::{
    error_of, generate_alone, generate_alone_with, tiny, tiny_prompts, value, Server,
};
use serde_json::{json, Value};

/// The answer to `body` at `path`, which must succeed.
fn answer(client: &Client, path: &str, body: &Value) -> Value {
    let r = client.post(path, &body.to_string()).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).unwrap()
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
fn several_prompts_in_one_request_answer_as_each_alone() {
    let server = Server::start(&tiny(), &["--max-queue", "4"]);
    let prompts = tiny_prompts();
    let c = &server.client;
    let alone: Vec<String> = prompts[..3]
        .iter()
        .map(|p| generate_alone(&tiny(), p, 6))
        .collect();
    let body = json!({"prompt": &prompts[..3], "max_tokens": 6, "temperature": 0, "n": 2});
    let v = answer(c, "/v1/completions", &body);
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6);
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(choice["text"], alone[i / 2], "choice {i}");
    }
    let prompt_tokens: usize = prompts[..3].iter().map(Vec::len).sum();
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    // Streamed, each choice's chunks carry its index.
    let mut s = c
        .stream(
            "/v1/completions",
            &json!({"prompt": &prompts[..3], "max_tokens": 6, "temperature": 0, "stream": true})
                .to_string(),
        )
        .unwrap();
    let mut texts = vec![String::new(); 3];
    while let Some(data) = s.next_event().unwrap() {
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(&data).unwrap();
        for choice in chunk["choices"].as_array().unwrap() {
            let index = choice["index"].as_u64().unwrap() as usize;
            texts[index].push_str(choice["text"].as_str().unwrap());
        }
    }
    assert_eq!(texts, alone);
    // Echo repeats each prompt before its own choices.
    let body = json!({"prompt": ["One", "Two"], "max_tokens": 2, "echo": true});
    let v: Value =
        serde_json::from_str(&c.post("/v1/completions", &body.to_string()).unwrap().body).unwrap();
    assert!(v["choices"][0]["text"].as_str().unwrap().starts_with("One"));
    assert!(v["choices"][1]["text"].as_str().unwrap().starts_with("Two"));
    // More prompts than the queue holds could never all wait, and none is empty.
    for body in [
        json!({"prompt": vec!["a"; 5]}),
        json!({"prompt": Vec::<String>::new()}),
    ] {
        let r = c.post("/v1/completions", &body.to_string()).unwrap();
        assert_eq!(r.status, 400, "{body}");
        assert_eq!(error_of(&r)["param"], "prompt");
    }
}

#[test]
fn the_model_is_listed_and_found_by_its_id() {
    let server = Server::start(&tiny(), &[]);
    let c = &server.client;
    let list: Value = serde_json::from_str(&c.get("/v1/models").unwrap().body).unwrap();
    let card = &list["data"][0];
    let id = card["id"].as_str().unwrap();
    let r = c.get(&format!("/v1/models/{id}")).unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(&serde_json::from_str::<Value>(&r.body).unwrap(), card);
    let r = c.get("/v1/models/gpt-9").unwrap();
    assert_eq!(r.status, 404);
    assert_eq!(error_of(&r)["code"], "model_not_found");
}

#[test]
fn prompts_and_chats_tokenize_as_the_endpoints_take_them() {
    let server = Server::start(&tiny(), &[]);
    let c = &server.client;
    let text = "Once upon a time, 12345.";
    let t = answer(c, "/tokenize", &json!({"prompt": text}));
    let want = tiny_tokenizer().encode(text, true).unwrap();
    assert_eq!(t["tokens"], json!(want));
    assert_eq!(t["count"], want.len());
    let models = serde_json::from_str::<Value>(&c.get("/v1/models").unwrap().body).unwrap();
    assert_eq!(t["max_model_len"], models["data"][0]["max_model_len"]);
    let back = answer(c, "/detokenize", &json!({"tokens": want}));
    assert_eq!(back["prompt"], text);
    // Messages count as the chat endpoint counts its prompt.
    let messages = json!([{"role": "user", "content": "Hi there"}]);
    let t = answer(c, "/tokenize", &json!({"messages": messages}));
    let chat = json!({"messages": messages, "max_tokens": 1});
    let usage = &answer(c, "/v1/chat/completions", &chat)["usage"];
    assert_eq!(t["count"], usage["prompt_tokens"]);
    for (path, body, status, param) in [
        (
            "/tokenize",
            json!({"prompt": "a", "messages": messages}),
            400,
            "prompt",
        ),
        ("/tokenize", json!({}), 400, "prompt"),
        ("/detokenize", json!({"tokens": [1, 999999]}), 400, "tokens"),
        (
            "/detokenize",
            json!({"tokens": [1], "model": "gpt-9"}),
            404,
            "model",
        ),
    ] {
        let r = c.post(path, &body.to_string()).unwrap();
        assert_eq!(r.status, status, "{body}");
        assert_eq!(error_of(&r)["param"], param, "{body}");
    }
}

/// Draws at a temperature over the whole vocabulary (no `top_k`, as OpenAI's clients send
/// them) read narrowed rows and their softmax totals, and go on over the rest of a row where a
/// draw lands past them: several requests in flight at once, with log-probabilities asked for
/// or not, on one rank or two (of which rank 0 alone reads rows beyond their narrowing), draw
/// what `generate` draws from the same seed.
#[test]
fn draws_over_the_whole_vocabulary_are_generates() {
    for ranks in ["1", "2"] {
        let server = Server::start(&tiny(), &["--ranks", ranks]);
        let (model, prompts) = (tiny(), tiny_prompts());
        for (temperature, top_p) in [(1.0, 1.0), (0.8, 0.9)] {
            let (t, p) = (temperature.to_string(), top_p.to_string());
            let options = ["--temperature", &t, "--top-p", &p, "--seed", "7"];
            let texts: Vec<Vec<String>> = std::thread::scope(|scope| {
                let asked: Vec<_> = (prompts.iter())
                    .map(|prompt| {
                        [None, Some(2)].map(|logprobs| {
                            let body = json!({
                                "prompt": prompt, "max_tokens": 16, "temperature": temperature,
                                "top_p": top_p, "seed": 7, "logprobs": logprobs,
                            });
                            let client = &server.client;
                            scope.spawn(move || answer(client, "/v1/completions", &body))
                        })
                    })
                    .collect();
                (asked.into_iter())
                    .map(|pair| {
                        pair.map(|h| {
                            h.join().unwrap()["choices"][0]["text"]
                                .as_str()
                                .unwrap()
                                .to_string()
                        })
                        .to_vec()
                    })
                    .collect()
            });
            for (prompt, got) in prompts.iter().zip(&texts) {
                let want = generate_alone_with(&model, prompt, 16, &options);
                assert_eq!(
                    got,
                    &[want.clone(), want],
                    "{ranks} ranks, temperature {t}, top_p {p}"
                );
            }
        }
        // Some draws landed past their narrowed rows: those at temperature 1 went on over the
        // rest of their rows on the backend, those cut by top_p past the row's likeliest read
        // them whole. The others read only their likeliest tokens and totals.
        let m = server.metrics();
        let whole = value(&m, "canopy_rows_read_whole_total");
        let walked = value(&m, "canopy_rows_tail_walked_total");
        let drawn = value(&m, "canopy_generation_tokens_total");
        assert!(
            walked > 0.0 && whole + walked < drawn,
            "{ranks} ranks: {walked} of {drawn} rows walked past their likeliest, {whole} read whole"
        );
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
        let v = answer(&server.client, "/v1/completions", &body);
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
    // Penalties that only lower logits draw from rows narrowed to their sampler's reach; a
    // bias too small to move a logit, but above 0, has its token's logit picked beside them,
    // and the same draw.
    let lowering = json!({"frequency_penalty": 0.7, "presence_penalty": 0.3});
    let narrowed = complete(lowering.clone());
    let mut lifting = lowering;
    lifting["logit_bias"] = json!({"0": 1e-30});
    assert_eq!(narrowed, complete(lifting));
    let options = ["--frequency-penalty", "0.7", "--presence-penalty", "0.3"];
    assert_eq!(narrowed, generate_alone_with(&model, &prompt, 24, &options));
    assert_ne!(narrowed, plain);
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

/// Draws over the whole vocabulary that change logits (penalties of either sign, as OpenAI's
/// clients send them at a temperature) read narrowed rows, their totals and the changed
/// tokens' logits, and rows whole only where those do not settle a draw: several requests in
/// flight at once, on one rank or two, draw what `generate` draws from the same seed.
#[test]
fn penalised_draws_over_the_whole_vocabulary_are_generates() {
    let cases = [
        (
            1.0,
            1.0,
            ["--frequency-penalty", "0.5", "--presence-penalty", "0.3"],
        ),
        (
            0.8,
            0.9,
            ["--repetition-penalty", "1.3", "--presence-penalty", "-0.2"],
        ),
    ];
    for ranks in ["1", "2"] {
        let server = Server::start(&tiny(), &["--ranks", ranks]);
        let (model, prompts) = (tiny(), tiny_prompts());
        for (temperature, top_p, penalties) in cases {
            let mut body = json!({
                "max_tokens": 16, "temperature": temperature, "top_p": top_p, "seed": 7,
            });
            for pair in penalties.chunks(2) {
                let field = pair[0].trim_start_matches("--").replace('-', "_");
                body[field] = json!(pair[1].parse::<f32>().unwrap());
            }
            let texts: Vec<String> = std::thread::scope(|scope| {
                let asked: Vec<_> = (prompts.iter())
                    .map(|prompt| {
                        let mut body = body.clone();
                        body["prompt"] = json!(prompt);
                        let client = &server.client;
                        scope.spawn(move || answer(client, "/v1/completions", &body))
                    })
                    .collect();
                (asked.into_iter())
                    .map(|h| {
                        h.join().unwrap()["choices"][0]["text"]
                            .as_str()
                            .unwrap()
                            .to_string()
                    })
                    .collect()
            });
            let (t, p) = (temperature.to_string(), top_p.to_string());
            let mut options = vec!["--temperature", &t, "--top-p", &p, "--seed", "7"];
            options.extend(penalties);
            for (prompt, got) in prompts.iter().zip(&texts) {
                let want = generate_alone_with(&model, prompt, 16, &options);
                assert_eq!(got, &want, "{ranks} ranks, {options:?}");
            }
        }
        let m = server.metrics();
        let whole = value(&m, "canopy_rows_read_whole_total");
        let drawn = value(&m, "canopy_generation_tokens_total");
        assert!(
            whole < drawn / 2.0,
            "{ranks} ranks: {whole} of {drawn} rows read whole"
        );
    }
}

#[test]
fn a_logit_bias_draws_or_bars_its_tokens() {
    let server = Server::start(&tiny(), &[]);
    let prompt = &tiny_prompts()[2];
    let tokens = |bias: Value| {
        let body = json!({
            "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 0,
            "logit_bias": bias,
        });
        let v = answer(&server.client, "/v1/completions", &body);
        v["choices"][0]["logprobs"]["tokens"].clone()
    };
    let id = |text: &str| tiny_vocab_id(text).to_string();
    let plain = tokens(json!({}));
    assert_eq!(tokens(json!({id("A"): 100})), json!(["A", "A", "A", "A"]));
    // Barring the plain first token changes the draw; a bias on tokens not drawn does not.
    let first = plain[0].as_str().unwrap();
    assert_ne!(tokens(json!({id(first): -100})), plain);
    let others: Vec<&str> = ["A", "B"]
        .into_iter()
        .filter(|t| !plain.as_array().unwrap().contains(&json!(t)))
        .collect();
    let mut bias = serde_json::Map::new();
    others.iter().for_each(|t| {
        bias.insert(id(t), json!(-100));
    });
    assert_eq!(tokens(Value::Object(bias)), plain);
    for bias in [json!({"x": 1}), json!({"65": 101}), json!({"99999": 1})] {
        let body = json!({"prompt": "a", "logit_bias": bias});
        let r = server
            .client
            .post("/v1/completions", &body.to_string())
            .unwrap();
        assert_eq!(r.status, 400, "{bias}");
        assert_eq!(error_of(&r)["param"], "logit_bias");
    }
}

/// An evaluation harness's request: a prompt echoed with its tokens' log-probabilities, and
/// one token drawn.
#[test]
fn an_echoed_prompt_reports_its_tokens_log_probabilities() {
    let server = Server::start(&tiny(), &["--prefill-chunk", "16"]);
    let c = &server.client;
    let prompt = tiny_prompts()[2].clone();
    let ask = |prompt: &[u32], echo: bool, stream: bool| {
        let body = json!({
            "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 2, "echo": echo,
            "stream": stream,
        });
        match stream {
            false => answer(c, "/v1/completions", &body)["choices"][0]["logprobs"].clone(),
            true => joined(
                &streamed_logprobs(c, "/v1/completions", body),
                &["tokens", "token_logprobs", "top_logprobs", "text_offset"],
            ),
        }
    };
    let drawn = ask(&prompt, false, false);
    let echoed = ask(&prompt, true, false);
    let n = prompt.len();
    let lps = echoed["token_logprobs"].as_array().unwrap();
    assert_eq!(lps.len(), n + 1);
    assert!(lps[0].is_null() && echoed["top_logprobs"][0].is_null());
    assert!(lps[1..].iter().all(|x| x.as_f64().unwrap() <= 0.0));
    let offsets: Vec<u64> = serde_json::from_value(echoed["text_offset"].clone()).unwrap();
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
    // The drawn token as when the prompt is not echoed.
    assert_close(&lps[n], &drawn["token_logprobs"][0]);
    assert_eq!(echoed["tokens"][n], drawn["tokens"][0]);
    // A prompt token's log-probability is the one decoding gives the token at its place.
    let greedy: u32 = tiny_vocab_id(drawn["tokens"][0].as_str().unwrap());
    let longer = [&prompt[..], &[greedy]].concat();
    let longer_echoed = ask(&longer, true, false);
    assert_close(
        &longer_echoed["token_logprobs"][n],
        &drawn["token_logprobs"][0],
    );
    assert_close(&longer_echoed["top_logprobs"][n], &drawn["top_logprobs"][0]);
    // Streamed, the echo comes once its log-probabilities are in, before the drawn token.
    assert_close(&ask(&prompt, true, true), &echoed);
    // With max_tokens 0 the prompt alone is scored, and no token drawn.
    let body = json!({"prompt": prompt, "max_tokens": 0, "logprobs": 2, "echo": true});
    let scored = answer(c, "/v1/completions", &body);
    assert_eq!(scored["usage"]["completion_tokens"], 0);
    assert_eq!(scored["choices"][0]["finish_reason"], "length");
    let lps = &scored["choices"][0]["logprobs"]["token_logprobs"];
    assert_close(
        lps,
        &Value::Array(echoed["token_logprobs"].as_array().unwrap()[..n].to_vec()),
    );
    let r = c
        .post("/v1/completions", r#"{"prompt": "a", "max_tokens": 0}"#)
        .unwrap();
    assert_eq!(
        (r.status, error_of(&r)["param"].clone()),
        (400, json!("max_tokens"))
    );
}

/// The tiny fixture model's tokenizer.
fn tiny_tokenizer() -> canopy_model::Tokenizer {
    let path = format!("{}/tokenizer.json", tiny());
    canopy_model::Tokenizer::from_file(std::path::Path::new(&path)).unwrap()
}

/// The id of token `text` in the tiny fixture model's vocabulary.
fn tiny_vocab_id(text: &str) -> u32 {
    tiny_tokenizer().token_to_id(text).unwrap()
}

#[test]
fn log_probabilities_and_echo_answer_as_openai_does() {
    let server = Server::start(&tiny(), &[]);
    let c = &server.client;
    let prompt = &tiny_prompts()[2];
    // A completion: each token's text, log-probability, its 3 most likely and offset.
    let body = json!({"prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 3});
    let v = answer(c, "/v1/completions", &body);
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
    let v = answer(c, "/v1/chat/completions", &chat);
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
    // Echo repeats the prompt.
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
            r#"{"prompt": "a", "logprobs": 21}"#,
            "logprobs",
        ),
        (
            "/v1/completions",
            r#"{"prompt": ["a", "b"], "n": 4000000000, "echo": true, "logprobs": 1}"#,
            "n",
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
