//! The header metadata of a trace: the model's attention geometry, where the prompt ends, and the
//! named spans (the needle, the question) that span-survival metrics look at.

use super::TraceError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// The value of `__metadata__.format` this crate reads and writes.
pub const FORMAT: &str = "kvtrace/1";

/// A named half-open token range `[start, end)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    /// The span's name, e.g. `needle`.
    pub name: String,
    /// First position.
    pub start: usize,
    /// One past the last position.
    pub end: usize,
}

/// Everything the header says about a trace, checked against the contract.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceMeta {
    /// Free-form model id.
    pub model: String,
    /// Number of layers.
    pub n_layers: usize,
    /// Query heads per layer.
    pub n_heads: usize,
    /// Key/value heads per layer.
    pub n_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Positions `[0, prompt_len)` are the prompt.
    pub prompt_len: usize,
    /// Softmax scale (default `1/sqrt(head_dim)`).
    pub scale: f32,
    /// Attention logit soft-cap, if the model uses one.
    pub softcap: Option<f32>,
    /// Base of the half-split rotary embedding the stored q and k went through, when known:
    /// what rotates them back (scorers that need the pre-rotary queries).
    pub rope_theta: Option<f32>,
    /// Per layer, the base of its half-split rotary, when layers differ (Gemma 3: 10,000 in the
    /// sliding layers, 1,000,000 in the global ones); empty: `rope_theta` for every layer.
    pub rope_thetas: Vec<f32>,
    /// Per layer, the attention window: a query at position `t` attends over keys
    /// `t - window < j <= t`; 0 is global attention. Empty: every layer is global.
    pub windows: Vec<usize>,
    /// Named spans.
    pub spans: Vec<Span>,
    /// Every other key of the header, kept as found (`prompt_text`, `source`, unknown keys).
    pub extra: BTreeMap<String, String>,
}

impl TraceMeta {
    /// The rotary base of layer `layer`, when the header gives one (`layer_rope_thetas`, else
    /// `rope_theta`).
    pub fn rope_theta_of(&self, layer: usize) -> Option<f32> {
        self.rope_thetas.get(layer).copied().or(self.rope_theta)
    }

    /// The attention window of layer `layer` (0: global).
    pub fn window(&self, layer: usize) -> usize {
        self.windows.get(layer).copied().unwrap_or(0)
    }

    /// The layers that attend globally: the ones a policy's budget compresses (a sliding-window
    /// layer already holds only its window, and is kept whole, as kvpress does for Gemma 3).
    pub fn global_layers(&self) -> Vec<usize> {
        (0..self.n_layers)
            .filter(|&layer| self.window(layer) == 0)
            .collect()
    }

