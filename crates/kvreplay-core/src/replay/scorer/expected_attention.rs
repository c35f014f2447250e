//! `expected-attention`: the attention future queries are expected to pay each key (Devoto et
//! al., 2025, arXiv:2510.00636; kvpress `ExpectedAttentionPress`,
//! `kvpress/presses/expected_attention_press.py` lines 62-165, commit 8bb29b9c). Per query head,
//! the mean μ and covariance Σ (divided by N) of the pre-rotary queries of the prompt after its
//! first `n_sink` tokens (lines 62-86); both are carried to the future by the rotary matrix
//! averaged over the next `n_future_positions` positions, R̄ = mean_t R(t): μ' = R̄ μ,
//! Σ' = R̄ Σ R̄ᵀ (lines 88-124). A key k after the sinks (after rotary, as cached) then scores the
//! softmax over those keys of μ'·k / √d + kᵀ Σ' k / (2d), the group's query heads averaged, times
//! ‖v‖ (`use_vnorm`, after adding `epsilon`); the sinks score the maximum + 1 (lines 126-165).
//! One-shot, as kvpress presses are.
//!
//! Deviations: kvpress takes the pre-rotary queries from the hidden states (`q_proj`, then any
//! q-norm, `kvpress/utils.py` lines 12-52); a trace stores the queries after rotary, so they are
//! turned back by the trace's `rope_theta` — the same vectors, for any model whose queries go
//! through the plain half-split rotary last (traces without `rope_theta` are refused for this
//! scorer). The sinks' maximum is taken per cache, not over the whole layer: the same kept sets
//! under the `uniform` head split; one that compares scores across caches (`adakv`) can rank
//! another cache's best token above a sink. Statistics are accumulated in f64. A prompt of at
//! most `n_sink` tokens, which kvpress refuses, scores all tokens alike.

use super::Scored;
use super::{ScoreState, Scorer, Started};
#[cfg(any(test, feature = "reference"))]
use crate::replay::reference::{self, Member, ScorerRule};
use crate::replay::rotary::{rotate, Rotary};
use crate::replay::settings::Broken;
use crate::replay::MethodFailed;
use crate::replay::{LayerContext, Protection, Timing, Unit};
use ndarray::{Array1, Array2, ArrayView1};
use std::ops::Range;

crate::settings! {
    /// Expected Attention: keys scored by the attention the statistics of the prompt's queries,
    /// rotated to future positions, are expected to pay them (arXiv:2510.00636; kvpress
    /// `ExpectedAttentionPress`).
    pub struct ExpectedAttention = "expected-attention" {
        /// Future positions the rotary matrix is averaged over (`n_future_positions`, 512).
        n_future_positions: usize = 512,
        /// Initial tokens left out of the statistics and always kept (`n_sink`, 4).
        n_sink: usize = 4,
        /// Add the queries' covariance term (`use_covariance`).
        use_covariance: bool = true,
        /// Multiply the scores by the value norms (`use_vnorm`).
        use_vnorm: bool = true,
        /// Added to the scores before the value norms multiply them (`epsilon`).
        epsilon: f64 = 0.0,
    }
}

#[derive(Clone)]
struct State {
    kv_head: usize,
    query_heads: Range<usize>,
    settings: ExpectedAttention,
}

impl Scorer for ExpectedAttention {
    fn check(&self) -> Result<(), Broken> {
        if self.n_future_positions == 0 {
            return Err(Broken {
                key: "n_future_positions",
                rule: "must be at least 1".into(),
            });
        }
        Ok(())
    }

    fn needs_values(&self) -> bool {
        self.use_vnorm
    }

    fn needs_rope(&self) -> bool {
        true
    }

    fn supports(&self, timing: Timing) -> bool {
        timing == Timing::Prefill
    }

    fn start(
        &self,
        _layer: &LayerContext<'_>,
        unit: &Unit,
        _: Protection,
    ) -> Result<Started, MethodFailed> {
        Ok(Box::new(State {
            kv_head: unit.kv_head,
            query_heads: unit.query_heads.clone(),
            settings: self.clone(),
        }))
    }

    #[cfg(any(test, feature = "reference"))]
    fn reference(&self) -> Option<Box<dyn ScorerRule>> {
        Some(Box::new(self.clone()))
    }
}

