//! One cache's entries as a quantizing cache stores them, step by step: entries arrive at full
//! precision, become integers as their scheme says (a token once older than the full-precision
//! window; KIVI's keys `residual` at a time, per channel), and leave when the policy evicts them.
//! An entry is quantized once, with the group it was quantized in; evicting its group's other
//! members later changes neither its value nor its group's scale. The vectors are held
//! dequantized, so attention reads them as it reads captured ones.

use super::{quantize_group, Grouping, Scheme};
use ndarray::{Array2, ArrayView1, ArrayView2};
use std::collections::VecDeque;

/// The entries of one stream (the keys, or the values) and where each one stands.
#[derive(Debug, Clone)]
struct Stream {
    grouping: Grouping,
    /// Per position: its vector, dequantized once it is quantized (`None`: not read, the trace
    /// has no values; the stream is then only counted).
    vectors: Option<Array2<f32>>,
    /// Full-precision held entries, oldest first.
    full: VecDeque<usize>,
    /// Per position: its quantization group, once quantized.
    group_of: Vec<Option<usize>>,
    /// Per group: its held members.
    members: Vec<usize>,
    /// Quantized entries held.
    quantized: usize,
}

impl Stream {
    fn new(grouping: Grouping, n_positions: usize, vectors: Option<Array2<f32>>) -> Self {
        Self {
            grouping,
            vectors,
            full: VecDeque::new(),
            group_of: vec![None; n_positions],
            members: Vec::new(),
            quantized: 0,
        }
    }

    fn evict(&mut self, position: usize) {
        match self.group_of[position] {
            Some(group) => {
                self.members[group] -= 1;
                self.quantized -= 1;
            }
            None => self.full.retain(|&j| j != position),
        }
    }

    /// Quantizes what the scheme says is due: per token, every full-precision entry beyond the
    /// newest `residual`; per channel, the oldest `residual` entries whenever that many are full
    /// precision, in groups of `group_size` consecutive entries. Adds the positions quantized to
    /// `quantized`.
    fn settle(&mut self, scheme: &Scheme, quantized: &mut Vec<usize>) {
        match self.grouping {
            Grouping::PerToken => {
                while self.full.len() > scheme.residual {
                    let position = self.full.pop_front().expect("more than residual");
                    self.quantize_token(position, scheme);
                    quantized.push(position);
                }
            }
            Grouping::PerChannel => {
                while self.full.len() >= scheme.residual {
                    let block: Vec<usize> = self.full.drain(..scheme.residual).collect();
                    for group in block.chunks(scheme.group_size) {
                        self.quantize_channels(group, scheme.bits);
                    }
                    quantized.extend(block);
                }
            }
        }
    }

    /// One token's channels, `group_size` at a time.
    fn quantize_token(&mut self, position: usize, scheme: &Scheme) {
        if let Some(vectors) = &mut self.vectors {
            let mut row = vectors.row_mut(position);
            let row = row.as_slice_mut().expect("standard layout");
            for group in row.chunks_mut(scheme.group_size) {
                quantize_group(group, scheme.bits);
            }
        }
        self.group_of[position] = Some(self.members.len());
        self.members.push(1);
        self.quantized += 1;
    }

    /// Each channel of the entries `group`, as one group.
    fn quantize_channels(&mut self, group: &[usize], bits: u32) {
        if let Some(vectors) = &mut self.vectors {
            let mut column = vec![0.0f32; group.len()];
            for channel in 0..vectors.ncols() {
                for (x, &j) in column.iter_mut().zip(group) {
                    *x = vectors[[j, channel]];
                }
                quantize_group(&mut column, bits);
                for (&x, &j) in column.iter().zip(group) {
                    vectors[[j, channel]] = x;
                }
            }
        }
        for &j in group {
            self.group_of[j] = Some(self.members.len());
        }
        self.members.push(group.len());
        self.quantized += group.len();
    }

    /// Bytes held: full-precision elements at `width` bytes, integers at `bits`, and one scale and
    /// one minimum at `width` per group with a held member (per token: per `group_size` channels
    /// of each quantized token; per channel: per channel of each group of entries).
    fn bytes(&self, scheme: &Scheme, d: usize, width: usize) -> f64 {
        let groups = match self.grouping {
            Grouping::PerToken => self.quantized * d.div_ceil(scheme.group_size),
            Grouping::PerChannel => self.members.iter().filter(|&&n| n > 0).count() * d,
        };
        scheme.stream_bytes(self.full.len(), self.quantized, groups, (d, width))
    }
}

