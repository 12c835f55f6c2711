//! The routes: the two generation endpoints, the model list, health and metrics, behind a
//! bearer key (all but `/health`) and a body size limit.

use crate::abort::Abort;
use crate::api::{
    ChatRequest, CompletionRequest, Content, DetokenizeRequest, Detokenized, Message, ModelCard,
    ModelList, Prompt, Sampling, TokenizeRequest, Tokenized,
};
use crate::error::ApiError;
use crate::job::{Job, Kind};
use crate::metrics::{Metrics, Outcome};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use canopy_model::{ChatMessage, ChatTemplate, Tokenizer};
use canopy_runtime::serving::EngineHandle;
use serde::de::DeserializeOwned;
use std::borrow::Cow;
use std::sync::Arc;

/// What every route reads.
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    /// `None`: the model has no chat template, and the chat endpoint says so.
    pub template: Option<Arc<ChatTemplate>>,
    /// The model's name in requests and responses.
    pub model: String,
    /// The model's vocabulary: token ids in a prompt must be below it.
    pub vocab: usize,
    /// Requests must carry `Authorization: Bearer` this.
    pub api_key: Option<String>,
    pub metrics: Metrics,
    /// When the server started (Unix seconds).
    pub created: u64,
    /// Request bodies over this many bytes are refused with 413.
    pub body_limit: usize,
    /// Ends every request in flight when the server stops without waiting for them.
    pub abort: Abort,
}

/// The server's routes over `state`; bodies over its `body_limit` bytes are refused.
pub fn router(state: Arc<AppState>) -> Router {
    let body_limit = state.body_limit;
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        // A wildcard: model ids such as `HuggingFaceTB/SmolLM2-135M-Instruct` hold slashes.
        .route("/v1/models/{*id}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth))
        .route("/health", get(health))
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_key);
        if !given.is_some_and(|g| same_secret(g.as_bytes(), key.as_bytes())) {
            st.metrics.outcome(Outcome::Rejected);
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing or wrong API key: send `Authorization: Bearer KEY` with the server's --api-key",
                "invalid_api_key",
            )
            .into_response();
        }
    }
    next.run(req).await
}

/// The key of an `Authorization: Bearer KEY` value, without the whitespace around it. The
/// scheme's name is matched in any case (`bearer`, `BEARER`), as RFC 9110 (section 11.1) has
/// authentication schemes; the key is taken as sent.
fn bearer_key(value: &str) -> Option<&str> {
    let (scheme, key) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
}

/// Compares secrets in time that does not depend on where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let job = parse::<CompletionRequest>(&st, body).and_then(|r| {
        served(&st, r.sampling.model.as_deref())?;
        let prompts = prompt_ids(&st, &r.prompt)?;
        let echo = r
            .echo
            .then(|| echo_texts(&st, &r.prompt, &prompts))
            .transpose()?;
        Job::submit(&st, Kind::Text, prompts, r.sampling, echo)
    });
    respond(st, job).await
}

async fn chat(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let job = parse::<ChatRequest>(&st, body).and_then(|r| {
        served(&st, r.sampling.model.as_deref())?;
        let prompt = chat_ids(&st, &r.messages)?;
        Job::submit(&st, Kind::Chat, vec![prompt], r.sampling, None)
    });
    respond(st, job).await
}

async fn respond(st: Arc<AppState>, job: Result<Job, ApiError>) -> Response {
    match job {
        Ok(job) => job.respond().await,
        Err(e) => {
            st.metrics.outcome(Outcome::Rejected);
            e.into_response()
        }
    }
}

/// The body as JSON of `T`: a 503 while draining, the body limit's refusal, or a 400 naming
/// what is wrong with it.
fn parse<T: DeserializeOwned>(
    st: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    if st.engine.is_draining() {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is shutting down; retry with another replica",
            "shutting_down",
        ));
    }
    let bytes = body.map_err(|r| match r.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the request body is over the server's limit of {} bytes (canopy serve --max-body)",
                st.body_limit
            ),
            "request_too_large",
        ),
        status => ApiError {
            status,
            message: r.body_text(),
            param: None,
            code: None,
        },
    })?;
    read_body(&bytes)
}

