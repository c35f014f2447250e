//! Cache quantizers: how the kept keys and values are stored. One quantizer per file, the file
//! name is the registry key (`per_token.rs` is `per-token`). A quantizer declares its scheme (bits,
//! groups, the full-precision window of recent entries); how a cache's entries move through it as
//! they arrive and leave is [`QuantizedCache`], shared by every scheme. Quantization is apart from
//! eviction: it changes what the kept entries hold, never which entries are kept, so any
//! allocator, head split, scorer and timing combines with any quantizer. Scorers see the vectors as
//! captured, as kvpress's presses score the prompt before any cache stores it.

mod cache;

pub use cache::QuantizedCache;

use super::settings::Broken;

mod kivi;
mod none;
mod per_token;

crate::registry! {
    Quantizer:
    none::NoQuantizer,
    kivi::Kivi,
    per_token::PerToken,
}

/// A way of storing a cache's keys and values.
pub trait Quantizer: Send + Sync {
    /// Rules its settings must follow beyond their types.
    fn check(&self) -> Result<(), Broken> {
        Ok(())
    }
    /// How it stores the entries; `None` when it stores them as captured (the plain cache).
    fn scheme(&self) -> Option<Scheme>;
}

/// Along which axis a quantization group runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grouping {
    /// One token's channels, `group_size` at a time: a token is quantized on its own, once it is
    /// older than the full-precision window.
    PerToken,
    /// One channel over `group_size` consecutive entries (KIVI's keys): the full-precision entries
    /// are quantized together whenever `residual` of them have gathered.
    PerChannel,
}

/// A quantization scheme: asymmetric min-max integers (`scale = (max - min) / (2^bits - 1)`, one
/// scale and one minimum per group, both stored at the cache's width), with the newest entries
/// kept at full precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheme {
    /// Bits per stored integer.
    pub bits: u32,
    /// Elements per group.
    pub group_size: usize,
    /// Recent entries kept at full precision.
    pub residual: usize,
    /// How the keys are grouped.
    pub keys: Grouping,
    /// How the values are grouped.
    pub values: Grouping,
}

impl Scheme {
    /// Whether a head of `head_dim` channels splits into its per-token groups (KIVI asserts it).
    pub fn check_head_dim(&self, head_dim: usize) -> Result<(), String> {
        let per_token = [self.keys, self.values].contains(&Grouping::PerToken);
        match per_token && !head_dim.is_multiple_of(self.group_size) {
            true => Err(format!(
                "group_size {} must divide the head size ({head_dim}): a token's channels are quantized in groups of it",
                self.group_size
            )),
            false => Ok(()),
        }
    }
}

/// Bytes one cache holds right after the prompt's cut when it keeps `n` entries of head size `d`
/// at full-precision width `width` (bytes), stored by `scheme` (`None`: as captured): what a
/// budget in bytes is resolved against ([`QuantizedCache::bytes`] counts the same while decoding).
pub fn bytes_at_cut(scheme: Option<&Scheme>, n: usize, d: usize, width: usize) -> f64 {
    let Some(scheme) = scheme else {
        return (n * 2 * d * width) as f64;
    };
    let stream = |grouping: Grouping| {
        let (quantized, groups) = match grouping {
            Grouping::PerToken => {
                let quantized = n.saturating_sub(scheme.residual);
                (quantized, quantized * d.div_ceil(scheme.group_size))
            }
            Grouping::PerChannel => {
                let quantized = n / scheme.residual * scheme.residual;
                (quantized, quantized / scheme.group_size * d)
            }
        };
        scheme.stream_bytes(n - quantized, quantized, groups, (d, width))
    };
    stream(scheme.keys) + stream(scheme.values)
}

impl Scheme {
    /// Bytes of one stream (keys or values) of head size `d`: `full` entries at full precision
    /// (`width` bytes an element), `quantized` entries at `bits`, and one scale and one minimum at
    /// `width` for each of `groups` groups.
    pub(crate) fn stream_bytes(
        &self,
        full: usize,
        quantized: usize,
        groups: usize,
        (d, width): (usize, usize),
    ) -> f64 {
        let width = width as f64;
        full as f64 * d as f64 * width
            + quantized as f64 * d as f64 * self.bits as f64 / 8.0
            + groups as f64 * 2.0 * width
    }
}

/// The bit widths a quantizer takes, beside 16 (the cache as captured).
pub const BITS: [u32; 3] = [2, 4, 8];

/// Checks `bits` against [`BITS`] and 16.
pub(crate) fn check_bits(bits: u32) -> Result<(), Broken> {
    match BITS.contains(&bits) || bits == 16 {
        true => Ok(()),
        false => Err(Broken {
            key: "bits",
            rule: "must be 2, 4 or 8 (integers), or 16 (the cache as captured)".into(),
        }),
    }
}