/// A quantizing cache over one KV head's keys and values.
#[derive(Debug, Clone)]
pub struct QuantizedCache {
    scheme: Scheme,
    keys: Stream,
    values: Stream,
    /// Held positions, ascending.
    held: Vec<usize>,
}

impl QuantizedCache {
    /// An empty cache of `scheme` over a head's keys and (when the trace has them) values,
    /// `[T, d]`.
    pub fn new(scheme: Scheme, keys: ArrayView2<f32>, values: Option<ArrayView2<f32>>) -> Self {
        Self::holding(scheme, keys.to_owned(), values.map(|v| v.to_owned()))
    }

    /// An empty cache of `scheme` over `n_positions` positions of head size `d` whose vectors
    /// are [written](Self::write) as they arrive (a running model's).
    pub fn unwritten(scheme: Scheme, n_positions: usize, d: usize) -> Self {
        let zeros = || Array2::zeros((n_positions, d));
        Self::holding(scheme, zeros(), Some(zeros()))
    }

    fn holding(scheme: Scheme, keys: Array2<f32>, values: Option<Array2<f32>>) -> Self {
        let n = keys.nrows();
        Self {
            scheme,
            keys: Stream::new(scheme.keys, n, Some(keys)),
            values: Stream::new(scheme.values, n, values),
            held: Vec::new(),
        }
    }

    /// Sets position `position`'s key and value as captured, before it is held.
    pub fn write(&mut self, position: usize, key: ArrayView1<f32>, value: ArrayView1<f32>) {
        for (stream, vector) in [
            (&mut self.keys, key.view()),
            (&mut self.values, value.view()),
        ] {
            if let Some(vectors) = &mut stream.vectors {
                vectors.row_mut(position).assign(&vector);
            }
        }
    }

    /// Brings the cache to hold `held` (ascending) at the step whose new token is `newest`:
    /// entries no longer held leave, entries new to the cache other than `newest` arrive (the
    /// prompt's kept entries at the cut, as KIVI's prefill), what is due is quantized, then
    /// `newest` arrives at full precision, so the step's query reads it as captured. Returns the
    /// positions quantized at this step (their key, their value or both), ascending.
    pub fn step(&mut self, held: &[usize], newest: usize) -> Vec<usize> {
        let before = &self.held;
        for &j in before.iter().filter(|j| held.binary_search(j).is_err()) {
            self.keys.evict(j);
            self.values.evict(j);
        }
        let mut newest_arrives = false;
        for &j in held.iter().filter(|j| before.binary_search(j).is_err()) {
            match j == newest {
                true => newest_arrives = true,
                false => {
                    self.keys.full.push_back(j);
                    self.values.full.push_back(j);
                }
            }
        }
        let mut quantized = Vec::new();
        self.keys.settle(&self.scheme, &mut quantized);
        self.values.settle(&self.scheme, &mut quantized);
        if newest_arrives {
            self.keys.full.push_back(newest);
            self.values.full.push_back(newest);
        }
        self.held.clear();
        self.held.extend_from_slice(held);
        quantized.sort_unstable();
        quantized.dedup();
        quantized
    }

