//! Live runs decoded together: the policies of one prompt step through their teacher-forced and
//! free-running tokens as the rows of one forward pass ([`Row`]), so every weight matrix is read
//! once per step for all of them. Each row keeps its own cache and its policy's own state, and a
//! row's logits do not depend on its batch, so a batched run's numbers are an unbatched run's,
//! bit for bit. A free run goes on from its teacher-forced run after the tokens they share;
//! free-running rows that stop leave the batch.

use super::drift::{CompressedLayers, LiveMass, StartKeys};
use super::stored::{NotesCompressions, Stored};
use super::streams::{LiveStreams, StreamsState};
use super::{FullStep, LiveStep};
use crate::model::{argmax, AttentionMask, CausalLm, ChunkVectors, Evicted, KvCache};
use crate::model::{ModelError, Row};
use crate::replay::merge::Eviction;
use crate::replay::{ReplayReport, ValidPolicy};
use crate::trace::TraceMeta;
use rayon::prelude::*;
use std::borrow::Cow;
use std::sync::Mutex;

/// What holds a policy's cache while it decodes: the positions a one-shot cut evicted, or the
/// policy's streams.
pub(super) enum PolicyMask<'p> {
    /// A `prefill`-timing cut.
    Fixed(Evicted),
    /// A policy that evicts or re-selects while the model runs.
    Streams(LiveStreams<'p>),
}

impl PolicyMask<'_> {
    /// A second continuation of the prompt (the teacher-forced one): a copy, whose streams take
    /// the live vectors until [`rejoin`](Self::rejoin) ([`LiveStreams::fork`]).
    fn fork(&mut self) -> Self {
        match self {
            PolicyMask::Fixed(evicted) => PolicyMask::Fixed(evicted.clone()),
            PolicyMask::Streams(streams) => PolicyMask::Streams(streams.fork()),
        }
    }

    /// The state of the policy's streams, to go back to; none for a fixed cut, which holds none.
    fn state(&self) -> Option<StreamsState> {
        match self {
            PolicyMask::Fixed(_) => None,
            PolicyMask::Streams(streams) => Some(streams.state()),
        }
    }

    /// Back to `state`, taken from these streams before they ran on.
    fn rewind(&mut self, state: StreamsState) {
        if let PolicyMask::Streams(streams) = self {
            streams.rewind(state);
        }
    }

    /// This mask handed over whole to a continuation that replaces it (the teacher-forced one,
    /// when the free run goes on from it): it keeps neither a fixed cut's positions nor its
    /// streams' state ([`LiveStreams::handed_over`]).
    fn handed_over(&mut self) -> Self {
        match self {
            PolicyMask::Fixed(evicted) => PolicyMask::Fixed(std::mem::take(evicted)),
            PolicyMask::Streams(streams) => PolicyMask::Streams(streams.handed_over()),
        }
    }

    /// Takes back what [`fork`](Self::fork) took, once the fork has run.
    fn rejoin(&mut self, fork: Self) {
        if let (PolicyMask::Streams(streams), PolicyMask::Streams(forked)) = (self, fork) {
            streams.rejoin(forked);
        }
    }
}

impl NotesCompressions for PolicyMask<'_> {
    fn compressions(&mut self, layer: usize) -> Vec<(Vec<usize>, Vec<Eviction>)> {
        match self {
            PolicyMask::Fixed(_) => Vec::new(),
            PolicyMask::Streams(streams) => streams.take_evictions(layer),
        }
    }
}

impl AttentionMask for PolicyMask<'_> {
    fn layer_mask(
        &mut self,
        layer: usize,
        chunk: &ChunkVectors<'_>,
    ) -> Result<Option<Vec<f32>>, ModelError> {
        match self {
            PolicyMask::Fixed(evicted) => evicted.layer_mask(layer, chunk),
            PolicyMask::Streams(streams) => streams.layer_mask(layer, chunk),
        }
    }
}

/// A policy's run at the prompt's end, ready to decode.
pub(super) struct Started<'s> {
    pub policy: &'s ValidPolicy,
    /// The policy's mask, and how its caches store their entries, on the model's layers.
    pub mask: CompressedLayers<Stored<PolicyMask<'s>>>,
    /// The cache after the prompt: the full run's, shared, unless the policy evicted while the
    /// prompt ran.
    pub cache: Cow<'s, KvCache>,
    /// The prompt's last logits.
    pub prompt_logits: Cow<'s, [f32]>,
    /// The open-loop replay of the same policy.
    pub open_loop: ReplayReport,
}

