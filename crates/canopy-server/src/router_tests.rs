//! The router's answers that come before a request reaches the engine: routes, methods, keys,
//! and the checks of a request's fields. The engine behind it takes requests and never runs
//! them.

use crate::abort::Abort;
use crate::metrics::{FloorFacts, Metrics};
use crate::routes::{router, AppState};
use axum::body::Body;
use axum::http::{header, HeaderMap, Request, StatusCode};
use canopy_model::Tokenizer;
use canopy_runtime::serving::{channel, EngineInbox, Limits};
use serde_json::Value;
use std::sync::Arc;
use tower::ServiceExt;

/// A server of model `model`, with `api_key` if given, whose context is 64 tokens of one
/// character each.
fn state(model: &str, api_key: Option<&str>) -> (Arc<AppState>, EngineInbox) {
    idle_state(model, api_key, Abort::new())
}

/// [`state`] with its stop signal `abort`: the server state the crate's tests run requests
/// against, over an engine that takes requests and never runs them, so that a test tells
/// their answers itself.
pub(crate) fn idle_state(
    model: &str,
    api_key: Option<&str>,
    abort: Abort,
) -> (Arc<AppState>, EngineInbox) {
    let limits = Limits {
        max_context: 64,
        max_samples: 4,
        page_size: 16,
        pages: 16,
    };
    let (engine, inbox) = channel(limits, 4);
    let st = AppState {
        engine,
        tokenizer: Arc::new(Tokenizer::code_points(256).unwrap()),
        template: None,
        model: model.into(),
        vocab: 256,
        api_key: api_key.map(str::to_string),
        metrics: Metrics::new(FloorFacts {
            weight_bytes: 0,
            copy_bandwidth: None,
        }),
        created: 0,
        body_limit: 1 << 20,
        abort,
    };
    (Arc::new(st), inbox)
}

/// A response's status, headers and body (as JSON; `Null` when empty or not JSON).
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Value,
}

impl Answer {
    /// The body's `error` object, after checking it has OpenAI's four fields.
    fn error(&self) -> &Value {
        let e = &self.body["error"];
        for field in ["message", "type", "param", "code"] {
            assert!(e.get(field).is_some(), "no {field} in {}", self.body);
        }
        e
    }
}

/// Sends `method path` with `body` (if any) and `Authorization: auth` (if given).
async fn ask(
    st: &Arc<AppState>,
    method: &str,
    path: &str,
    auth: Option<&str>,
    body: Option<&str>,
) -> Answer {
    let mut req = Request::builder().method(method).uri(path);
    if let Some(auth) = auth {
        req = req.header(header::AUTHORIZATION, auth);
    }
    if body.is_some() {
        req = req.header(header::CONTENT_TYPE, "application/json");
    }
    let req = req
        .body(body.map_or_else(Body::empty, |b| Body::from(b.to_string())))
        .unwrap();
    let response = router(st.clone()).oneshot(req).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    Answer {
        status,
        headers,
        body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    }
}

/// A route asked with a method it does not take gets 405, its `Allow` header and an error
/// body; a path no route has gets 404 and one too.
#[tokio::test]
async fn wrong_methods_and_unknown_paths_get_error_bodies() {
    let (st, _inbox) = state("m", None);
    for (method, path, allow) in [
        ("GET", "/v1/completions", "POST"),
        ("GET", "/v1/chat/completions", "POST"),
        ("POST", "/health", "GET,HEAD"),
        ("DELETE", "/v1/models", "GET,HEAD"),
        ("PUT", "/metrics", "GET,HEAD"),
    ] {
        let a = ask(&st, method, path, None, None).await;
        assert_eq!(a.status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
        assert_eq!(a.headers[header::ALLOW], allow, "{method} {path}");
        let e = a.error();
        assert_eq!(e["code"], "method_not_allowed", "{method} {path}");
        assert!(
            e["message"].as_str().unwrap().contains(method),
            "{method} {path}: {e}"
        );
    }
    for (method, path) in [("GET", "/v2/models"), ("POST", "/v1/embeddings")] {
        let a = ask(&st, method, path, None, Some("{}")).await;
        assert_eq!(a.status, StatusCode::NOT_FOUND, "{method} {path}");
        assert_eq!(a.error()["code"], "not_found", "{method} {path}");
    }
    assert_eq!(
        ask(&st, "GET", "/health", None, None).await.status,
        StatusCode::OK
    );
}

/// A model id with slashes is found by its path, its slashes as they are or escaped; another
/// id, with slashes or not, is not.
#[tokio::test]
async fn a_model_id_with_slashes_is_found() {
    let id = "HuggingFaceTB/SmolLM2-135M-Instruct";
    let (st, _inbox) = state(id, None);
    for path in [
        "/v1/models/HuggingFaceTB/SmolLM2-135M-Instruct",
        "/v1/models/HuggingFaceTB%2FSmolLM2-135M-Instruct",
    ] {
        let a = ask(&st, "GET", path, None, None).await;
        assert_eq!(a.status, StatusCode::OK, "{path}: {}", a.body);
        assert_eq!(a.body["id"], id, "{path}");
    }
    for (path, code) in [
        ("/v1/models/HuggingFaceTB/other", "model_not_found"),
        ("/v1/models/SmolLM2-135M-Instruct", "model_not_found"),
        ("/v1/models/", "not_found"),
    ] {
        let a = ask(&st, "GET", path, None, None).await;
        assert_eq!(a.status, StatusCode::NOT_FOUND, "{path}");
        assert_eq!(a.error()["code"], code, "{path}");
    }
}
