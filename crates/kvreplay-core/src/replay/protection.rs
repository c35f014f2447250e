//! The tokens no policy evicts: the first `sinks` (attention sinks) and the most recent
//! `window` of a cache. One value, used by every selection, streaming eviction, head split and
//! allocator floor.

/// Tokens a policy never evicts: the first `sinks` and the most recent `window` of a cache
/// (SnapKV's observation window is this window).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Protection {
    /// First positions always kept (attention sinks).
    pub sinks: usize,
    /// Most recent positions always kept.
    pub window: usize,
}

impl Protection {
    /// How many tokens are protected.
    pub fn tokens(self) -> usize {
        self.sinks + self.window
    }

    /// Whether entry `index` of a cache of `len` entries (or position `index` of a prompt of
    /// `len` tokens) is protected.
    pub fn covers(self, index: usize, len: usize) -> bool {
        index < self.sinks || index + self.window >= len
    }
}
