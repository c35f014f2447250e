//! Eviction scorers: which tokens a cache keeps. One scorer per file, the file name is the
//! registry key (`key_proxy.rs` is `key-proxy`). A scorer only ranks; how many tokens are kept is
//! the allocator's business.
//!
//! A scorer consumes a stream: [`ScoreState::on_append`] sees each token as it enters the cache
//! (its key arrives, its query attends), [`ScoreState::on_evict`] each eviction, and
//! [`ScoreState::scores`] is asked whenever the engine must choose. Higher scores are kept. The
//! layer's vectors come with every call rather than being held by the state, so the stream can
//! come from a trace (the whole layer at once) or from a live model (one more position each
//! step); a state reads only the positions up to the newest one, unless its scorer declares it
//! reads the future.

use super::settings::Broken;
use super::{Aggregation, MethodFailed, Protection, Timing};
use super::{LayerContext, Unit};
use crate::attention::{softmax_in_place, softmax_into, sparse_logits, CausalLogits};

mod cake;
mod chunkkv;
mod defensivekv;
mod expected_attention;
mod key_proxy;
mod keydiff;
mod knorm;
mod kvzip;
mod lagkv;
mod observed_attention;
mod oracle_static;
mod qfilter;
mod quest;
mod random;
mod recency;
mod rkv;
mod snapkv;
mod tova;
#[cfg(test)]
mod toy;
mod true_query;
mod value_aware;

crate::registry! {
    Scorer:
    key_proxy::KeyProxy,
    true_query::TrueQuery,
    snapkv::SnapKv,
    cake::Cake,
    tova::Tova,
    recency::Recency,
    knorm::Knorm,
    keydiff::KeyDiff,
    lagkv::LagKv,
    kvzip::Kvzip,
    expected_attention::ExpectedAttention,
    chunkkv::ChunkKv,
    value_aware::ValueAware,
    qfilter::QFilter,
    quest::Quest,
    rkv::RKv,
    defensivekv::DefensiveKv,
    observed_attention::ObservedAttention,
    random::Random,
    oracle_static::OracleStatic,
    #[cfg(test)]
    toy::Toy,
}

pub use snapkv::Pooling;

/// A way of ranking cached tokens.
pub trait Scorer: Send + Sync {
    /// Rules its settings must follow beyond their types.
    fn check(&self) -> Result<(), Broken> {
        Ok(())
    }
    /// Whether it reads queries beyond the current position (an oracle): only such methods may.
    fn reads_future(&self) -> bool {
        false
    }
    /// Whether it scores the values too (the trace must have them).
    fn needs_values(&self) -> bool {
        false
    }
    /// Whether it reads each layer's attention inputs, the hidden states and projection weights
    /// (the trace must hold them: `docs/trace-format.md`, "Attention inputs").
    fn needs_inputs(&self) -> bool {
        false
    }
    /// Whether it reads the trace's reconstruction pass (`kvzip`; its `check_trace` says what
    /// the trace lacks): a replay of scorers that do not reads the layers without it.
    fn needs_reconstruction(&self) -> bool {
        false
    }
    /// Whether it rotates the queries back before the rotary (the trace must give `rope_theta`).
    fn needs_rope(&self) -> bool {
        false
    }
    /// Whether it can score a trace of this header, beyond `needs_values` and `needs_rope`
    /// (`qfilter`'s calibration trace must come from the same model); the error says why not.
    fn check_trace(&self, _meta: &crate::trace::TraceMeta) -> Result<(), String> {
        Ok(())
    }
    /// Whether the scorer is defined for this timing (SnapKV is one-shot).
    fn supports(&self, _timing: Timing) -> bool {
        true
    }
    /// Whether a streaming cache may cut several entries at once while decoding (`interval` above
    /// 1); not for a scorer that keeps its own cache order through single evictions (CAKE).
    fn cuts_while_decoding(&self) -> bool {
        true
    }
    /// A fresh state for one cache of one layer; `protect` is the policy's protection (SnapKV's
    /// observation window is its window). `layer` gives the layer's shape and prompt length; only
    /// a scorer that reads the future may read its vectors here. It and every call of the state
    /// return a result: only a scorer written outside the library (Python) fails.
    fn start(
        &self,
        layer: &LayerContext<'_>,
        unit: &Unit,
        protect: Protection,
    ) -> Result<Started, MethodFailed>;
    /// Its brute-force rule ([`super::reference`]), written from the method's description in
    /// its own file, and the settings it runs with on the test fixtures: the conformance tests
    /// compare the engine with it under every timing and layout the scorer supports. A scorer
    /// without one fails them, naming it.
    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn super::reference::ScorerRule>> {
        None
    }
}