/// What the decoding of one row measured.
pub(super) struct Decoded<'s> {
    pub policy: &'s ValidPolicy,
    /// Teacher-forced steps.
    pub steps: Vec<LiveStep>,
    /// Per layer, the live kept share.
    pub live_layers: Vec<f64>,
    /// The free-running tokens.
    pub generated: Vec<u32>,
    pub open_loop: ReplayReport,
}

/// The full run a batch decodes against.
pub(super) struct Reference<'a> {
    pub model: &'a dyn CausalLm,
    pub meta: &'a TraceMeta,
    /// The full run's tokens.
    pub tokens: &'a [u32],
    /// `logits[i]` predicts `tokens[i + 1]`.
    pub logits: &'a [Vec<f32>],
    /// The full prefill's last logits.
    pub prefill_logits: &'a [f32],
    /// Free-running tokens at most.
    pub generate: usize,
    /// Whether rows whose kept sets are fixed take the teacher-forced tokens in one pass.
    pub forced_in_one_pass: bool,
    /// Whether a free-running row starts where its teacher-forced run last agreed with the full
    /// run's tokens, where it can ([`free_start`]).
    pub resumed_free_runs: bool,
    /// Whether a row's cache copies hold only the windows of the sliding layers it does not
    /// compress.
    pub windowed_copies: bool,
    /// Whether the rows that start from a shared cache (the full run's) read its positions
    /// from it on the global layers instead of from copies of their own (the batching asks for
    /// it and the model's family can).
    pub shared_prompt: bool,
    /// Asked before each decoding step whether to stop there.
    pub stop: crate::stop::Stop<'a>,
}

impl Reference<'_> {
    /// A row of `policy`'s copy of `cache` with room for `extra` positions, holding of each layer
    /// what [`held_prompt`] says (`prefixed`: the row reads the global layers' prompt positions
    /// from `cache` itself, [`prefix`](Self::prefix)).
    fn copy(
        &self,
        cache: &KvCache,
        policy: &ValidPolicy,
        (extra, prefixed): (usize, bool),
    ) -> Result<KvCache, ModelError> {
        let held = held_prompt(self.meta, policy, (self.windowed_copies, prefixed));
        cache.with_room_holding(extra, &held)
    }

    /// The cache a row of `row`'s starts from, when it reads the prompt's positions there instead
    /// of from a copy of its own: one it shares (the full run's), whose entries its policy leaves
    /// as captured.
    fn prefix<'s>(&self, row: &Started<'s>) -> Option<&'s KvCache> {
        let reads = self.shared_prompt && row.mask.inner().is_captured();
        match (&row.cache, reads) {
            (Cow::Borrowed(cache), true) => Some(*cache),
            _ => None,
        }
    }
}

/// One row's teacher-forced state: its mask measuring the live mass, its cache and its steps.
struct Teacher<'s> {
    /// Whether the kept sets were fixed at the prompt's end (a one-shot cut) and the entries
    /// stored as captured: the mask holds no state that the tokens change.
    fixed: bool,
    mask: CompressedLayers<LiveMass<Stored<PolicyMask<'s>>>>,
    cache: KvCache,
    /// The cache `cache` continues on the global layers.
    prefix: Option<&'s KvCache>,
    steps: Vec<LiveStep>,
    /// The most likely token after the prompt.
    first: u32,
    /// The most likely token after each teacher-forced token.
    greedy: Vec<u32>,
    /// The state of its streams after the tokens on which its most likely token agreed with the
    /// full run's, kept when it first differed where it decides at each token and its entries
    /// are stored as captured (its cache then only grows).
    parting: Option<StreamsState>,
}

/// One free-running row.
struct Free<'s> {
    mask: CompressedLayers<Stored<PolicyMask<'s>>>,
    cache: KvCache,
    /// The cache `cache` continues on the global layers.
    prefix: Option<&'s KvCache>,
    next: u32,
    generated: Vec<u32>,
}