impl ScoreState for State {
    fn scores(&mut self, layer: &LayerContext<'_>, cache: &[usize], out: &mut Vec<f32>) -> Scored {
        let settings = &self.settings;
        let sinks = settings.n_sink.min(cache.len());
        out.clear();
        if cache.len() <= settings.n_sink {
            out.resize(cache.len(), 1.0);
            return Ok(());
        }
        let rotary = Rotary::new(
            layer
                .rope_theta
                .expect("the engine checks the trace's rope_theta"),
            layer.q.shape()[2],
        );
        // kvpress's `q_len`: the position after the newest (the cache's length on a global layer).
        let next = cache.last().map_or(0, |&newest| newest + 1);
        let future = next..next + settings.n_future_positions;
        let (cos, sin) = rotary.mean_over(future);
        let keys = layer.keys(self.kv_head);
        let scored = &cache[sinks..];
        let mut total = vec![0.0f64; scored.len()];
        for head in self.query_heads.clone() {
            let (mean, covariance) = query_statistics(layer, head, scored, &rotary);
            let mean = rotate(mean.view(), &cos, &sin);
            let covariance = settings.use_covariance.then(|| {
                let rotated_columns = map_columns(&covariance, |c| rotate(c, &cos, &sin));
                map_columns(&rotated_columns.t().to_owned(), |c| rotate(c, &cos, &sin))
            });
            let d = mean.len() as f64;
            let logits: Vec<f32> = scored
                .iter()
                .map(|&position| {
                    let key = keys.row(position).mapv(f64::from);
                    let mut logit = mean.dot(&key) / d.sqrt();
                    if let Some(covariance) = &covariance {
                        logit += key.dot(&covariance.dot(&key)) / d / 2.0;
                    }
                    logit as f32
                })
                .collect();
            for (sum, p) in total.iter_mut().zip(crate::attention::softmax(&logits)) {
                *sum += f64::from(p);
            }
        }
        let heads = self.query_heads.len() as f64;
        let values = layer.values(self.kv_head);
        let scores: Vec<f32> = scored
            .iter()
            .zip(&total)
            .map(|(&position, &sum)| {
                let score = sum / heads;
                match (&values, settings.use_vnorm) {
                    (Some(values), true) => {
                        let value = values.row(position);
                        ((score + settings.epsilon) * f64::from(value.dot(&value).sqrt())) as f32
                    }
                    _ => score as f32,
                }
            })
            .collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        out.extend(std::iter::repeat_n(max + 1.0, sinks));
        out.extend(scores);
        Ok(())
    }
}

/// `f` applied to every column of `matrix`.
fn map_columns(matrix: &Array2<f64>, f: impl Fn(ArrayView1<f64>) -> Array1<f64>) -> Array2<f64> {
    let mut out = Array2::zeros(matrix.raw_dim());
    for (column, mut target) in matrix.columns().into_iter().zip(out.columns_mut()) {
        target.assign(&f(column));
    }
    out
}

/// The mean and covariance (divided by N) of query head `head`'s pre-rotary queries at
/// `positions`.
fn query_statistics(
    layer: &LayerContext<'_>,
    head: usize,
    positions: &[usize],
    rotary: &Rotary,
) -> (Array1<f64>, Array2<f64>) {
    let d = layer.q.shape()[2];
    let queries: Vec<Array1<f64>> = positions
        .iter()
        .map(|&position| {
            let (cos, sin) = rotary.at(position);
            let minus_sin: Vec<f64> = sin.iter().map(|s| -s).collect();
            rotate(
                layer.query(head, position).mapv(f64::from).view(),
                &cos,
                &minus_sin,
            )
        })
        .collect();
    let n = queries.len() as f64;
    let mean = queries.iter().fold(Array1::zeros(d), |sum, q| sum + q) / n;
    let mut covariance = Array2::<f64>::zeros((d, d));
    for query in &queries {
        let centred = query - &mean;
        for i in 0..d {
            for j in 0..d {
                covariance[[i, j]] += centred[i] * centred[j] / n;
            }
        }
    }
    (mean, covariance)
}