/// The scorer registered as `name`, with its default settings, for a scorer that wraps another
/// (`chunkkv`, `value-aware`): its `inner` setting must name another registered scorer than the
/// wrapper `outer` itself.
pub(crate) fn inner_scorer(name: &str, outer: &str) -> Result<Box<dyn Scorer>, Broken> {
    let broken = Broken {
        key: "inner",
        rule: "must name another registered scorer (`kvreplay methods` lists them)".into(),
    };
    let method = super::settings::find(REGISTRY, name)
        .filter(|_| name != outer)
        .ok_or_else(|| broken.clone())?;
    (method.build)(&(method.defaults)()).map_err(|_| broken)
}

/// What a call of a scorer or its state returns.
pub type Scored = Result<(), MethodFailed>;

/// A scorer's state for one cache, as `start` returns it.
pub type Started = Box<dyn ScoreState>;

/// A cache order as `torch.topk` leaves it after a compression (CAKE's and R-KV's): the scored
/// entries that stay by descending score (equal scores keep their places), then `window` as it
/// was.
pub(crate) fn topk_order(mut stays: Vec<(usize, f32)>, window: &[usize]) -> Vec<usize> {
    stays.sort_by(|a, b| b.1.total_cmp(&a.1));
    stays
        .into_iter()
        .map(|(p, _)| p)
        .chain(window.iter().copied())
        .collect()
}

/// The running state of a scorer for one cache. `layer` holds at least the positions of `cache`;
/// cloning a state forks the stream (a live run decodes two continuations of one prompt).
pub trait ScoreState: dyn_clone::DynClone + Send {
    /// The last entry of `cache` (positions in insertion order) has just been appended; a state
    /// that keeps nothing per entry has nothing to do.
    fn on_append(&mut self, _layer: &LayerContext<'_>, _cache: &[usize]) -> Scored {
        Ok(())
    }
    /// Writes one score per entry of `cache` into `out` (cleared first); higher is kept.
    fn scores(&mut self, layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored;
    /// Entry `index` of the cache has been evicted.
    fn on_evict(&mut self, _index: usize) -> Scored {
        Ok(())
    }
    /// Entry `index` (the oldest) has slid out of a sliding-window layer's attention window, before
    /// the next token is appended: not the policy's choice, and no scores were asked for it.
    fn on_slide_out(&mut self, index: usize) -> Scored {
        self.on_evict(index)
    }
    /// Every entry `i` with `kept[i] == false` has been evicted at once (the cut at the end of the
    /// prompt); states that keep one value per entry override it to drop them in one pass.
    fn on_cut(&mut self, kept: &[bool]) -> Scored {
        for index in (0..kept.len()).rev() {
            if !kept[index] {
                self.on_evict(index)?;
            }
        }
        Ok(())
    }
}

dyn_clone::clone_trait_object!(ScoreState);

/// The queries of one cache's heads, and their attention over a cache. While the cache is the
/// whole prefix `0..=position` (prefill, or streaming before the first eviction) the logits come
/// from block matrix multiplications ([`CausalLogits`]); once evictions have made it sparse, from
/// one dot product per cached key, so a streaming step costs O(budget), not O(T). The block's
/// working memory is kept only while prefix rows are asked for one after another: a one-off row
/// (the last prompt query of a prefill-time cut) and the sparse steps free it, so caches scored
/// side by side (`gqa = layer`) do not each hold one.
#[derive(Clone)]
pub(crate) struct GroupQueries {
    unit: Unit,
    rows: CausalLogits,
    /// The prefix row that would continue the last one served.
    next_prefix: Option<usize>,
    /// Each head's weights of the last row served (reused from row to row).
    weights: Vec<Vec<f32>>,
}

impl GroupQueries {
    pub fn new(layer: &LayerContext<'_>, unit: &Unit) -> Self {
        let head_dim = layer.q.shape()[2];
        Self {
            unit: unit.clone(),
            rows: CausalLogits::new(unit.query_heads.len(), head_dim, layer.scale, layer.softcap),
            next_prefix: None,
            weights: vec![Vec::new(); unit.query_heads.len()],
        }
    }

