//! The weight products of a batched decode step, each row's result the one it gets alone.
//!
//! candle multiplies by the `gemm` crate (0.19), whose sums depend on the number of rows. One row
//! goes through its matrix-vector paths (`gemm-common` `gemv.rs`): against a row-major weight,
//! every output starts from the product of the first terms and adds the others in order with
//! fused multiply-adds (`mixed_gemv_colmajor`); against a transposed one (Gemma 3's tied
//! embedding as its output layer), every output is a dot product summed in eight SIMD
//! accumulators, added pairwise, then lane by lane (`mixed_gemv_rowmajor`). Several rows go
//! through its blocked kernel, which sums the depth in blocks of up to 1,024 and then adds the
//! blocks: the same sums as the first path up to that depth, not beyond it (a Llama MLP's down
//! projection, 1,536 deep in SmolLM2; 2,048 in Gemma 3 270M), and never the second path's.
//! [`rows_product`] sums a batch of single-token rows as those paths sum one row, so each row
//! gets its unbatched logits bit for bit. (The blocks are 512 deep for small products and depend
//! on the processor's caches otherwise, so no depth is safe to leave to the blocked kernel.)

use super::strips::{append_strip, Strips};
use super::ModelError;
use candle_core::{Device, Storage, Tensor};
use rayon::prelude::*;

/// `x · w` for `x` `[m, k]` stacking rows of tokens at `spans` and `w` `[k, n]`, each row's
/// result as it gets it alone: a product per row unless every row is one token, then the
/// one-row summation of `gemm` on all of them at once (never its blocked kernel, whose depth
/// blocks depend on the shapes and on the processor's caches).
pub(crate) fn rows_product(
    x: &Tensor,
    w: &Tensor,
    spans: &[(usize, usize)],
) -> Result<Tensor, ModelError> {
    product_of_rows(x, w, spans, || Ok(None))
}

/// [`rows_product`], one-token rows summed from `w`'s [`Strips`] where `strips` gives them.
pub(crate) fn product_of_rows<'w>(
    x: &Tensor,
    w: &Tensor,
    spans: &[(usize, usize)],
    strips: impl FnOnce() -> Result<Option<&'w Strips>, ModelError>,
) -> Result<Tensor, ModelError> {
    if spans.len() == 1 {
        return Ok(x.matmul(w)?);
    }
    if spans.iter().any(|&(_, n)| n != 1) {
        // Side by side: a short row's product may be too small for `gemm` to share out, and
        // `gemm` sums each output alike on any number of threads.
        let parts = spans
            .par_iter()
            .map(|&(first, n)| x.narrow(0, first, n)?.matmul(w))
            .collect::<Result<Vec<_>, _>>()?;
        return Ok(Tensor::cat(&parts, 0)?);
    }
    let (m, k) = x.dims2()?;
    let n = w.dims2()?.1;
    let xs = x.flatten_all()?.to_vec1::<f32>()?;
    let strips = strips()?;
    let chained = with_rows(w, |rows, stride| {
        one_token_rows(&xs, (rows, stride, strips), (m, k, n))
    })?;
    let out = match chained {
        Some(out) => out,
        None => {
            let dotted = with_rows(&w.t()?, |rows, stride| {
                dot_rows(&xs, rows, stride, (m, k, n))
            })?;
            match dotted {
                Some(out) => out,
                None => {
                    let rows = w.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
                    one_token_rows(&xs, (&rows, n, None), (m, k, n))
                }
            }
        }
    };
    Ok(Tensor::from_vec(out, (m, n), &Device::Cpu)?)
}

/// `x [m, k] · w [k, n]` as [`rows_product`] sums rows of one token each, for any `m`: every
/// output `x[r, 0]·w[0, j]` and then the later terms added in order, each one multiply-add
/// ([`chain_term`]). A row's outputs are the ones it gets alone, and a chain stopped at some depth
/// continues by [`chain_term`] to the sum over the whole depth.
pub(crate) fn chain_product(
    x: &[f32],
    (m, k): (usize, usize),
    w: &Tensor,
) -> Result<Vec<f32>, ModelError> {
    let n = w.dims2()?.1;
    let product = |rows: &[f32], stride| one_token_rows(x, (rows, stride, None), (m, k, n));
    if let Some(out) = with_rows(w, product)? {
        return Ok(out);
    }
    let rows = w.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    Ok(product(&rows, n))
}

/// A chain's `sum` with the next term `a · b` added as the products here add it: fused where
/// `fused` ([`fuses_multiply_add`]).
#[inline]
pub(crate) fn chain_term(sum: f32, (a, b): (f32, f32), fused: bool) -> f32 {
    match fused {
        true => a.mul_add(b, sum),
        false => a * b + sum,
    }
}

/// Chains `sums[j]` carried on over the terms `a[p] · b[p · stride + j]`, `p` in order, each
/// added by [`chain_term`]: the rest of a product's depth after a part of it.
pub(crate) fn continue_chains(sums: &mut [f32], a: &[f32], (b, stride): (&[f32], usize)) {
    #[cfg(target_arch = "x86_64")]
    if fuses_multiply_add() {
        // SAFETY: `fuses_multiply_add` detected FMA.
        unsafe { continue_fused(sums, a, (b, stride)) };
        return;
    }
    continue_by(sums, a, (b, stride), fuses_multiply_add());
}

