//! Token log-probabilities as the two endpoints ask for and answer them.
//!
//! - `/v1/completions`: `logprobs: N` (0-20). Each choice gets `tokens`, `token_logprobs`,
//!   `top_logprobs` (the `N` most likely tokens, and the drawn one where it is not among
//!   them) and `text_offset` (where each token's text begins in the choice's text, in
//!   characters). With `echo`, the prompt's tokens come first, the first of them with no
//!   log-probability (`null`), as evaluation harnesses read them.
//! - `/v1/chat/completions`: `logprobs: true` and `top_logprobs: N` (0-20). Each choice gets
//!   `content`: per token its text, log-probability, bytes and the `N` most likely tokens.
//!
//! A token's text is its bytes where they are whole characters; a byte-level token that ends
//! inside a character is written `bytes:\xNN…`, as OpenAI writes it. The log-probabilities are
//! the model's own, before the draw's temperature and cuts
//! ([`canopy_runtime::TokenLogprobs`]).

use crate::api::Logprobs;
use crate::error::ApiError;
use canopy_model::Tokenizer;
use canopy_runtime::{TokenLogprobs, LOGPROBS_MAX};
use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};

/// One token as a choice reports it: drawn, or of an echoed prompt.
#[derive(Debug, Clone)]
pub struct Entry {
    pub token: u32,
    /// `None`: a prompt's first token, or a prompt token not yet computed.
    pub logprobs: Option<TokenLogprobs>,
    /// Characters of the choice's text before this token's.
    pub text_offset: usize,
}

/// The entries of an echoed `prompt`, before their log-probabilities come: each token's text
/// begins where the texts of the tokens before it end.
pub fn prompt_entries(tokenizer: &Tokenizer, prompt: &[u32]) -> Vec<Entry> {
    let mut offset = 0;
    prompt
        .iter()
        .map(|&token| {
            let entry = Entry {
                token,
                logprobs: None,
                text_offset: offset,
            };
            offset += String::from_utf8_lossy(&tokenizer.token_bytes(token))
                .chars()
                .count();
            entry
        })
        .collect()
}

/// How many alternatives a completion request asks for beside each token (`None`: no
/// log-probabilities).
pub fn completion_request(logprobs: Option<Logprobs>) -> Result<Option<usize>, ApiError> {
    match logprobs {
        None => Ok(None),
        Some(Logprobs::Count(n)) if n as usize <= LOGPROBS_MAX => Ok(Some(n as usize)),
        Some(_) => Err(ApiError::invalid(
            format!("logprobs is a number of most likely tokens, 0 to {LOGPROBS_MAX}"),
            Some("logprobs"),
        )),
    }
}

/// How many alternatives a chat request asks for beside each token (`None`: no
/// log-probabilities).
pub fn chat_request(
    logprobs: Option<Logprobs>,
    top_logprobs: Option<u32>,
) -> Result<Option<usize>, ApiError> {
    let wanted = match logprobs {
        None | Some(Logprobs::Flag(false)) => false,
        Some(Logprobs::Flag(true)) => true,
        Some(Logprobs::Count(_)) => {
            return Err(ApiError::invalid(
                "logprobs is true or false here; top_logprobs says how many most likely tokens",
                Some("logprobs"),
            ))
        }
    };
    match top_logprobs {
        Some(n) if n as usize > LOGPROBS_MAX => Err(ApiError::invalid(
            format!("top_logprobs must be 0 to {LOGPROBS_MAX}"),
            Some("top_logprobs"),
        )),
        Some(n) if n > 0 && !wanted => Err(ApiError::invalid(
            "top_logprobs needs logprobs set to true",
            Some("top_logprobs"),
        )),
        n => Ok(wanted.then(|| n.unwrap_or(0) as usize)),
    }
}

/// A token's text: its bytes where they are whole characters, else `bytes:\xNN…`.
fn token_text(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) => text.to_string(),
        Err(_) => bytes.iter().fold(String::from("bytes:"), |mut s, b| {
            s.push_str(&format!("\\x{b:02x}"));
            s
        }),
    }
}

/// Tokens and their log-probabilities in the order given, as a JSON object.
#[derive(Debug, Clone)]
pub struct TopMap(Vec<(String, f32)>);

impl Serialize for TopMap {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (token, logprob) in &self.0 {
            map.serialize_entry(token, logprob)?;
        }
        map.end()
    }
}

/// A completion choice's `logprobs`.
#[derive(Debug, Clone, Serialize)]
pub struct TextLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<TopMap>>,
    pub text_offset: Vec<usize>,
}

