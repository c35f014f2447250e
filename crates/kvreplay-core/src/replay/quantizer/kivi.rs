//! `kivi`: KIVI's asymmetric 2-bit cache (Liu et al., ICML 2024, arXiv:2402.02750; code
//! github.com/jy-yuan/KIVI at commit 876b4d2, `models/llama_kivi.py`): keys quantized per channel
//! over groups of `group_size` consecutive entries, values per token over groups of `group_size`
//! channels, with min-max integers of `bits` bits. The newest entries stay at full precision:
//! keys gather until `residual` of them are full precision and are then quantized together
//! (lines 131-136 while decoding; 193-204 at the prompt's end, which quantizes all but the last
//! `prompt mod residual`), values are quantized one at a time as they become older than the
//! newest `residual` (lines 174-179; 210-219 at the prompt's end). As there, a step's query
//! attends before that step's quantization. Deliberate deviations: arithmetic at the trace's f32
//! width where KIVI runs fp16, and a constant group keeps its value where KIVI divides by zero.

use super::{check_bits, check_group, Grouping, Quantizer, Scheme};
use crate::replay::settings::Broken;

crate::settings! {
    /// KIVI: keys per channel, values per token, `residual` newest entries at full precision
    /// (arXiv:2402.02750, github.com/jy-yuan/KIVI).
    pub struct Kivi = "kivi" {
        /// Bits per integer (`k_bits` = `v_bits` of KIVI): 2, 4 or 8; 16 stores the cache as
        /// captured.
        bits: u32 = 2,
        /// Elements per quantization group (KIVI's `group_size`): entries per key group,
        /// channels per value group (must divide the head size).
        group_size: usize = 32,
        /// Newest entries kept at full precision (KIVI's `residual_length`), a multiple of
        /// `group_size`.
        residual: usize = 128,
    }
}

impl Quantizer for Kivi {
    fn check(&self) -> Result<(), Broken> {
        check_bits(self.bits)?;
        check_group(self.group_size)?;
        if self.residual == 0 || !self.residual.is_multiple_of(self.group_size) {
            return Err(Broken {
                key: "residual",
                rule: "must be a positive multiple of group_size (KIVI quantizes the keys `residual` at a time, in groups)".into(),
            });
        }
        Ok(())
    }

    fn scheme(&self) -> Option<Scheme> {
        (self.bits != 16).then_some(Scheme {
            bits: self.bits,
            group_size: self.group_size,
            residual: self.residual,
            keys: Grouping::PerChannel,
            values: Grouping::PerToken,
        })
    }
}
