//! Text to token ids and back, with the `tokenizers` crate.
//!
//! A Hugging Face directory ships its tokenizer whole (`tokenizer.json`). A GGUF file ships
//! only the parts — vocabulary, merges or scores, token types, the name of its pre-tokenizer —
//! and the tokenizer is assembled here as llama.cpp and transformers' GGUF converter do, for
//! the two kinds Llama-family files use:
//! - byte-level BPE (`tokenizer.ggml.model = "gpt2"`: Llama 3, SmolLM2): a BPE model over
//!   GPT-2's byte-to-unicode alphabet and the pre-tokenizer split its vocabulary was trained
//!   with;
//! - sentencepiece BPE (`"llama"`: Llama 2, TinyLlama, Mistral): merges derived from the
//!   pieces' scores, spaces as `▁`, bytes for characters outside the vocabulary.
//!
//! In both, every control token (`token_type` 3) is registered as a special token, so that it
//! is matched whole in text.

use std::path::Path;

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::models::wordlevel::WordLevel;
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::NormalizerWrapper;
use tokenizers::{AddedToken, Decoder, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// llama.cpp's `LLAMA_TOKEN_TYPE_CONTROL`: tokens like `<|im_start|>` that text never spells
/// by accident.
const TOKEN_TYPE_CONTROL: i64 = 3;

/// Llama 3's split (also written by llama.cpp for models that reuse its tokenizer): letters
/// with one leading non-letter, numbers in runs of at most three digits.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2's split: Llama 3's with every digit on its own.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The smallest vocabulary [`Tokenizer::code_points`] serves: ASCII.
const CODE_POINTS_MIN_VOCAB: usize = 128;

/// A tokenizer, from `tokenizer.json` or a GGUF file's metadata.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    /// Loads a `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner =
            tokenizers::Tokenizer::from_file(path).map_err(|source| ModelError::Tokenizer {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(Tokenizer { inner })
    }

    /// Builds the tokenizer a GGUF file describes (`tokenizer.ggml.*`).
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let model = gguf.require_str("tokenizer.ggml.model")?;
        let corrupt = |reason: String| gguf.corrupt(format!("tokenizer: {reason}"));
        let tokens = gguf.get_strings("tokenizer.ggml.tokens")?.ok_or_else(|| {
            ModelError::MissingMetadata {
                path: gguf.path().to_path_buf(),
                key: "tokenizer.ggml.tokens".into(),
            }
        })?;
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(id, token)| (token.to_string(), id as u32))
            .collect();
        let (mut inner, bos_by_default) = match model {
            "gpt2" => (byte_level_bpe(gguf, vocab)?, false),
            "llama" => (sentencepiece_bpe(gguf, &tokens, vocab)?, true),
            _ => {
                return Err(ModelError::UnsupportedTokenizer {
                    path: gguf.path().to_path_buf(),
                    model: model.to_string(),
                })
            }
        };

        if let Some(token_types) = gguf.get_ints("tokenizer.ggml.token_type")? {
            let control: Vec<AddedToken> = tokens
                .iter()
                .zip(&token_types)
                .filter(|&(_, &kind)| kind == TOKEN_TYPE_CONTROL)
                .map(|(token, _)| AddedToken::from(token.to_string(), true).normalized(false))
                .collect();
            inner.add_special_tokens(&control);
        }

        if gguf
            .get_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(bos_by_default)
        {
            let bos_id = gguf
                .get_u64("tokenizer.ggml.bos_token_id")?
                .ok_or_else(|| ModelError::MissingMetadata {
                    path: gguf.path().to_path_buf(),
                    key: "tokenizer.ggml.bos_token_id".into(),
                })? as u32;
            let bos = tokens
                .get(bos_id as usize)
                .ok_or_else(|| corrupt(format!("bos id {bos_id} is outside the vocabulary")))?;
            let template = TemplateProcessing::builder()
                .try_single(format!("{bos}:0 $A:0"))
                .and_then(|b| b.try_pair(format!("{bos}:0 $A:0 {bos}:1 $B:1")))
                .map_err(|e| corrupt(e.to_string()))?
                .special_tokens(vec![(bos.to_string(), bos_id)])
                .build()
                .map_err(|e| corrupt(e.to_string()))?;
            inner.with_post_processor(Some(template));
        }
        Ok(Tokenizer { inner })
    }

    /// A stand-in for a model that has no tokenizer (a shape with random weights), for timing
    /// only: one token per Unicode scalar value, id = code point, for the ids below `vocab`.
    /// Text of characters below `vocab` round-trips; a character at or above it encodes as
    /// `?`. Every id decodes to text of its own (a character, or `<U+D800>` for the surrogate
    /// code points, which are no characters), so a random model's tokens stream one by one.
    /// It is not any model's tokenizer: prompt lengths in characters are lengths in tokens.
    pub fn code_points(vocab: usize) -> Result<Self> {
        if vocab < CODE_POINTS_MIN_VOCAB {
            return Err(ModelError::SmallVocabulary { vocab });
        }
        let vocab: Vocab = (0..vocab as u32)
            .map(|id| {
                let text = char::from_u32(id).map_or_else(|| format!("<U+{id:X}>"), String::from);
                (text, id)
            })
            .collect();
        let model = WordLevel::builder()
            .vocab(vocab)
            .unk_token("?".into())
            .build()
            .map_err(ModelError::Encoding)?;
        let mut inner = tokenizers::Tokenizer::new(model);
        let every_char = Split::new(
            SplitPattern::Regex(r"[\s\S]".into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(ModelError::Encoding)?;
        inner.with_pre_tokenizer(Some(every_char));
        inner.with_decoder(Some(Fuse::new()));
        Ok(Tokenizer { inner })
    }

    /// The ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (e.g. a
    /// leading BOS). Special tokens spelled in `text` (`<|im_start|>`) are always matched.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(ModelError::Encoding)?;
        Ok(encoding.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(ModelError::Encoding)
    }

    /// The number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// A decoder for ids arriving one at a time, e.g. while sampling.
    pub fn incremental_decoder(&self, skip_special_tokens: bool) -> IncrementalDecoder<'_> {
        IncrementalDecoder {
            tokenizer: self,
            skip_special_tokens,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The bytes token `id` stands for in the middle of a text, as a client that reads tokens
    /// one at a time (log-probabilities) needs them: a byte-level piece may end inside a
    /// character, and decoding a piece alone would drop the space a sequence's first piece
    /// loses. A special token stands for its own text; an id outside the vocabulary for none.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(piece) = self.inner.id_to_token(id) else {
            return Vec::new();
        };
        if self.inner.get_added_tokens_decoder().contains_key(&id) {
            return piece.into_bytes();
        }
        let mut decoders = Vec::new();
        flatten_decoders(self.inner.get_decoder(), &mut decoders);
        let has = |f: fn(&DecoderWrapper) -> bool| decoders.iter().any(|d| f(d));
        if has(|d| matches!(d, DecoderWrapper::ByteLevel(_))) {
            if let Some(bytes) = piece.chars().map(byte_level_byte).collect() {
                return bytes;
            }
        }
        if has(|d| matches!(d, DecoderWrapper::ByteFallback(_))) {
            if let Some(byte) = fallback_byte(&piece) {
                return vec![byte];
            }
        }
        // Each decoder's rewriting of the piece behind another (`Strip` trims a whole text's
        // ends, not a piece's).
        let mut chain = vec![PIECE_BEFORE.to_string(), piece.clone()];
        for d in decoders
            .iter()
            .filter(|d| !matches!(d, DecoderWrapper::Strip(_)))
        {
            match d.decode_chain(chain.clone()) {
                Ok(next) => chain = next,
                Err(_) => return piece.into_bytes(),
            }
        }
        let text = chain.concat();
        text.strip_prefix(PIECE_BEFORE)
            .map_or_else(|| piece.into_bytes(), |rest| rest.as_bytes().to_vec())
    }
}

