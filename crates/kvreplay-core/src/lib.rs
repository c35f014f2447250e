//! kvreplay's pure core: the kvtrace/1 trace format, the replay engine with its registries of
//! allocators, head splits, scorers, timings, quantizers, channel pruners, merges and metrics, and
//! the brute-force reference the engine is tested against. No model, command line, data frames,
//! plots or processes: the `kvreplay` crate builds those on top and re-exports these modules.

#![warn(missing_docs)]

pub mod atomic;
pub mod attention;
pub mod replay;
pub mod splitmix;
pub mod stop;
pub mod trace;
