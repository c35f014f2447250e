//! `none`: the cache stores its keys and values as captured (the default).

use super::{Quantizer, Scheme};

crate::settings! {
    /// The cache as captured: no quantization.
    pub struct NoQuantizer = "none" {}
}

impl Quantizer for NoQuantizer {
    fn scheme(&self) -> Option<Scheme> {
        None
    }
}