/// [`continue_chains`], by [`chain_term`] as `fused` says.
#[inline(always)]
fn continue_by(sums: &mut [f32], a: &[f32], (b, stride): (&[f32], usize), fused: bool) {
    for (depth, &a) in a.iter().enumerate() {
        let b = &b[depth * stride..][..sums.len()];
        for (sum, &b) in sums.iter_mut().zip(b) {
            *sum = chain_term(*sum, (a, b), fused);
        }
    }
}

/// [`continue_chains`] with the processor's fused multiply-add instruction (not a library call).
///
/// # Safety
/// The processor has FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn continue_fused(sums: &mut [f32], a: &[f32], (b, stride): (&[f32], usize)) {
    continue_by(sums, a, (b, stride), true);
}

/// `f` of the rows of 2-D `t` in memory (from its first element) and their stride, where its
/// columns are adjacent (a row-major matrix or a slice of its rows or columns); `None` otherwise.
pub(crate) fn with_rows<R>(
    t: &Tensor,
    f: impl FnOnce(&[f32], usize) -> R,
) -> Result<Option<R>, ModelError> {
    let (rows, columns) = t.dims2()?;
    let (storage, layout) = t.storage_and_layout();
    let stride = layout.stride();
    let Storage::Cpu(cpu) = &*storage else {
        return Ok(None);
    };
    if stride[1] != 1 || rows == 0 {
        return Ok(None);
    }
    let start = layout.start_offset();
    let data = &cpu.as_slice::<f32>()?[start..][..(rows - 1) * stride[0] + columns];
    Ok(Some(f(data, stride[0])))
}

/// Columns one task computes.
const TASK_COLUMNS: usize = 64;

/// `x [m, k] · w [k, n]`, row-major (its rows `stride` apart, its whole strips also in `strips`
/// where given), each output `x[r, 0]·w[0, j]` and then the later terms added in order by
/// multiply-adds, fused where `gemm` fuses them (AVX2 with FMA).
fn one_token_rows(
    x: &[f32],
    (w, stride, strips): (&[f32], usize, Option<&Strips>),
    (m, k, n): (usize, usize, usize),
) -> Vec<f32> {
    by_column_blocks(m, n, |(row, rows), (first, width), block| {
        let x = &x[row * k..][..rows * k];
        chain_block(x, (w, stride, strips), (rows, k), (first, width), block)
    })
}

/// An `[m, n]` output computed in blocks of `TASK_COLUMNS` consecutive columns on worker
/// threads, a block's rows split among tasks where the columns give too few blocks to keep every
/// thread busy to the end (a key or value projection of one decode step is a few blocks wide):
/// `fill((row, rows), (first, width), part)` writes rows `row..row + rows` of the block of
/// columns from `first`, `[rows, width]`. Each output is its own sum, whichever task makes it.
fn by_column_blocks(
    m: usize,
    n: usize,
    fill: impl Fn((usize, usize), (usize, usize), &mut [f32]) + Sync,
) -> Vec<f32> {
    let starts: Vec<usize> = (0..n).step_by(TASK_COLUMNS).collect();
    // Zeroed on worker threads too: a Gemma 3 logits step's blocks are 84 MB.
    let mut blocks: Vec<Vec<f32>> = starts
        .par_iter()
        .map(|&first| vec![0.0f32; m * TASK_COLUMNS.min(n - first)])
        .collect();
    let rows = task_rows(m, starts.len(), rayon::current_num_threads());
    let mut tasks = Vec::new();
    for (&first, block) in starts.iter().zip(&mut blocks) {
        let width = TASK_COLUMNS.min(n - first);
        for (group, part) in block.chunks_mut(rows * width).enumerate() {
            tasks.push(((group * rows, part.len() / width), (first, width), part));
        }
    }
    tasks
        .into_par_iter()
        .for_each(|(rows, columns, part)| fill(rows, columns, part));
    assemble(&blocks, m, n)
}

/// Tasks at least per worker thread in a product ([`by_column_blocks`]).
const TASKS_PER_THREAD: usize = 4;

/// Rows a task of [`by_column_blocks`] computes of a block, when `m` rows give `blocks` column
/// blocks for `threads` threads: all of them, unless splitting them in groups of whole passes
/// (multiples of [`WIDE_ROWS`] rows) is needed for [`TASKS_PER_THREAD`] tasks a thread.
fn task_rows(m: usize, blocks: usize, threads: usize) -> usize {
    let wanted = TASKS_PER_THREAD * threads.max(1);
    let groups = wanted
        .div_ceil(blocks.max(1))
        .min(m.div_ceil(WIDE_ROWS))
        .max(1);
    m.div_ceil(groups).next_multiple_of(WIDE_ROWS).max(1)
}

/// The task blocks `[m, width]` of consecutive columns, as one `[m, n]`, a row on each worker
/// thread in turn (a Gemma 3 output of 128 rows is 128 MiB).
fn assemble(blocks: &[Vec<f32>], m: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0; m * n];
    if n == 0 {
        return out;
    }
    out.par_chunks_mut(n).enumerate().for_each(|(row, out)| {
        let mut first = 0;
        for block in blocks {
            let width = block.len() / m;
            out[first..][..width].copy_from_slice(&block[row * width..][..width]);
            first += width;
        }
    });
    out
}

