//! The models' integration tests, one binary: each module is one suite (the forwards and
//! tokenizers against transformers, chat templates, capture through both paths, the RULER
//! recipes), on the real assets the test kit fetches.

use kvreplay_testkit as common;

mod chat_template;
mod hf_capture;
mod qwen2;
mod real_model;
mod ruler;
