//! `none`: evicted entries are dropped (the default).

use super::{Merge, ValueMerge};

crate::settings! {
    /// Evicted entries are dropped.
    pub struct NoMerge = "none" {}
}

impl Merge for NoMerge {
    fn merging(&self) -> Option<ValueMerge> {
        None
    }
}
