//! `qfilter`: Q-Filters (Godey et al., 2025, arXiv:2503.02812): a key's score is its projection on
//! the principal direction of the queries of its heads, computed once, without attention.
//!
//! Filters, as the official `make_filters.py` computes them (github.com/NathanGodey/qfilters,
//! commit cda5c38, lines 86-94): for each query head, the first right singular vector `v` of the
//! matrix of its post-rotary queries, signed by the majority sign of the first left singular
//! vector (`+1` when more than half of `Q v` is positive, else `-1`); the filter is minus that, and
//! a KV head's filter is the mean of its query heads'. Scores, as kvpress's `QFilterPress.score`
//! (`kvpress/presses/qfilter_press.py` lines 80-87, commit 8bb29b9c): minus the key's dot product
//! with its KV head's filter, so the keys pointing along the queries' main direction are kept.
//!
//! Deviations: the official script takes 3,000 random query rows from 20 sequences of a
//! calibration corpus; here `calibration = "prompt"` uses every prompt query of the trace itself
//! (known at the end of the prompt, so not the `streaming` timing, which would read the prompt's
//! queries ahead), and `calibration = "<path>"` every query of another kvtrace/1 file of the same
//! geometry (any timing). The singular vector is the dominant eigenvector of `QᵀQ` by power
//! iteration in f64 (to 1e-12), not LAPACK's SVD. Keys only: under `gqa = "query-head"` every
//! head of a group gets its KV head's scores.

use super::Scored;
use super::{ScoreState, Scorer, Started};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::settings::Broken;
use crate::replay::MethodFailed;
use crate::replay::{LayerContext, Protection, Timing, Unit};
use crate::trace::{TraceMeta, TraceReader};
use ndarray::{Array2, ArrayView2, Axis};
use std::sync::{Arc, OnceLock};

crate::settings! {
    /// Q-Filters: keys projected on the queries' principal direction (Godey et al., 2025,
    /// arXiv:2503.02812; kvpress `QFilterPress`).
    pub struct QFilter = "qfilter" {
        /// Where the filters come from: `prompt` (this trace's prompt queries) or the path of a
        /// kvtrace/1 file of the same model (all its queries).
        calibration: String = "prompt".to_string(),
    }
    loaded {
        /// A calibration trace's geometry and filters (per layer, one per KV head), read once
        /// when the settings are checked.
        calibrated: Arc<OnceLock<Calibrated>>,
    }
}

/// What a calibration trace gives: its geometry, to check traces against, and its filters.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibrated {
    /// (layers, heads, KV heads, head_dim).
    geometry: (usize, usize, usize, usize),
    /// Per layer, per KV head, the filter.
    filters: Vec<Vec<Arc<Vec<f32>>>>,
}

/// The calibration spelling that means "this trace's prompt queries".
const PROMPT: &str = "prompt";

/// One KV head's filter.
#[derive(Clone)]
struct State {
    kv_head: usize,
    filter: Arc<Vec<f32>>,
}

impl Scorer for QFilter {
    /// Reads the calibration trace, if one is named, and computes its filters: a file that
    /// cannot be read is an error of the setting, before anything runs.
    fn check(&self) -> Result<(), Broken> {
        if self.calibration.trim().is_empty() {
            return Err(Broken {
                key: "calibration",
                rule: "must be `prompt` or the path of a kvtrace/1 file".into(),
            });
        }
        if self.calibration == PROMPT || self.calibrated.get().is_some() {
            return Ok(());
        }
        let calibrated = calibrate(&self.calibration).map_err(|err| Broken {
            key: "calibration",
            rule: format!("the calibration trace cannot be read: {err}").into(),
        })?;
        let _ = self.calibrated.set(calibrated);
        Ok(())
    }

    fn supports(&self, timing: Timing) -> bool {
        self.calibration != PROMPT || timing != Timing::Streaming
    }

    fn check_trace(&self, meta: &TraceMeta) -> Result<(), String> {
        let Some(calibrated) = self.calibrated.get() else {
            return Ok(());
        };
        let geometry = (meta.n_layers, meta.n_heads, meta.n_kv_heads, meta.head_dim);
        if calibrated.geometry != geometry {
            return Err(format!(
                "scorer `qfilter`: calibration trace {} has (layers, heads, KV heads, head_dim) = {:?}, this trace {:?}: it must come from the same model",
                self.calibration, calibrated.geometry, geometry
            ));
        }
        Ok(())
    }

    fn start(
        &self,
        layer: &LayerContext<'_>,
        unit: &Unit,
        _: Protection,
    ) -> Result<Started, MethodFailed> {
        let filters = match self.calibrated.get() {
            Some(calibrated) => calibrated.filters[layer.layer][unit.kv_head].clone(),
            None => {
                let prompt = layer.q.slice(ndarray::s![.., ..layer.prompt_len, ..]);
                Arc::new(kv_head_filter(prompt, unit.kv_head, layer.group_size()))
            }
        };
        Ok(Box::new(State {
            kv_head: unit.kv_head,
            filter: filters,
        }))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        (self.calibration == PROMPT).then(|| Box::new(self.clone()) as Box<dyn ScorerRule>)
    }
}