/// Columns `first..first + width` of `x · w` (`w`'s rows `stride` apart) into `block`
/// `[m, width]`, summed as a chain: strips of columns in vector registers where the processor
/// fuses (read from `strips` where given), the columns left over one by one.
fn chain_block(
    x: &[f32],
    (w, stride, strips): (&[f32], usize, Option<&Strips>),
    (m, k): (usize, usize),
    (first, width): (usize, usize),
    block: &mut [f32],
) {
    let fused = fuses_multiply_add();
    #[cfg(target_arch = "x86_64")]
    let done = match fused {
        // SAFETY: `fuses_multiply_add` detected AVX2 and FMA, and `wide` AVX-512F.
        true => unsafe {
            let weights = (w, stride, strips);
            chain_strips(x, weights, (m, k), (first, width), (block, wide()))
        },
        false => 0,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    let columns = (first, done, width);
    #[cfg(target_arch = "x86_64")]
    if fused {
        // SAFETY: `fuses_multiply_add` detected AVX2 and FMA.
        unsafe { fused_columns(x, (w, stride), (m, k), columns, block) };
        return;
    }
    chain_columns(x, (w, stride), (m, k), columns, (block, fused));
}

/// Columns `first + done..first + width` of [`chain_block`] one at a time, each added by
/// [`chain_term`] as `fused` says.
#[inline(always)]
fn chain_columns(
    x: &[f32],
    (w, stride): (&[f32], usize),
    (m, k): (usize, usize),
    (first, done, width): (usize, usize, usize),
    (block, fused): (&mut [f32], bool),
) {
    for column in done..width {
        let weight = |depth: usize| w[depth * stride + first + column];
        for row in 0..m {
            let mut sum = x[row * k] * weight(0);
            for depth in 1..k {
                sum = chain_term(sum, (x[row * k + depth], weight(depth)), fused);
            }
            block[row * width + column] = sum;
        }
    }
}

/// [`chain_columns`] fused, by the processor's instruction (not a library call).
///
/// # Safety
/// The processor has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fused_columns(
    x: &[f32],
    w: (&[f32], usize),
    shape: (usize, usize),
    columns: (usize, usize, usize),
    block: &mut [f32],
) {
    chain_columns(x, w, shape, columns, (block, true));
}

/// The least distance between a matrix's rows, in elements, at which a strip read by more than
/// one pass is packed: rows closer than a kilobyte (a head's values, 64 or 256 wide) fill whole
/// cache lines of a strip already and spread over the cache's sets.
const PACKED_STRIDE: usize = 256;

/// Rows a pass over a strip of two 8-lane vectors sums at once: twelve accumulators of AVX2's
/// sixteen registers.
const ROWS: usize = 6;
/// Rows a pass over a strip of two 16-lane vectors sums at once: sixteen accumulators of
/// AVX-512's thirty-two registers.
const WIDE_ROWS: usize = 8;

/// [`chain_block`]'s strips of columns from its first column on, two vectors wide (four where
/// so few rows that one pass takes them all, as attention's heads of one key-value head over a
/// cache; one for a last vector's width of columns), in 16-lane vectors (AVX-512) when `wide`,
/// else 8-lane ones. A strip's weights are read from `strips` when given (a weight's,
/// [`strip_columns`] wide), else copied once into consecutive memory when more than one pass
/// reads them (a weight matrix's rows lie kilobytes apart, a multiple of 2 KiB in these models,
/// and would crowd a few cache sets); each pass sums its rows over the whole depth in registers.
/// The number of columns done.
///
/// # Safety
/// The processor has AVX2 and FMA, and AVX-512F if `wide`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chain_strips(
    x: &[f32],
    (w, n, strips): (&[f32], usize, Option<&Strips>),
    (m, k): (usize, usize),
    (first, width): (usize, usize),
    (block, wide): (&mut [f32], bool),
) -> usize {
    let (lanes, pass_rows, few) = match wide {
        true => (16, WIDE_ROWS, 4),
        false => (8, ROWS, 3),
    };
    let mut packed = Vec::new();
    let mut column = 0;
    while column + lanes <= width {
        let vectors = match column + 2 * lanes <= width {
            true if strips.is_none() && m <= few && column + 4 * lanes <= width => 4,
            true => 2,
            false => 1,
        };
        let columns = vectors * lanes;
        let weights = match strips {
            Some(strips) if vectors == 2 => {
                assert_eq!(strips.width(), columns, "strips of the kernel's width");
                strips.strip(first + column).expect("a whole strip")
            }
            _ => {
                let pack = m > pass_rows && n >= PACKED_STRIDE;
                strip_weights(&w[first + column..], (n, k), columns, pack, &mut packed)
            }
        };
        let strip = Strip {
            weights,
            k,
            column,
            width,
        };
        let mut row = 0;
        while row < m {
            let rows = (row, pass_rows.min(m - row));
            match (wide, vectors) {
                (true, 4) => wide_pass::<4>(x, &strip, rows, block),
                (true, 2) => wide_pass::<2>(x, &strip, rows, block),
                (true, _) => wide_pass::<1>(x, &strip, rows, block),
                (false, 4) => narrow_pass::<4>(x, &strip, rows, block),
                (false, 2) => narrow_pass::<2>(x, &strip, rows, block),
                (false, _) => narrow_pass::<1>(x, &strip, rows, block),
            }
            row += rows.1;
        }
        column += columns;
    }
    column
}

