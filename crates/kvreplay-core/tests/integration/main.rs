//! The core's integration tests, one binary: the kvtrace/1 reader and writer against the format's
//! rules, and the replay engine against its brute-force reference, on the tiny fixtures the test
//! kit writes (without its `models` feature: these build no model, no data frames, no command
//! line).

mod common {
    pub use kvreplay_testkit::*;
}

mod replay_engine;
mod trace_format;