/// KV head `kv_head`'s filter from queries `[n_heads, N, d]` (`group` query heads per KV head):
/// the mean over its query heads of minus their signed principal direction.
fn kv_head_filter(queries: ndarray::ArrayView3<'_, f32>, kv_head: usize, group: usize) -> Vec<f32> {
    let d = queries.shape()[2];
    let mut filter = vec![0.0f64; d];
    for head in kv_head * group..(kv_head + 1) * group {
        let direction = signed_direction(queries.index_axis(Axis(0), head));
        for (total, x) in filter.iter_mut().zip(direction) {
            *total -= x / group as f64;
        }
    }
    filter.into_iter().map(|x| x as f32).collect()
}

/// The first right singular vector `v` of `q` `[N, d]`, times `+1` when more than half of `q v`
/// is positive and `-1` otherwise (the official rule, applied to LAPACK's `u[:, 0]`, whose
/// entries have the signs of `q v`). On an exact tie (half positive) the official filter takes
/// the sign LAPACK happened to give `v`; here `v`'s largest entry is positive.
fn signed_direction(q: ArrayView2<'_, f32>) -> Vec<f64> {
    let q = q.mapv(f64::from);
    let gram: Array2<f64> = q.t().dot(&q);
    let v = dominant_eigenvector(&gram);
    let projections = q.dot(&ndarray::Array1::from(v.clone()));
    let positive = projections.iter().filter(|&&p| p > 0.0).count();
    let sign = if 2 * positive > q.nrows() { 1.0 } else { -1.0 };
    v.into_iter().map(|x| sign * x).collect()
}

/// The unit eigenvector of the largest eigenvalue of a symmetric positive semi-definite matrix,
/// by power iteration from the all-ones vector (deterministic), until it moves by less than
/// 1e-12, signed so that its entry of largest magnitude (the first of equals) is positive.
fn dominant_eigenvector(matrix: &Array2<f64>) -> Vec<f64> {
    let d = matrix.nrows();
    let mut v = ndarray::Array1::from_elem(d, 1.0 / (d as f64).sqrt());
    for _ in 0..100_000 {
        let mut next = matrix.dot(&v);
        let norm = next.dot(&next).sqrt();
        if norm == 0.0 {
            break;
        }
        next /= norm;
        let moved = (&next - &v).mapv(f64::abs).sum();
        v = next;
        if moved < 1e-12 {
            break;
        }
    }
    let largest = v
        .iter()
        .fold(0.0f64, |m, x| if x.abs() > m.abs() { *x } else { m });
    if largest < 0.0 {
        v = -v;
    }
    v.to_vec()
}

/// The filters of every layer and KV head from every query of the calibration trace at `path`.
fn calibrate(path: &str) -> Result<Calibrated, crate::trace::TraceError> {
    let trace = TraceReader::open(std::path::Path::new(path))?;
    let meta = trace.meta();
    let filters = (0..meta.n_layers)
        .map(|layer| {
            let tensors = trace.layer(layer)?;
            Ok((0..meta.n_kv_heads)
                .map(|head| Arc::new(kv_head_filter(tensors.q.view(), head, meta.group_size())))
                .collect())
        })
        .collect::<Result<_, crate::trace::TraceError>>()?;
    Ok(Calibrated {
        geometry: (meta.n_layers, meta.n_heads, meta.n_kv_heads, meta.head_dim),
        filters,
    })
}

impl ScoreState for State {
    fn scores(&mut self, layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        let keys = layer.keys(self.kv_head);
        out.clear();
        out.extend(cache.iter().map(|&position| {
            -keys
                .row(position)
                .iter()
                .zip(self.filter.iter())
                .map(|(k, f)| k * f)
                .sum::<f32>()
        }));
        Ok(())
    }
}

/// The brute-force rule, calibrated on the prompt (`calibration = "prompt"`): per query head the
/// dominant eigenvector of QᵀQ over its prompt queries, by repeated squaring of the matrix (G, G²,
/// G⁴, … normalised; the column of largest norm of G^(2^40) spans the dominant eigenspace), its
/// largest entry made positive, then signed by the majority sign of the projections; the KV
/// head's filter is minus their mean, and a key scores minus its dot product with it.
#[cfg(any(test, feature = "reference"))]
impl ScorerRule for QFilter {
    fn scores(
        &self,
        layer: &reference::Layer,
        _: &reference::Policy,
        cache: &Member,
        positions: &[usize],
        _: &[f64],
    ) -> Vec<f64> {
        let filter = prompt_filter(layer, cache.kv);
        positions
            .iter()
            .map(|&j| -reference::dot(&layer.key(cache.kv, j), &filter))
            .collect()
    }
}

