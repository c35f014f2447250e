//! `pyramid`: PyramidKV's linear per-layer schedule (Cai et al., 2024, arXiv:2406.02069), as the
//! official code computes it (KVCache-Factory `pyramidkv_utils.py`; shared/reference/policies.md):
//!
//! ```text
//! B = cap - W;  min = B // beta;  max = 2B - min;  if max >= n - W: max = n - W; min = 2B - max
//! steps = (max - min) // (L - 1);   layer l keeps max - l*steps selected tokens, plus W
//! n < cap: keep everything;   n < 2B: every layer B (plain SnapKV)
//! ```
//! `rounding = official` keeps the floor divisions, so the mean overshoots B (L = 30, cap = 64,
//! W = 8: mean 74.5); `exact-mean` rounds the same line by largest remainder so the mean is B.
//! The paper's text uses m where the code uses L - 1 (KVCache-Factory issue #36); we follow the code.

use super::{AllocationInput, Allocator};

/// PyramidKV's linear schedule.
pub struct Pyramid {
    pub(super) beta: f64,
    pub(super) exact_mean: bool,
}

impl Allocator for Pyramid {
    fn name(&self) -> &'static str {
        "pyramid"
    }

    fn allocate(&self, input: &AllocationInput<'_>) -> Vec<usize> {
        let (cap, window, n, layers) =
            (input.budget, input.window, input.prompt_len, input.n_layers);
        let selected = cap.saturating_sub(window);
        if n < cap || n < 2 * selected || layers < 2 {
            return vec![cap; layers];
        }
        let mut min = (selected as f64 / self.beta).floor() as usize;
        let mut max = 2 * selected - min;
        if max >= n - window {
            max = n - window;
            min = 2 * selected - max;
        }
        if !self.exact_mean {
            let steps = (max - min) / (layers - 1);
            return (0..layers).map(|l| max - l * steps + window).collect();
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
        kept.into_iter().map(|k| k + window).collect()
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
            window: 8,
            sinks: 0,
            profiles: &[],
            mass_curves: &[],
        };
        Pyramid {
            beta: 20.0,
            exact_mean,
        }
        .allocate(&input)
    }

    #[test]
    fn official_test_vectors() {
        // shared/reference/policies.md / issue 3: L = 32, W = 8, n = 8000, beta 20.
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