/// Decodes `rows` together: the full run's tokens teacher-forced, then greedy decoding, each
/// step one forward pass over every row still running.
pub(super) fn decode<'s>(
    reference: &Reference<'_>,
    rows: Vec<Started<'s>>,
) -> Result<Vec<Decoded<'s>>, ModelError> {
    // Each row copies its cache, its mask and the live keys it measures against (about a third
    // of a second of one core a row at ~1K on SmolLM2): the rows copy in parallel, here and for
    // the free-running copies below.
    let mut rows = rows;
    let shared = shared_start_keys(&rows)?;
    let full = FullSteps::new(reference);
    let teachers = rows
        .par_iter_mut()
        .map(|row| teacher(reference, row, (&shared, &full.prefill)))
        .collect::<Result<Vec<_>, _>>()?;
    drop(shared);
    // What the teacher-forced rows measured; the caches no free run continues go before the
    // free-running copies come.
    let teachers = teacher_forced(reference, teachers, &full.steps)?;
    let (measured, starts): (Vec<_>, Vec<_>) = rows
        .into_iter()
        .zip(teachers)
        .map(|(row, teacher)| free_start(reference, row, teacher))
        .unzip();
    let free = starts
        .into_par_iter()
        .map(|start| match start {
            FreeStart::Resumed(free) => Ok(free),
            FreeStart::AtPromptEnd(row) => {
                let room = (reference.generate, row.prefix.is_some());
                Ok(Free {
                    next: row.first,
                    cache: reference.copy(&row.cache, row.policy, room)?,
                    prefix: row.prefix,
                    mask: row.mask,
                    generated: Vec::new(),
                })
            }
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let free = free_running(reference, free)?;
    Ok(measured
        .into_iter()
        .zip(free)
        .map(|(measured, free)| Decoded {
            policy: measured.policy,
            live_layers: measured.live_layers,
            steps: measured.steps,
            generated: free.generated,
            open_loop: measured.open_loop,
        })
        .collect())
}

/// What a row's teacher-forced run measured.
struct Measured<'s> {
    policy: &'s ValidPolicy,
    open_loop: ReplayReport,
    steps: Vec<LiveStep>,
    live_layers: Vec<f64>,
}

/// Where a row's free run starts.
enum FreeStart<'s> {
    /// From its teacher-forced state.
    Resumed(Free<'s>),
    /// From the prompt's end, its cache still to copy.
    AtPromptEnd(PromptEnd<'s>),
}

/// A row at the prompt's end, its mask as it was there.
struct PromptEnd<'s> {
    policy: &'s ValidPolicy,
    mask: CompressedLayers<Stored<PolicyMask<'s>>>,
    cache: Cow<'s, KvCache>,
    prefix: Option<&'s KvCache>,
    /// The most likely token after the prompt.
    first: u32,
}

/// What `row`'s teacher-forced run `teacher` measured, and where its free run starts. Until its
/// most likely token first differs from the full run's, a free run feeds the full run's tokens:
/// it is the teacher-forced run, state for state. So, when `reference.resumed_free_runs`, it
/// goes on from the teacher-forced state after the tokens they share where that state is at
/// hand: that of a row that agreed on every token, or of any row whose entries are stored as
/// captured, its cache then rewound to those tokens: a fixed cut's mask holds no state, streams
/// were kept where they parted ([`keep_parting`]), or are the prompt end's where they parted at
/// the first token. Any other row's free run starts from a copy of its cache at the prompt's
/// end.
fn free_start<'s>(
    reference: &Reference<'_>,
    row: Started<'s>,
    teacher: Teacher<'s>,
) -> (Measured<'s>, FreeStart<'s>) {
    let Teacher {
        fixed,
        mask: forced,
        cache: mut forced_cache,
        prefix,
        steps,
        first,
        greedy,
        parting,
    } = teacher;
    let measured = Measured {
        policy: row.policy,
        open_loop: row.open_loop,
        steps,
        live_layers: forced.inner().per_layer(),
    };
    let tokens = reference.tokens;
    let agreed = agreed_tokens(tokens, first, &greedy);
    let mut forced = forced.map(LiveMass::into_inner);
    let captured = forced.inner().is_captured();
    let mut mask = row.mask;
    if reference.resumed_free_runs && (captured || agreed == tokens.len()) {
        forced_cache.rewind(tokens.len() - agreed);
        let mask = match parting {
            Some(state) => {
                forced.inner_mut().inner_mut().rewind(state);
                forced
            }
            None if !fixed && agreed < tokens.len() => {
                debug_assert_eq!(agreed, 0, "streams are kept where they part");
                mask.inner_mut()
                    .inner_mut()
                    .rejoin(forced.into_inner().into_inner());
                mask
            }
            None => forced,
        };
        let free = Free {
            mask,
            cache: forced_cache,
            prefix,
            next: match agreed {
                0 => first,
                _ => greedy[agreed - 1],
            },
            generated: tokens[..agreed].to_vec(),
        };
        return (measured, FreeStart::Resumed(free));
    }
    mask.inner_mut()
        .inner_mut()
        .rejoin(forced.into_inner().into_inner());
    let start = PromptEnd {
        policy: row.policy,
        mask,
        cache: row.cache,
        prefix,
        first,
    };
    (measured, FreeStart::AtPromptEnd(start))
}

