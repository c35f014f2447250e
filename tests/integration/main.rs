//! The integration tests, one binary: each module is one suite (the CLI, the replay engine
//! against its brute-force reference, parity with official code, live mode...), built on the
//! tiny fixtures `common` writes. One binary links the library once; the memory tests
//! (`tests/memory.rs`, `tests/quantized_memory.rs`) stay binaries of their own, since each
//! measures the peak of its own process.

#[path = "../common/mod.rs"]
mod common;

mod bench_references;
mod chat_template;
mod cli;
mod experiments;
mod gemma3;
mod hf_capture;
mod hf_live;
mod hostile;
mod layering;
mod live;
mod parity;
mod protocols;
mod questions;
mod qwen2;
mod real_model;
mod replay_engine;
mod ruler;
mod sliding_layers;
mod slurm;
mod trace_format;
mod view;
