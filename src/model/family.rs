//! The model-family registry: which native forward runs a GGUF, chosen by its
//! `general.architecture`. Adding a family is one file implementing [`CausalLm`] (with a
//! `from_gguf` constructor) and one line of the [`families!`](crate::families) list in
//! `model/mod.rs`, which declares its module, re-exports its type and registers it here.

use super::causal_lm::CausalLm;
use super::gguf::GgufFile;
use super::ModelError;
use std::path::Path;

/// One model family.
pub struct Family {
    /// The GGUF `general.architecture` it runs.
    pub architecture: &'static str,
    /// Loads an opened GGUF of this architecture.
    pub load: fn(GgufFile) -> Result<Box<dyn CausalLm + Send>, ModelError>,
}

/// Declares the model families, one line each (`module::Type = "architecture"`): their modules,
/// the re-export of each type, and `FAMILIES`, the list [`load`] reads.
#[macro_export]
macro_rules! families {
    ($( $module:ident :: $model:ident = $architecture:literal ),+ $(,)?) => {
        $( mod $module; pub use $module::$model; )+

        /// Every family, by architecture.
        pub const FAMILIES: &[family::Family] = &[
            $( family::Family {
                architecture: $architecture,
                load: |gguf| Ok(Box::new($model::from_gguf(gguf)?)),
            }, )+
        ];
    };
}

/// Loads the GGUF at `path` with the family its architecture names.
pub fn load(path: &Path) -> Result<Box<dyn CausalLm + Send>, ModelError> {
    let gguf = GgufFile::open(path)?;
    let architecture = gguf.architecture();
    match super::FAMILIES
        .iter()
        .find(|f| f.architecture == architecture)
    {
        Some(family) => (family.load)(gguf),
        None => Err(ModelError::Architecture {
            path: path.to_owned(),
            architecture: architecture.to_owned(),
            known: super::FAMILIES
                .iter()
                .map(|f| f.architecture)
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}
