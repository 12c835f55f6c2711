//! Chat templates: the Jinja program a model ships to turn a conversation into its prompt
//! text, rendered with `minijinja` the way transformers' `apply_chat_template` renders it
//! (blocks trim their newline and strip leading space, loop controls, `raise_exception`,
//! `strftime_now`, Python string methods such as `.strip()` through `minijinja-contrib`'s
//! pycompat).

use std::path::Path;

use chrono::format::{Item, StrftimeItems};
use chrono::Local;
use minijinja::syntax::SyntaxConfig;
use minijinja::{context, Environment, ErrorKind};
use serde::Serialize;
use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A model's chat template with the special tokens it may refer to.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Self {
        ChatTemplate {
            source: source.into(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        }
    }

    /// The template of a Hugging Face directory: `chat_template.jinja` where present (newer
    /// transformers save it there), else `tokenizer_config.json`'s `chat_template` — a string,
    /// or a list of named templates of which the one named `default` is used. The special
    /// tokens are `tokenizer_config.json`'s, else `fallback_tokens` (bos, eos).
    pub fn from_hf_dir(dir: &Path, fallback_tokens: (&str, &str)) -> Result<Option<Self>> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = if config_path.is_file() {
            let text = std::fs::read_to_string(&config_path)
                .map_err(|e| ModelError::io(&config_path, e))?;
            serde_json::from_str(&text).map_err(|source| ModelError::Json {
                path: config_path.clone(),
                source,
            })?
        } else {
            Value::Null
        };
        let jinja_path = dir.join("chat_template.jinja");
        let source = if jinja_path.is_file() {
            Some(std::fs::read_to_string(&jinja_path).map_err(|e| ModelError::io(&jinja_path, e))?)
        } else {
            match config.get("chat_template") {
                Some(Value::String(source)) => Some(source.clone()),
                Some(Value::Array(named)) => named
                    .iter()
                    .find(|entry| entry.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|entry| entry.get("template"))
                    .and_then(Value::as_str)
                    .map(str::to_string),
                _ => None,
            }
        };
        // A special token is written as its text or as an AddedToken object with `content`.
        let token = |key: &str, fallback: &str| {
            config
                .get(key)
                .and_then(|v| {
                    v.as_str()
                        .or_else(|| v.get("content").and_then(Value::as_str))
                })
                .unwrap_or(fallback)
                .to_string()
        };
        Ok(source.map(|source| ChatTemplate {
            source,
            bos_token: token("bos_token", fallback_tokens.0),
            eos_token: token("eos_token", fallback_tokens.1),
        }))
    }

    /// The template of a GGUF file (`tokenizer.chat_template`), with the texts of its bos and
    /// eos tokens.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Option<Self>> {
        let Some(source) = gguf.get_str("tokenizer.chat_template")? else {
            return Ok(None);
        };
        let tokens = gguf
            .get_strings("tokenizer.ggml.tokens")?
            .unwrap_or_default();
        let token_text = |key: &str| -> Result<String> {
            Ok(gguf
                .get_u64(key)?
                .and_then(|id| tokens.get(id as usize))
                .map_or_else(String::new, |t| t.to_string()))
        };
        Ok(Some(ChatTemplate {
            source: source.to_string(),
            bos_token: token_text("tokenizer.ggml.bos_token_id")?,
            eos_token: token_text("tokenizer.ggml.eos_token_id")?,
        }))
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` into prompt text; `add_generation_prompt` appends the opening of
    /// the assistant's turn, so the model's next tokens are its reply.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(ModelError::ChatTemplate)?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function("strftime_now", strftime_now);
        env.render_str(
            &self.source,
            context! {
                messages => minijinja::Value::from(minijinja::value::Serde(messages)),
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            },
        )
        .map_err(ModelError::ChatTemplate)
    }
}

/// The local time in `format`, Python's `strftime` codes: what transformers gives templates,
/// such as Llama 3.2's, that date their system prompt (`strftime_now("%d %b %Y")`). Without it
/// those templates fall back to a fixed date, and the prompt differs from transformers'.
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    let items: Vec<Item> = StrftimeItems::new(&format).collect();
    if items.contains(&Item::Error) {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: {format:?} is not a strftime format"),
        ));
    }
    Ok(Local::now().format_with_items(items.iter()).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn renders_chatml_with_generation_prompt() {
        let template = ChatTemplate::new(CHATML, "<|im_start|>", "<|im_end|>");
        let text = template
            .render(&[ChatMessage::new("user", "Hi")], true)
            .unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_string_methods_trimmed_blocks_and_raise_exception() {
        let source = "{{ bos_token }}\n{% for m in messages %}\n  {{ m.content.strip() | upper }}|{% endfor %}\n{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}";
        let template = ChatTemplate::new(source, "<s>", "</s>");
        assert_eq!(
            template
                .render(&[ChatMessage::new("user", "  hi  ")], false)
                .unwrap(),
            "<s>\n  HI|"
        );
        let err = template
            .render(
                &[ChatMessage::new("user", "a"), ChatMessage::new("user", "b")],
                false,
            )
            .unwrap_err();
        assert!(err.to_string().contains("one message only"), "{err}");
    }

    /// Llama 3.2's templates date their system prompt with `strftime_now` where it is
    /// defined, as transformers defines it, and with a fixed date otherwise.
    #[test]
    fn strftime_now_dates_the_prompt_like_transformers() {
        let source = "{%- if not date_string is defined %}{%- if strftime_now is defined %}{%- set date_string = strftime_now(\"%d %b %Y\") %}{%- else %}{%- set date_string = \"26 Jul 2024\" %}{%- endif %}{%- endif %}Today Date: {{ date_string }}";
        let template = ChatTemplate::new(source, "<s>", "</s>");
        let before = Local::now().format("%d %b %Y").to_string();
        let text = template
            .render(&[ChatMessage::new("user", "hi")], true)
            .unwrap();
        let after = Local::now().format("%d %b %Y").to_string();
        assert!(
            [
                format!("Today Date: {before}"),
                format!("Today Date: {after}")
            ]
            .contains(&text),
            "{text}"
        );
        let bad = ChatTemplate::new("{{ strftime_now('%Q') }}", "<s>", "</s>");
        let err = bad.render(&[], false).unwrap_err();
        assert!(err.to_string().contains("not a strftime format"), "{err}");
    }

    #[test]
    fn named_templates_use_default() {
        let dir = tempfile::tempdir().unwrap();
        let config = serde_json::json!({
            "chat_template": [
                {"name": "tool_use", "template": "tools"},
                {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"}
            ],
            "bos_token": {"content": "<s>", "special": true},
        });
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let template = ChatTemplate::from_hf_dir(dir.path(), ("?", "?"))
            .unwrap()
            .unwrap();
        assert_eq!(
            template
                .render(&[ChatMessage::new("user", "x")], false)
                .unwrap(),
            "<s>x"
        );
    }
}
