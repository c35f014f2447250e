//! A policy's kept sets on a trace as boolean masks, for whoever post-processes or plots them
//! (the Python package's `kept`): one mask per compressed layer and cache, over the prompt at its
//! end, or over every position at each decode step.

use super::engine::{
    compressed_layers, protocol_view, stopping_kept_sets, stopping_layer_budgets, Checkpoints,
};
use super::{PolicyError, UnitKept, ValidPolicy};
use crate::trace::TraceReader;
use ndarray::{ArrayD, IxDyn};

/// The kept sets of one policy on one trace.
#[derive(Debug, Clone, PartialEq)]
pub struct KeptMasks {
    /// The compressed layers, in depth order (the first axis of `mask`).
    pub layers: Vec<usize>,
    /// Each compressed layer's budget per cache (rounded down where the `global` allocator gives
    /// a layer a total its caches do not divide; the mask shows what each cache keeps).
    pub budgets: Vec<usize>,
    /// Each compressed layer's budget as the tokens its caches keep together.
    pub totals: Vec<usize>,
    /// `[layer, cache, position]` over the prompt: kept at the prompt's end (for a policy that
    /// chooses again later, what it keeps when the first decode step attends); or, per step,
    /// `[layer, cache, step, position]` over every position.
    pub mask: ArrayD<bool>,
}

/// The kept sets of `policy` on `trace`, at the prompt's end or, with `per_step`, at every decode
/// step; `checkpoints` is called after each layer and asked within it (its `stop` also within the
/// allocator's passes over every layer, which come first).
pub fn kept_masks(
    trace: &TraceReader,
    policy: &ValidPolicy,
    per_step: bool,
    checkpoints: Checkpoints<'_>,
) -> Result<KeptMasks, PolicyError> {
    let all_budgets = stopping_layer_budgets(trace, policy, checkpoints.stop)?;
    let layers = compressed_layers(trace.meta(), policy);
    let kept = layers
        .iter()
        .map(|&layer| {
            let kept = stopping_kept_sets(trace, policy, &all_budgets, layer, checkpoints.stop)?;
            (checkpoints.after_layer)()?;
            Ok::<_, PolicyError>(kept)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let view = protocol_view(trace, policy)?;
    let prompt_len = view.as_ref().unwrap_or(trace).meta().prompt_len;
    let n_positions = trace.n_positions();
    let caches = kept.first().map_or(0, |k| k.kept.len());
    let steps = n_positions - prompt_len;
    let shape = match per_step {
        true => vec![layers.len(), caches, steps, n_positions],
        false => vec![layers.len(), caches, prompt_len],
    };
    let mut mask = ArrayD::from_elem(IxDyn(&shape), false);
    for (l, layer) in kept.iter().enumerate() {
        for (c, unit) in layer.kept.iter().enumerate() {
            if per_step {
                for step in 0..steps {
                    for p in unit.kept_positions(step, prompt_len) {
                        mask[[l, c, step, p].as_slice()] = true;
                    }
                }
            } else {
                for p in at_prompt_end(unit).iter().filter(|&&p| p < prompt_len) {
                    mask[[l, c, *p].as_slice()] = true;
                }
            }
        }
    }
    Ok(KeptMasks {
        budgets: layers.iter().map(|&l| all_budgets[l].per_cache()).collect(),
        totals: layers.iter().map(|&l| all_budgets[l].total()).collect(),
        layers,
        mask,
    })
}

/// What a cache holds of the prompt when the first decode step attends.
fn at_prompt_end(unit: &UnitKept) -> &[usize] {
    match unit {
        UnitKept::Fixed(prompt) => prompt,
        UnitKept::PerStep(steps) | UnitKept::Compressing(steps, _) => {
            steps.first().map_or(&[], Vec::as_slice)
        }
    }
}