/// A strip of columns as a pass reads it: its weights (rows `stride` apart, `k` of them) and
/// where its sums go in a block `width` columns wide.
struct Strip<'a> {
    weights: (&'a [f32], usize),
    k: usize,
    column: usize,
    width: usize,
}

impl Strip<'_> {
    /// Rows `row..` of `sums`, `V` vectors of `L` lanes each, into `block`.
    fn put<const L: usize, const V: usize>(
        &self,
        block: &mut [f32],
        row: usize,
        sums: &[[[f32; L]; V]],
    ) {
        for (offset, vectors) in sums.iter().enumerate() {
            let out = &mut block[(row + offset) * self.width + self.column..][..L * V];
            for (values, vector) in out.chunks_exact_mut(L).zip(vectors) {
                values.copy_from_slice(vector);
            }
        }
    }
}

/// The first `columns` columns of `strip` (rows `n` apart, `k` of them) as a pass reads them:
/// copied into `packed`, rows `columns` apart, when `pack`; else where they lie.
fn strip_weights<'a>(
    strip: &'a [f32],
    (n, k): (usize, usize),
    columns: usize,
    pack: bool,
    packed: &'a mut Vec<f32>,
) -> (&'a [f32], usize) {
    if !pack {
        return (strip, n);
    }
    packed.clear();
    append_strip(strip, (n, k), columns, packed);
    (packed, columns)
}

/// A pass and its kernel at one vector width. `$pass::<V>` sums `rows` rows from `row` of a strip
/// `V` vectors wide by `$kernel::<R, V>`, the kernel made for that many rows (one of `$rows`).
/// `$kernel::<R, V>` sums rows `row..row + R` by the strip's columns (`w`'s rows `stride` apart)
/// as a chain: each output the product of its first terms, then the later ones added in order by
/// fused multiply-adds. Every lane at either width does the same operations, so the widths give
/// the same sums. (The bounds are checked once, before the loads.)
///
/// Both are `unsafe`: the processor has `$feature`.
macro_rules! chain_kernel {
    (
        $pass:ident, $kernel:ident: $feature:literal, $vector:ident of $lanes:literal,
        rows $($rows:literal)+;
        $zero:ident, $load:ident, $splat:ident, $mul:ident, $fmadd:ident, $store:ident
    ) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feature)]
        unsafe fn $pass<const V: usize>(
            x: &[f32],
            strip: &Strip<'_>,
            (row, rows): (usize, usize),
            block: &mut [f32],
        ) {
            let (weights, k) = (strip.weights, strip.k);
            match rows {
                $($rows => strip.put(block, row, &$kernel::<$rows, V>(x, weights, k, row)),)+
                _ => unreachable!("a pass of {rows} rows"),
            }
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feature)]
        #[inline]
        unsafe fn $kernel<const R: usize, const V: usize>(
            x: &[f32],
            (w, stride): (&[f32], usize),
            k: usize,
            row: usize,
        ) -> [[[f32; $lanes]; V]; R] {
            use std::arch::x86_64::*;
            assert!(k > 0 && (k - 1) * stride + $lanes * V <= w.len() && (row + R) * k <= x.len());
            let (w, x) = (w.as_ptr(), x.as_ptr().add(row * k));
            let mut weights: [$vector; V] = [$zero(); V];
            let mut sums = [[$zero(); V]; R];
            for (index, weight) in weights.iter_mut().enumerate() {
                *weight = $load(w.add($lanes * index));
            }
            for (offset, sum) in sums.iter_mut().enumerate() {
                let a = $splat(*x.add(offset * k));
                for (value, weight) in sum.iter_mut().zip(&weights) {
                    *value = $mul(a, *weight);
                }
            }
            for depth in 1..k {
                let at = w.add(depth * stride);
                for (index, weight) in weights.iter_mut().enumerate() {
                    *weight = $load(at.add($lanes * index));
                }
                for (offset, sum) in sums.iter_mut().enumerate() {
                    let a = $splat(*x.add(offset * k + depth));
                    for (value, weight) in sum.iter_mut().zip(&weights) {
                        *value = $fmadd(a, *weight, *value);
                    }
                }
            }
            let mut out = [[[0.0f32; $lanes]; V]; R];
            for (values, sum) in out.iter_mut().zip(&sums) {
                for (lanes, vector) in values.iter_mut().zip(sum) {
                    $store(lanes.as_mut_ptr(), *vector);
                }
            }
            out
        }
    };
}

chain_kernel!(
    narrow_pass, chain_narrow: "avx2,fma", __m256 of 8, rows 1 2 3 4 5 6;
    _mm256_setzero_ps, _mm256_loadu_ps, _mm256_set1_ps, _mm256_mul_ps, _mm256_fmadd_ps,
    _mm256_storeu_ps
);
chain_kernel!(
    wide_pass, chain_wide: "avx512f", __m512 of 16, rows 1 2 3 4 5 6 7 8;
    _mm512_setzero_ps, _mm512_loadu_ps, _mm512_set1_ps, _mm512_mul_ps, _mm512_fmadd_ps,
    _mm512_storeu_ps
);

