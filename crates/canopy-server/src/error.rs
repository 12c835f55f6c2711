//! Errors as OpenAI's API gives them: a status and `{"error": {"message", "type", "param",
//! "code"}}`, so that clients show the message.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use canopy_runtime::serving::RequestError;
use serde::Serialize;
use std::borrow::Cow;

/// A request's failure, as its client sees it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault, if one is (a path such as `stream_options.include_usage`
    /// where the field is nested).
    pub param: Option<Cow<'static, str>>,
    pub code: Option<&'static str>,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Detail<'a>,
}

#[derive(Serialize)]
struct Detail<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'a str>,
    code: Option<&'static str>,
}

impl ApiError {
    /// 400: the request is malformed or asks for what cannot be.
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: param.map(Cow::Borrowed),
            code: None,
        }
    }

    pub fn new(status: StatusCode, message: impl Into<String>, code: &'static str) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
            code: Some(code),
        }
    }

    /// 404: a request names model `asked`, and this server serves only `served`.
    pub fn unknown_model(asked: &str, served: &str) -> ApiError {
        ApiError {
            param: Some(Cow::Borrowed("model")),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                format!("the model `{asked}` does not exist; this server serves `{served}`"),
                "model_not_found",
            )
        }
    }

    /// OpenAI's `type` for this status.
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::NOT_FOUND => "not_found_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The error body alone (a streamed error is sent as an event of it).
    pub fn body(&self) -> String {
        serde_json::to_string(&Body {
            error: Detail {
                message: &self.message,
                kind: self.kind(),
                param: self.param.as_deref(),
                code: self.code,
            },
        })
        .expect("an error body serializes")
    }
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> ApiError {
        let message = e.to_string();
        match e {
            RequestError::QueueFull { .. } => {
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, message, "queue_full")
            }
            RequestError::Stopped => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message, "shutting_down")
            }
            RequestError::EmptyPrompt => ApiError::invalid(message, Some("prompt")),
            RequestError::NoTokens => ApiError::invalid(message, Some("max_tokens")),
            RequestError::Samples { .. } => ApiError::invalid(message, Some("n")),
            RequestError::TooLong { .. } | RequestError::TooBig { .. } => ApiError {
                code: Some("context_length_exceeded"),
                ..ApiError::invalid(message, Some("max_tokens"))
            },
        }
    }
}

/// Seconds a client told 429 should wait before it retries.
pub const RETRY_AFTER_S: u32 = 1;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            self.body(),
        )
            .into_response();
        if matches!(
            self.status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        ) {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_S));
        }
        response
    }
}
