//! The model-family registry: which native forward runs a GGUF, chosen by its
//! `general.architecture`. Adding a family is one file implementing [`CausalLm`] and one line here.

use super::causal_lm::CausalLm;
use super::gguf::GgufFile;
use super::{Gemma3, Llama, ModelError};
use std::path::Path;

/// One model family.
pub struct Family {
    /// The GGUF `general.architecture` it runs.
    pub architecture: &'static str,
    /// Loads an opened GGUF of this architecture.
    pub load: fn(GgufFile) -> Result<Box<dyn CausalLm + Send>, ModelError>,
}

/// Every family, by architecture.
pub const FAMILIES: &[Family] = &[
    Family {
        architecture: "llama",
        load: |gguf| Ok(Box::new(Llama::from_gguf(gguf)?)),
    },
    Family {
        architecture: "gemma3",
        load: |gguf| Ok(Box::new(Gemma3::from_gguf(gguf)?)),
    },
];

/// Loads the GGUF at `path` with the family its architecture names.
pub fn load(path: &Path) -> Result<Box<dyn CausalLm + Send>, ModelError> {
    let gguf = GgufFile::open(path)?;
    let architecture = gguf.architecture();
    match FAMILIES.iter().find(|f| f.architecture == architecture) {
        Some(family) => (family.load)(gguf),
        None => Err(ModelError::Metadata {
            path: path.to_owned(),
            key: "general.architecture".into(),
            expected: "an architecture kvreplay runs (llama, gemma3)",
        }),
    }
}