    /// Query heads that share one KV head.
    pub fn group_size(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// Parses and checks the header's `__metadata__` (everything but tensor-dependent rules).
    pub fn from_header(
        path: &Path,
        header: Option<&std::collections::HashMap<String, String>>,
    ) -> Result<Self, TraceError> {
        let empty = std::collections::HashMap::new();
        let header = Header {
            path,
            map: header.unwrap_or(&empty),
        };
        let found_format = header.map.get("format").cloned();
        if found_format.as_deref() != Some(FORMAT) {
            return Err(TraceError::Format {
                path: path.to_owned(),
                found: found_format,
            });
        }
        let model = header.required("model")?.clone();
        let n_layers = header.integer("n_layers")?;
        let n_heads = header.integer("n_heads")?;
        let n_kv_heads = header.integer("n_kv_heads")?;
        let head_dim = header.integer("head_dim")?;
        let prompt_len = header.integer("prompt_len")?;
        let rope = header.required("rope")?;
        if rope != "post" {
            return Err(header.bad(
                "rope",
                rope,
                "\"post\" (q and k stored after rotary embedding)",
            ));
        }
        if n_kv_heads == 0 || n_heads == 0 || n_heads % n_kv_heads != 0 {
            return Err(TraceError::Heads {
                path: path.to_owned(),
                n_heads,
                n_kv_heads,
            });
        }
        for (key, value) in [("n_layers", n_layers), ("head_dim", head_dim)] {
            if value == 0 {
                return Err(header.bad(key, "0", "a positive integer"));
            }
        }
        let windows = header.layer_list(
            "layer_windows",
            n_layers,
            |_: &usize| true,
            "a JSON list of n_layers non-negative integers (0 = global attention)",
        )?;
        let rope_thetas = header.layer_list(
            "layer_rope_thetas",
            n_layers,
            |theta: &f32| theta.is_finite() && *theta > 0.0,
            "a JSON list of n_layers positive finite numbers",
        )?;
        let spans = match header.map.get("spans") {
            None => Vec::new(),
            Some(text) => {
                serde_json::from_str::<Vec<Span>>(text).map_err(|err| TraceError::Spans {
                    path: path.to_owned(),
                    detail: format!("not a JSON list of {{name, start, end}}: {err}"),
                })?
            }
        };
        Ok(Self {
            model,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            prompt_len,
            scale: header
                .float("scale")?
                .unwrap_or(1.0 / (head_dim as f32).sqrt()),
            softcap: header.float("softcap")?,
            rope_theta: header.float("rope_theta")?,
            rope_thetas,
            windows,
            spans,
            extra: header.extra(),
        })
    }

    /// Checks the rules that need T, the number of positions.
    pub fn check_positions(&self, path: &Path, n_positions: usize) -> Result<(), TraceError> {
        if self.prompt_len == 0 || self.prompt_len > n_positions {
            return Err(TraceError::PromptLen {
                path: path.to_owned(),
                prompt_len: self.prompt_len,
                n_positions,
            });
        }
        for span in &self.spans {
            if span.start >= span.end || span.end > n_positions {
                return Err(TraceError::Spans {
                    path: path.to_owned(),
                    detail: format!(
                        "span `{}` = [{}, {}) is empty or ends beyond T = {n_positions}",
                        span.name, span.start, span.end
                    ),
                });
            }
        }
        Ok(())
    }

    /// The header as written to a file: every value a string.
    pub fn to_header(&self) -> std::collections::HashMap<String, String> {
        let mut header: std::collections::HashMap<String, String> =
            self.extra.clone().into_iter().collect();
        header.insert("format".into(), FORMAT.into());
        header.insert("model".into(), self.model.clone());
        header.insert("n_layers".into(), self.n_layers.to_string());
        header.insert("n_heads".into(), self.n_heads.to_string());
        header.insert("n_kv_heads".into(), self.n_kv_heads.to_string());
        header.insert("head_dim".into(), self.head_dim.to_string());
        header.insert("prompt_len".into(), self.prompt_len.to_string());
        header.insert("rope".into(), "post".into());
        header.insert("scale".into(), format!("{:e}", self.scale));
        if let Some(softcap) = self.softcap {
            header.insert("softcap".into(), format!("{softcap:e}"));
        }
        if let Some(theta) = self.rope_theta {
            header.insert("rope_theta".into(), format!("{theta:e}"));
        }
        if !self.rope_thetas.is_empty() {
            header.insert(
                "layer_rope_thetas".into(),
                serde_json::to_string(&self.rope_thetas).expect("thetas serialise"),
            );
        }
        if self.windows.iter().any(|&window| window > 0) {
            header.insert(
                "layer_windows".into(),
                serde_json::to_string(&self.windows).expect("windows serialise"),
            );
        }
        if !self.spans.is_empty() {
            header.insert(
                "spans".into(),
                serde_json::to_string(&self.spans).expect("spans serialise"),
            );
        }
        header
    }
}

/// The header keys this version reads; the others are kept as they are (`extra`).
const KNOWN_KEYS: [&str; 14] = [
    "format",
    "layer_rope_thetas",
    "layer_windows",
    "model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "prompt_len",
    "rope",
    "rope_theta",
    "scale",
    "softcap",
    "spans",
];

/// A trace's string header, read key by key with errors naming the file, the key and the rule.
struct Header<'a> {
    path: &'a Path,
    map: &'a std::collections::HashMap<String, String>,
}

impl Header<'_> {
    fn bad(&self, key: &'static str, value: &str, expected: &'static str) -> TraceError {
        TraceError::BadValue {
            path: self.path.to_owned(),
            key,
            value: value.to_owned(),
            expected,
        }
    }

    fn required(&self, key: &'static str) -> Result<&String, TraceError> {
        self.map.get(key).ok_or_else(|| TraceError::MissingKey {
            path: self.path.to_owned(),
            key,
        })
    }

    fn integer(&self, key: &'static str) -> Result<usize, TraceError> {
        let value = self.required(key)?;
        value
            .trim()
            .parse::<usize>()
            .map_err(|_| self.bad(key, value, "a non-negative decimal integer"))
    }

    /// An optional positive finite number.
    fn float(&self, key: &'static str) -> Result<Option<f32>, TraceError> {
        match self.map.get(key) {
            None => Ok(None),
            Some(value) => match value.trim().parse::<f32>() {
                Ok(parsed) if parsed.is_finite() && parsed > 0.0 => Ok(Some(parsed)),
                _ => Err(self.bad(key, value, "a positive finite number")),
            },
        }
    }

    /// An optional JSON list of one valid value per layer (empty when absent).
    fn layer_list<T: serde::de::DeserializeOwned>(
        &self,
        key: &'static str,
        n_layers: usize,
        valid: impl Fn(&T) -> bool,
        expected: &'static str,
    ) -> Result<Vec<T>, TraceError> {
        match self.map.get(key) {
            None => Ok(Vec::new()),
            Some(text) => match serde_json::from_str::<Vec<T>>(text) {
                Ok(list) if list.len() == n_layers && list.iter().all(&valid) => Ok(list),
                _ => Err(self.bad(key, text, expected)),
            },
        }
    }

    /// The keys this version does not read.
    fn extra(&self) -> std::collections::BTreeMap<String, String> {
        self.map
            .iter()
            .filter(|(key, _)| !KNOWN_KEYS.contains(&key.as_str()))
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect()
    }
}
