//! Key-channel pruning: which channels of each kept key a cache stores. One method per file, the
//! file name is the registry key. Pruning is apart from eviction: it changes what the kept keys
//! hold (the pruned channels are gone, so they add nothing to any query's logits), never which
//! entries are kept, so any allocator, head split, scorer and timing combines with it. The
//! channels are chosen once, at the prompt's cut, for the prompt entries the cache holds then;
//! entries that arrive later keep every channel (as kvpress's `ThinKPress` prunes the prefilled
//! cache only). How a cache holds its keys step by step is [`PrunedKeys`].

mod cache;

pub use cache::PrunedKeys;

use super::settings::Broken;
use ndarray::ArrayView2;

mod none;
mod think;

crate::registry! {
    KeyChannels:
    none::AllChannels,
    think::Think,
}

/// A rule for the key channels a cache stores.
pub trait KeyChannels: Send + Sync {
    /// Rules its settings must follow beyond their types.
    fn check(&self) -> Result<(), Broken> {
        Ok(())
    }
    /// How it prunes; `None` when every channel is kept (the plain cache).
    fn pruning(&self) -> Option<ChannelPruning>;
}

/// ThinK's query-driven channel pruning: per cache, the `fraction` of its key channels with the
/// lowest score `mean_q(q_c²) · mean_k(k_c²)` are pruned, the query means taken over the last
/// `window` queries before the cut of the query heads that read the cache, the key means over the
/// prompt keys the cache holds at the cut.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChannelPruning {
    /// Share of each head's key channels pruned.
    pub fraction: f64,
    /// Queries before the cut that score the channels.
    pub window: usize,
}

impl ChannelPruning {
    /// Channels pruned from a head of `d`: `int(d · fraction)`, as kvpress counts them.
    pub fn pruned(&self, d: usize) -> usize {
        (d as f64 * self.fraction) as usize
    }

    /// Chooses the channels to prune from the scoring `queries` and the `held` rows of the prompt
    /// keys `keys` (`[cut, d]`, [`lowest_channels`]) and zeroes them in every row of `keys`, in
    /// place; returns them.
    pub fn prune_prompt(
        &self,
        queries: &[ArrayView2<f32>],
        mut keys: ndarray::ArrayViewMut2<f32>,
        held: &[usize],
    ) -> Vec<usize> {
        let channels = lowest_channels(queries, keys.view(), held, self.pruned(keys.ncols()));
        for &c in &channels {
            keys.column_mut(c).fill(0.0);
        }
        channels
    }

    /// Bytes one cache holds right after the prompt's cut when it keeps `n` prompt entries of head
    /// size `d` at `width` bytes an element: values whole, keys without their pruned channels, and
    /// the mask of kept channels (one bit a channel).
    pub fn bytes_at_cut(&self, n: usize, d: usize, width: usize) -> f64 {
        (n * (2 * d - self.pruned(d)) * width) as f64 + mask_bytes(d)
    }
}

/// Bytes of a mask of `d` channels, one bit each.
pub fn mask_bytes(d: usize) -> f64 {
    d as f64 / 8.0
}

/// The `pruned` channels with the lowest ThinK score, ascending: per channel `c`,
/// `mean_q(q_c²) · mean_j(k_jc²)`, the query term averaged over `queries` (one `[window, d]` block
/// per query head reading the cache, each head's mean first, as kvpress averages a KV group), the
/// key term over the positions `held` of `keys` (`[T, d]`). Transcribes kvpress 0.5.5's
/// `ThinKPress.compress` (`kvpress/presses/think_press.py` lines 78-86) in f64; its `topk(largest
/// = False)` leaves the order of equal scores open, here the lower channel goes first.
pub fn lowest_channels(
    queries: &[ArrayView2<f32>],
    keys: ArrayView2<f32>,
    held: &[usize],
    pruned: usize,
) -> Vec<usize> {
    let d = keys.ncols();
    let mean_square = |rows: &mut dyn Iterator<Item = ndarray::ArrayView1<f32>>, c: usize| {
        let (mut sum, mut n) = (0.0f64, 0usize);
        for row in rows {
            sum += (row[c] as f64).powi(2);
            n += 1;
        }
        sum / n.max(1) as f64
    };
    let score = |c: usize| {
        let query = queries
            .iter()
            .map(|block| mean_square(&mut block.rows().into_iter(), c))
            .sum::<f64>()
            / queries.len().max(1) as f64;
        let key = mean_square(&mut held.iter().map(|&j| keys.row(j)), c);
        query * key
    };
    let scores: Vec<f64> = (0..d).map(score).collect();
    let mut order: Vec<usize> = (0..d).collect();
    order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]).then(a.cmp(&b)));
    let mut lowest = order[..pruned.min(d)].to_vec();
    lowest.sort_unstable();
    lowest
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::array;

    #[test]
    fn channel_scores_by_hand() {
        // Two query heads over a window of two, d = 3. Query means of squares: head 0: [(1+9)/2,
        // (4+0)/2, (0+1)/2] = [5, 2, 0.5]; head 1: [1, 8, 0.5]; their mean [3, 5, 0.5]. Keys held
        // {0, 2} of three: means of squares [(4+0)/2, (1+1)/2, (9+1)/2] = [2, 1, 5] (row 1 is not
        // held and would change them). Scores [6, 5, 2.5]: the lowest one is channel 2, the
        // lowest two are 1 and 2.
        let head0 = array![[1.0f32, 2.0, 0.0], [3.0, 0.0, 1.0]];
        let head1 = array![[1.0f32, 2.0, 1.0], [1.0, 2.0 * 3f32.sqrt(), 0.0]];
        let keys = array![[2.0f32, 1.0, 3.0], [100.0, 0.0, 0.0], [0.0, -1.0, 1.0]];
        let queries = [head0.view(), head1.view()];
        assert_eq!(lowest_channels(&queries, keys.view(), &[0, 2], 1), [2]);
        assert_eq!(lowest_channels(&queries, keys.view(), &[0, 2], 2), [1, 2]);
        assert_eq!(
            lowest_channels(&queries, keys.view(), &[0, 2], 0),
            [] as [usize; 0]
        );
        // Equal scores: the lower channel goes first.
        let flat = array![[1.0f32, 1.0, 1.0]];
        assert_eq!(
            lowest_channels(&[flat.view()], flat.view(), &[0], 2),
            [0, 1]
        );
    }

    #[test]
    fn pruned_channels_are_counted_as_kvpress_counts_them() {
        let pruning = |fraction| ChannelPruning {
            fraction,
            window: 32,
        };
        assert_eq!(pruning(0.5).pruned(64), 32);
        assert_eq!(pruning(0.3).pruned(64), 19);
        assert_eq!(pruning(0.0).pruned(64), 0);
        // 10 entries, d = 8 at 2 bytes: values 10 * 8 * 2, keys 10 * 4 * 2, mask 1 byte.
        assert_eq!(pruning(0.5).bytes_at_cut(10, 8, 2), 160.0 + 80.0 + 1.0);
    }
}
