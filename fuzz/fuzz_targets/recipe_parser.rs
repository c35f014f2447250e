//! Any text as a recipe: parsing may fail, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = kvreplay::recipe::Recipe::parse(text, std::path::Path::new("fuzz.toml"));
    }
});