/// A piece every decoder leaves as it is, put before the piece [`Tokenizer::token_bytes`]
/// decodes so that the piece is not a text's first.
const PIECE_BEFORE: &str = "a";

/// `decoder` as the list of decoders it applies in order.
fn flatten_decoders<'a>(decoder: Option<&'a DecoderWrapper>, out: &mut Vec<&'a DecoderWrapper>) {
    match decoder {
        Some(DecoderWrapper::Sequence(seq)) => seq
            .get_decoders()
            .iter()
            .for_each(|d| flatten_decoders(Some(d), out)),
        Some(d) => out.push(d),
        None => {}
    }
}

/// The byte that character `c` of GPT-2's byte-level alphabet stands for. The alphabet spells
/// the printable Latin-1 bytes (`!`-`~`, `¡`-`¬`, `®`-`ÿ`) as themselves and the 68 others,
/// in byte order, as U+0100 onwards.
fn byte_level_byte(c: char) -> Option<u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    match u32::from(c) {
        b @ 0..=0xFF => u8::try_from(b).ok().filter(|&b| printable(b)),
        n => (0..=u8::MAX)
            .filter(|&b| !printable(b))
            .nth(usize::try_from(n - 0x100).ok()?),
    }
}

/// The byte of a sentencepiece byte piece (`<0x0A>`).
fn fallback_byte(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

/// A byte-level BPE (`tokenizer.ggml.model = "gpt2"`) from its vocabulary and merges.
fn byte_level_bpe(gguf: &GgufFile, vocab: Vocab) -> Result<tokenizers::Tokenizer> {
    let corrupt = |reason: String| gguf.corrupt(format!("tokenizer: {reason}"));
    let merges: Merges = gguf
        .get_strings("tokenizer.ggml.merges")?
        .unwrap_or_default()
        .into_iter()
        .map(|merge| {
            merge
                .split_once(' ')
                .map(|(left, right)| (left.to_string(), right.to_string()))
                .ok_or_else(|| {
                    corrupt(format!(
                        "merge {merge:?} is not two tokens separated by a space"
                    ))
                })
        })
        .collect::<Result<_>>()?;
    let pre = gguf.get_str("tokenizer.ggml.pre")?.unwrap_or("default");
    let is_llama3_family = matches!(
        pre,
        "llama3" | "llama-v3" | "llama-bpe" | "smaug-bpe" | "falcon3" | "dbrx"
    );
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        // Llama 3's tokenizer.json (and llama.cpp for it) takes a whole pre-token that is
        // itself in the vocabulary before trying any merge.
        .ignore_merges(is_llama3_family)
        .build()
        .map_err(|e| corrupt(e.to_string()))?;
    let add_prefix_space = gguf
        .get_bool("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(false);
    let pre_tokenizer =
        gpt2_pre_tokenizer(pre, is_llama3_family, add_prefix_space).map_err(|source| {
            ModelError::Tokenizer {
                path: gguf.path().to_path_buf(),
                source,
            }
        })?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(pre_tokenizer));
    inner.with_decoder(Some(ByteLevel::default()));
    Ok(inner)
}

/// sentencepiece's word boundary: a space, as the vocabulary spells it.
const SPM_SPACE: &str = "\u{2581}";

/// A sentencepiece BPE vocabulary (`tokenizer.ggml.model = "llama"`: Llama 2, TinyLlama,
/// Mistral) as the BPE it encodes like. sentencepiece merges the adjacent pair whose joined
/// piece scores highest; the merges below are every pair of pieces that joins into a piece,
/// ranked by that piece's score (ties: the pair of higher-scoring halves first), as
/// transformers' GGUF converter derives them. Characters outside the vocabulary fall back to
/// their UTF-8 bytes (`<0xNN>` pieces).
///
/// The text's spaces become `▁`, and each stretch of text between control tokens gets one more
/// at its front (sentencepiece's dummy prefix, which llama.cpp adds the same way) unless the
/// file sets `tokenizer.ggml.add_space_prefix` false. transformers 5.17 adds neither that
/// prefix nor BOS for such a file, unlike the model's own sentencepiece tokenizer and
/// llama.cpp, which this follows (`tests/fixtures/spm/`).
fn sentencepiece_bpe(
    gguf: &GgufFile,
    tokens: &[&str],
    vocab: Vocab,
) -> Result<tokenizers::Tokenizer> {
    let corrupt = |reason: String| gguf.corrupt(format!("tokenizer: {reason}"));
    let scores =
        gguf.get_floats("tokenizer.ggml.scores")?
            .ok_or_else(|| ModelError::MissingMetadata {
                path: gguf.path().to_path_buf(),
                key: "tokenizer.ggml.scores".into(),
            })?;
    if scores.len() != tokens.len() {
        return Err(corrupt(format!(
            "{} scores for {} tokens",
            scores.len(),
            tokens.len()
        )));
    }
    let unk =
        match gguf.get_u64("tokenizer.ggml.unknown_token_id")? {
            Some(id) => Some(tokens.get(id as usize).ok_or_else(|| {
                corrupt(format!("unknown token id {id} is outside the vocabulary"))
            })?),
            None => None,
        };
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, sentencepiece_merges(tokens, &scores))
        .fuse_unk(true)
        .byte_fallback(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk.to_string());
    }
    let bpe = builder.build().map_err(|e| corrupt(e.to_string()))?;
    let add_space_prefix = gguf
        .get_bool("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(true);
    let tokenizer_error = |source| ModelError::Tokenizer {
        path: gguf.path().to_path_buf(),
        source,
    };
    let spaces = NormalizerWrapper::from(Replace::new(" ", SPM_SPACE).map_err(tokenizer_error)?);
    let mut decoders = vec![
        DecoderWrapper::from(Replace::new(SPM_SPACE, " ").map_err(tokenizer_error)?),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    let normalizer = if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
        NormalizerSequence::new(vec![Prepend::new(SPM_SPACE.into()).into(), spaces]).into()
    } else {
        spaces
    };
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_normalizer(Some(normalizer));
    inner.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(inner)
}

