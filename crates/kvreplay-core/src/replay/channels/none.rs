//! `none`: every key keeps every channel (the default).

use super::{ChannelPruning, KeyChannels};

crate::settings! {
    /// Every key channel is stored.
    pub struct AllChannels = "none" {}
}

impl KeyChannels for AllChannels {
    fn pruning(&self) -> Option<ChannelPruning> {
        None
    }
}
