//! `per-token`: plain per-token integer quantization of keys and values alike, each token's
//! channels in groups of `group_size` with their own min-max scale, the newest `residual` tokens
//! at full precision: the scheme of transformers' `QuantizedCache` (`q_group_size`,
//! `residual_length`, `nbits`; axis 0 of its quanto/HQQ back-ends) with KIVI's rounding
//! ([`quantize_group`](super::quantize_group)).

use super::{check_bits, check_group, Grouping, Quantizer, Scheme};
use crate::replay::settings::Broken;

crate::settings! {
    /// Per-token min-max integers for keys and values, the newest `residual` tokens at full
    /// precision (transformers' `QuantizedCache` scheme).
    pub struct PerToken = "per-token" {
        /// Bits per integer: 2, 4 or 8; 16 stores the cache as captured.
        bits: u32 = 4,
        /// Channels per quantization group (must divide the head size).
        group_size: usize = 32,
        /// Newest tokens kept at full precision.
        residual: usize = 0,
    }
}

impl Quantizer for PerToken {
    fn check(&self) -> Result<(), Broken> {
        check_bits(self.bits)?;
        check_group(self.group_size)
    }

    fn scheme(&self) -> Option<Scheme> {
        (self.bits != 16).then_some(Scheme {
            bits: self.bits,
            group_size: self.group_size,
            residual: self.residual,
            keys: Grouping::PerToken,
            values: Grouping::PerToken,
        })
    }
}