/// `x [m, k] · wᵀ` for `w` `[n, k]` (rows `stride` apart): each output the dot product of a row
/// of `x` and one of `w`, summed as `gemm`'s one-row path against a transposed weight sums it.
/// Where the processor has the registers (AVX-512), three rows and two columns at a time share
/// their loads (a last column's rows three at a time); with AVX2 alone, pairs of rows and groups
/// of four columns: the same operations per row, so the same sums, at fewer loads per
/// multiply-add.
fn dot_rows(x: &[f32], w: &[f32], stride: usize, (m, k, n): (usize, usize, usize)) -> Vec<f32> {
    let shared = shares_weight_loads();
    let blocked = !shared && fuses_multiply_add();
    by_column_blocks(m, n, |(row, m), (first, width), block| {
        let x = &x[row * k..][..m * k];
        let weight = |column: usize| &w[(first + column) * stride..][..k];
        let mut column = 0;
        #[cfg(target_arch = "x86_64")]
        if shared {
            // SAFETY: `shares_weight_loads` detected AVX2, FMA, AVX-512F and AVX-512VL.
            let kernel = |rows: [&[f32]; 3], weights: [&[f32]; 2]| unsafe {
                gemv_dot_3x2_avx512(rows, weights)
            };
            column = dot_tiles(x, weight, (m, k, width), block, kernel, shared);
        } else if blocked {
            // SAFETY: `fuses_multiply_add` detected AVX2 and FMA.
            let kernel = |rows: [&[f32]; 2], weights: [&[f32]; 4]| unsafe {
                gemv_dot_2x4_avx2(rows, weights)
            };
            column = dot_tiles(x, weight, (m, k, width), block, kernel, shared);
        }
        for column in column..width {
            dot_column(x, weight(column), (0, m, k), (block, width, column), shared);
        }
    })
}

/// The rows of `x` `R` at a time through the columns of `block` (`width` wide, column `c` the
/// dot products with `weight(c)`) `C` at a time, by `kernel`, so that the rows stay in the
/// first-level cache while the weights pass; the rows past the last whole group of `R`, column by
/// column ([`dot_column`]). Returns the columns done: the whole groups of `C`.
#[cfg(target_arch = "x86_64")]
fn dot_tiles<'w, const R: usize, const C: usize>(
    x: &[f32],
    weight: impl Fn(usize) -> &'w [f32],
    (m, k, width): (usize, usize, usize),
    block: &mut [f32],
    kernel: impl Fn([&[f32]; R], [&[f32]; C]) -> [[f32; C]; R],
    shared: bool,
) -> usize {
    let (grouped, tiled) = (m / R * R, width / C * C);
    for row in (0..grouped).step_by(R) {
        let rows: [&[f32]; R] = std::array::from_fn(|r| &x[(row + r) * k..][..k]);
        for column in (0..tiled).step_by(C) {
            let weights: [&[f32]; C] = std::array::from_fn(|c| weight(column + c));
            let sums = kernel(rows, weights);
            for (r, sums) in sums.into_iter().enumerate() {
                block[(row + r) * width + column..][..C].copy_from_slice(&sums);
            }
        }
    }
    for column in 0..tiled {
        dot_column(
            x,
            weight(column),
            (grouped, m, k),
            (block, width, column),
            shared,
        );
    }
    tiled
}

/// Rows `from..m` of `x` dotted with `weight` into column `column` of `block` (`width` wide), by
/// [`gemv_dot`], three rows sharing each load of the weight where `shared`.
fn dot_column(
    x: &[f32],
    weight: &[f32],
    (from, m, k): (usize, usize, usize),
    (block, width, column): (&mut [f32], usize, usize),
    shared: bool,
) {
    let mut row = from;
    #[cfg(target_arch = "x86_64")]
    while shared && row + 3 <= m {
        let rows = [0, 1, 2].map(|r| &x[(row + r) * k..][..k]);
        // SAFETY: `shares_weight_loads` detected AVX2, FMA and AVX-512VL.
        let sums = unsafe { gemv_dot3_avx512vl(rows, weight) };
        for (r, sum) in sums.into_iter().enumerate() {
            block[(row + r) * width + column] = sum;
        }
        row += 3;
    }
    for row in row..m {
        block[row * width + column] = gemv_dot(&x[row * k..][..k], weight);
    }
}

/// `a · b` summed as `gemm`'s `mixed_gemv_rowmajor` sums it: with AVX2 and FMA, eight 8-lane
/// accumulators over blocks of 64 terms, added pairwise; whole vectors into the first; its
/// lanes in order; the remaining terms one by one, all fused. Without them, the same with
/// 1-lane accumulators, unfused.
fn gemv_dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if fuses_multiply_add() {
        // SAFETY: `fuses_multiply_add` detected AVX2 and FMA.
        return unsafe { gemv_dot_avx2(a, b) };
    }
    let k = a.len();
    let mut acc = [0.0f32; 8];
    let mut depth = 0;
    while depth + 8 <= k {
        for (lane, value) in acc.iter_mut().enumerate() {
            *value += a[depth + lane] * b[depth + lane];
        }
        depth += 8;
    }
    let mut total =
        ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for index in depth..k {
        total += a[index] * b[index];
    }
    total
}

