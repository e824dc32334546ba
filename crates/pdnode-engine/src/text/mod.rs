//! Text: tokenizer, chat templates and incremental detokenization.
//!
//! - [`Tokenizer`]: a `tokenizers::Tokenizer` built from an HF `tokenizer.json` or from the
//!   tokenizer stored in GGUF metadata ([`crate::loader::TokenizerSource`]), plus the special token
//!   ids and chat template of the model.
//! - [`ChatTemplate`]: the model's Jinja chat template rendered with minijinja the way HF's
//!   `apply_chat_template` renders it.
//! - [`IncrementalDecoder`]: UTF-8-safe streaming detokenization (never emits half a character).
//!
//! Everything here takes input from the network: ids out of range and bad templates are errors
//! ([`TextError`]), never panics.

mod chat;
mod detok;
mod gguf;
mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate, MAX_RENDER_BYTES, RENDER_FUEL, RenderOptions};
pub use detok::IncrementalDecoder;
pub use tokenizer::Tokenizer;

/// A value handed to a chat template (minijinja's; deserialize JSON into it to keep key order).
pub use minijinja::Value as TemplateValue;

use pdnode_core::ErrorKind;
use pdnode_core::error::Classify;
use std::path::PathBuf;

/// Errors of the text layer.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// The model comes without a tokenizer (a dummy preset, an HF directory without
    /// `tokenizer.json`): only token ids can be served.
    #[error("the model has no tokenizer; send token ids instead of text")]
    NoTokenizer,
    /// The tokenizer file or metadata could not be turned into a tokenizer.
    #[error("cannot load the tokenizer{}: {reason}", path.as_ref().map(|p| format!(" from {}", p.display())).unwrap_or_default())]
    Load {
        path: Option<PathBuf>,
        reason: String,
    },
    /// A tokenizer kind this build cannot reproduce faithfully.
    #[error("unsupported tokenizer `{model}`: {reason}")]
    Unsupported { model: String, reason: String },
    /// Encoding the text failed.
    #[error("cannot tokenize the input: {reason}")]
    Encode { reason: String },
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab_size} tokens")]
    TokenOutOfRange { id: u32, vocab_size: usize },
    /// Decoding ids failed inside the tokenizer.
    #[error("cannot decode token ids: {reason}")]
    Decode { reason: String },
    /// A chat request for a model that has no chat template.
    #[error(
        "the model has no chat template, so chat requests (and `--chat`) cannot be served; send a plain prompt"
    )]
    NoChatTemplate,
    /// The chat template does not compile.
    #[error("the model's chat template is invalid: {reason}")]
    TemplateSyntax { reason: String },
    /// Rendering the chat template failed for these messages (the template raised an exception,
    /// e.g. "roles must alternate", or used a value it could not handle).
    #[error("cannot render the chat template for these messages: {reason}")]
    TemplateRender { reason: String },
}

impl Classify for TextError {
    fn kind(&self) -> ErrorKind {
        match self {
            TextError::NoTokenizer
            | TextError::Encode { .. }
            | TextError::TokenOutOfRange { .. }
            | TextError::NoChatTemplate
            | TextError::TemplateRender { .. } => ErrorKind::InvalidRequest,
            TextError::Load { .. }
            | TextError::Unsupported { .. }
            | TextError::Decode { .. }
            | TextError::TemplateSyntax { .. } => ErrorKind::Internal,
        }
    }
}