/// The merges of a sentencepiece BPE vocabulary (see [`sentencepiece_bpe`]): for each piece in
/// vocabulary order, every split of it into two pieces, higher-scoring halves first; then all
/// of them ordered by the joined piece's score, highest first, keeping that order among ties.
fn sentencepiece_merges(tokens: &[&str], scores: &[f64]) -> Merges {
    let score: std::collections::HashMap<&str, f64> =
        tokens.iter().copied().zip(scores.iter().copied()).collect();
    let mut merges: Vec<(&str, &str, f64)> = Vec::new();
    for &piece in tokens {
        let start = merges.len();
        for (at, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(at);
            if score.contains_key(left) && score.contains_key(right) {
                merges.push((left, right, score[piece]));
            }
        }
        merges[start..].sort_by(|a, b| {
            (score[b.0], score[b.1])
                .partial_cmp(&(score[a.0], score[a.1]))
                .unwrap_or(std::cmp::Ordering::Equal)
        });
    }
    merges.sort_by(|a, b| b.2.partial_cmp(&a.2).unwrap_or(std::cmp::Ordering::Equal));
    merges
        .into_iter()
        .map(|(left, right, _)| (left.to_string(), right.to_string()))
        .collect()
}

/// The pre-tokenizer of a byte-level BPE vocabulary named `pre` by llama.cpp: the regex split
/// its merges were learned on, then GPT-2's byte-to-unicode mapping. Names without a split of
/// their own here use GPT-2's, as transformers' converter does.
fn gpt2_pre_tokenizer(
    pre: &str,
    is_llama3_family: bool,
    add_prefix_space: bool,
) -> tokenizers::Result<PreTokenizerWrapper> {
    let byte_level = |use_regex: bool| {
        PreTokenizerWrapper::from(ByteLevel::new(add_prefix_space, true, use_regex))
    };
    let split_then_bytes = |pattern: &str| -> tokenizers::Result<PreTokenizerWrapper> {
        let split = Split::new(
            SplitPattern::Regex(pattern.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )?;
        Ok(Sequence::new(vec![split.into(), byte_level(false)]).into())
    };
    if is_llama3_family {
        return split_then_bytes(LLAMA3_SPLIT);
    }
    match pre {
        "qwen2" | "deepseek-r1-qwen" => split_then_bytes(QWEN2_SPLIT),
        // SmolLM's (and StarCoder's) tokenizer.json: every digit alone, then GPT-2's split.
        "smollm" | "starcoder" => {
            Ok(Sequence::new(vec![Digits::new(true).into(), byte_level(true)]).into())
        }
        _ => Ok(byte_level(true)),
    }
}

/// Turns ids into text as they arrive, emitting only whole characters.
///
/// Byte-level tokens can end inside a UTF-8 character, and some decoders change a token's
/// text depending on its neighbours, so each step decodes a short window of recent ids and
/// emits what the newest id added once it no longer ends in a partial character (U+FFFD).
pub struct IncrementalDecoder<'a> {
    tokenizer: &'a Tokenizer,
    skip_special_tokens: bool,
    /// Ids from the start of the window; earlier ones have been dropped.
    ids: Vec<u32>,
    /// Start of the window decoded for context.
    prefix_offset: usize,
    /// Ids before this have been emitted.
    read_offset: usize,
}