/// `bytes` as the JSON of request `T`, or a 400 naming what is wrong with it and, where serde
/// says, the field at fault (`param`).
fn read_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    json(bytes).map_err(|(e, path)| {
        if e.is_syntax() || e.is_eof() {
            return ApiError::invalid(format!("the body is not valid JSON: {e}"), None);
        }
        // The sampling fields are flattened into the generation requests, and serde reads
        // flattened fields from a buffer that it does not trace: their path is the body's, and
        // they are read again on their own to name the one at fault.
        let param = missing_field(&e)
            .or(path)
            .or_else(|| json::<Sampling>(bytes).err().and_then(|(_, p)| p));
        let message = match &param {
            Some(p) => format!("the body does not match the API at `{p}`: {e}"),
            None => format!("the body does not match the API: {e}"),
        };
        ApiError {
            param: param.map(Cow::Owned),
            ..ApiError::invalid(message, None)
        }
    })
}

/// The field a request lacks, from serde's message for it (its path is the last field read,
/// not the one missing).
fn missing_field(e: &serde_json::Error) -> Option<String> {
    let message = e.to_string();
    let rest = message.strip_prefix("missing field `")?;
    Some(rest[..rest.find('`')?].to_string())
}

/// `bytes` as JSON of `T`; an error comes with the path of the field at fault (`None`: the
/// body as a whole, a path serde could not trace, or one into a body that is an array, which
/// serde reads as a struct's fields in order).
fn json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, (serde_json::Error, Option<String>)> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let known = path != "." && !path.starts_with('[') && !path.contains('?');
        (e.into_inner(), known.then_some(path))
    })?;
    de.end().map_err(|e| (e, None))?;
    Ok(value)
}

/// A completion's prompts as token ids: text is tokenized (with the model's special
/// tokens); ids must be in the vocabulary. A request lists at most as many prompts as the
/// engine's queue holds, since each waits there as a request of its own.
fn prompt_ids(st: &AppState, prompt: &Prompt) -> Result<Vec<Vec<u32>>, ApiError> {
    let prompts = match prompt {
        Prompt::Text(text) => vec![encode(st, text, true)?],
        Prompt::Texts(texts) => texts
            .iter()
            .map(|t| encode(st, t, true))
            .collect::<Result<_, _>>()?,
        Prompt::Ids(ids) => vec![ids.clone()],
        Prompt::IdLists(lists) => lists.clone(),
    };
    let most = st.engine.queue_capacity();
    if prompts.is_empty() || prompts.len() > most {
        return Err(ApiError::invalid(
            format!(
                "a request lists 1 to {most} prompts (the server's --max-queue); this one lists {}",
                prompts.len()
            ),
            Some("prompt"),
        ));
    }
    for prompt in &prompts {
        in_vocabulary(st, prompt, "prompt")?;
    }
    Ok(prompts)
}

/// Refuses token ids (the request's field `param`) outside the model's vocabulary.
fn in_vocabulary(st: &AppState, ids: &[u32], param: &'static str) -> Result<(), ApiError> {
    match ids.iter().find(|&&t| t as usize >= st.vocab) {
        Some(bad) => Err(ApiError::invalid(
            format!(
                "token id {bad} is not in the model's vocabulary of {} tokens",
                st.vocab
            ),
            Some(param),
        )),
        None => Ok(()),
    }
}

/// A completion's prompts as `echo` repeats them: the texts given, or their `ids` decoded.
fn echo_texts(st: &AppState, prompt: &Prompt, ids: &[Vec<u32>]) -> Result<Vec<String>, ApiError> {
    match prompt {
        Prompt::Text(text) => Ok(vec![text.clone()]),
        Prompt::Texts(texts) => Ok(texts.clone()),
        Prompt::Ids(_) | Prompt::IdLists(_) => ids
            .iter()
            .map(|ids| {
                st.tokenizer.decode(ids, false).map_err(|e| {
                    ApiError::invalid(
                        format!("the prompt's ids could not be decoded: {e}"),
                        Some("prompt"),
                    )
                })
            })
            .collect(),
    }
}

fn encode(st: &AppState, text: &str, special: bool) -> Result<Vec<u32>, ApiError> {
    st.tokenizer.encode(text, special).map_err(|e| {
        ApiError::invalid(
            format!("the prompt could not be tokenized: {e}"),
            Some("prompt"),
        )
    })
}

/// The messages rendered by the model's chat template, then tokenized.
fn chat_ids(st: &AppState, messages: &[Message]) -> Result<Vec<u32>, ApiError> {
    let template = st.template.as_ref().ok_or_else(|| {
        ApiError::invalid(
            "this model has no chat template; use /v1/completions with a prompt",
            Some("messages"),
        )
    })?;
    let messages = chat_messages(messages)?;
    let text = template.render(&messages, true).map_err(|e| {
        ApiError::invalid(format!("the chat template failed: {e}"), Some("messages"))
    })?;
    // A chat rendering carries its own special tokens.
    encode(st, &text, false)
}

