//! The model-family registry: which native forward runs a GGUF, chosen by its
//! `general.architecture`. Adding a family is one file implementing [`CausalLm`] (with a
//! `from_gguf` constructor), its module line and one line of the [`families!`](crate::families)
//! list in `model/mod.rs`, which registers it here.
//!
//! A model is named by a fetchable asset's name (`crate::assets::MODELS`) or, for a GGUF already
//! on disk, `gguf:PATH` ([`gguf_path`]); either way this registry picks its family.

use super::causal_lm::CausalLm;
use super::gguf::GgufFile;
use super::prompt::TextTokenizer;
use super::ModelError;
use super::{ChatTokenizer, SpmTokenizer};
use std::path::{Path, PathBuf};

/// One model family.
pub struct Family {
    /// The GGUF `general.architecture` it runs.
    pub architecture: &'static str,
    /// Loads an opened GGUF of this architecture.
    pub load: fn(GgufFile) -> Result<Box<dyn CausalLm + Send>, ModelError>,
}

/// Registers the model families, one line each (`module::Type = "architecture"`): the re-export
/// of each type, and `FAMILIES`, the list [`load`] reads (the modules are declared beside it,
/// written out).
#[macro_export]
macro_rules! families {
    ($( $module:ident :: $model:ident = $architecture:literal ),+ $(,)?) => {
        $( pub use $module::$model; )+

        /// Every family, by architecture.
        pub const FAMILIES: &[family::Family] = &[
            $( family::Family {
                architecture: $architecture,
                load: |gguf| Ok(Box::new($model::from_gguf(gguf)?)),
            }, )+
        ];
    };
}

/// How a recipe names a GGUF on disk: `gguf:PATH`.
pub const GGUF_PREFIX: &str = "gguf:";

/// The file a `gguf:PATH` model name names (a leading `~/` is the home directory), or `None` for
/// another kind of name.
pub fn gguf_path(name: &str) -> Option<PathBuf> {
    let path = name.strip_prefix(GGUF_PREFIX)?;
    Some(match path.strip_prefix("~/") {
        Some(rest) => std::env::var_os("HOME").map(PathBuf::from)?.join(rest),
        None => PathBuf::from(path),
    })
}

/// Loads the GGUF at `path` with the family its architecture names (each family refuses, before
/// reading a weight, weights that would not fit the memory available).
pub fn load(path: &Path) -> Result<Box<dyn CausalLm + Send>, ModelError> {
    load_gguf(GgufFile::open(path)?)
}

/// [`load`], the weights held as the file stores them whatever their size: the path a model
/// above 8 GB as f32 takes, for a smaller one (its speed and memory measured on it). Families that
/// hold only f32 (Gemma 3) refuse.
pub fn load_quantized(path: &Path) -> Result<Box<dyn CausalLm + Send>, ModelError> {
    load_gguf(GgufFile::open(path)?.held_quantized())
}

fn load_gguf(gguf: GgufFile) -> Result<Box<dyn CausalLm + Send>, ModelError> {
    let path = gguf.path.clone();
    let architecture = gguf.architecture();
    match super::FAMILIES
        .iter()
        .find(|f| f.architecture == architecture)
    {
        Some(family) => (family.load)(gguf),
        None => Err(ModelError::Architecture {
            path,
            architecture: architecture.to_owned(),
            known: super::FAMILIES
                .iter()
                .map(|f| f.architecture)
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

/// The tokenizer of the GGUF at `path`, without its weights: byte-level BPE
/// (`tokenizer.ggml.model` = `gpt2`) or SentencePiece (`llama`), whichever the file names, with
/// the file's chat template where it has one, so a trace's positions can be shown as text.
pub fn tokenizer(path: &Path) -> Result<Box<dyn TextTokenizer>, ModelError> {
    let gguf = GgufFile::open(path)?;
    match gguf.str_value("tokenizer.ggml.model").unwrap_or_default() {
        "llama" => Ok(Box::new(SpmTokenizer::from_gguf(&gguf)?)),
        _ => Ok(Box::new(ChatTokenizer::from_gguf(&gguf)?)),
    }
}