/// The full run's distributions the rows are compared with, computed once: after the prompt, and
/// after each teacher-forced token.
struct FullSteps {
    prefill: FullStep,
    steps: Vec<FullStep>,
}

impl FullSteps {
    fn new(reference: &Reference<'_>) -> Self {
        Self {
            prefill: FullStep::new(reference.prefill_logits),
            steps: reference
                .logits
                .par_iter()
                .map(|logits| FullStep::new(logits))
                .collect(),
        }
    }
}

/// The keys of each cache that rows borrow (the full run's), taken once for all of them, with
/// the cache's address.
fn shared_start_keys(rows: &[Started<'_>]) -> Result<Vec<(usize, StartKeys)>, ModelError> {
    let mut shared: Vec<(usize, StartKeys)> = Vec::new();
    for row in rows {
        if let Cow::Borrowed(cache) = &row.cache {
            let address = std::ptr::from_ref(*cache) as usize;
            if !shared.iter().any(|&(held, _)| held == address) {
                shared.push((address, StartKeys::new(cache)?));
            }
        }
    }
    Ok(shared)
}

/// A row's teacher-forced start: a copy of its cache, its mask measuring the live mass (from
/// the `shared` keys of the cache it borrows, if it does), and, for a policy that evicted while
/// the prompt ran, the prompt's last logits compared already (with the full run's, `prefill`).
fn teacher<'s>(
    reference: &Reference<'_>,
    row: &mut Started<'s>,
    (shared, prefill): (&[(usize, StartKeys)], &FullStep),
) -> Result<Teacher<'s>, ModelError> {
    let meta = reference.meta;
    let compressed = crate::replay::compressed_layers(meta, row.policy);
    let windows = compressed.iter().map(|&l| meta.window(l)).collect();
    let own;
    let address = std::ptr::from_ref(&*row.cache) as usize;
    let start = match shared.iter().find(|&&(cache, _)| cache == address) {
        Some((_, keys)) => keys,
        None => {
            own = StartKeys::new(&row.cache)?;
            &own
        }
    };
    // A free run that goes on from this one never needs the prompt end's state when it shares
    // the full run's first token and its entries are stored as captured ([`free_start`]).
    let first = argmax(&row.prompt_logits);
    let continued = reference.resumed_free_runs
        && row.mask.inner().is_captured()
        && reference.tokens.first() == Some(&first);
    let forced = match continued {
        true => row.mask.inner_mut().fork_with(PolicyMask::handed_over),
        false => row.mask.inner_mut().fork_with(PolicyMask::fork),
    };
    let measured = LiveMass::new(
        forced,
        start,
        (&compressed, windows),
        meta.n_heads / meta.n_kv_heads,
        meta.scale,
        meta.softcap,
    );
    let mut steps = Vec::with_capacity(reference.tokens.len());
    if row.policy.params().changes_the_prompt() {
        steps.push(prefill.compare(&row.prompt_logits, reference.tokens[0]));
    }
    let prefix = reference.prefix(row);
    let room = (reference.tokens.len(), prefix.is_some());
    // A cache of its own (made with room for the decode) the row hands over whole where the
    // free run goes on from this one whatever it does: its entries are stored as captured.
    let cache = match &mut row.cache {
        Cow::Owned(cache) if reference.resumed_free_runs && row.mask.inner().is_captured() => {
            std::mem::take(cache)
        }
        cache => reference.copy(cache, row.policy, room)?,
    };
    Ok(Teacher {
        fixed: row.mask.inner().is_captured()
            && matches!(row.mask.inner().inner(), PolicyMask::Fixed(_)),
        mask: CompressedLayers::new(measured, &compressed, meta.n_layers),
        cache,
        prefix,
        steps,
        first,
        greedy: Vec::with_capacity(reference.tokens.len()),
        parting: None,
    })
}

