//! What recipes and generation need of a tokenizer, whatever the model family: ids of text, text
//! of ids, the token that ends a generation, the BOS token, and the prompt template.

use super::chat_template::ChatTemplate;

/// How a model's prompts are laid out.
#[derive(Debug, Clone, Copy)]
pub enum Template<'t> {
    /// The model's own chat template (ChatML, Llama 3, …), for instruction-tuned models.
    Chat(&'t ChatTemplate),
    /// Plain text for a base model: the context, then `Question: …\nAnswer:`.
    Plain,
}

/// A model's tokenizer, as recipes and generation use it.
pub trait TextTokenizer: Send + Sync {
    /// Token ids of a text; special tokens written in it are recognised.
    fn encode(&self, text: &str) -> Vec<u32>;
    /// The text of token ids, special tokens included.
    fn decode(&self, ids: &[u32]) -> String;
    /// The text of one token, for tables.
    fn token_text(&self, id: u32) -> String {
        self.decode(&[id])
    }
    /// Generation stops before this token.
    fn stop_token(&self) -> u32;
    /// The token every prompt starts with, if the model has one.
    fn bos(&self) -> Option<u32>;
    /// The prompt layout recipes build.
    fn template(&self) -> Template<'_>;
}