impl IncrementalDecoder<'_> {
    /// Adds one id; returns the text it completes (empty while a character is unfinished).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let window = &self.ids[self.prefix_offset..];
        let emitted = self.tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let text = self.tokenizer.decode(window, self.skip_special_tokens)?;
        if text.len() <= emitted.len() || text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let new_text = match text.strip_prefix(&emitted) {
            Some(rest) => rest.to_string(),
            None => text.get(emitted.len()..).unwrap_or_default().to_string(),
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        // Only the last step's ids are needed as context.
        self.ids.drain(..self.prefix_offset);
        self.read_offset -= self.prefix_offset;
        self.prefix_offset = 0;
        Ok(new_text)
    }

    /// The text of ids not yet emitted (an unfinished character decodes as U+FFFD).
    pub fn finish(mut self) -> Result<String> {
        let emitted = self.tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let text = self
            .tokenizer
            .decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        self.ids.clear();
        Ok(match text.strip_prefix(&emitted) {
            Some(rest) => rest.to_string(),
            None => text.get(emitted.len()..).unwrap_or_default().to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_level_alphabet_spells_each_byte_once() {
        let alphabet = ('!'..='~')
            .chain('\u{A1}'..='\u{AC}')
            .chain('\u{AE}'..='\u{FF}')
            .chain('\u{100}'..='\u{143}');
        let mut bytes: Vec<u8> = alphabet.map(|c| byte_level_byte(c).unwrap()).collect();
        bytes.sort_unstable();
        assert!(bytes.iter().copied().eq(0..=u8::MAX));
        assert_eq!(byte_level_byte('Ġ'), Some(b' '));
        assert_eq!(byte_level_byte('Ċ'), Some(b'\n'));
        assert_eq!(
            (byte_level_byte(' '), byte_level_byte('\u{144}')),
            (None, None)
        );
        assert_eq!(fallback_byte("<0xE2>"), Some(0xE2));
        assert_eq!(
            (fallback_byte("<0xE>"), fallback_byte("0xE2")),
            (None, None)
        );
    }

    #[test]
    fn a_code_point_token_stands_for_its_character() {
        let t = Tokenizer::code_points(10_000).unwrap();
        assert_eq!(t.token_bytes(65), b"A");
        // sentencepiece's word boundary is an ordinary character here.
        assert_eq!(t.token_bytes(0x2581), "\u{2581}".as_bytes());
        assert!(t.token_bytes(20_000).is_empty());
    }

    #[test]
    fn code_points_are_one_token_per_character_and_every_id_has_text() {
        let t = Tokenizer::code_points(60_000).unwrap();
        assert_eq!(t.vocab_size(), 60_000);
        let text = "Ab é\n\n→ 1";
        let ids = t.encode(text, true).unwrap();
        assert_eq!(ids.len(), text.chars().count());
        assert_eq!(ids[..2], [65, 98]);
        assert_eq!(t.decode(&ids, true).unwrap(), text);
        // A character beyond the vocabulary is `?`; surrogate ids have text of their own.
        assert_eq!(t.encode("😀", false).unwrap(), [63]);
        assert_eq!(t.decode(&[0xD800, 66], false).unwrap(), "<U+D800>B");
        let mut stream = t.incremental_decoder(true);
        for id in [0x4E2D, 0xDFFF, 7, 59_999] {
            assert!(!stream.push(id).unwrap().is_empty(), "id {id}");
        }
        assert!(matches!(
            Tokenizer::code_points(100),
            Err(ModelError::SmallVocabulary { vocab: 100 })
        ));
    }
}
