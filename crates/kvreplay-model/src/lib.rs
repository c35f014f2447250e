//! kvreplay's models: the native forwards of the model families (the weights a GGUF file holds,
//! their tokenizers and chat templates), the recorder that captures a kvtrace/1 file from them,
//! the prompt recipes, the assets they are fetched from, and the closed loop (policies of the core
//! holding the model's real KV cache). It builds on the pure core ([`kvreplay_core`]), whose
//! modules it re-exports, and never prints.

#![warn(missing_docs)]

pub use kvreplay_core::{atomic, attention, replay, splitmix, stop, trace};

pub mod assets;
pub mod capture;
pub mod live;
pub mod model;
pub mod recipe;
pub mod sys;
