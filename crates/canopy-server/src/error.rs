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

    /// 400 `context_length_exceeded` for a request whose longest prompt, of `prompt` tokens
    /// (the request's field `field`: `prompt`, or a chat's `messages`), and `max_tokens` pass
    /// `max_context`; `None` where they fit. A prompt that leaves no room for a token alone is
    /// named, since no `max_tokens` would fit it; otherwise `max_tokens` is, and where the
    /// client sent none (`given` false) the message says the default was taken.
    pub fn context_length(
        field: &'static str,
        prompt: usize,
        max_tokens: usize,
        given: bool,
        max_context: usize,
    ) -> Option<ApiError> {
        let limit = format!("this server's maximum context length is {max_context} tokens");
        let (message, param) = if prompt + max_tokens.min(1) > max_context {
            let what = match field {
                "messages" => "the messages alone have",
                _ => "the prompt alone has",
            };
            let room = if max_tokens == 0 {
                ""
            } else {
                ", which leaves no room for a completion"
            };
            (
                format!("{limit}, but {what} {prompt} tokens{room}; shorten the {field}"),
                field,
            )
        } else if prompt + max_tokens > max_context {
            let asked = if given {
                format!("max_tokens {max_tokens}")
            } else {
                format!("the default max_tokens of {max_tokens} (none was sent)")
            };
            let total = prompt + max_tokens;
            (
                format!(
                    "{limit}, but the request has {prompt} prompt tokens and {asked} ({total}); \
                     shorten the {field} or send a max_tokens of at most {}",
                    max_context - prompt
                ),
                "max_tokens",
            )
        } else {
            return None;
        };
        Some(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid(message, Some(param))
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A prompt too long alone names its field and no max_tokens; a max_tokens too large is
    /// named, as sent or as the default; a request that fits gets none.
    #[test]
    fn context_errors_name_what_the_client_can_change() {
        let e = ApiError::context_length("messages", 64, 1, false, 64).unwrap();
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert_eq!(e.code, Some("context_length_exceeded"));
        assert!(e.message.contains("messages alone have 64 tokens"), "{e}");
        assert!(!e.message.contains("max_tokens"), "{e}");
        let e = ApiError::context_length("prompt", 70, 5, true, 64).unwrap();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        assert!(e.message.contains("prompt alone has 70 tokens"), "{e}");
        assert!(!e.message.contains("max_tokens"), "{e}");
        // A prompt scored alone (max_tokens 0) fits the context exactly.
        assert_eq!(ApiError::context_length("prompt", 64, 0, true, 64), None);
        let e = ApiError::context_length("prompt", 65, 0, true, 64).unwrap();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        let e = ApiError::context_length("prompt", 60, 16, true, 64).unwrap();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(e.message.contains("max_tokens 16 (76)"), "{e}");
        assert!(e.message.contains("at most 4"), "{e}");
        let e = ApiError::context_length("prompt", 60, 16, false, 64).unwrap();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(
            e.message
                .contains("default max_tokens of 16 (none was sent)"),
            "{e}"
        );
        assert_eq!(ApiError::context_length("prompt", 48, 16, false, 64), None);
    }
}