/// Checks that a group holds at least one element.
pub(crate) fn check_group(group_size: usize) -> Result<(), Broken> {
    match group_size {
        0 => Err(Broken {
            key: "group_size",
            rule: "must be at least 1".into(),
        }),
        _ => Ok(()),
    }
}

/// Quantizes `group` in place and writes back what it dequantizes to, as KIVI's
/// `quant_and_pack_vcache` and `unpack_and_dequant_vcache` compute it (`quant/new_pack.py`, KIVI
/// commit 876b4d2, lines 31-48 and 69-82) at the cache's f32 width: `mn`, `mx` over the group,
/// `scale = (mx - mn) / (2^bits - 1)`, `q = round(clamp((x - mn) / scale, 0, 2^bits - 1))`
/// (ties to even, as `torch.round`), then `q * scale + mn`. Deliberate deviation: a constant group
/// (`scale = 0`, where KIVI divides by zero) dequantizes to its value.
pub fn quantize_group(group: &mut [f32], bits: u32) {
    let max_int = ((1u64 << bits) - 1) as f32;
    let mn = group.iter().copied().fold(f32::INFINITY, f32::min);
    let mx = group.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let scale = (mx - mn) / max_int;
    if scale == 0.0 || !scale.is_finite() {
        return;
    }
    for x in group {
        let code = ((*x - mn) / scale).clamp(0.0, max_int).round_ties_even();
        *x = code * scale + mn;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_by_hand() {
        // 2 bits over [0, 0.1, 0.5, 0.9, 1.2]: mn 0, scale 1.2 / 3 = 0.4; codes round(x / 0.4) =
        // round(0, 0.25, 1.25, 2.25, 3) = 0, 0, 1, 2, 3 (ties to even leave none here); back: 0,
        // 0, 0.4, 0.8, 1.2.
        let mut group = [0.0f32, 0.1, 0.5, 0.9, 1.2];
        quantize_group(&mut group, 2);
        let scale = 1.2f32 / 3.0;
        assert_eq!(group, [0.0, 0.0, scale, 2.0 * scale, 3.0 * scale]);
        // A tie rounds to even: [0, 1, 2, 3] at 1 bit... at 2 bits over [0, 0.5, 3]: scale 1,
        // 0.5 -> 0 (even).
        let mut tie = [0.0f32, 0.5, 3.0];
        quantize_group(&mut tie, 2);
        assert_eq!(tie, [0.0, 0.0, 3.0]);
        // A constant group keeps its value.
        let mut constant = [0.7f32; 4];
        quantize_group(&mut constant, 4);
        assert_eq!(constant, [0.7; 4]);
        // 8 bits moves no value by more than half a step.
        let mut fine: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        let original = fine.clone();
        quantize_group(&mut fine, 8);
        let step = 2.0 / 255.0;
        assert!(fine
            .iter()
            .zip(&original)
            .all(|(a, b)| (a - b).abs() <= step / 2.0 + 1e-6));
    }

    #[test]
    fn bytes_at_the_cut_are_what_the_cache_holds_there() {
        // Every prompt size, both groupings, against the stream's own count right after the cut
        // (the prompt's entries arrived and settled, the first decode token not yet in).
        let keys = ndarray::Array2::from_shape_fn((40, 8), |(j, c)| (j * 8 + c) as f32);
        for scheme in [
            Scheme {
                bits: 2,
                group_size: 4,
                residual: 8,
                keys: Grouping::PerChannel,
                values: Grouping::PerToken,
            },
            Scheme {
                bits: 4,
                group_size: 8,
                residual: 3,
                keys: Grouping::PerToken,
                values: Grouping::PerToken,
            },
        ] {
            for n in 0..32 {
                let mut cache = QuantizedCache::new(scheme, keys.view(), None);
                cache.step(&(0..n).collect::<Vec<_>>(), n);
                assert_eq!(
                    bytes_at_cut(Some(&scheme), n, 8, 2),
                    cache.bytes(8, 2),
                    "{scheme:?} {n}"
                );
            }
        }
        assert_eq!(bytes_at_cut(None, 10, 8, 2), 320.0);
        // KIVI keys quantize a block at `residual`: 8 entries hold fewer bytes than 7.
        let kivi = Scheme {
            bits: 2,
            group_size: 4,
            residual: 8,
            keys: Grouping::PerChannel,
            values: Grouping::PerToken,
        };
        assert!(bytes_at_cut(Some(&kivi), 8, 8, 2) < bytes_at_cut(Some(&kivi), 7, 8, 2));
    }

    #[test]
    fn bits_are_checked() {
        assert!(check_bits(3).is_err());
        assert!([2, 4, 8, 16]
            .into_iter()
            .all(|bits| check_bits(bits).is_ok()));
        assert!(check_group(0).is_err());
    }
}
