//! The traces of an experiment: trace files as given, or recipes captured next to themselves on
//! first use; each identified by the sha256 of its content, so stored runs are bound to the data
//! they were computed on, not to a file name.

use super::SweepError;
use crate::assets::sha256_file;
use crate::capture::{question_trace, CaptureError};
use crate::recipe::samples::sample_recipes;
use crate::recipe::Recipe;
use crate::trace::{read_header, TraceMeta};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A trace file of an experiment and the sha256 of its content (and of its recipe's, when it was
/// made from one: a closed-loop run also depends on what the recipe asks, e.g. its `answer`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceFile {
    /// The file.
    pub path: PathBuf,
    /// sha256 of its bytes, lower-case hex.
    pub sha256: String,
    /// The recipe file it was captured from, if any.
    pub recipe: Option<PathBuf>,
    /// Which of the recipe's questions it asks (from 0), for a recipe that asks several of one
    /// context.
    pub question: Option<usize>,
    /// sha256 of the recipe file it was captured from, if any.
    pub recipe_sha256: Option<String>,
    /// Its query and KV heads, as its header says (read while hashing it; `None` for a file
    /// whose header does not say).
    pub heads: Option<(usize, usize)>,
    /// Its prompt length, as its header says.
    pub prompt_len: Option<usize>,
    /// The model that made it, as its header says.
    pub model: Option<String>,
    /// The layers a policy compresses (those its `layer_windows` gives 0), in the model's
    /// numbering; `None` when the header has no `layer_windows` (no sliding-window layers: every
    /// layer is compressed).
    pub global_layers: Option<Vec<usize>>,
}

impl TraceFile {
    /// Identifies the trace file at `path` by its content.
    pub fn identify(path: &Path) -> Result<Self, SweepError> {
        let fail = |detail: String| SweepError::Io {
            path: path.to_owned(),
            detail,
        };
        if path.is_dir() {
            return Err(fail("is a directory, not a trace file".into()));
        }
        let (sha256, header) = content_sha256(path).map_err(|err| fail(err.to_string()))?;
        Ok(Self::identified(path, sha256, header))
    }

    /// A trace held in memory (`bytes`, as a file of it would hold them), identified as
    /// [`identify`](Self::identify) identifies that file; `label` stands for its path.
    pub fn of_bytes(label: &Path, bytes: &[u8]) -> Self {
        let (sha256, header) = content_sha256_of(|| Ok(bytes)).expect("bytes in memory read");
        Self::identified(label, sha256, header)
    }

    /// The trace at `path` of content hash `sha256`, its header's counts read from `header`.
    fn identified(path: &Path, sha256: String, header: Option<serde_json::Value>) -> Self {
        let count = |key: &str| {
            header.as_ref()?["__metadata__"][key]
                .as_str()?
                .parse::<usize>()
                .ok()
        };
        Self {
            path: path.to_owned(),
            sha256,
            recipe: None,
            question: None,
            recipe_sha256: None,
            heads: count("n_heads").zip(count("n_kv_heads")),
            prompt_len: count("prompt_len"),
            model: header
                .as_ref()
                .and_then(|h| h["__metadata__"]["model"].as_str())
                .map(str::to_owned),
            global_layers: header.as_ref().and_then(|h| {
                let metadata: HashMap<String, String> =
                    serde_json::from_value(h["__metadata__"].clone()).ok()?;
                metadata.contains_key("layer_windows").then_some(())?;
                Some(
                    TraceMeta::from_header(path, Some(&metadata))
                        .ok()?
                        .global_layers(),
                )
            }),
        }
    }
}

/// sha256 of a safetensors file's content: its header with keys in sorted order (older traces,
/// and other writers such as the Python capture, order its keys as a hash map does, differently
/// in each write), then its data bytes. Not a safetensors header: the file's bytes as they are.
/// Returns the digest and the parsed header.
fn content_sha256(path: &Path) -> std::io::Result<(String, Option<serde_json::Value>)> {
    content_sha256_of(|| Ok(std::io::BufReader::new(std::fs::File::open(path)?)))
}