/// Feeds every generated token of the full run to every row, the last one too (its logits
/// predict nothing compared), so the live attention covers the decode steps the open-loop
/// replay measures; the logits after token `i` are compared with `full[i]`.
fn teacher_forced<'s>(
    reference: &Reference<'_>,
    mut teachers: Vec<Teacher<'s>>,
    full: &[FullStep],
) -> Result<Vec<Teacher<'s>>, ModelError> {
    let (mut fixed, mut evolving): (Vec<_>, Vec<_>) = teachers
        .iter_mut()
        .partition(|teacher| teacher.fixed && reference.forced_in_one_pass);
    // Side by side: the steps of the evolving rows leave a core idle between their products,
    // which the one pass of the fixed rows fills; each row's numbers are its own either way.
    let (fixed, evolving) = rayon::join(
        || in_one_pass(reference, &mut fixed, full),
        || step_by_step(reference, &mut evolving, full),
    );
    fixed?;
    evolving?;
    Ok(teachers)
}

/// Rows whose kept sets were fixed at the prompt's end: every token in one pass
/// ([`CausalLm::forward_steps`](crate::model::CausalLm::forward_steps)), the numbers those of
/// [`step_by_step`] bit for bit.
fn in_one_pass(
    reference: &Reference<'_>,
    teachers: &mut [&mut Teacher<'_>],
    full: &[FullStep],
) -> Result<(), ModelError> {
    let tokens = reference.tokens;
    if teachers.is_empty() || tokens.is_empty() {
        return Ok(());
    }
    let (mut rows, mut measured): (Vec<Row<'_, '_>>, Vec<_>) = teachers
        .iter_mut()
        .map(|teacher| {
            let Teacher {
                mask,
                cache,
                prefix,
                steps,
                greedy,
                ..
            } = &mut **teacher;
            (
                Row::new(tokens, cache, Some(mask)).over_prefix(*prefix),
                (steps, greedy),
            )
        })
        .unzip();
    let compared = Mutex::new(Vec::new());
    reference
        .model
        .forward_steps(&mut rows, &|row, step, logits| {
            let step_compared = tokens
                .get(step + 1)
                .map(|&next| full[step].compare(logits, next));
            let greedy = argmax(logits);
            let mut compared = compared.lock().expect("no comparison panicked");
            compared.push((row, step, step_compared, greedy));
        })?;
    let mut compared = compared.into_inner().expect("no comparison panicked");
    compared.sort_by_key(|&(row, step, ..)| (row, step));
    for (row, _, step, greedy) in compared {
        let (steps, greedies) = &mut measured[row];
        steps.extend(step);
        greedies.push(greedy);
    }
    Ok(())
}

/// Keeps `teacher`'s state where its most likely token first differs from the full run's
/// (after its last token), if its streams decide at each token and its entries are stored as
/// captured.
fn keep_parting(tokens: &[u32], teacher: &mut Teacher<'_>) {
    let agreed = agreed_tokens(tokens, teacher.first, &teacher.greedy);
    let parts = agreed == teacher.greedy.len() && agreed < tokens.len();
    let stored = teacher.mask.inner().inner();
    if parts && stored.is_captured() {
        if let Some(state) = stored.inner().state() {
            teacher.parting = Some(state);
        }
    }
}

/// How many of the full run's `tokens` a free run feeds before its most likely token first
/// differs from theirs: `first` after the prompt, `greedy[i]` after `tokens[i]`.
fn agreed_tokens(tokens: &[u32], first: u32, greedy: &[u32]) -> usize {
    let choice = |index: usize| match index {
        0 => Some(first),
        _ => greedy.get(index - 1).copied(),
    };
    (0..tokens.len())
        .find(|&index| choice(index) != Some(tokens[index]))
        .unwrap_or(tokens.len())
}

/// Rows whose policies evict as tokens arrive: one pass per token.
fn step_by_step(
    reference: &Reference<'_>,
    teachers: &mut [&mut Teacher<'_>],
    full: &[FullStep],
) -> Result<(), ModelError> {
    if teachers.is_empty() {
        return Ok(());
    }
    for (index, &token) in reference.tokens.iter().enumerate() {
        let ids = [token];
        let mut rows: Vec<Row<'_, '_>> = teachers
            .iter_mut()
            .map(|teacher| {
                Row::new(&ids, &mut teacher.cache, Some(&mut teacher.mask))
                    .over_prefix(teacher.prefix)
            })
            .collect();
        (reference.stop)()?;
        let logits = reference.model.forward_rows(&mut rows)?;
        drop(rows);
        let next = reference.tokens.get(index + 1);
        teachers
            .par_iter_mut()
            .zip(&logits)
            .for_each(|(teacher, logits)| {
                if let Some(&next) = next {
                    teacher.steps.push(full[index].compare(logits, next));
                }
                teacher.greedy.push(argmax(logits));
                if reference.resumed_free_runs {
                    keep_parting(reference.tokens, teacher);
                }
            });
    }
    Ok(())
}

/// Greedy decoding of every row, up to `generate` tokens each, a row leaving the batch at its
/// stop token. Rows that start with tokens generated join the batch when the others have as
/// many.
fn free_running<'s>(
    reference: &Reference<'_>,
    mut rows: Vec<Free<'s>>,
) -> Result<Vec<Free<'s>>, ModelError> {
    let stop = reference.model.tokenizer().stop_token();
    let runs = |row: &Free<'_>| row.generated.len() < reference.generate && row.next != stop;
    loop {
        let Some(step) = rows
            .iter()
            .filter(|row| runs(row))
            .map(|row| row.generated.len())
            .min()
        else {
            return Ok(rows);
        };
        let mut running: Vec<&mut Free<'s>> = rows
            .iter_mut()
            .filter(|row| runs(row) && row.generated.len() == step)
            .collect();
        let ids: Vec<[u32; 1]> = running.iter().map(|row| [row.next]).collect();
        let mut batch: Vec<Row<'_, '_>> = running
            .iter_mut()
            .zip(&ids)
            .map(|(row, ids)| {
                row.generated.push(ids[0]);
                Row::new(ids, &mut row.cache, Some(&mut row.mask)).over_prefix(row.prefix)
            })
            .collect();
        (reference.stop)()?;
        let logits = reference.model.forward_rows(&mut batch)?;
        drop(batch);
        for (row, logits) in running.iter_mut().zip(&logits) {
            row.next = argmax(logits);
        }
    }
}

