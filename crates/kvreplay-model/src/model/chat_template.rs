//! A model's own chat template, rendered as transformers renders it, and the text it writes
//! around each message's content.
//!
//! A GGUF (and a Hugging Face tokenizer) carries its chat template as Jinja source
//! (`tokenizer.chat_template`). kvreplay renders it with minijinja under the settings of
//! transformers' `apply_chat_template` (`transformers/utils/chat_template_utils.py`,
//! `_cached_compile_jinja_template` and `render_jinja_template`): `trim_blocks` and
//! `lstrip_blocks` on, loop controls, macros, `loop.previtem`, a `raise_exception(message)`
//! function, Python's string methods (`split`, `strip`, `startswith`, …), and the variables
//! `messages`, `tools = none`, `documents = none`, `add_generation_prompt` and the tokenizer's
//! special tokens (`bos_token`, `eos_token`). Its output is tokenized with special tokens recognised and no BOS added, as
//! `apply_chat_template` tokenizes it (`add_special_tokens=False`): a template that wants a BOS
//! writes `{{ bos_token }}` itself.
//!
//! One deliberate deviation: transformers defines `strftime_now`, so Llama 3.2's template writes
//! today's date into every prompt; kvreplay leaves it undefined, so such a template takes its own
//! fallback date and a prompt does not depend on the day it is built.
//!
//! Recipes assemble prompts in token space (each piece tokenized on its own, so spans are exact):
//! [`ChatTemplate::around`] renders a conversation whose contents are markers and returns the text
//! the template writes before, between and after them.

use super::gguf::{GgufFile, BOS_KEY, EOS_KEY};
use super::ModelError;
use minijinja::syntax::SyntaxConfig;
use minijinja::{context, Environment, Error, ErrorKind, Value};

/// One message of a chat.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// Stands for the `i`-th content in [`ChatTemplate::around`]: private-use characters no template
/// writes.
fn marker(i: usize) -> String {
    format!("\u{F0000}{i}\u{F0001}")
}

/// A chat template and the special tokens it may write.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// [`ChatTemplate::user_turn`]'s two pieces.
    user_turn: [String; 2],
}

impl ChatTemplate {
    /// The template `source`, with the texts of the tokenizer's BOS and EOS tokens. The template
    /// is checked by rendering a one-message conversation; the error is minijinja's message.
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, String> {
        let mut template = Self {
            source: source.to_owned(),
            bos_token,
            eos_token,
            user_turn: Default::default(),
        };
        let pieces = template.around(None, 1)?;
        template.user_turn = [pieces[0].clone(), pieces[1].clone()];
        Ok(template)
    }

    /// The text before and after the content of a conversation's one user message, without a
    /// system message of its own: the template's default system turn where it inserts one and
    /// the user's header; the user's turn closed and the assistant's opened.
    pub fn user_turn(&self) -> (&str, &str) {
        (&self.user_turn[0], &self.user_turn[1])
    }

    /// The template's text for `messages`, ending with the assistant's turn opened when
    /// `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|err| err.to_string())?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        let variables = context! {
            messages => messages
                .iter()
                .map(|m| context! { role => m.role.as_str(), content => m.content.as_str() })
                .collect::<Vec<Value>>(),
            tools => Value::from(()),
            documents => Value::from(()),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_deref(),
            eos_token => self.eos_token.as_deref(),
        };
        env.render_str(&self.source, variables)
            .map_err(|err| format!("the chat template fails: {err:#}"))
    }

    /// The text the template writes around the contents of a conversation of an optional
    /// `system` message and `user_turns` user messages, with the assistant's turn opened:
    /// `user_turns + 1` pieces, the first before the first user content (the system turn, the
    /// template's default one where it inserts it, and the user's header), the last after the
    /// last (the user's turn closed and the assistant's opened). The template's filters on a
    /// content (Llama 3's `| trim`) do not reach the content spliced between the pieces.
    pub fn around(&self, system: Option<&str>, user_turns: usize) -> Result<Vec<String>, String> {
        let system = system.map(|content| ChatMessage {
            role: "system".into(),
            content: content.into(),
        });
        let users = (0..user_turns).map(|i| ChatMessage {
            role: "user".into(),
            content: marker(i),
        });
        let messages: Vec<ChatMessage> = system.into_iter().chain(users).collect();
        let text = self.render(&messages, true)?;
        split_at_markers(&text, user_turns)
    }

    /// The text the template writes right after an assistant message's content: where the
    /// model's turn ends (`<|im_end|>\n` for ChatML, `<|eot_id|>` for Llama 3).
    pub fn after_answer(&self) -> Result<String, String> {
        let messages = [
            ChatMessage {
                role: "user".into(),
                content: "?".into(),
            },
            ChatMessage {
                role: "assistant".into(),
                content: marker(0),
            },
        ];
        let text = self.render(&messages, false)?;
        let (_, after) = text
            .split_once(&marker(0))
            .ok_or("the chat template does not write an assistant message's content")?;
        Ok(after.to_owned())
    }
}

/// The metadata key of a GGUF's chat template.
const CHAT_KEY: &str = "tokenizer.chat_template";

