//! Any bytes as a trace file: opening and reading every layer may fail, never panic or hang.
//! Run: `cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run trace_reader corpus/trace_reader seeds/trace_reader -- -max_total_time=300`.
#![no_main]

use kvreplay_core::trace;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("kvreplay-fuzz-{}.safetensors", std::process::id()));
    std::fs::write(&path, data).expect("temp file");
    if let Ok(reader) = trace::TraceReader::open(&path) {
        let _ = reader.tokens();
        for layer in 0..reader.meta().n_layers.min(64) {
            let _ = reader.layer(layer);
        }
    }
});
