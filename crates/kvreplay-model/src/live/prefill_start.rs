//! Where a policy that evicts while the prompt runs starts its own prefill. Up to the first
//! position where one of its queries loses sight of a position up to its own, every layer runs
//! as the full run's; its prefill takes over the full run's cache there and runs the rest, when
//! that gives the numbers of its prefill from position 0 bit for bit.
//!
//! Candle multiplies a chunk's rows by `gemm` (0.19), which sums each output's depth in blocks.
//! A product of more than 64 rows (or columns) takes blocks set by its depth and the processor's
//! caches alone (`gemm-common` `cache.rs`, `kernel_params`); one of at most 64 rows and 64
//! columns takes blocks of 512 (`gemm.rs`, `gemm_basic_generic`), and one row its matrix-vector
//! paths. A chunk cut short at the start keeps its rows' sums when it keeps more than 64 rows and
//! every depth: the keys its queries read, from position 0 where the policy masks them, from its
//! first query's window on where an unmasked sliding-window layer reads them.

/// The most rows of a product `gemm` may sum in depth blocks of its own.
const GEMM_SMALL_ROWS: usize = 64;

/// The position an own prefill of a prompt cut at `cut` (run from position 0 in chunks of
/// `chunk` positions) starts at, given the first position `first` where the policy hides
/// anything, the full run's prefill having run its first `segment` positions in the same chunks,
/// on a model whose layers attend over `windows` (0: global): `first` when the chunk it falls
/// in can be cut short there ([module doc](self)), else that chunk's start, or 0 where the full
/// run's chunk ended elsewhere. At least the last position runs, for the prompt's logits.
pub(super) fn prefill_start(
    first: usize,
    (cut, chunk, segment): (usize, usize, usize),
    windows: &[usize],
) -> usize {
    let first = first.min(cut.saturating_sub(1));
    let chunk_start = first - first % chunk;
    let chunk_end = (chunk_start + chunk).min(cut);
    if (chunk_start + chunk).min(segment) != chunk_end {
        return 0;
    }
    let same_keys = windows
        .iter()
        .filter(|&&window| window > 0)
        .all(|&w| (first + 1).saturating_sub(w) == (chunk_start + 1).saturating_sub(w));
    match chunk_end - first > GEMM_SMALL_ROWS && same_keys {
        true => first,
        false => chunk_start,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 1,000-position prompt in chunks of 512, prefilled so by the full run too.
    const PROMPT: (usize, usize, usize) = (1000, 512, 1000);

    #[test]
    fn a_chunk_is_cut_short_where_more_than_64_of_its_rows_remain() {
        assert_eq!(prefill_start(100, PROMPT, &[0, 0]), 100);
        assert_eq!(prefill_start(447, PROMPT, &[0]), 447);
        // 64 rows left in the first chunk, 40 in the second: each runs whole.
        assert_eq!(prefill_start(448, PROMPT, &[0]), 0);
        assert_eq!(prefill_start(960, PROMPT, &[0]), 512);
        assert_eq!(prefill_start(600, PROMPT, &[0]), 600);
        assert_eq!(prefill_start(0, PROMPT, &[0]), 0);
        // Nothing hidden: the last chunk runs, for the prompt's logits.
        assert_eq!(prefill_start(1000, PROMPT, &[0]), 512);
        assert_eq!(prefill_start(5000, (300, 128, 300), &[0]), 256);
    }

    #[test]
    fn a_chunk_the_full_run_ended_elsewhere_is_not_taken_over() {
        // The full run prefilled a shared context of 900 positions, then the question: its
        // second chunk held 388 positions, the own prefill's holds 488.
        assert_eq!(prefill_start(600, (1000, 512, 900), &[0]), 0);
        assert_eq!(prefill_start(100, (1000, 512, 900), &[0]), 100);
        // Cut at the question (900) over the full run's 1,000-position chunks.
        assert_eq!(prefill_start(600, (900, 512, 1000), &[0]), 0);
    }

    #[test]
    fn a_sliding_layer_keeps_the_keys_its_chunk_reads() {
        // Window 512: a chunk from 600 reads keys from 89 on, the whole chunk from 1.
        assert_eq!(prefill_start(600, PROMPT, &[512, 0]), 512);
        // Both read from position 0.
        assert_eq!(prefill_start(100, PROMPT, &[512, 0]), 100);
        assert_eq!(prefill_start(400, (1000, 256, 1000), &[512]), 400);
        assert_eq!(prefill_start(600, (1000, 256, 1000), &[512]), 512);
    }
}