    /// Attention of each head's query at `position` over `cache` (positions, ascending).
    pub fn per_head(
        &mut self,
        layer: &LayerContext<'_>,
        position: usize,
        cache: &[usize],
    ) -> &[Vec<f32>] {
        let is_prefix = cache.last() == Some(&position) && cache.len() == position + 1;
        if is_prefix {
            let one_off = self.next_prefix != Some(position);
            let queries = layer
                .q
                .slice(ndarray::s![self.unit.query_heads.clone(), .., ..]);
            let keys = layer.keys(self.unit.kv_head);
            for (head, weights) in self.weights.iter_mut().enumerate() {
                softmax_into(self.rows.row(queries, keys, head, position), weights);
            }
            if one_off {
                self.rows.release();
            }
            self.next_prefix = Some(position + 1);
            return &self.weights;
        }
        self.rows.release();
        self.next_prefix = None;
        // A sparse cache (after evictions): one dot product per cached key and head, O(budget).
        let keys = layer.keys(self.unit.kv_head);
        let queries = layer.queries_at(self.unit.query_heads.clone(), position);
        sparse_logits(
            &queries,
            keys,
            cache,
            layer.scale,
            layer.softcap,
            &mut self.weights,
        );
        for weights in self.weights.iter_mut() {
            softmax_in_place(weights);
        }
        &self.weights
    }

    /// The same, aggregated over the group into `out`: one weight per cache entry, each
    /// [`Aggregation::combine`] of the heads' weights in head order (the same arithmetic, run
    /// head by head over whole rows).
    pub fn aggregated_into(
        &mut self,
        layer: &LayerContext<'_>,
        position: usize,
        cache: &[usize],
        agg: Aggregation,
        out: &mut Vec<f32>,
    ) {
        let per_head = self.per_head(layer, position, cache);
        out.clear();
        out.resize(cache.len(), 0.0);
        aggregate(per_head, 0, agg, out);
    }

    /// Adds [`GroupQueries::aggregated_into`]'s weights to `scores` (one per cache entry): the
    /// same arithmetic, element by element, in one pass over the heads' rows by blocks that stay
    /// in registers (cumulative scores: H2O).
    pub fn accumulate_aggregated(
        &mut self,
        layer: &LayerContext<'_>,
        position: usize,
        cache: &[usize],
        agg: Aggregation,
        scores: &mut [f32],
    ) {
        const BLOCK: usize = 64;
        let per_head = self.per_head(layer, position, cache);
        let mut block = [0.0f32; BLOCK];
        for (index, scores) in scores.chunks_mut(BLOCK).enumerate() {
            let block = &mut block[..scores.len()];
            aggregate(per_head, index * BLOCK, agg, block);
            for (score, &weight) in scores.iter_mut().zip(block.iter()) {
                *score += weight;
            }
        }
    }