/// [`gemv_dot`] with AVX2 and FMA.
///
/// # Safety
/// The processor has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gemv_dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let k = a.len();
    assert_eq!(a.len(), b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut depth = 0;
    while depth + 64 <= k {
        for (index, sum) in acc.iter_mut().enumerate() {
            let at = depth + 8 * index;
            *sum = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(at)),
                _mm256_loadu_ps(pb.add(at)),
                *sum,
            );
        }
        depth += 64;
    }
    dot_tail_avx2(acc, (a, b), depth)
}

/// Three rows `a` dotted with `b` as [`gemv_dot_avx2`] dots each, every load of `b` shared by
/// the three (24 accumulators: AVX-512VL's 32 vector registers hold them).
///
/// # Safety
/// The processor has AVX2, FMA and AVX-512VL.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
unsafe fn gemv_dot3_avx512vl(a: [&[f32]; 3], b: &[f32]) -> [f32; 3] {
    use std::arch::x86_64::*;
    let k = b.len();
    assert!(a.iter().all(|row| row.len() == k));
    let pa = a.map(<[f32]>::as_ptr);
    let pb = b.as_ptr();
    let mut acc = [[_mm256_setzero_ps(); 8]; 3];
    let mut depth = 0;
    while depth + 64 <= k {
        for index in 0..8 {
            let at = depth + 8 * index;
            let weight = _mm256_loadu_ps(pb.add(at));
            for (sums, row) in acc.iter_mut().zip(&pa) {
                sums[index] = _mm256_fmadd_ps(_mm256_loadu_ps(row.add(at)), weight, sums[index]);
            }
        }
        depth += 64;
    }
    // Plain loops, not closures: a closure borrowing the accumulators keeps them in memory,
    // stored after every multiply-add.
    let mut dots = [0.0f32; 3];
    for (r, dot) in dots.iter_mut().enumerate() {
        *dot = dot_tail_avx2(acc[r], (a[r], b), depth);
    }
    dots
}

/// Three rows `a` each dotted with two columns `b` as [`gemv_dot_avx2`] dots them, in 16-lane
/// vectors: lanes 0-7 of the `i`-th vector are the 8-lane accumulator `2i`, lanes 8-15 the
/// accumulator `2i + 1`, each lane the same chain of fused multiply-adds, so the sums are
/// [`gemv_dot_avx2`]'s bit for bit. Each load of a row serves two columns and each of a column
/// three rows (24 accumulators of AVX-512's 32 registers).
///
/// # Safety
/// The processor has AVX2, FMA, AVX-512F and AVX-512VL.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
unsafe fn gemv_dot_3x2_avx512(a: [&[f32]; 3], b: [&[f32]; 2]) -> [[f32; 2]; 3] {
    use std::arch::x86_64::*;
    let k = b[0].len();
    assert!(a.iter().chain(&b).all(|v| v.len() == k));
    let (pa, pb) = (a.map(<[f32]>::as_ptr), b.map(<[f32]>::as_ptr));
    let mut acc = [[[_mm512_setzero_ps(); 4]; 2]; 3];
    let mut depth = 0;
    while depth + 64 <= k {
        for index in 0..4 {
            let at = depth + 16 * index;
            let weights = pb.map(|column| _mm512_loadu_ps(column.add(at)));
            for (row_sums, row) in acc.iter_mut().zip(&pa) {
                let value = _mm512_loadu_ps(row.add(at));
                for (sums, weight) in row_sums.iter_mut().zip(&weights) {
                    sums[index] = _mm512_fmadd_ps(value, *weight, sums[index]);
                }
            }
        }
        depth += 64;
    }
    let mut narrow = [[[_mm256_setzero_ps(); 8]; 2]; 3];
    for (narrow, acc) in narrow.iter_mut().zip(acc) {
        for (narrow, acc) in narrow.iter_mut().zip(acc) {
            *narrow = halves(acc);
        }
    }
    finish_dots(narrow, (a, b), depth)
}

/// Four 16-lane accumulators as the eight 8-lane ones they hold, each vector's low half first.
///
/// # Safety
/// The processor has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn halves(wide: [std::arch::x86_64::__m512; 4]) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    let high = |v: __m512| _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    std::array::from_fn(|index| match index % 2 {
        0 => _mm512_castps512_ps256(wide[index / 2]),
        _ => high(wide[index / 2]),
    })
}