/// The brute-force rule, with covariance and value norms (the defaults): each head's pre-rotary
/// queries after the `n_sink` sinks (the stored ones turned back by −position × θ^(−2i/d) on pairs
/// (i, i + d/2), θ the layer's rotary base), their mean and covariance (/N) carried by the mean of
/// the rotary matrices of the next `n_future_positions` positions, built as full d × d matrices;
/// logits μ·k / √d + kᵀ S k / (2d) over the keys after the sinks, softmaxed per head, averaged
/// over heads, times ‖v‖; the sinks score the maximum + 1.
#[cfg(any(test, feature = "reference"))]
impl ScorerRule for ExpectedAttention {
    fn scores(
        &self,
        layer: &reference::Layer,
        _: &reference::Policy,
        cache: &Member,
        positions: &[usize],
        _: &[f64],
    ) -> Vec<f64> {
        let (sinks, future) = (self.n_sink, self.n_future_positions);
        let n = positions.len();
        let d = layer.head_dim();
        let half = d / 2;
        let angle = |position: usize, i: usize| {
            position as f64 / layer.rope_theta.powf(2.0 * (i % half) as f64 / d as f64)
        };
        // R(t)[i][j]: cos on the diagonal, −sin at (i, i + d/2), +sin at (i + d/2, i).
        let rotation = |t: usize| -> Vec<Vec<f64>> {
            let mut r = vec![vec![0.0; d]; d];
            for (i, row) in r.iter_mut().enumerate() {
                row[i] = angle(t, i).cos();
            }
            for i in 0..half {
                r[i][i + half] = -angle(t, i).sin();
                r[i + half][i] = angle(t, i).sin();
            }
            r
        };
        let mut mean_rotation = vec![vec![0.0; d]; d];
        for t in n..n + future {
            let r = rotation(t);
            for i in 0..d {
                for j in 0..d {
                    mean_rotation[i][j] += r[i][j] / future as f64;
                }
            }
        }
        let apply = |m: &Vec<Vec<f64>>, x: &[f64]| -> Vec<f64> {
            (0..d).map(|i| reference::dot(&m[i], x)).collect()
        };
        let product = |a: &Vec<Vec<f64>>, b: &dyn Fn(usize, usize) -> f64| -> Vec<Vec<f64>> {
            (0..d)
                .map(|i| {
                    (0..d)
                        .map(|j| (0..d).map(|k| a[i][k] * b(k, j)).sum())
                        .collect()
                })
                .collect()
        };
        let mut total = vec![0.0; n - sinks];
        for &h in &cache.heads {
            let queries: Vec<Vec<f64>> = positions[sinks..]
                .iter()
                .map(|&p| {
                    let r = rotation(p);
                    // R(p) is orthogonal: its transpose turns the stored query back.
                    let rt: Vec<Vec<f64>> =
                        (0..d).map(|i| (0..d).map(|j| r[j][i]).collect()).collect();
                    apply(&rt, &layer.query(h, p))
                })
                .collect();
            let m = queries.len() as f64;
            let mu: Vec<f64> = (0..d)
                .map(|i| queries.iter().map(|q| q[i]).sum::<f64>() / m)
                .collect();
            let cov: Vec<Vec<f64>> = (0..d)
                .map(|i| {
                    (0..d)
                        .map(|j| {
                            queries
                                .iter()
                                .map(|q| (q[i] - mu[i]) * (q[j] - mu[j]))
                                .sum::<f64>()
                                / m
                        })
                        .collect()
                })
                .collect();
            let mu = apply(&mean_rotation, &mu);
            // S = R cov Rᵀ.
            let rc = product(&mean_rotation, &|k, j| cov[k][j]);
            let s = product(&rc, &|k, j| mean_rotation[j][k]);
            let logits: Vec<f64> = positions[sinks..]
                .iter()
                .map(|&j| {
                    let k = layer.key(cache.kv, j);
                    let quadratic = reference::dot(&k, &apply(&s, &k)) / d as f64 / 2.0;
                    reference::dot(&mu, &k) / (d as f64).sqrt() + quadratic
                })
                .collect();
            for (t, p) in total.iter_mut().zip(reference::softmax(&logits)) {
                *t += p / cache.heads.len() as f64;
            }
        }
        let scores: Vec<f64> = positions[sinks..]
            .iter()
            .zip(&total)
            .map(|(&j, t)| {
                let v = layer.value(cache.kv, j);
                t * reference::dot(&v, &v).sqrt()
            })
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        std::iter::repeat_n(max + 1.0, sinks)
            .chain(scores)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use approx::assert_abs_diff_eq;

    #[test]
    fn rotating_back_undoes_the_rotary() {
        let rotary = Rotary::new(10_000.0, 4);
        let x = Array1::from(vec![0.3, -1.2, 0.7, 2.0]);
        let (cos, sin) = rotary.at(37);
        let turned = rotate(x.view(), &cos, &sin);
        let minus: Vec<f64> = sin.iter().map(|s| -s).collect();
        let back = rotate(turned.view(), &cos, &minus);
        for (a, b) in back.iter().zip(&x) {
            assert_abs_diff_eq!(a, b, epsilon = 1e-12);
        }
        // Pair 0 turns by 37 rad: (0.3, 0.7) -> (0.3 cos 37 - 0.7 sin 37, 0.7 cos 37 + 0.3 sin 37).
        let (c, s) = (37f64.cos(), 37f64.sin());
        assert_abs_diff_eq!(turned[0], 0.3 * c - 0.7 * s, epsilon = 1e-12);
        assert_abs_diff_eq!(turned[2], 0.7 * c + 0.3 * s, epsilon = 1e-12);
    }
}