    /// [`GroupQueries::aggregated_into`] as a new vector.
    pub fn aggregated(
        &mut self,
        layer: &LayerContext<'_>,
        position: usize,
        cache: &[usize],
        agg: Aggregation,
    ) -> Vec<f32> {
        let mut out = Vec::with_capacity(cache.len());
        self.aggregated_into(layer, position, cache, agg, &mut out);
        out
    }
}

/// The group's aggregate of the heads' weights at entries `from..from + out.len()` into `out`:
/// each [`Aggregation::combine`] of the heads' weights in head order, run head by head over the
/// block.
fn aggregate(per_head: &[Vec<f32>], from: usize, agg: Aggregation, out: &mut [f32]) {
    let entries = from..from + out.len();
    if let [only] = per_head {
        out.copy_from_slice(&only[entries]);
        return;
    }
    let rows = per_head.iter().map(|weights| &weights[entries.clone()]);
    out.fill(match agg {
        Aggregation::Max => f32::NEG_INFINITY,
        _ => 0.0,
    });
    for weights in rows {
        match agg {
            Aggregation::Max => {
                for (acc, &w) in out.iter_mut().zip(weights) {
                    *acc = acc.max(w);
                }
            }
            _ => {
                for (acc, &w) in out.iter_mut().zip(weights) {
                    *acc += w;
                }
            }
        }
    }
    if agg == Aggregation::Mean {
        let count = per_head.len() as f32;
        for acc in out.iter_mut() {
            *acc /= count;
        }
    }
}

/// Scores of the newest query's attention over the cache, computed when asked for: TOVA's score
/// (under the `per-step` timing, the per-step oracle's).
#[derive(Clone)]
pub(crate) struct CurrentQuery {
    queries: GroupQueries,
    agg: Aggregation,
}

impl CurrentQuery {
    pub fn new(layer: &LayerContext<'_>, unit: &Unit, agg: Aggregation) -> Self {
        Self {
            queries: GroupQueries::new(layer, unit),
            agg,
        }
    }
}

impl ScoreState for CurrentQuery {
    fn scores(&mut self, layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        let newest = *cache.last().expect("non-empty cache");
        self.queries
            .aggregated_into(layer, newest, cache, self.agg, out);
        Ok(())
    }
}

/// Scores kept aligned with the cache: one per entry, removed on eviction.
#[derive(Debug, Default, Clone)]
pub(crate) struct AlignedScores(pub Vec<f32>);

impl AlignedScores {
    pub fn copy_to(&self, out: &mut Vec<f32>) {
        out.clear();
        out.extend_from_slice(&self.0);
    }

    /// Adds one weight per entry (cumulative scores: the key-as-query proxy).
    pub fn accumulate(&mut self, weights: impl IntoIterator<Item = f32>) {
        for (score, weight) in self.0.iter_mut().zip(weights) {
            *score += weight;
        }
    }

    pub fn remove(&mut self, index: usize) {
        self.0.remove(index);
    }

    /// Keeps the entries `kept` marks, in one pass.
    pub fn retain(&mut self, kept: &[bool]) {
        let mut marks = kept.iter();
        self.0
            .retain(|_| *marks.next().expect("one mark per entry"));
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! A tiny hand-checkable layer for scorer tests.
    use super::*;
    use ndarray::Array3;

    /// One head, d = 2, T positions, keys and queries given as rows.
    pub fn layer_with(
        q: &[[f32; 2]],
        k: &[[f32; 2]],
        prompt_len: usize,
    ) -> (Array3<f32>, Array3<f32>, usize) {
        let qa = Array3::from_shape_fn((1, q.len(), 2), |(_, t, d)| q[t][d]);
        let ka = Array3::from_shape_fn((1, k.len(), 2), |(_, t, d)| k[t][d]);
        (qa, ka, prompt_len)
    }

    pub fn context<'a>(
        q: &'a Array3<f32>,
        k: &'a Array3<f32>,
        prompt_len: usize,
    ) -> LayerContext<'a> {
        LayerContext {
            layer: 0,
            q: q.view(),
            k: k.view(),
            v: None,
            prompt_len,
            scale: 1.0,
            softcap: None,
            rope_theta: None,
            window: 0,
            inputs: None,
            reconstruction: None,
        }
    }

    pub fn unit() -> Unit {
        Unit {
            index: 0,
            kv_head: 0,
            query_heads: 0..1,
        }
    }

