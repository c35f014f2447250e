//! `pyramid`: PyramidKV's linear per-layer schedule (Cai et al., 2024, arXiv:2406.02069), as the
//! official code computes it (KVCache-Factory `pyramidkv/pyramidkv_utils.py`, `PyramidKVCluster`;
//! docs/policies.md):
//!
//! ```text
//! B = cap - W;  min = B // beta;  max = 2B - min;  if max >= n - W: max = n - W; min = 2B - max
//! steps = (max - min) // (L - 1);   layer l keeps max - l*steps selected tokens, plus W
//! n < cap: keep everything;   n < 2B: every layer B (plain SnapKV)
//! ```
//! `rounding = official` keeps the floor divisions, so the mean overshoots B (L = 30, cap = 64,
//! W = 8: mean 74.5); `exact-mean` rounds the same line by largest remainder so the mean is B.
//! The paper's text uses m where the code uses L - 1 (reported on KVCache-Factory's tracker as #36); we follow the code.

use super::{positive_finite, AllocationInput, Allocator};
use crate::replay::settings::Broken;
use crate::replay::MethodFailed;

crate::settings! {
    /// PyramidKV's linear per-layer schedule, as the official code computes it (Cai et al., 2024,
    /// arXiv:2406.02069; KVCache-Factory `pyramidkv/pyramidkv_utils.py` lines 360-370).
    pub struct Pyramid = "pyramid" {
        /// The divisor beta of the official code: the last layer keeps `(cap - W) // beta`
        /// selected tokens (`pyramidkv_utils.py` line 360; 20 in the paper's runs).
        beta: f64 = 20.0,
        /// `official` keeps the code's floor divisions (its mean overshoots the budget);
        /// `exact-mean` rounds the same line by largest remainder so the mean is the budget.
        rounding: Rounding = Rounding::Official,
    }
}

/// PyramidKV's rounding of its linear schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Rounding {
    /// The official code's floor division (its mean overshoots the nominal budget).
    Official,
    /// The same line, rounded by largest remainder so the mean is exactly the budget.
    ExactMean,
}

impl Allocator for Pyramid {
    fn check(&self) -> Result<(), Broken> {
        positive_finite("beta", self.beta)
    }

    fn allocate(&self, input: &AllocationInput<'_>) -> Result<Vec<usize>, MethodFailed> {
        let (cap, window, n, layers) = (
            input.budget,
            input.protect.window,
            input.prompt_len,
            input.n_layers,
        );
        let selected = cap.saturating_sub(window);
        if n < cap || n < 2 * selected || layers < 2 {
            return Ok(vec![cap; layers]);
        }
        let mut min = (selected as f64 / self.beta).floor() as usize;
        let mut max = 2 * selected - min;
        if max >= n - window {
            max = n - window;
            min = 2 * selected - max;
        }
        if self.rounding == Rounding::Official {
            let steps = (max - min) / (layers - 1);
            return Ok((0..layers).map(|l| max - l * steps + window).collect());
        }
        let line: Vec<f64> = (0..layers)
            .map(|l| max as f64 - l as f64 * (max - min) as f64 / (layers - 1) as f64)
            .collect();
        let mut kept: Vec<usize> = line.iter().map(|x| x.floor() as usize).collect();
        let mut order: Vec<usize> = (0..layers).collect();
        order.sort_by(|&a, &b| {
            (line[b] - line[b].floor())
                .total_cmp(&(line[a] - line[a].floor()))
                .then(a.cmp(&b))
        });
        let missing = (selected * layers).saturating_sub(kept.iter().sum());
        for &l in order.iter().take(missing) {
            kept[l] += 1;
        }
        Ok(kept.into_iter().map(|k| k + window).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(cap: usize, n: usize, layers: usize, exact_mean: bool) -> Vec<usize> {
        let input = AllocationInput {
            n_layers: layers,
            budget: cap,
            prompt_len: n,
            protect: crate::replay::Protection {
                sinks: 0,
                window: 8,
            },
            profiles: &[],
            mass_curves: &[],
            n_caches: 1,
            candidates: &[],
            prompt_scores: &[],
        };
        Pyramid {
            beta: 20.0,
            rounding: if exact_mean {
                Rounding::ExactMean
            } else {
                Rounding::Official
            },
        }
        .allocate(&input)
        .expect("the library's allocators do not fail")
    }

    #[test]
    fn official_test_vectors() {
        // The official formula (docs/policies.md) by hand, L = 32, W = 8, n = 8000, beta 20: at
        // cap 128, B = 120, min = 6, max = 234, steps = 7: 242 ... 25, sum 32 * 242 - 7 * 496.
        for (cap, first, last, total) in [
            (128, 242, 25, 4272),
            (512, 991, 61, 16832),
            (2048, 3986, 111, 65552),
        ] {
            let budgets = schedule(cap, 8000, 32, false);
            assert_eq!(budgets[0], first, "cap {cap}");
            assert_eq!(budgets[31], last, "cap {cap}");
            assert_eq!(budgets.iter().sum::<usize>(), total, "cap {cap}");
        }
    }

    #[test]
    fn official_rounding_overshoots_and_exact_mean_does_not() {
        // policies.md: L = 30, cap = 64, W = 8 keeps 118 ... 31, mean 74.5.
        let official = schedule(64, 8000, 30, false);
        assert_eq!((official[0], official[29]), (118, 31));
        assert_eq!(official.iter().sum::<usize>() as f64 / 30.0, 74.5);
        let exact = schedule(64, 8000, 30, true);
        assert_eq!(exact.iter().sum::<usize>(), 64 * 30);
        assert!(exact.windows(2).all(|w| w[0] >= w[1]));
    }

    #[test]
    fn short_prompts_fall_back_to_flat() {
        assert_eq!(schedule(128, 100, 4, false), vec![128; 4]);
        assert_eq!(schedule(128, 200, 4, false), vec![128; 4]);
    }
}