/// How many of the prompt's last positions a row of `policy` copies of each layer
/// ([`KvCache::with_room_holding`]): every one, except the window of each sliding-window layer
/// the policy does not compress when its copies are `windowed` (its queries attend over their
/// window alone), and none of a global layer's when it reads them from the cache it starts
/// from (`prefixed`).
fn held_prompt(
    meta: &TraceMeta,
    policy: &ValidPolicy,
    (windowed, prefixed): (bool, bool),
) -> Vec<usize> {
    let compressed = crate::replay::compressed_layers(meta, policy);
    (0..meta.n_layers)
        .map(|layer| match meta.window(layer) {
            0 if prefixed => 0,
            0 => usize::MAX,
            window if windowed && !compressed.contains(&layer) => window,
            _ => usize::MAX,
        })
        .collect()
}

/// About how many bytes a row of `policy` holds while it decodes `capacity` positions: its
/// running cache (what [`held_prompt`] copies of the prompt, `prefixed` when it reads the
/// global layers' prompt positions from the full run's cache, and the positions after it; and
/// the start it copies, whole, when it prefilled on its own), its streams' vectors twice when it
/// streams (the policy's and the copy that measures its live mass), the
/// live keys that measure its mass where it holds its own (a start of its own, or a compressed
/// sliding-window layer: the rows that start from the full run's cache share its keys), and a
/// stored cache's own vectors. The teacher-forced cache is freed before the free-running copy is
/// made.
pub(super) fn row_bytes(
    meta: &TraceMeta,
    policy: &ValidPolicy,
    (capacity, own_prefill, windowed, prefixed): (usize, bool, bool, bool),
) -> usize {
    const F32: usize = 4;
    let compressed = crate::replay::compressed_layers(meta, policy);
    let (heads, kv, d) = (meta.n_heads, meta.n_kv_heads, meta.head_dim);
    let entry = 2 * kv * d * F32;
    let room = capacity.saturating_sub(meta.prompt_len);
    let prefixed = prefixed && !own_prefill && policy.storage().is_captured();
    let copy: usize = held_prompt(meta, policy, (windowed, prefixed))
        .into_iter()
        .map(|held| entry * held.saturating_add(room).min(capacity))
        .sum();
    let whole = meta.n_layers * entry * capacity;
    let own_keys = compressed
        .iter()
        .filter(|&&layer| own_prefill || meta.window(layer) > 0)
        .count();
    let keys = own_keys * kv * d * capacity * F32;
    let compressed = compressed.len();
    let streams = match policy.params().timing {
        crate::replay::Timing::Prefill => 0,
        _ => compressed * (heads + 2 * kv) * d * capacity * F32,
    };
    // A stored cache's own copy of its keys and values, in the teacher-forced and the
    // free-running mask.
    let stored = match policy.storage().is_captured() {
        true => 0,
        false => 2 * compressed * 2 * kv * d * capacity * F32,
    };
    usize::from(own_prefill) * whole + copy + 2 * streams + keys + stored
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::PolicyParams;

    #[test]
    fn a_windowed_row_holds_its_sliding_layers_windows_only() {
        // Gemma 3 270M's shape: 18 layers, one KV head of 256, a window of 512 on all but layers
        // 5, 11 and 17; an 8,000-token prompt and 33 positions of room.
        let meta = TraceMeta {
            model: "gemma3".into(),
            n_layers: 18,
            n_heads: 4,
            n_kv_heads: 1,
            head_dim: 256,
            prompt_len: 8000,
            scale: 1.0,
            softcap: None,
            rope_theta: None,
            rope_thetas: Vec::new(),
            windows: (0..18).map(|l| if l % 6 == 5 { 0 } else { 512 }).collect(),
            spans: Vec::new(),
            extra: Default::default(),
        };
        let policy = PolicyParams::default().check().unwrap();
        // A position of one layer: keys and values, 256 f32 each: 2,048 bytes.
        let capacity = 8033;
        let entry = 2048;
        // The rows that start from the full run's cache share its keys for the live mass; one
        // that prefilled on its own holds its own.
        let keys = 3 * 1024 * capacity;
        let whole = row_bytes(&meta, &policy, (capacity, false, false, false));
        assert_eq!(whole, 18 * entry * capacity);
        let windowed = row_bytes(&meta, &policy, (capacity, false, true, false));
        assert_eq!(windowed, (3 * capacity + 15 * (512 + 33)) * entry);
        let own_start = row_bytes(&meta, &policy, (capacity, true, true, false));
        assert_eq!(own_start, windowed + 18 * entry * capacity + keys);
        // 80 rows: 23.7 GB (22,592 MiB) whole, 5.3 GB (5,042 MiB) windowed.
        assert_eq!((80 * whole) >> 20, 22_592);
        assert_eq!((80 * windowed) >> 20, 5_042);
        // Reading the prompt's positions from the full run's cache, its global layers hold the
        // 33 positions after the prompt: 80 rows, 1.4 GB (1,292 MiB).
        let prefixed = row_bytes(&meta, &policy, (capacity, false, true, true));
        assert_eq!(prefixed, (3 * 33 + 15 * (512 + 33)) * entry);
        assert_eq!((80 * prefixed) >> 20, 1_292);
        // One that prefilled on its own copies its own start whole.
        assert_eq!(
            row_bytes(&meta, &policy, (capacity, true, true, true)),
            own_start
        );
        // A policy that compresses every layer keeps them whole.
        let all = PolicyParams {
            layers: crate::replay::Layers::All,
            ..PolicyParams::default()
        };
        let all = all.check().unwrap();
        // Its sliding-window layers' live keys are its own.
        let whole_all = 18 * entry * capacity + 15 * 1024 * capacity;
        assert_eq!(
            row_bytes(&meta, &all, (capacity, false, true, false)),
            whole_all
        );
    }
}