/// The roles a chat message may have, OpenAI's (`function` among them, which its API still
/// takes though it is deprecated): each goes to the model's template as named (one the
/// template does not take is its error, a 400).
const ROLES: [&str; 6] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

/// The messages as the chat template takes them: a role of [`ROLES`], and the text of a
/// content string or of its parts joined. A role outside them, a part other than text (an
/// image, audio, a file: the models here read text) or a text part without its text is a 400
/// that names the field, as OpenAI's API refuses them, rather than a turn the prompt leaves
/// out unseen.
fn chat_messages(messages: &[Message]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages is empty", Some("messages")));
    }
    let invalid = |message: String, param: String| ApiError {
        param: Some(Cow::Owned(param)),
        ..ApiError::invalid(message, None)
    };
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            if !ROLES.contains(&m.role.as_str()) {
                return Err(invalid(
                    format!(
                        "messages[{i}] has the role {:?}; a message's role is one of {}",
                        m.role,
                        ROLES.join(", ")
                    ),
                    format!("messages[{i}].role"),
                ));
            }
            let text = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => text.push_str(t),
                            ("text", None) => {
                                return Err(invalid(
                                    format!(
                                    "messages[{i}].content[{j}] is a text part without its text"
                                ),
                                    format!("messages[{i}].content[{j}].text"),
                                ))
                            }
                            (kind, _) => {
                                return Err(invalid(
                                    format!(
                                        "messages[{i}].content[{j}] is a part of type {kind:?}; \
                                         this server's models read text parts only"
                                    ),
                                    format!("messages[{i}].content[{j}].type"),
                                ))
                            }
                        }
                    }
                    text
                }
            };
            Ok(ChatMessage::new(m.role.as_str(), text))
        })
        .collect()
}

/// Refuses a request that names a model this server does not serve.
fn served(st: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model.filter(|m| *m != st.model) {
        Some(m) => Err(ApiError::unknown_model(m, &st.model)),
        None => Ok(()),
    }
}

/// A prompt's token ids, or chat messages' as the model's template renders them, as the
/// generation endpoints would take them.
async fn tokenize(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let tokens = parse::<TokenizeRequest>(&st, body).and_then(|r| {
        served(&st, r.model.as_deref())?;
        match (&r.prompt, &r.messages) {
            (Some(prompt), None) => encode(&st, prompt, r.add_special_tokens.unwrap_or(true)),
            (None, Some(messages)) => chat_ids(&st, messages),
            _ => Err(ApiError::invalid(
                "give a prompt or messages, one of them",
                Some("prompt"),
            )),
        }
    });
    match tokens {
        Ok(tokens) => Json(Tokenized {
            count: tokens.len(),
            max_model_len: st.engine.limits().max_context,
            tokens,
        })
        .into_response(),
        Err(e) => e.into_response(),
    }
}

/// Token ids back to text, special tokens included.
async fn detokenize(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let text = parse::<DetokenizeRequest>(&st, body).and_then(|r| {
        served(&st, r.model.as_deref())?;
        in_vocabulary(&st, &r.tokens, "tokens")?;
        st.tokenizer.decode(&r.tokens, false).map_err(|e| {
            ApiError::invalid(
                format!("the tokens could not be decoded: {e}"),
                Some("tokens"),
            )
        })
    });
    match text {
        Ok(prompt) => Json(Detokenized { prompt }).into_response(),
        Err(e) => e.into_response(),
    }
}

fn card(st: &AppState) -> ModelCard {
    ModelCard {
        id: st.model.clone(),
        object: "model",
        created: st.created,
        owned_by: "canopy",
        max_model_len: st.engine.limits().max_context,
        vocab_size: st.vocab,
    }
}

async fn models(State(st): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![card(&st)],
    })
}

/// The model card of `id`, the one model this server serves; `id` is the rest of the path,
/// its slashes as sent or escaped (`%2F`).
async fn model(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if id == st.model {
        Json(card(&st)).into_response()
    } else {
        ApiError::unknown_model(&id, &st.model).into_response()
    }
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    let status = st.engine.status();
    let (code, state) = match (&status.failure, st.engine.is_draining()) {
        (Some(f), _) => (StatusCode::SERVICE_UNAVAILABLE, format!("failed: {f}")),
        (None, true) => (StatusCode::SERVICE_UNAVAILABLE, "draining".to_string()),
        (None, false) => (StatusCode::OK, "ok".to_string()),
    };
    (code, Json(serde_json::json!({ "status": state }))).into_response()
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        st.metrics.render(&st.engine.status()),
    )
        .into_response()
}

