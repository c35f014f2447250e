//! Any bytes as a trace file: opening and reading every layer may fail, never panic or hang.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("kvreplay-fuzz-{}.safetensors", std::process::id()));
    std::fs::write(&path, data).expect("temp file");
    if let Ok(trace) = kvreplay::trace::TraceReader::open(&path) {
        let _ = trace.tokens();
        for layer in 0..trace.meta().n_layers.min(64) {
            let _ = trace.layer(layer);
        }
    }
});
