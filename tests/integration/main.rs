//! The library's integration tests, one binary: each module is one suite (the CLI, the replay
//! engine against its brute-force reference, parity with official code, live mode...), built on
//! the tiny fixtures `common` writes. The models' own suites (their forwards against
//! transformers, capture, recipes) are the binary of `crates/kvreplay-model`. One binary links
//! the library once; the memory tests (`tests/memory.rs`, `tests/quantized_memory.rs`) stay
//! binaries of their own, since each measures the peak of its own process.

#[path = "../common/mod.rs"]
mod common;

mod bench_references;
mod cli;
mod experiments;
mod gemma3;
mod hf_live;
mod hostile;
mod layering;
mod live;
mod parity;
mod protocols;
mod questions;
mod sliding_layers;
mod slurm;
mod view;