/// A route asked with a method it does not take: 405 in OpenAI's error body (axum adds the
/// `Allow` header that names the methods the route takes).
async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "{} does not take {} (the Allow header names the methods it takes)",
            req.uri().path(),
            req.method()
        ),
        "method_not_allowed",
    )
}

async fn not_found(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no route {} {}", req.method(), req.uri().path()),
        "not_found",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A field of the wrong type is named in `param`, flattened sampling fields and nested
    /// ones too; a body that is not JSON, or wrong as a whole, names none.
    #[test]
    fn wrong_types_name_their_field() {
        let param = |body: &str| {
            let e = read_body::<CompletionRequest>(body.as_bytes()).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            e.param.map(|p| p.into_owned())
        };
        for (body, field) in [
            (r#"{"prompt": "a", "max_tokens": "x"}"#, "max_tokens"),
            (
                r#"{"max_tokens": 1, "temperature": [], "prompt": "a"}"#,
                "temperature",
            ),
            (r#"{"prompt": "a", "echo": 3}"#, "echo"),
            (r#"{"prompt": 7}"#, "prompt"),
            (
                r#"{"prompt": "a", "stream_options": {"include_usage": "yes"}}"#,
                "stream_options.include_usage",
            ),
        ] {
            assert_eq!(param(body).as_deref(), Some(field), "{body}");
        }
        assert_eq!(param(r#"{"prompt": "a""#), None);
        assert_eq!(param(r#"{"prompt": "a"} x"#), None);
        assert_eq!(param(r#"[1]"#), None);
        assert_eq!(param(r#"[{"prompt": "a"}]"#), None);
        // A missing field is named, not the last one read.
        assert_eq!(param(r#"{"max_tokens": 1}"#).as_deref(), Some("prompt"));
        let e = read_body::<DetokenizeRequest>(br#"{"model": "m", "n": 1}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tokens"));
        let e = read_body::<ChatRequest>(br#"{"messages": [{"role": 1}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        assert!(e.message.contains("at `messages[0].role`"), "{}", e.message);
        assert!(
            e.body().contains(r#""param":"messages[0].role""#),
            "{}",
            e.body()
        );
    }

    /// Every role of OpenAI's and text parts reach the template; an unknown role, a part
    /// that is not text and a text part without text are refused naming their field.
    #[test]
    fn chats_of_unknown_roles_or_parts_are_refused() {
        let messages = |json: &str| {
            chat_messages(&serde_json::from_str::<Vec<Message>>(json).unwrap())
                .map_err(|e| (e.status, e.param.map(Cow::into_owned)))
        };
        let ok = messages(
            r#"[{"role": "system", "content": "s"}, {"role": "developer", "content": "d"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null}, {"role": "tool", "content": "t"},
                {"role": "function", "content": "f"}]"#,
        )
        .unwrap();
        let roles: Vec<_> = ok.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ROLES);
        assert_eq!(ok[2].content, "ab");
        for (json, param) in [
            (
                r#"[{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]"#,
                "messages[1].role",
            ),
            (
                r#"[{"role": "user", "content": [{"type": "text", "text": "a"},
                    {"type": "image_url", "image_url": {"url": "x"}}]}]"#,
                "messages[0].content[1].type",
            ),
            (
                r#"[{"role": "user", "content": [{"type": "text"}]}]"#,
                "messages[0].content[0].text",
            ),
            (r#"[]"#, "messages"),
        ] {
            assert_eq!(
                messages(json),
                Err((StatusCode::BAD_REQUEST, Some(param.to_string()))),
                "{json}"
            );
        }
    }

    /// The scheme is read in any case, the key as sent.
    #[test]
    fn bearer_keys_are_read_in_any_case_of_the_scheme() {
        for value in [
            "Bearer sk-a",
            "bearer sk-a",
            "BEARER  sk-a ",
            " bEaReR sk-a",
        ] {
            assert_eq!(bearer_key(value), Some("sk-a"), "{value:?}");
        }
        assert_eq!(bearer_key("Bearer SK-A"), Some("SK-A"));
        for value in ["Basic sk-a", "Bearersk-a", "Bearer", "sk-a", ""] {
            assert_eq!(bearer_key(value), None, "{value:?}");
        }
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"ab", b"abc"));
    }
}