/// The GGUF's chat template (`tokenizer.chat_template`), with the texts of its BOS and EOS tokens
/// (`tokenizer.ggml.bos_token_id`, `eos_token_id`) among `tokens`; `None` for a file without one.
pub(crate) fn of_gguf(
    gguf: &GgufFile,
    tokens: &[String],
) -> Result<Option<ChatTemplate>, ModelError> {
    let Some(source) = gguf.str_value(CHAT_KEY) else {
        return Ok(None);
    };
    let text = |key: &str| {
        let id = gguf.value(key).and_then(|v| v.to_u32().ok())?;
        tokens.get(id as usize).cloned()
    };
    let (bos, eos) = (text(BOS_KEY), text(EOS_KEY));
    ChatTemplate::new(source, bos, eos)
        .map(Some)
        .map_err(|err| ModelError::Tokenizer {
            path: gguf.path.clone(),
            detail: format!("{CHAT_KEY}: {err}"),
        })
}

/// The token a generation stops at: the first of what `chat` writes after an answer, where
/// `encode` makes it a control token (`is_control`), else `eos`.
pub(crate) fn stop_token(
    chat: Option<&ChatTemplate>,
    encode: impl Fn(&str) -> Vec<u32>,
    is_control: impl Fn(u32) -> bool,
    eos: Option<u32>,
) -> Option<u32> {
    let after = chat.and_then(|chat| chat.after_answer().ok());
    let first = after.and_then(|text| encode(&text).first().copied());
    first.filter(|&id| is_control(id)).or(eos)
}

/// `text` cut at the markers `0..count`, which must each appear once, in order.
fn split_at_markers(text: &str, count: usize) -> Result<Vec<String>, String> {
    let mut pieces = Vec::with_capacity(count + 1);
    let mut rest = text;
    for i in 0..count {
        let marker = marker(i);
        let (before, after) = rest.split_once(&marker).ok_or_else(|| {
            format!("the chat template does not write user message {i}'s content as given")
        })?;
        if after.contains(&marker) {
            return Err(format!(
                "the chat template writes user message {i}'s content more than once"
            ));
        }
        pieces.push(before.to_owned());
        rest = after;
    }
    pieces.push(rest.to_owned());
    Ok(pieces)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M-Instruct's template, as its GGUF holds it.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    /// A template in Llama 3.1's layout, written for the tests (this crate's
    /// `tests/integration/chat_template.rs` renders it with transformers too).
    const LLAMA3: &str =
        include_str!("../../../../tests/fixtures/chat_templates/llama3-layout.jinja");

    fn message(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    #[test]
    fn chatml_renders_its_turns_and_default_system_message() {
        let template = ChatTemplate::new(SMOLLM2, None, None).unwrap();
        let system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";
        assert_eq!(
            template.render(&[message("user", "hi")], true).unwrap(),
            format!("{system}<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        );
        assert_eq!(
            template.user_turn(),
            (
                format!("{system}<|im_start|>user\n").as_str(),
                "<|im_end|>\n<|im_start|>assistant\n"
            )
        );
        // A system message of the conversation's own replaces the default one.
        assert_eq!(
            template.around(Some("S"), 2).unwrap(),
            [
                "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n",
                "<|im_end|>\n<|im_start|>user\n",
                "<|im_end|>\n<|im_start|>assistant\n"
            ]
        );
        assert_eq!(template.after_answer().unwrap(), "<|im_end|>\n");
    }

    #[test]
    fn a_llama3_layout_writes_its_bos_headers_and_date() {
        let template = ChatTemplate::new(LLAMA3, Some("<|begin_of_text|>".into()), None).unwrap();
        assert_eq!(
            template.user_turn(),
            (
                "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n",
                "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
            )
        );
        let text = template
            .render(&[message("system", " S "), message("user", " hi\n")], false)
            .unwrap();
        assert!(
            text.ends_with(
                "\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
            ),
            "{text}"
        );
        assert_eq!(template.after_answer().unwrap(), "<|eot_id|>");
    }

    #[test]
    fn python_string_methods_and_namespaces_work_as_in_transformers() {
        // DeepSeek-R1's distilled models cut an answer's reasoning with `split`, in a namespace.
        let source = "{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% endif %}{% endfor %}{{ ns.system }}{% for m in messages %}{% if m['role'] == 'user' %}<U>{{ m['content'] }}{% elif m['role'] == 'assistant' %}<A>{{ m['content'].split('</think>')[-1] }}<E>{% endif %}{% endfor %}{% if add_generation_prompt %}<A><think>\n{% endif %}";
        let template = ChatTemplate::new(source, Some("<B>".into()), None).unwrap();
        let text = template
            .render(
                &[
                    message("system", "S"),
                    message("user", "q"),
                    message("assistant", "why</think>42"),
                ],
                true,
            )
            .unwrap();
        assert_eq!(text, "<B>S<U>q<A>42<E><A><think>\n");
        assert_eq!(template.after_answer().unwrap(), "<E>");
    }

    #[test]
    fn a_template_that_refuses_or_drops_content_is_an_error() {
        let strict = "{% for m in messages %}{% if m['role'] == 'user' and loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}[{{ m['content'] }}]{% endfor %}";
        let template = ChatTemplate::new(strict, None, None).unwrap();
        let err = template.around(None, 2).unwrap_err();
        assert!(err.contains("roles must alternate"), "{err}");
        let dropping = "{% for m in messages %}[{{ m['role'] }}]{% endfor %}";
        let err = ChatTemplate::new(dropping, None, None).unwrap_err();
        assert!(
            err.contains("does not write user message 0's content"),
            "{err}"
        );
        let err = ChatTemplate::new("{% for m in messages %}", None, None).unwrap_err();
        assert!(err.contains("the chat template fails"), "{err}");
    }
}
