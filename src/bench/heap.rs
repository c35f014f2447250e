//! What a piece of work holds on the heap, counted exactly: a global allocator that forwards
//! every call to the system's and, while [`heap_growth`] runs, counts the bytes allocated and
//! freed and the peak of their difference. Resident memory ([`super::resident_growth`]) is what
//! the process shows the system, and includes memory the allocator keeps after it is freed; this
//! is what the work itself held live. A program (or test binary) opts in by installing it:
//! `#[global_allocator] static HEAP: CountingAllocator = CountingAllocator;`.

use super::Growth;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};

/// Whether allocations are being counted (only inside [`heap_growth`]).
static COUNTING: AtomicBool = AtomicBool::new(false);
/// Bytes allocated less bytes freed since counting began (blocks allocated before and freed
/// during count negative).
static LIVE: AtomicIsize = AtomicIsize::new(0);
/// The largest `LIVE` since counting began.
static PEAK: AtomicIsize = AtomicIsize::new(0);

/// The system allocator, counting while [`heap_growth`] runs.
pub struct CountingAllocator;

fn grew(bytes: usize) {
    if COUNTING.load(Ordering::Relaxed) {
        let live = LIVE.fetch_add(bytes as isize, Ordering::SeqCst) + bytes as isize;
        PEAK.fetch_max(live, Ordering::SeqCst);
    }
}

fn shrank(bytes: usize) {
    if COUNTING.load(Ordering::Relaxed) {
        LIVE.fetch_sub(bytes as isize, Ordering::SeqCst);
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged; only sizes are counted.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        shrank(layout.size());
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // Old and new blocks are both live while the data is copied.
        grew(new_size);
        let moved = System.realloc(ptr, layout, new_size);
        shrank(layout.size());
        moved
    }
}

/// Runs `work` (its threads included) and counts what it allocated: the peak of its live heap
/// bytes, and what stays live after it. `None` unless [`CountingAllocator`] is the global
/// allocator. Not reentrant: one count at a time per process.
pub fn heap_growth<T>(work: impl FnOnce() -> T) -> (T, Option<Growth>) {
    let restart = || {
        LIVE.store(0, Ordering::SeqCst);
        PEAK.store(0, Ordering::SeqCst);
    };
    restart();
    COUNTING.store(true, Ordering::SeqCst);
    // A probe: only the counting allocator sees it.
    drop(std::hint::black_box(vec![0u8; 1]));
    let installed = PEAK.load(Ordering::SeqCst) > 0;
    restart();
    let result = work();
    COUNTING.store(false, Ordering::SeqCst);
    let growth = installed.then(|| Growth {
        peak: PEAK.load(Ordering::SeqCst).max(0) as usize,
        retained: LIVE.load(Ordering::SeqCst).max(0) as usize,
    });
    (result, growth)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_the_allocator_installed_nothing_is_counted() {
        // The library's test binary keeps the system allocator.
        let (sum, growth) = heap_growth(|| {
            vec![1u8; 1 << 20]
                .iter()
                .map(|&b| b as usize)
                .sum::<usize>()
        });
        assert_eq!(sum, 1 << 20);
        assert_eq!(growth, None);
    }
}
