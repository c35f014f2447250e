//! The traces of an experiment: trace files as given, or recipes captured next to themselves on
//! first use; each identified by the sha256 of its content, so stored runs are bound to the data
//! they were computed on, not to a file name.

use super::{Experiment, SweepError};
use crate::assets::sha256_file;
use crate::capture::CaptureError;
use crate::recipe::Recipe;
use std::path::{Path, PathBuf};

/// A trace file of an experiment and the sha256 of its content (and of its recipe's, when it was
/// made from one: a closed-loop run also depends on what the recipe asks, e.g. its `answer`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceFile {
    /// The file.
    pub path: PathBuf,
    /// sha256 of its bytes, lower-case hex.
    pub sha256: String,
    /// sha256 of the recipe file it was captured from, if any.
    pub recipe_sha256: Option<String>,
}

impl TraceFile {
    /// Hashes the file at `path` (a trace, or a recipe).
    pub fn identify(path: &Path) -> Result<Self, SweepError> {
        if path.is_dir() {
            return Err(SweepError::Io {
                path: path.to_owned(),
                detail: "is a directory, not a trace file".into(),
            });
        }
        let sha256 = sha256_file(path).map_err(|err| SweepError::Io {
            path: path.to_owned(),
            detail: err.to_string(),
        })?;
        Ok(Self {
            path: path.to_owned(),
            sha256,
            recipe_sha256: None,
        })
    }
}

/// Captures a recipe (first path) into a trace file (second path).
pub type Capture<'a> = &'a mut dyn FnMut(&Path, &Path) -> Result<(), CaptureError>;

impl Experiment {
    /// The experiment's trace files, in its order. A recipe (`.toml`) stands for the trace beside
    /// it (`.safetensors`); one not captured yet is captured with `capture`, or is an error when
    /// there is none (`kvreplay report` runs nothing).
    pub fn trace_files(
        &self,
        mut capture: Option<Capture<'_>>,
    ) -> Result<Vec<TraceFile>, SweepError> {
        self.traces
            .iter()
            .map(|entry| {
                let is_recipe = entry.extension().is_some_and(|e| e == "toml");
                let trace = if is_recipe {
                    entry.with_extension("safetensors")
                } else {
                    entry.clone()
                };
                if !trace.is_file() {
                    match capture.as_mut() {
                        Some(capture) if is_recipe => capture(entry, &trace)?,
                        _ => {
                            return Err(SweepError::Io {
                                path: trace,
                                detail: if is_recipe {
                                    "not captured yet; run `kvreplay sweep` first".into()
                                } else {
                                    "trace file not found".into()
                                },
                            })
                        }
                    }
                }
                let mut file = TraceFile::identify(&trace)?;
                if is_recipe {
                    file.recipe_sha256 = Some(TraceFile::identify(entry)?.sha256);
                }
                Ok(file)
            })
            .collect()
    }

    /// The needle grid: for each trace made from a needle recipe, its prompt length and depth.
    pub fn needle_cells(&self, traces: &[TraceFile]) -> Vec<super::report::NeedleCell> {
        self.traces
            .iter()
            .zip(traces)
            .filter_map(|(entry, trace)| match Recipe::load(entry) {
                Ok((Recipe::Niah(niah), _)) => Some(super::report::NeedleCell {
                    trace: trace.path.clone(),
                    length: niah.prompt_tokens,
                    depth: niah.depth_percent,
                }),
                _ => None,
            })
            .collect()
    }
}