    /// The keys as held, `[T, d]` (positions never held are as captured).
    pub fn keys(&self) -> ArrayView2<'_, f32> {
        self.keys.vectors.as_ref().expect("keys are read").view()
    }

    /// The values as held, when the trace has them.
    pub fn values(&self) -> Option<ArrayView2<'_, f32>> {
        self.values.vectors.as_ref().map(Array2::view)
    }

    /// Bytes the cache holds: keys and values of head size `d`, full precision at `width` bytes.
    pub fn bytes(&self, d: usize, width: usize) -> f64 {
        self.keys.bytes(&self.scheme, d, width) + self.values.bytes(&self.scheme, d, width)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kivi(residual: usize, group_size: usize) -> Scheme {
        Scheme {
            bits: 2,
            group_size,
            residual,
            keys: Grouping::PerChannel,
            values: Grouping::PerToken,
        }
    }

    #[test]
    fn kivi_quantizes_keys_by_blocks_and_values_by_age() {
        // 10 prompt positions, d = 2, residual 4, groups of 2. At the cut (the prompt held, the
        // newest 10 arriving): keys 0..8 quantized (two blocks of 4, groups {0,1} {2,3} {4,5}
        // {6,7}), 8, 9 and 10 full; values 0..6 quantized (older than the newest 4 at the cut),
        // 6..10 and 10 full (5: a step's query reads its own value at full precision).
        let t = 14;
        let keys = Array2::from_shape_fn((t, 2), |(j, c)| {
            (j * 3 + c) as f32 * 0.1 + 0.05 * (j % 3) as f32
        });
        let values = Array2::from_shape_fn((t, 2), |(j, c)| (j as f32 * 0.7 + c as f32).sin());
        let mut cache = QuantizedCache::new(kivi(4, 2), keys.view(), Some(values.view()));
        let prompt: Vec<usize> = (0..=10).collect();
        // Quantized at the cut: keys 0..8, values 0..6.
        assert_eq!(cache.step(&prompt, 10), (0..8).collect::<Vec<_>>());
        let changed = |now: ArrayView2<f32>, was: &Array2<f32>| -> Vec<usize> {
            (0..t).filter(|&j| now.row(j) != was.row(j)).collect()
        };
        // A key group of two entries is quantized to its two ends exactly: 2 bits over two
        // values maps them to min and max, so nothing moves; the test data moves in 3 steps.
        let keys_changed = changed(cache.keys(), &keys);
        assert!(keys_changed.iter().all(|&j| j < 8), "{keys_changed:?}");
        assert_eq!(cache.keys.quantized, 8);
        assert_eq!(cache.keys.full, [8, 9, 10]);
        assert_eq!(cache.values.quantized, 6);
        assert_eq!(cache.values.full, [6, 7, 8, 9, 10]);
        // Bytes at width 2, d = 2: keys 3 full * 2 * 2 + 8 * 2 * 2 bits / 8 + 4 groups * 2
        // channels * 2 * 2 = 12 + 4 + 32; values 5 * 4 + 6 * 0.5 + 6 tokens * 1 group * 4 = 20 +
        // 3 + 24.
        assert_eq!(cache.bytes(2, 2), 48.0 + 47.0);
        // Next step: 11 arrives; first the values beyond the newest 4 (6) are quantized.
        let mut held = prompt.clone();
        held.push(11);
        assert_eq!(cache.step(&held, 11), [6]);
        assert_eq!(cache.values.full, [7, 8, 9, 10, 11]);
        assert_eq!(cache.keys.full, [8, 9, 10, 11]);
        // Then 12: the keys' residual had reached 4, so 8..12 are quantized before 12 arrives;
        // evicting 3 leaves its group {2, 3} with one member, whose scales stay.
        held.retain(|&j| j != 3);
        held.push(12);
        assert_eq!(cache.step(&held, 12), [7, 8, 9, 10, 11]);
        assert_eq!(cache.keys.full, [12]);
        assert_eq!(cache.keys.quantized, 11);
        assert_eq!(cache.keys.members.iter().filter(|&&n| n > 0).count(), 6);
        assert_eq!(cache.keys.group_of[2], Some(1));
    }

    #[test]
    fn a_value_is_quantized_alone_per_token() {
        // Per-token values, residual 0: every entry but the step's newest is quantized, each
        // token in groups of 2 channels; the newest reads as captured.
        let values = Array2::from_shape_fn((4, 4), |(j, c)| (j * 4 + c) as f32 * 0.3 - 1.0);
        let scheme = Scheme {
            bits: 2,
            group_size: 2,
            residual: 0,
            keys: Grouping::PerToken,
            values: Grouping::PerToken,
        };
        let mut cache = QuantizedCache::new(scheme, values.view(), Some(values.view()));
        cache.step(&[0, 1, 2], 2);
        assert_eq!(cache.values.quantized, 2);
        assert_eq!(cache.values().unwrap().row(2), values.row(2));
        let mut row = values.row(1).to_vec();
        for group in row.chunks_mut(2) {
            quantize_group(group, 2);
        }
        assert_eq!(cache.values().unwrap().row(1).to_vec(), row);
    }
}