/// Two rows `a` each dotted with four columns `b` as [`gemv_dot_avx2`] dots them, where AVX2's
/// 16 vector registers cannot hold two rows' 16 accumulators: each of the eight accumulators
/// runs through the depth in turn (its sum alone depends on its order), for the eight
/// (row, column) pairs at once, so each load of a row serves four columns and each of a column
/// two rows.
///
/// # Safety
/// The processor has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gemv_dot_2x4_avx2(a: [&[f32]; 2], b: [&[f32]; 4]) -> [[f32; 4]; 2] {
    use std::arch::x86_64::*;
    let k = b[0].len();
    assert!(a.iter().chain(&b).all(|v| v.len() == k));
    let (pa, pb) = (a.map(<[f32]>::as_ptr), b.map(<[f32]>::as_ptr));
    let whole = k / 64 * 64;
    let mut acc = [[[_mm256_setzero_ps(); 8]; 4]; 2];
    for index in 0..8 {
        let mut sums = [[_mm256_setzero_ps(); 4]; 2];
        for depth in (0..whole).step_by(64) {
            let at = depth + 8 * index;
            let mut weights = [_mm256_setzero_ps(); 4];
            for (weight, column) in weights.iter_mut().zip(&pb) {
                *weight = _mm256_loadu_ps(column.add(at));
            }
            for (row_sums, row) in sums.iter_mut().zip(&pa) {
                let value = _mm256_loadu_ps(row.add(at));
                for (sum, weight) in row_sums.iter_mut().zip(&weights) {
                    *sum = _mm256_fmadd_ps(value, *weight, *sum);
                }
            }
        }
        for (row_acc, row_sums) in acc.iter_mut().zip(&sums) {
            for (column_acc, sum) in row_acc.iter_mut().zip(row_sums) {
                column_acc[index] = *sum;
            }
        }
    }
    finish_dots(acc, (a, b), whole)
}

/// Each row of `a` dotted with each column of `b` as [`gemv_dot_avx2`] dots them, from the
/// eight accumulators of their sum up to `depth` ([`dot_tail_avx2`]). Plain loops, not closures:
/// a closure borrowing the accumulators in the kernel that made them keeps them in memory, stored
/// after every multiply-add.
///
/// # Safety
/// The processor has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn finish_dots<const R: usize, const C: usize>(
    acc: [[[std::arch::x86_64::__m256; 8]; C]; R],
    (a, b): ([&[f32]; R], [&[f32]; C]),
    depth: usize,
) -> [[f32; C]; R] {
    let mut dots = [[0.0f32; C]; R];
    for ((dots, acc), a) in dots.iter_mut().zip(acc).zip(a) {
        for ((dot, acc), b) in dots.iter_mut().zip(acc).zip(b) {
            *dot = dot_tail_avx2(acc, (a, b), depth);
        }
    }
    dots
}

