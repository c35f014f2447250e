//! Recycled buffers for a chunk's policy mask. At ~4K positions a prompt chunk's mask is tens of
//! megabytes per layer, above what the allocator keeps for reuse: each fresh one came from the
//! operating system and cost a page fault per 4 KiB written (on a ~4K SmolLM2 calibration prompt,
//! most of 120 GB of faults). A mask taken here and given back once its chunk has attended is
//! written over in memory already mapped.

use std::sync::Mutex;

/// Buffers kept for reuse at most (two cores each building one layer's mask, and room to spare).
const KEPT: usize = 8;

static BUFFERS: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());

/// `len` copies of `value`, in a recycled buffer when one is kept: the smallest that holds
/// `len`, else the largest (grown).
pub(crate) fn filled(len: usize, value: f32) -> Vec<f32> {
    let mut buffer = take(len);
    buffer.clear();
    buffer.resize(len, value);
    buffer
}

/// An empty buffer with room for `len` values, recycled when one is kept (as [`filled`]).
pub(crate) fn with_capacity(len: usize) -> Vec<f32> {
    let mut buffer = take(len);
    buffer.clear();
    buffer.reserve(len);
    buffer
}

/// Keeps `buffer` for a later mask, dropping the smallest kept one when they are [`KEPT`].
pub(crate) fn give_back(buffer: Vec<f32>) {
    let mut buffers = BUFFERS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    buffers.push(buffer);
    if buffers.len() > KEPT {
        let smallest = (0..buffers.len())
            .min_by_key(|&index| buffers[index].capacity())
            .expect("more than KEPT buffers");
        buffers.swap_remove(smallest);
    }
}

fn take(len: usize) -> Vec<f32> {
    let mut buffers = BUFFERS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let fits = (0..buffers.len())
        .filter(|&index| buffers[index].capacity() >= len)
        .min_by_key(|&index| buffers[index].capacity());
    let largest = || (0..buffers.len()).max_by_key(|&index| buffers[index].capacity());
    match fits.or_else(largest) {
        Some(index) => buffers.swap_remove(index),
        None => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_given_back_is_filled_anew_and_reused() {
        // Other tests share the pool: this one only checks what it can see of its own buffer.
        let mut mask = filled(1 << 20, f32::NEG_INFINITY);
        mask[7] = 0.0;
        let address = mask.as_ptr();
        give_back(mask);
        let again = filled(1 << 20, 2.5);
        assert_eq!(again.len(), 1 << 20);
        assert!(again.iter().all(|&v| v == 2.5));
        // The kept buffer that holds it is reused when no other test took it in between.
        if again.as_ptr() == address {
            assert!(again.capacity() >= 1 << 20);
        }
        let empty = with_capacity(100);
        assert!(empty.is_empty() && empty.capacity() >= 100);
    }

    #[test]
    fn no_more_than_kept_buffers_stay() {
        for size in 1..=2 * KEPT {
            give_back(Vec::with_capacity(size));
        }
        assert!(BUFFERS.lock().unwrap().len() <= KEPT);
    }
}
