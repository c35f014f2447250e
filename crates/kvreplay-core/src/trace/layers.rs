//! A trace's layers in words: each layer's attention kind (`global` or `window W`), which layers
//! slide and which are global, and runs of layer indices as ranges.

use super::TraceMeta;

/// A layer's kind in a table: `global` or `window W`.
pub fn layer_kind(window: usize) -> String {
    match window {
        0 => "global".into(),
        w => format!("window {w}"),
    }
}

/// The layers' attention kinds in words: `global` when every layer is, else which layers slide
/// over which window and which are global (the ones a policy compresses by default).
pub fn layer_kinds(meta: &TraceMeta) -> String {
    let global = meta.global_layers();
    if global.len() == meta.n_layers {
        return "global (all layers)".into();
    }
    let mut windows: Vec<usize> = (0..meta.n_layers)
        .map(|layer| meta.window(layer))
        .filter(|&window| window > 0)
        .collect();
    windows.sort_unstable();
    windows.dedup();
    let mut parts: Vec<String> = windows
        .iter()
        .map(|&window| {
            let layers: Vec<usize> = (0..meta.n_layers)
                .filter(|&layer| meta.window(layer) == window)
                .collect();
            format!("sliding window {window}: layers {}", ranges(&layers))
        })
        .collect();
    parts.push(format!(
        "global (the layers a policy compresses unless `layers = all`): layers {}",
        if global.is_empty() {
            "none".into()
        } else {
            ranges(&global)
        }
    ));
    parts.join("; ")
}

/// `0-4, 6-10, 12` from `[0, 1, 2, 3, 4, 6, ..., 12]`.
pub fn ranges(layers: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut start = 0;
    for index in 1..=layers.len() {
        if index == layers.len() || layers[index] != layers[index - 1] + 1 {
            parts.push(match index - start {
                1 => layers[start].to_string(),
                _ => format!("{}-{}", layers[start], layers[index - 1]),
            });
            start = index;
        }
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_kinds_name_the_sliding_and_the_global_layers() {
        let mut meta = TraceMeta {
            model: "m".into(),
            n_layers: 7,
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 2,
            prompt_len: 1,
            scale: 1.0,
            softcap: None,
            rope_theta: None,
            rope_thetas: Vec::new(),
            windows: Vec::new(),
            spans: Vec::new(),
            extra: Default::default(),
        };
        assert_eq!(layer_kinds(&meta), "global (all layers)");
        meta.windows = vec![512, 512, 512, 0, 512, 0, 64];
        assert_eq!(
            layer_kinds(&meta),
            "sliding window 64: layers 6; sliding window 512: layers 0-2, 4; global (the layers a policy compresses unless `layers = all`): layers 3, 5"
        );
    }
}