/// The end of [`gemv_dot_avx2`]'s sum from `depth` on, given its eight accumulators: added
/// pairwise, whole vectors into the first, its lanes in order, the remaining terms one by one.
///
/// # Safety
/// The processor has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_tail_avx2(
    acc: [std::arch::x86_64::__m256; 8],
    (a, b): (&[f32], &[f32]),
    mut depth: usize,
) -> f32 {
    use std::arch::x86_64::*;
    let k = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let low = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let high = _mm256_add_ps(_mm256_add_ps(acc[4], acc[5]), _mm256_add_ps(acc[6], acc[7]));
    let mut sum = _mm256_add_ps(low, high);
    while depth + 8 <= k {
        sum = _mm256_fmadd_ps(
            _mm256_loadu_ps(pa.add(depth)),
            _mm256_loadu_ps(pb.add(depth)),
            sum,
        );
        depth += 8;
    }
    let mut lanes = [0.0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
    let mut total = lanes[0];
    for value in &lanes[1..] {
        total += value;
    }
    for index in depth..k {
        total = a[index].mul_add(b[index], total);
    }
    total
}

/// Whether `gemm` fuses its multiply-adds here: it runs its AVX2 kernels (which fuse) where the
/// processor has AVX2 and FMA, and otherwise multiplies and adds.
fn fuses_multiply_add() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("avx2");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The width of the strips [`chain_strips`] reads a weight's columns in (two vectors), where the
/// products sum in strips here (AVX2 and FMA).
pub(crate) fn strip_columns() -> Option<usize> {
    match (fuses_multiply_add(), wide()) {
        (false, _) => None,
        (true, true) => Some(32),
        (true, false) => Some(16),
    }
}

/// Whether [`chain_block`] may sum in 16-lane vectors: AVX-512F.
fn wide() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::is_x86_feature_detected!("avx512f");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether [`dot_rows`] may share loads among three rows (and two columns): AVX-512F and
/// AVX-512VL besides AVX2 and FMA.
fn shares_weight_loads() -> bool {
    #[cfg(target_arch = "x86_64")]
    return fuses_multiply_add() && wide() && std::is_x86_feature_detected!("avx512vl");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Values in (-1, 1) that differ from element to element.
    pub(crate) fn wave(len: usize, seed: f32) -> Vec<f32> {
        (0..len)
            .map(|i| ((i as f32 + seed) * 0.7123).sin())
            .collect()
    }

    /// `rows_product` of `x`'s rows, one token each, asserted to be each row's product alone.
    fn each_row_as_alone(x: &Tensor, w: &Tensor, case: &str) -> Vec<Vec<f32>> {
        let spans: Vec<(usize, usize)> = (0..x.dims2().unwrap().0).map(|r| (r, 1)).collect();
        let batched: Vec<Vec<f32>> = rows_product(x, w, &spans).unwrap().to_vec2().unwrap();
        for (row, got) in batched.iter().enumerate() {
            let alone = x.narrow(0, row, 1).unwrap().matmul(w).unwrap();
            let alone: Vec<Vec<f32>> = alone.to_vec2().unwrap();
            assert_eq!(got, &alone[0], "{case}: row {row}");
        }
        batched
    }

    #[test]
    fn one_token_rows_sum_as_a_row_alone() {
        // Deeper than a gemm block. Five rows read each strip's weights where they lie; nineteen
        // from packed copies, in whole passes and a pass of the rows left. A task's last block
        // of columns is 8 wide (n = 200: no strip, column by column) or 48 (n = 176). Three and
        // four rows, as attention's heads of one key-value head, take strips four vectors wide.
        // Forty rows of one block of columns, and 21 of two, are split among tasks by rows.
        let k = 1536;
        for (m, n) in [
            (5, 200),
            (19, 176),
            (19, 200),
            (3, 64),
            (4, 256),
            (40, 64),
            (21, 120),
        ] {
            let x = Tensor::from_vec(wave(m * k, 0.5), (m, k), &Device::Cpu).unwrap();
            let w = Tensor::from_vec(wave(k * n, 1.5), (k, n), &Device::Cpu).unwrap();
            let batched = each_row_as_alone(&x, &w, &format!("{m} rows, n = {n}"));
            // gemm's own stacked product differs in the last bits at this depth: the case above
            // is not one that any summation would pass.
            let stacked: Vec<Vec<f32>> = x.matmul(&w).unwrap().to_vec2().unwrap();
            assert_ne!(stacked, batched);
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn strips_of_either_width_are_the_fused_chain() {
        if !fuses_multiply_add() {
            return;
        }
        let (k, n, first) = (300, 200, 8);
        let (x, w) = (wave(19 * k, 0.5), wave(k * n, 1.5));
        let chain = |row: usize, column: usize| {
            let mut sum = x[row * k] * w[first + column];
            for depth in 1..k {
                sum = x[row * k + depth].mul_add(w[depth * n + first + column], sum);
            }
            sum
        };
        // A strip's weights read where they lie or packed, in whole passes and a pass of the
        // rest; four vectors wide for three or four rows; one vector wide for a last vector's
        // width of columns; a block's last columns left over.
        for (m, width) in [
            (3, 64),
            (4, 64),
            (13, 64),
            (2, 48),
            (19, 48),
            (13, 56),
            (2, 44),
        ] {
            for wide in [false, wide()] {
                let mut block = vec![f32::NAN; m * width];
                // SAFETY: AVX2 and FMA detected above, AVX-512F where `wide`.
                let done = unsafe {
                    chain_strips(
                        &x,
                        (&w, n, None),
                        (m, k),
                        (first, width),
                        (&mut block, wide),
                    )
                };
                let lanes = if wide { 16 } else { 8 };
                assert_eq!(done, width / lanes * lanes);
                for (row, column) in (0..m).flat_map(|row| (0..done).map(move |c| (row, c))) {
                    let got = block[row * width + column];
                    assert_eq!(
                        got,
                        chain(row, column),
                        "{m} rows, wide {wide}: {row}, {column}"
                    );
                }
            }
        }
    }

    #[test]
    fn one_token_rows_against_a_transposed_weight_sum_as_a_row_alone() {
        // Depths with and without a remainder past the 64-term blocks and past whole vectors;
        // more outputs than gemm's small-product kernel takes (16 × 16).
        for k in [640, 650, 13] {
            // Seven rows: two groups of three through pairs of columns, and one alone (with
            // AVX-512); three pairs sharing loads of four columns, and one alone (with AVX2 only).
            // The last task's 46 columns leave two outside the groups of four. Then 29 rows of
            // 301 columns, split among tasks by rows: the last task's 45 columns leave one
            // outside the pairs, its rows three at a time.
            for (m, n) in [(7, 302), (29, 301)] {
                let x = Tensor::from_vec(wave(m * k, 0.25), (m, k), &Device::Cpu).unwrap();
                let rows = Tensor::from_vec(wave(n * k, 4.5), (n, k), &Device::Cpu).unwrap();
                let w = rows.t().unwrap();
                each_row_as_alone(&x, &w, &format!("k = {k}, {m} rows"));
            }
        }
    }

    #[test]
    fn a_product_of_few_column_blocks_splits_its_rows_in_whole_passes() {
        // Two threads want eight tasks: 80 rows of three blocks (a SmolLM2 key projection) in
        // groups of 32 rows, three a block; of nine blocks, whole; one block of 3 rows, whole.
        assert_eq!(task_rows(80, 3, 2), 32);
        assert_eq!(task_rows(80, 9, 2), 80);
        assert_eq!(task_rows(3, 1, 2), 8);
        assert_eq!(task_rows(80, 1, 1), 24);
        assert_eq!(task_rows(0, 1, 2), 1);
    }

    #[test]
    fn rows_of_several_tokens_get_their_own_products() {
        let (k, n) = (1100, 64);
        let x = Tensor::from_vec(wave(5 * k, 2.5), (5, k), &Device::Cpu).unwrap();
        let w = Tensor::from_vec(wave(k * n, 3.5), (k, n), &Device::Cpu).unwrap();
        let spans = [(0, 2), (2, 3)];
        let got: Vec<Vec<f32>> = rows_product(&x, &w, &spans).unwrap().to_vec2().unwrap();
        for &(first, rows) in &spans {
            let alone: Vec<Vec<f32>> = x
                .narrow(0, first, rows)
                .unwrap()
                .matmul(&w)
                .unwrap()
                .to_vec2()
                .unwrap();
            assert_eq!(got[first..first + rows], alone[..]);
        }
    }
}
