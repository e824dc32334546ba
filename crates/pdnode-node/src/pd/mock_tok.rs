//! The tokenizer of the simulated engine (`engine.backend = "mock"`), which has no model: text
//! encodes to its UTF-8 bytes (ids 0-255); ids from 256 up decode to ` t<id>`. Named for what it
//! is; never used with a real model.

use pdnode_router::{ChatMessage, ChatRender, Tokenize, TokenizeError};

pub struct MockTokenizer {
    pub vocab_size: u32,
}

impl Tokenize for MockTokenizer {
    fn encode(&self, text: &str, _add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        Ok(text.bytes().map(u32::from).collect())
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        let mut bytes = Vec::new();
        for &id in ids {
            if id < 256 {
                bytes.push(id as u8);
            } else {
                bytes.extend_from_slice(format!(" t{id}").as_bytes());
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn vocab_size(&self) -> u32 {
        self.vocab_size
    }
}

impl ChatRender for MockTokenizer {
    fn render(&self, messages: &[ChatMessage]) -> Result<String, TokenizeError> {
        Ok(messages
            .iter()
            .map(|m| format!("<{}>{}\n", m.role, m.content))
            .collect::<String>()
            + "<assistant>")
    }
}
