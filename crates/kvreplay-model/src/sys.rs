//! How kvreplay tunes the process it runs in: glibc's allocator thresholds (the replay frees a
//! layer at a time, the native model allocates and frees activations every step) and handing
//! freed memory back between layers, both no-ops where the C library is not glibc; the thread
//! count and spin limit of the model's thread pools. None changes a result.

use crate::replay::Stopped;
use crate::stop::Stop;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Layers are large, short-lived buffers: glibc hands blocks of this size and more back to the
/// system when freed (its adaptive threshold otherwise keeps them in the heap), so resident memory
/// tracks about one layer instead of growing with each one read.
pub const MMAP_THRESHOLD: usize = 128 << 10;

/// The native model (captures, live runs, closed-loop sweeps) allocates and frees its activations
/// and logits at every step, most of them over [`MMAP_THRESHOLD`]: under the replay's tuning each
/// was mapped, faulted in page by page and unmapped again, and a live run on a ~1K prompt spent 40%
/// of its CPU time in the kernel (4.4 million page faults). While the model runs, blocks up to
/// this size come from the heap and freed ones stay there for the next step.
const MODEL_MMAP_THRESHOLD: usize = 32 << 20;

/// glibc's default trim threshold, which the replay keeps.
const REPLAY_TRIM_THRESHOLD: usize = 128 << 10;

/// glibc's tuning knobs kvreplay sets.
#[derive(Clone, Copy)]
enum MallocOption {
    /// `M_MMAP_THRESHOLD`: blocks of this size and more are mapped, and unmapped when freed.
    MmapThreshold,
    /// `M_TRIM_THRESHOLD`: free memory at the top of a heap beyond this is handed back.
    TrimThreshold,
}

/// Sets one of glibc's tuning knobs (which turns its adaptive thresholds off).
fn set_malloc_option(option: MallocOption, bytes: usize) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning; it takes the allocator's lock.
    unsafe {
        let option = match option {
            MallocOption::MmapThreshold => libc::M_MMAP_THRESHOLD,
            MallocOption::TrimThreshold => libc::M_TRIM_THRESHOLD,
        };
        libc::mallopt(option, bytes as i32);
    }
    let _ = (option, bytes);
}

/// Sets glibc's threshold above which allocations are mapped (and unmapped when freed); this
/// turns its adaptive threshold off.
pub fn set_mmap_threshold(bytes: usize) {
    set_malloc_option(MallocOption::MmapThreshold, bytes);
}

/// The process's tuning for the replay: called once at start.
pub fn tune_for_replay() {
    set_mmap_threshold(MMAP_THRESHOLD);
    tune_thread_pools();
}

/// glibc tuned for the native model while one lives (they nest: a closed-loop sweep captures its
/// recipes), for the replay again when the last is dropped.
pub struct ModelMalloc;

/// How many [`ModelMalloc`] live.
static MODEL_MALLOC_HELD: AtomicUsize = AtomicUsize::new(0);

impl ModelMalloc {
    /// Tunes the allocator for the native model until the returned guard (and every other one)
    /// is dropped.
    pub fn tune() -> Self {
        if MODEL_MALLOC_HELD.fetch_add(1, Ordering::SeqCst) == 0 {
            set_malloc_option(MallocOption::MmapThreshold, MODEL_MMAP_THRESHOLD);
            set_malloc_option(MallocOption::TrimThreshold, 2 * MODEL_MMAP_THRESHOLD);
        }
        ModelMalloc
    }
}

impl Drop for ModelMalloc {
    fn drop(&mut self) {
        if MODEL_MALLOC_HELD.fetch_sub(1, Ordering::SeqCst) == 1 {
            set_malloc_option(MallocOption::MmapThreshold, MMAP_THRESHOLD);
            set_malloc_option(MallocOption::TrimThreshold, REPLAY_TRIM_THRESHOLD);
        }
    }
}

/// candle sizes each matrix product of the native model by `RAYON_NUM_THREADS` or, when it is
/// unset, by counting the physical cores in /proc/cpuinfo, once per product: a decode step spent
/// a tenth of its time reading that file. Naming rayon's own default (the available parallelism)
/// before any thread starts spares the reads and leaves kvreplay's thread pool as it was; the
/// products' sums do not depend on their thread count, so results are unchanged. Also sets how
/// long candle's own threads spin between operations ([`CANDLE_SPINS`]). A variable the user set
/// is left as it is. Called before any thread starts: by [`tune_for_replay`], and by the Python
/// module when it is imported.
pub fn tune_thread_pools() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
    if std::env::var_os(CANDLE_SPIN_LIMIT).is_none() {
        std::env::set_var(CANDLE_SPIN_LIMIT, CANDLE_SPINS.to_string());
    }
}

/// How many times candle's worker threads spin, between two of the model's operations, before
/// they sleep until the next. candle spins 25,000 times by default (about half a millisecond),
/// on cores that kvreplay's own threads share with it: in a profile of a closed-loop sweep, whose
/// policies score and copy on rayon's threads between the model's operations, that spin took
/// 5.5% of the CPU time; with 100, 0.06%. Where the spins end changes no result.
const CANDLE_SPINS: u32 = 100;

/// The variable candle reads its spin limit from, once, when its thread pool starts.
const CANDLE_SPIN_LIMIT: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";

/// The memory the system can still give this process (`MemAvailable` of /proc/meminfo), or 4 GiB
/// where that cannot be read.
pub fn available_memory() -> usize {
    memory_available().unwrap_or(4 << 30)
}

/// `MemAvailable` of /proc/meminfo, where it can be read.
pub fn memory_available() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}

/// Hands the memory freed by a layer's work back to the system. glibc keeps freed blocks of its
/// per-thread arenas resident, and the reports allocated among them pin them: without this, a
/// 36-policy pass over niah-2k grew resident memory by 34 MB for 4 MB of live results; with it,
/// by 18 MB. Only glibc's own heap is touched.
pub fn return_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory of glibc's arenas to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// What a sweep does after each layer of a replay: hands the freed memory back, except in a
/// closed-loop sweep, whose heap stays with the model that runs beside the replays.
pub fn after_sweep_layer(closed_loop: bool) -> Stop<'static> {
    match closed_loop {
        true => &|| Ok(()),
        false => &returning_free_memory,
    }
}

/// What hands the freed memory back after each layer and never stops the work.
pub fn returning_free_memory() -> Result<(), Stopped> {
    return_free_memory();
    Ok(())
}
