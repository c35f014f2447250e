//! How far a policy's next-token distribution is from the full run's at a step: the KL
//! divergence, whether the top token is the same, and the log-probability of the full run's
//! token lost. The full run's side of a step is computed once ([`FullStep`]) and compared with
//! every policy's.

use super::LiveStep;
use crate::model::argmax;

/// The full run's next-token distribution at one step, in f64.
pub(crate) struct FullStep {
    log_p: Vec<f64>,
    /// Each log-probability's exponential.
    p: Vec<f64>,
    top1: u32,
}

impl FullStep {
    /// The distribution of the full run's `full` logits.
    pub fn new(full: &[f32]) -> Self {
        let log_p = log_softmax(full);
        let p = log_p.iter().map(|lp| lp.exp()).collect();
        Self {
            log_p,
            p,
            top1: argmax(full),
        }
    }

    /// Compares the policy's next-token logits with these, for the full run's `token`.
    pub fn compare(&self, policy: &[f32], token: u32) -> LiveStep {
        // The policy's log-probabilities as `log_softmax` gives them, each read where it is
        // summed rather than kept (a vocabulary of 262K is 2 MB a row and step).
        let log_total = log_total(policy);
        let log_q = |logit: f32| logit as f64 - log_total;
        let kl = self
            .p
            .iter()
            .zip(&self.log_p)
            .zip(policy)
            .map(|((p, lp), &logit)| p * (lp - log_q(logit)))
            .sum::<f64>()
            .max(0.0);
        LiveStep {
            kl,
            top1: argmax(policy) == self.top1,
            logprob_lost: self.log_p[token as usize] - log_q(policy[token as usize]),
        }
    }
}

/// Compares the policy's next-token logits with the full run's, for the full run's `token`.
pub fn compare_step(full: &[f32], policy: &[f32], token: u32) -> LiveStep {
    FullStep::new(full).compare(policy, token)
}

/// Natural log-softmax in f64.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let log_total = log_total(logits);
    logits.iter().map(|&x| x as f64 - log_total).collect()
}

/// The log of the logits' exponentials' sum, in f64, from their largest.
fn log_total(logits: &[f32]) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let total: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    total.ln() + max
}

#[cfg(test)]
mod tests {
    use super::*;
    use approx::assert_abs_diff_eq;

    #[test]
    fn kl_and_lost_logprob_by_hand() {
        // p = softmax([0, ln 3]) = [0.25, 0.75]; q = softmax([0, 0]) = [0.5, 0.5].
        // KL(p || q) = 0.25 ln(0.5) + 0.75 ln(1.5) = 0.130812; token 1: ln 0.75 - ln 0.5 = 0.405465.
        let step = compare_step(&[0.0, 3f32.ln()], &[0.0, 0.0], 1);
        assert_abs_diff_eq!(step.kl, 0.130_812, epsilon = 1e-6);
        assert_abs_diff_eq!(step.logprob_lost, 0.405_465, epsilon = 1e-6);
        // Equal tops: argmax of [0, 0] is index 0, of p index 1.
        assert!(!step.top1);
        let same = compare_step(&[1.0, 2.0, 0.5], &[1.0, 2.0, 0.5], 2);
        assert_eq!((same.kl, same.top1, same.logprob_lost), (0.0, true, 0.0));
    }
}
