//! The router's `Tokenize` and `ChatRender` over the engine's tokenizer and chat template.

use pdnode_engine::text::{ChatTemplate, RenderOptions, Tokenizer};
use pdnode_router::{ChatMessage, ChatRender, Tokenize, TokenizeError};
use std::sync::Arc;

pub struct EngineTokenizer {
    tok: Arc<Tokenizer>,
    chat: Option<ChatTemplate>,
    chat_error: Option<String>,
}

impl EngineTokenizer {
    pub fn new(tok: Arc<Tokenizer>) -> Self {
        let (chat, chat_error) = match tok.chat_template() {
            Ok(t) => (Some(t), None),
            Err(e) => (None, Some(e.to_string())),
        };
        Self {
            tok,
            chat,
            chat_error,
        }
    }
}

impl Tokenize for EngineTokenizer {
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        self.tok
            .encode(text, add_special_tokens)
            .map_err(|e| TokenizeError(e.to_string()))
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        self.tok
            .decode(ids, true)
            .map_err(|e| TokenizeError(e.to_string()))
    }

    fn vocab_size(&self) -> u32 {
        // saturating: a tokenizer whose largest id is u32::MAX would wrap to 0 and refuse every
        // prompt
        u32::try_from(self.tok.vocab_size()).unwrap_or(u32::MAX)
    }
}

impl ChatRender for EngineTokenizer {
    fn render(&self, messages: &[ChatMessage]) -> Result<String, TokenizeError> {
        let Some(chat) = &self.chat else {
            return Err(TokenizeError(format!(
                "this model has no usable chat template: {}",
                self.chat_error.as_deref().unwrap_or("none")
            )));
        };
        let opts = RenderOptions {
            add_generation_prompt: true,
            ..Default::default()
        };
        chat.render(messages, &opts)
            .map_err(|e| TokenizeError(e.to_string()))
    }
}