    /// Queries of `heads` heads and keys and values of one KV head, over `t` positions of `d`
    /// lanes, filled from a hash (values in [-0.5, 0.5), keys twice that, values four times).
    pub fn hashed_group(
        heads: usize,
        t: usize,
        d: usize,
    ) -> (Array3<f32>, Array3<f32>, Array3<f32>) {
        let value = |i: usize| ((i * 2654435761) % 1009) as f32 / 1009.0 - 0.5;
        let q = Array3::from_shape_fn((heads, t, d), |(h, p, c)| value(h * 997 + p * d + c));
        let k = Array3::from_shape_fn((1, t, d), |(_, p, c)| value(5 + p * d + c) * 2.0);
        let v = Array3::from_shape_fn((1, t, d), |(_, p, c)| value(11 + p * d + c) * 4.0);
        (q, k, v)
    }

    /// A global layer of `q`, `k` and `v` with scale 0.5.
    pub fn global_layer<'a>(
        q: &'a Array3<f32>,
        k: &'a Array3<f32>,
        v: Option<&'a Array3<f32>>,
        prompt_len: usize,
    ) -> LayerContext<'a> {
        LayerContext {
            v: v.map(Array3::view),
            scale: 0.5,
            ..context(q, k, prompt_len)
        }
    }

    /// The one cache of all query heads of KV head 0.
    pub fn group_unit(heads: usize) -> Unit {
        Unit {
            query_heads: 0..heads,
            ..unit()
        }
    }

    /// Appends positions 0..n of `layer` one by one and returns the final scores.
    pub fn scores_after(
        state: &mut dyn ScoreState,
        layer: &LayerContext<'_>,
        n: usize,
    ) -> Vec<f32> {
        let mut cache = Vec::new();
        for position in 0..n {
            cache.push(position);
            state
                .on_append(layer, &cache)
                .expect("the library's scorers do not fail");
        }
        let mut out = Vec::new();
        state
            .scores(layer, &cache, &mut out)
            .expect("the library's scorers do not fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{global_layer, group_unit, hashed_group};
    use super::*;

    /// Every registered scorer lives in the file its name names (`expected-attention` in
    /// `expected_attention.rs`) and carries unit tests there (its hand-computed cases), beside the
    /// brute-force rule the conformance tests compare it with.
    #[test]
    fn every_scorer_is_its_own_file_with_its_own_unit_tests() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/replay/scorer");
        for method in REGISTRY {
            let file = dir.join(format!("{}.rs", method.name.replace('-', "_")));
            let source = std::fs::read_to_string(&file).unwrap_or_else(|err| {
                panic!("scorer `{}`: {}: {err}", method.name, file.display())
            });
            let tests = source.split_once("#[cfg(test)]").map(|(_, tests)| tests);
            assert!(
                tests.is_some_and(|tests| tests.contains("#[test]")),
                "scorer `{}`: {} has no unit test",
                method.name,
                file.display()
            );
        }
    }

    #[test]
    fn accumulating_the_aggregate_adds_what_aggregated_into_gives() {
        // Three query heads on one KV head, 150 positions (two blocks of 64 and a remainder),
        // every aggregation, a prefix cache and a sparse one: the fused pass gives the bits of
        // aggregating and then adding.
        let (heads, t, d) = (3, 150, 4);
        let (q, k, _) = hashed_group(heads, t, d);
        let layer = global_layer(&q, &k, None, t);
        let unit = group_unit(heads);
        let prefix: Vec<usize> = (0..t).collect();
        let sparse: Vec<usize> = (0..t).filter(|p| p % 3 != 1).collect();
        for agg in [Aggregation::Mean, Aggregation::Max, Aggregation::Sum] {
            for cache in [&prefix, &sparse] {
                let position = *cache.last().unwrap();
                let base: Vec<f32> = (0..cache.len()).map(|i| (i % 7) as f32 + 0.125).collect();
                let aggregated =
                    GroupQueries::new(&layer, &unit).aggregated(&layer, position, cache, agg);
                let expected: Vec<f32> = base.iter().zip(&aggregated).map(|(s, w)| s + w).collect();
                let mut scores = base.clone();
                GroupQueries::new(&layer, &unit).accumulate_aggregated(
                    &layer,
                    position,
                    cache,
                    agg,
                    &mut scores,
                );
                assert_eq!(scores, expected, "{agg:?}");
            }
        }
    }
}
