//! The OpenAI API's request and response bodies, as far as canopy serves them. Requests
//! ignore fields they do not know (clients send many); a field of the wrong type is an error
//! that names it. Every optional field takes `null` as its default, as OpenAI's API allows and
//! its clients send.

use crate::logprobs::{ChatLogprobs, TextLogprobs};
use serde::{Deserialize, Deserializer, Serialize};

/// An optional field with a default other than `None` (a flag): `null` is the default, since
/// OpenAI's API allows `null` for every optional field and clients send it.
fn null_is_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// `prompt`: a text, or token ids; a list of one of either.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default, deserialize_with = "null_is_default")]
    pub include_usage: bool,
}

/// `logprobs`: a chat asks with `true`, a completion with a number of most likely tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum Logprobs {
    Flag(bool),
    Count(u32),
}

/// The sampling fields both endpoints share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Sampling {
    pub model: Option<String>,
    pub max_tokens: Option<u32>,
    /// The chat API's newer name for `max_tokens`.
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// 0 or -1: every token.
    pub top_k: Option<i64>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub n: Option<u32>,
    #[serde(default, deserialize_with = "null_is_default")]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// Not OpenAI's: draw past the end-of-sequence tokens, to `max_tokens`.
    pub ignore_eos: Option<bool>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    /// Not OpenAI's (transformers' and other engines'): 1 is none.
    pub repetition_penalty: Option<f32>,
    /// Token id (as text) to a bias added to its logit, -100 to 100.
    pub logit_bias: Option<std::collections::HashMap<String, f32>>,
    pub logprobs: Option<Logprobs>,
    /// The chat's count of most likely tokens beside each drawn one.
    pub top_logprobs: Option<u32>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// Put the prompt's text before each choice's.
    #[serde(default, deserialize_with = "null_is_default")]
    pub echo: bool,
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// A message's content: a text, or a list of parts of which the text ones count.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// `POST /tokenize` (other engines' extension): a prompt, or chat messages rendered by the
/// model's template.
#[derive(Debug, Clone, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<Message>>,
    /// Whether a prompt gets the tokenizer's special tokens (a BOS); true unless given.
    pub add_special_tokens: Option<bool>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Tokenized {
    pub count: usize,
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
}

/// `POST /detokenize` (other engines' extension): token ids back to text.
#[derive(Debug, Clone, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Detokenized {
    pub prompt: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct PromptDetails {
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptDetails,
}

/// One choice of a completion, whole or as a streamed piece.
#[derive(Debug, Clone, Serialize)]
pub struct TextChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<TextLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatMessage {
    pub role: &'static str,
    pub content: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ChatMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// What a streamed chat chunk adds to a choice's message.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct DeltaChoice {
    pub index: usize,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// A response or a streamed chunk: `object` says which, `choices` holds its kind of choice.
#[derive(Debug, Clone, Serialize)]
pub struct Response<C> {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<C>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub max_model_len: usize,
    /// Token ids a prompt may hold are below this.
    pub vocab_size: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_of_every_shape_and_unknown_fields_parse() {
        let r: CompletionRequest = serde_json::from_str(
            r#"{"prompt": [1, 2], "max_tokens": 3, "logit_bias": {}, "user": "x", "stop": "a"}"#,
        )
        .unwrap();
        assert!(matches!(r.prompt, Prompt::Ids(ref v) if v == &[1, 2]));
        assert_eq!(r.sampling.max_tokens, Some(3));
        assert_eq!(r.sampling.stop.unwrap().into_vec(), ["a"]);
        let r: CompletionRequest = serde_json::from_str(r#"{"prompt": [[5]]}"#).unwrap();
        assert!(matches!(r.prompt, Prompt::IdLists(_)));
        let r: ChatRequest = serde_json::from_str(
            r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "stream": true}"#,
        )
        .unwrap();
        assert!(r.sampling.stream);
        assert_eq!(r.sampling.ignore_eos, None);
        let r: CompletionRequest =
            serde_json::from_str(r#"{"prompt": "a", "ignore_eos": true}"#).unwrap();
        assert_eq!(r.sampling.ignore_eos, Some(true));
        let r: CompletionRequest =
            serde_json::from_str(r#"{"prompt": "a", "logprobs": 2, "echo": true}"#).unwrap();
        assert_eq!(
            (r.sampling.logprobs, r.echo),
            (Some(Logprobs::Count(2)), true)
        );
        let r: ChatRequest =
            serde_json::from_str(r#"{"messages": [], "logprobs": true, "top_logprobs": 3}"#)
                .unwrap();
        assert_eq!(r.sampling.logprobs, Some(Logprobs::Flag(true)));
        assert_eq!(r.sampling.top_logprobs, Some(3));
        let e =
            serde_json::from_str::<CompletionRequest>(r#"{"prompt": "a", "max_tokens": "many"}"#)
                .unwrap_err();
        assert!(e.to_string().contains("invalid type"), "{e}");
    }

    /// OpenAI's API allows `null` for every optional field: it is the field's default.
    #[test]
    fn null_optional_fields_take_their_defaults() {
        let r: CompletionRequest = serde_json::from_str(
            r#"{"prompt": "a", "stream": null, "echo": null, "stream_options": {"include_usage": null},
                "max_tokens": null, "temperature": null, "top_p": null, "top_k": null, "seed": null,
                "stop": null, "n": null, "ignore_eos": null, "frequency_penalty": null,
                "presence_penalty": null, "repetition_penalty": null, "logit_bias": null,
                "logprobs": null, "top_logprobs": null, "model": null,
                "max_completion_tokens": null}"#,
        )
        .unwrap();
        assert!(!r.echo && !r.sampling.stream);
        assert!(!r.sampling.stream_options.unwrap().include_usage);
        assert_eq!(r.sampling.max_tokens, None);
        let r: ChatRequest = serde_json::from_str(
            r#"{"messages": [{"role": "user", "content": null}], "stream": null, "stream_options": null}"#,
        )
        .unwrap();
        assert!(!r.sampling.stream && r.sampling.stream_options.is_none());
        let r: TokenizeRequest = serde_json::from_str(
            r#"{"prompt": "a", "add_special_tokens": null, "messages": null}"#,
        )
        .unwrap();
        assert_eq!(r.add_special_tokens, None);
        // A flag given is still read, and a wrong type is still an error.
        let r: CompletionRequest =
            serde_json::from_str(r#"{"prompt": "a", "stream": true, "echo": true}"#).unwrap();
        assert!(r.echo && r.sampling.stream);
        assert!(
            serde_json::from_str::<CompletionRequest>(r#"{"prompt": "a", "stream": 1}"#).is_err()
        );
    }
}