/// [`content_sha256`] of the bytes `open` reads from their start (called again to hash them
/// whole when they have no safetensors header).
fn content_sha256_of<R: std::io::Read>(
    open: impl Fn() -> std::io::Result<R>,
) -> std::io::Result<(String, Option<serde_json::Value>)> {
    let mut reader = open()?;
    let mut hasher = Sha256::new();
    let header = read_header(&mut reader).ok().map(|(_, json)| json);
    match &header {
        // Its keys are sorted: the canonical header.
        Some(json) => hasher.update(json.to_string().as_bytes()),
        None => reader = open()?,
    }
    std::io::copy(&mut reader, &mut HashWriter(&mut hasher))?;
    Ok((format!("{:x}", hasher.finalize()), header))
}

/// Feeds what is written to a hasher.
struct HashWriter<'a>(&'a mut Sha256);

impl std::io::Write for HashWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.update(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Captures a recipe (first path) into a trace file (second path).
pub type Capture<'a> = &'a mut dyn FnMut(&Path, &Path) -> Result<(), CaptureError>;

/// One trace of a needle grid: its file, context length (prompt tokens) and needle depth (%).
#[derive(Debug, Clone, PartialEq)]
pub struct NeedleCell {
    /// The trace file.
    pub trace: PathBuf,
    /// Prompt tokens asked for.
    pub length: usize,
    /// Needle depth in percent.
    pub depth: f64,
}

/// An entry of an experiment's traces, as found on disk.
#[derive(Debug, Clone)]
pub enum TraceEntry {
    /// Its trace files (a recipe's, one per question), identified.
    Captured(Vec<TraceFile>),
    /// A recipe not captured yet (into the trace beside it, [`captured_into`]).
    Uncaptured(PathBuf),
}

/// An experiment's `entries` with each recipe of `samples = N` replaced by its N sample recipes
/// ([`sample_recipes`], written beside it on first use).
fn sampled(entries: &[PathBuf]) -> Result<Vec<PathBuf>, SweepError> {
    let mut expanded = Vec::new();
    for entry in entries {
        match entry.extension().is_some_and(|e| e == "toml") {
            true => expanded.extend(sample_recipes(entry).map_err(CaptureError::from)?),
            false => expanded.push(entry.clone()),
        }
    }
    Ok(expanded)
}

/// The entries of an experiment's `entries`, in its order. A recipe (`.toml`) stands for the trace
/// beside it (`.safetensors`), or for one per question when it asks several of one context
/// ([`question_trace`]), or for its samples' when it has `samples`; a trace file (any other path)
/// must exist.
pub(crate) fn trace_entries(entries: &[PathBuf]) -> Result<Vec<TraceEntry>, SweepError> {
    sampled(entries)?
        .iter()
        .map(|entry| {
            if entry.extension().is_none_or(|e| e != "toml") {
                if !entry.is_file() {
                    return Err(SweepError::Io {
                        path: entry.clone(),
                        detail: "trace file not found".into(),
                    });
                }
                return Ok(TraceEntry::Captured(vec![TraceFile::identify(entry)?]));
            }
            match recipe_traces(entry)?.iter().all(|trace| trace.is_file()) {
                true => Ok(TraceEntry::Captured(captured_traces(entry)?)),
                false => Ok(TraceEntry::Uncaptured(entry.clone())),
            }
        })
        .collect()
}

/// The trace files of an experiment's `entries` ([`trace_entries`]), in its order; a recipe not
/// captured yet is captured with `capture`, or is an error when there is none (`kvreplay report`
/// runs nothing).
pub(crate) fn trace_files(
    entries: &[PathBuf],
    mut capture: Option<Capture<'_>>,
) -> Result<Vec<TraceFile>, SweepError> {
    let mut files = Vec::new();
    for entry in trace_entries(entries)? {
        match entry {
            TraceEntry::Captured(captured) => files.extend(captured),
            TraceEntry::Uncaptured(recipe) => {
                // A capture writes the first question last: it stands for them all.
                match capture.as_mut() {
                    Some(capture) => capture(&recipe, &captured_into(&recipe))?,
                    None => {
                        return Err(SweepError::Io {
                            path: recipe_traces(&recipe)?.swap_remove(0),
                            detail: "not captured yet; run `kvreplay sweep` first".into(),
                        })
                    }
                }
                files.extend(captured_traces(&recipe)?);
            }
        }
    }
    Ok(files)
}

/// The trace a capture of recipe file `recipe` writes (a recipe of several questions, each one's
/// [`question_trace`] of it): the file beside it.
pub(crate) fn captured_into(recipe: &Path) -> PathBuf {
    recipe.with_extension("safetensors")
}

/// The trace files recipe file `recipe` is captured into: one per question.
pub(crate) fn recipe_traces(recipe: &Path) -> Result<Vec<PathBuf>, SweepError> {
    let questions = Recipe::load(recipe)
        .map_err(CaptureError::from)?
        .0
        .questions();
    let trace = captured_into(recipe);
    Ok((0..questions)
        .map(|question| question_trace(&trace, question, questions))
        .collect())
}

/// The trace files of captured recipe file `recipe`, identified.
pub(crate) fn captured_traces(recipe: &Path) -> Result<Vec<TraceFile>, SweepError> {
    let traces = recipe_traces(recipe)?;
    let recipe_sha256 = sha256_file(recipe).map_err(|err| SweepError::Io {
        path: recipe.to_owned(),
        detail: err.to_string(),
    })?;
    let several = traces.len() > 1;
    traces
        .iter()
        .enumerate()
        .map(|(question, trace)| {
            Ok(TraceFile {
                recipe: Some(recipe.to_owned()),
                question: several.then_some(question),
                recipe_sha256: Some(recipe_sha256.clone()),
                ..TraceFile::identify(trace)?
            })
        })
        .collect()
}

/// The needle grid: for each of `traces` made from a needle recipe, its prompt length and depth.
pub(crate) fn needle_cells(traces: &[TraceFile]) -> Vec<NeedleCell> {
    traces
        .iter()
        .filter_map(|trace| match Recipe::load(trace.recipe.as_ref()?) {
            Ok((Recipe::Niah(niah), _)) => Some(NeedleCell {
                trace: trace.path.clone(),
                length: niah.prompt_tokens,
                depth: niah.depth_percent,
            }),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{StorageDtype, TraceMeta, TraceWriter};
    use ndarray::Array3;

    fn write(path: &Path, value: f32) {
        let mut extra = std::collections::BTreeMap::new();
        for key in ["prompt_text", "generated_text", "source", "a", "b", "c"] {
            extra.insert(key.to_string(), format!("{key} text"));
        }
        let meta = TraceMeta {
            model: "m".into(),
            n_layers: 1,
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 2,
            prompt_len: 2,
            scale: 1.0,
            softcap: None,
            rope_theta: None,
            rope_thetas: Vec::new(),
            windows: Vec::new(),
            spans: Vec::new(),
            extra,
        };
        let q = Array3::from_elem((1, 3, 2), value);
        let mut writer = TraceWriter::new(meta, StorageDtype::F32, vec![1, 2, 3]);
        writer.push_layer(q.clone(), q, None);
        writer.write(path).unwrap();
    }

    #[test]
    fn identity_is_the_content_not_the_header_order() {
        let dir = tempfile::tempdir().unwrap();
        let paths: Vec<PathBuf> = (0..4)
            .map(|i| dir.path().join(format!("t{i}.safetensors")))
            .collect();
        for path in &paths {
            write(path, 0.5);
        }
        let ids: Vec<String> = paths
            .iter()
            .map(|p| TraceFile::identify(p).unwrap().sha256)
            .collect();
        assert!(ids.iter().all(|id| *id == ids[0]), "{ids:?}");
        write(&paths[0], 0.25);
        assert_ne!(TraceFile::identify(&paths[0]).unwrap().sha256, ids[1]);
    }
}