impl TextLogprobs {
    pub fn of(tokenizer: &Tokenizer, entries: &[Entry]) -> TextLogprobs {
        let text = |t: u32| token_text(&tokenizer.token_bytes(t));
        TextLogprobs {
            tokens: entries.iter().map(|e| text(e.token)).collect(),
            token_logprobs: entries
                .iter()
                .map(|e| e.logprobs.as_ref().map(|lp| lp.logprob))
                .collect(),
            top_logprobs: entries
                .iter()
                .map(|e| {
                    let lp = e.logprobs.as_ref()?;
                    let mut top: Vec<(String, f32)> =
                        lp.top.iter().map(|&(t, x)| (text(t), x)).collect();
                    if !lp.top.iter().any(|&(t, _)| t == e.token) {
                        top.push((text(e.token), lp.logprob));
                    }
                    Some(TopMap(top))
                })
                .collect(),
            text_offset: entries.iter().map(|e| e.text_offset).collect(),
        }
    }
}

/// One token of a chat choice's `logprobs.content`, or one of its `top_logprobs`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatToken {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatTokenLogprobs {
    #[serde(flatten)]
    pub drawn: ChatToken,
    pub top_logprobs: Vec<ChatToken>,
}

/// A chat choice's `logprobs`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprobs>,
}

impl ChatLogprobs {
    pub fn of(tokenizer: &Tokenizer, entries: &[Entry]) -> ChatLogprobs {
        let token = |t: u32, logprob: f32| {
            let bytes = tokenizer.token_bytes(t);
            ChatToken {
                token: token_text(&bytes),
                logprob,
                bytes,
            }
        };
        ChatLogprobs {
            content: entries
                .iter()
                .filter_map(|e| {
                    let lp = e.logprobs.as_ref()?;
                    Some(ChatTokenLogprobs {
                        drawn: token(e.token, lp.logprob),
                        top_logprobs: lp.top.iter().map(|&(t, x)| token(t, x)).collect(),
                    })
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_checked_per_endpoint() {
        assert_eq!(completion_request(None).unwrap(), None);
        assert_eq!(
            completion_request(Some(Logprobs::Count(3))).unwrap(),
            Some(3)
        );
        assert!(completion_request(Some(Logprobs::Count(21))).is_err());
        assert!(completion_request(Some(Logprobs::Flag(true))).is_err());
        assert_eq!(
            chat_request(Some(Logprobs::Flag(true)), None).unwrap(),
            Some(0)
        );
        assert_eq!(
            chat_request(Some(Logprobs::Flag(true)), Some(5)).unwrap(),
            Some(5)
        );
        assert_eq!(
            chat_request(Some(Logprobs::Flag(false)), Some(0)).unwrap(),
            None
        );
        assert_eq!(
            chat_request(None, Some(2)).unwrap_err().param.as_deref(),
            Some("top_logprobs")
        );
        assert!(chat_request(Some(Logprobs::Flag(true)), Some(21)).is_err());
        assert_eq!(
            chat_request(Some(Logprobs::Count(2)), None)
                .unwrap_err()
                .param
                .as_deref(),
            Some("logprobs")
        );
    }

    #[test]
    fn texts_spell_whole_characters_or_bytes() {
        assert_eq!(token_text(b" Paris"), " Paris");
        assert_eq!(token_text(&[0xF0, 0x9F]), "bytes:\\xf0\\x9f");
    }

    #[test]
    fn a_completion_lists_the_drawn_token_beside_the_top_ones() {
        let tok = Tokenizer::code_points(256).unwrap();
        let entries = [
            Entry {
                token: u32::from(b'a'),
                logprobs: Some(TokenLogprobs {
                    logprob: -0.5,
                    top: vec![(u32::from(b'a'), -0.5), (u32::from(b'b'), -1.0)],
                }),
                text_offset: 0,
            },
            Entry {
                token: u32::from(b'c'),
                logprobs: Some(TokenLogprobs {
                    logprob: -3.0,
                    top: vec![(u32::from(b'b'), -0.25)],
                }),
                text_offset: 1,
            },
        ];
        let json = serde_json::to_value(TextLogprobs::of(&tok, &entries)).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "tokens": ["a", "c"],
                "token_logprobs": [-0.5, -3.0],
                "top_logprobs": [{"a": -0.5, "b": -1.0}, {"b": -0.25, "c": -3.0}],
                "text_offset": [0, 1],
            })
        );
        let json = serde_json::to_value(ChatLogprobs::of(&tok, &entries[1..])).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"content": [{
                "token": "c", "logprob": -3.0, "bytes": [99],
                "top_logprobs": [{"token": "b", "logprob": -0.25, "bytes": [98]}],
            }]})
        );
    }
}