/// The reference's filter of KV head `kv` from its heads' prompt queries.
#[cfg(any(test, feature = "reference"))]
fn prompt_filter(layer: &reference::Layer, kv: usize) -> Vec<f64> {
    let n = layer.prompt_len;
    let d = layer.head_dim();
    let group = layer.group();
    let mut filter = vec![0.0; d];
    for head in kv * group..(kv + 1) * group {
        let rows: Vec<Vec<f64>> = (0..n).map(|at| layer.query(head, at)).collect();
        let mut g: Vec<Vec<f64>> = (0..d)
            .map(|a| {
                (0..d)
                    .map(|b| rows.iter().map(|r| r[a] * r[b]).sum())
                    .collect()
            })
            .collect();
        for _ in 0..40 {
            let squared: Vec<Vec<f64>> = (0..d)
                .map(|a| {
                    (0..d)
                        .map(|b| (0..d).map(|c| g[a][c] * g[c][b]).sum())
                        .collect()
                })
                .collect();
            let scale = squared.iter().flatten().fold(0.0f64, |m, x| m.max(x.abs()));
            g = squared
                .into_iter()
                .map(|row| row.into_iter().map(|x| x / scale).collect())
                .collect();
        }
        let column_norm = |c: usize| g.iter().map(|row| row[c] * row[c]).sum::<f64>();
        let column = (0..d)
            .max_by(|&a, &b| column_norm(a).total_cmp(&column_norm(b)))
            .expect("d > 0");
        let norm = column_norm(column).sqrt();
        let mut v: Vec<f64> = g.iter().map(|row| row[column] / norm).collect();
        let largest = v
            .iter()
            .fold(0.0f64, |m, x| if x.abs() > m.abs() { *x } else { m });
        if largest < 0.0 {
            v.iter_mut().for_each(|x| *x = -*x);
        }
        let positive = rows.iter().filter(|r| reference::dot(r, &v) > 0.0).count();
        let sign = if 2 * positive > n { 1.0 } else { -1.0 };
        for (total, x) in filter.iter_mut().zip(&v) {
            *total -= sign * x / group as f64;
        }
    }
    filter
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use approx::assert_abs_diff_eq;

    #[test]
    fn the_filter_is_minus_the_signed_principal_direction_of_the_queries() {
        // Queries (2, 0.1), (3, -0.1), (-1, 0), (4, 0.2): QᵀQ = [[30, 0.7], [0.7, 0.06]], its top
        // eigenvector (0.7, λ - 30) normalised ≈ (0.99973, 0.02336) (λ ≈ 30.0164). Projections
        // 2.002, 2.997, -1.000, 4.004: three of four positive, so the sign is +1 and the filter is
        // minus the eigenvector.
        let (q, k, n) = layer_with(
            &[[2.0, 0.1], [3.0, -0.1], [-1.0, 0.0], [4.0, 0.2]],
            &[[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.5, 0.5]],
            4,
        );
        let layer = context(&q, &k, n);
        let filter = kv_head_filter(layer.q.view(), 0, 1);
        let lambda = (30.06 + ((30.0f64 - 0.06).powi(2) + 4.0 * 0.49).sqrt()) / 2.0;
        let (x, y) = (0.7, lambda - 30.0);
        let norm = (x * x + y * y).sqrt();
        assert_abs_diff_eq!(filter[0] as f64, -x / norm, epsilon = 1e-7);
        assert_abs_diff_eq!(filter[1] as f64, -y / norm, epsilon = 1e-7);
        // Scores: minus key · filter, so keys along the queries' direction score highest.
        let mut state = QFilter::default()
            .start(&layer, &unit(), Protection::default())
            .unwrap();
        let scores = scores_after(state.as_mut(), &layer, 4);
        assert_abs_diff_eq!(scores[0] as f64, x / norm, epsilon = 1e-6);
        assert_abs_diff_eq!(scores[1] as f64, -x / norm, epsilon = 1e-6);
        assert_abs_diff_eq!(scores[2] as f64, y / norm, epsilon = 1e-6);
    }

    #[test]
    fn a_minority_of_positive_projections_flips_the_direction() {
        let (q, k, n) = layer_with(&[[-2.0, 0.0], [-3.0, 0.0], [1.0, 0.0]], &[[1.0, 0.0]; 3], 3);
        let layer = context(&q, &k, n);
        let filter = kv_head_filter(layer.q.view(), 0, 1);
        // Power iteration gives (1, 0); one of three projections is positive: sign -1, and the
        // filter is -(-1) * (1, 0) = (1, 0).
        assert_abs_diff_eq!(filter[0], 1.0, epsilon = 1e-7);
        assert_abs_diff_eq!(filter[1], 0.0, epsilon = 1e-7);
    }
}
