//! The logit product `out[r][j] = scale · Σ_d a[r][d] · k[j][d]` of a block of query rows
//! against a prefix of keys: the q·Kᵀ half of the attention-scoring kernel. It was
//! ndarray's `general_mat_mul` (matrixmultiply); this is the same microkernel design (a 6 × 16
//! register tile of fused multiply-adds, BLIS's Haswell shape) with two differences that matter
//! at attention's shapes, where the inner dimension is only the head size (64):
//! - the keys are packed once per scorer ([`PackedKeys`], on demand as the prefix grows), not
//!   once per product: matrixmultiply packed the whole prefix again for every 64-row block;
//! - nothing is allocated per product: matrixmultiply allocated a ~272 KiB packing buffer for
//!   every call, which the binary's allocator tuning (blocks ≥ 128 KiB are mapped) turned into
//!   fresh page faults every time.
//!
//! Every output is one chain of fused multiply-adds over `d` in order, then one multiply by the
//! scale, in the AVX2/FMA code and the portable code alike (`mul_add` rounds once, like the
//! instruction), so results do not depend on the machine.

use ndarray::ArrayView2;

/// Keys per packed panel (two AVX vectors, one cache line per dimension).
const PANEL: usize = 16;
/// Query rows per register tile: 6 rows × 2 vectors = 12 accumulators, plus two key vectors
/// and one broadcast query value, fit AVX2's 16 registers.
const TILE_ROWS: usize = 6;

/// One dimension of one panel: the sixteen keys' values there, on their own cache line.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct PanelRow([f32; PANEL]);

/// A prefix of keys `[T, d]` packed for [`scaled_product`]: panels of [`PANEL`] consecutive
/// keys, each stored dimension-major (`d` rows of [`PANEL`] values), the last one zero-padded.
/// Panels are packed when a product first needs them; the keys come with every product, so a
/// prefix that grows between products (a live model's keys, token by token) packs only what is
/// new: the last panel again if it was partial, then the panels after it.
#[derive(Debug, Clone)]
pub struct PackedKeys {
    head_dim: usize,
    panels: Vec<PanelRow>,
    /// Keys packed so far (the last panel may hold fewer than [`PANEL`]).
    packed_keys: usize,
}

impl PackedKeys {
    /// Packs nothing yet.
    pub fn new(head_dim: usize) -> Self {
        Self {
            head_dim,
            panels: Vec::new(),
            packed_keys: 0,
        }
    }

    /// Frees the packed panels; they are packed again when next needed.
    pub fn release(&mut self) {
        self.panels = Vec::new();
        self.packed_keys = 0;
    }

    /// Packs the panels that hold keys `0..n_keys` of `keys`.
    fn ensure(&mut self, keys: ArrayView2<f32>, n_keys: usize) {
        let head_dim = self.head_dim;
        if n_keys <= self.packed_keys || head_dim == 0 {
            return;
        }
        if self.panels.capacity() == 0 {
            // One allocation sized for every key there is (its pages become resident only as
            // panels are written).
            self.panels
                .reserve_exact(keys.nrows().div_ceil(PANEL) * head_dim);
        }
        let first = self.packed_keys / PANEL;
        let needed = n_keys.div_ceil(PANEL);
        self.panels.truncate(first * head_dim);
        for panel in first..needed {
            let start = self.panels.len();
            self.panels.resize(start + head_dim, PanelRow([0.0; PANEL]));
            let rows = &mut self.panels[start..];
            let panel_keys = keys.outer_iter().skip(panel * PANEL).take(PANEL);
            for (column, key) in panel_keys.enumerate() {
                for (row, value) in rows.iter_mut().zip(key) {
                    row.0[column] = *value;
                }
            }
        }
        self.packed_keys = (needed * PANEL).min(keys.nrows());
    }
}

/// `out[r · n_keys + j] = scale · rows[r] · keys[j]` for every row of `rows` `[R, d]` and the
/// first `n_keys` keys. Full register tiles need `R` to be a multiple of 6.
pub fn scaled_product(
    rows: ArrayView2<f32>,
    keys: ArrayView2<f32>,
    packed: &mut PackedKeys,
    n_keys: usize,
    scale: f32,
    out: &mut [f32],
) {
    let (n_rows, head_dim) = rows.dim();
    assert_eq!(
        head_dim, packed.head_dim,
        "queries and keys differ in head size"
    );
    assert!(n_keys <= keys.nrows(), "more keys asked for than there are");
    assert_eq!(out.len(), n_rows * n_keys, "output is rows × keys");
    let rows = rows.as_standard_layout();
    packed.ensure(keys, n_keys);
    let product = Product {
        queries: rows.as_slice().expect("standard layout"),
        n_rows,
        head_dim,
        panels: &packed.panels,
        n_keys,
        scale,
    };
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the features were detected just above.
        return unsafe { product.run_avx2(out) };
    }
    product.run::<false>(out);
}

/// The operands of one product, checked by [`scaled_product`].
struct Product<'p> {
    /// `[n_rows, head_dim]`, row-major.
    queries: &'p [f32],
    n_rows: usize,
    head_dim: usize,
    /// At least the panels covering `n_keys`.
    panels: &'p [PanelRow],
    n_keys: usize,
    scale: f32,
}

impl Product<'_> {
    /// # Safety
    /// The processor has AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self, out: &mut [f32]) {
        self.run::<true>(out);
    }

    /// Every panel against every tile of rows (a panel, `d` cache lines, stays in L1 while the
    /// rows stream past it); `VECTOR` picks the AVX2 tiles (only called so from `run_avx2`).
    #[inline(always)]
    fn run<const VECTOR: bool>(&self, out: &mut [f32]) {
        let n_rows = self.n_rows;
        for (panel, first_key) in (0..self.n_keys).step_by(PANEL).enumerate() {
            let tile = Tile {
                panel: &self.panels[panel * self.head_dim..(panel + 1) * self.head_dim],
                scale: self.scale,
                columns: PANEL.min(self.n_keys - first_key),
                out_stride: self.n_keys,
            };
            for first_row in (0..n_rows).step_by(TILE_ROWS) {
                let count = TILE_ROWS.min(n_rows - first_row);
                let queries = &self.queries[first_row * self.head_dim..][..count * self.head_dim];
                let out = &mut out[first_row * self.n_keys + first_key..];
                match count {
                    6 => tile.run::<6, VECTOR>(queries, out),
                    5 => tile.run::<5, VECTOR>(queries, out),
                    4 => tile.run::<4, VECTOR>(queries, out),
                    3 => tile.run::<3, VECTOR>(queries, out),
                    2 => tile.run::<2, VECTOR>(queries, out),
                    _ => tile.run::<1, VECTOR>(queries, out),
                }
            }
        }
    }
}

/// One panel of keys against up to [`TILE_ROWS`] query rows.
struct Tile<'p> {
    /// `head_dim` rows.
    panel: &'p [PanelRow],
    scale: f32,
    /// Valid keys in the panel (the rest is padding, not written out).
    columns: usize,
    out_stride: usize,
}

impl Tile<'_> {
    /// `queries` holds `R` rows of the panel's `head_dim`; row `i`'s results go to
    /// `out[i · out_stride ..][..columns]`.
    #[inline(always)]
    fn run<const R: usize, const VECTOR: bool>(&self, queries: &[f32], out: &mut [f32]) {
        assert!(queries.len() == R * self.panel.len());
        assert!(out.len() >= (R - 1) * self.out_stride + self.columns);
        #[cfg(target_arch = "x86_64")]
        if VECTOR {
            // SAFETY: `VECTOR` is only set under `run_avx2`; the sizes were checked.
            return unsafe { self.run_avx2::<R>(queries, out) };
        }
        self.run_portable::<R>(queries, out);
    }

    fn run_portable<const R: usize>(&self, queries: &[f32], out: &mut [f32]) {
        let head_dim = self.panel.len();
        let mut sums = [[0.0f32; PANEL]; R];
        for (d, keys) in self.panel.iter().enumerate() {
            for (row, sums) in sums.iter_mut().enumerate() {
                let query = queries[row * head_dim + d];
                for (sum, key) in sums.iter_mut().zip(&keys.0) {
                    *sum = query.mul_add(*key, *sum);
                }
            }
        }
        for (row, sums) in sums.iter().enumerate() {
            let out = &mut out[row * self.out_stride..][..self.columns];
            for (out, sum) in out.iter_mut().zip(sums) {
                *out = sum * self.scale;
            }
        }
    }

    /// # Safety
    /// The processor has AVX2 and FMA; sizes as checked by [`Tile::run`].
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2<const R: usize>(&self, queries: &[f32], out: &mut [f32]) {
        use std::arch::x86_64::*;
        let head_dim = self.panel.len();
        let mut sums = [[_mm256_setzero_ps(); 2]; R];
        let mut queries = queries.as_ptr();
        for keys in self.panel {
            let keys = keys.0.as_ptr();
            // SAFETY: a panel row holds sixteen floats; `queries` walks the first row's
            // `head_dim` floats, and row `i` is `i · head_dim` further, within the
            // `R · head_dim` floats checked by `run`.
            unsafe {
                let (low, high) = (_mm256_load_ps(keys), _mm256_load_ps(keys.add(8)));
                for (row, sums) in sums.iter_mut().enumerate() {
                    let query = _mm256_broadcast_ss(&*queries.add(row * head_dim));
                    sums[0] = _mm256_fmadd_ps(query, low, sums[0]);
                    sums[1] = _mm256_fmadd_ps(query, high, sums[1]);
                }
                queries = queries.add(1);
            }
        }
        let scale = _mm256_set1_ps(self.scale);
        for (row, sums) in sums.iter().enumerate() {
            let (low, high) = (_mm256_mul_ps(sums[0], scale), _mm256_mul_ps(sums[1], scale));
            let out = &mut out[row * self.out_stride..][..self.columns];
            if self.columns == PANEL {
                // SAFETY: `out` holds a whole panel's sixteen floats.
                unsafe {
                    _mm256_storeu_ps(out.as_mut_ptr(), low);
                    _mm256_storeu_ps(out.as_mut_ptr().add(8), high);
                }
            } else {
                let mut scaled = [0.0f32; PANEL];
                // SAFETY: `scaled` holds two vectors.
                unsafe {
                    _mm256_storeu_ps(scaled.as_mut_ptr(), low);
                    _mm256_storeu_ps(scaled.as_mut_ptr().add(8), high);
                }
                for (out, value) in out.iter_mut().zip(scaled) {
                    *out = value;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array2;

    fn fixture(rows: usize, n_keys: usize, head_dim: usize) -> (Array2<f32>, Array2<f32>) {
        let queries = Array2::from_shape_fn((rows, head_dim), |(r, d)| {
            ((r * 37 + d * 11) % 23) as f32 * 0.17 - 1.9
        });
        let keys = Array2::from_shape_fn((n_keys, head_dim), |(j, d)| {
            ((j * 13 + d * 7) % 19) as f32 * 0.21 - 1.7
        });
        (queries, keys)
    }

    /// Brute force: one fused multiply-add chain per output, as documented.
    fn brute(queries: &Array2<f32>, keys: &Array2<f32>, n_keys: usize, scale: f32) -> Vec<f32> {
        let mut out = Vec::new();
        for query in queries.outer_iter() {
            for key in keys.outer_iter().take(n_keys) {
                let sum = query
                    .iter()
                    .zip(&key)
                    .fold(0.0f32, |s, (q, k)| q.mul_add(*k, s));
                out.push(sum * scale);
            }
        }
        out
    }

    #[test]
    fn matches_the_brute_force_bit_for_bit_at_every_edge() {
        // Row counts around the 6-row tile, key counts around the 16-key panel, odd head sizes.
        for (rows, n_keys, head_dim) in [
            (1, 1, 1),
            (6, 16, 8),
            (7, 17, 3),
            (64, 150, 64),
            (13, 33, 5),
        ] {
            let (queries, keys) = fixture(rows, n_keys, head_dim);
            let mut packed = PackedKeys::new(head_dim);
            // Growing prefixes, as a causal scorer asks for them, then a shorter one again.
            for prefix in [n_keys / 3, n_keys, 1, n_keys / 2] {
                let prefix = prefix.max(1);
                let mut out = vec![f32::NAN; rows * prefix];
                scaled_product(
                    queries.view(),
                    keys.view(),
                    &mut packed,
                    prefix,
                    0.125,
                    &mut out,
                );
                let want = brute(&queries, &keys, prefix, 0.125);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&out), bits(&want), "{rows}×{prefix}×{head_dim}");
            }
        }
    }

    #[test]
    fn portable_tiles_agree_with_the_dispatched_product() {
        let (queries, keys) = fixture(6, 16, 64);
        let mut packed = PackedKeys::new(64);
        let mut product = vec![0.0; 96];
        scaled_product(
            queries.view(),
            keys.view(),
            &mut packed,
            16,
            0.3,
            &mut product,
        );
        let tile = Tile {
            panel: &packed.panels,
            scale: 0.3,
            columns: 16,
            out_stride: 16,
        };
        let mut portable = vec![0.0; 96];
        tile.run_portable::<6>(queries.as_slice().expect("standard layout"), &mut portable);
        assert_eq!(product, portable);
    }

    #[test]
    fn packs_only_what_is_asked_for() {
        let (_, keys) = fixture(1, 100, 4);
        let mut packed = PackedKeys::new(4);
        packed.ensure(keys.view(), 17);
        assert_eq!(packed.packed_keys, 32);
        assert_eq!(packed.panels.len(), 2 * 4);
        // Key 17 is column 1 of panel 1; its dimension 2 is that panel's row 2.
        assert_eq!(packed.panels[4 + 2].0[1], keys[[17, 2]]);
        assert_eq!(
            packed.panels.as_ptr() as usize % 64,
            0,
            "cache-line aligned"
        );
        packed.ensure(keys.view(), 100);
        assert_eq!(packed.panels.len(), 7 * 4);
        // Padding after key 99 (column 3 of panel 6) is zero.
        assert_eq!(packed.panels[6 * 4 + 3].0[PANEL - 1], 0.0);
        assert_eq!(packed.panels[6 * 4 + 3].0[3], keys[[99, 3]]);
    }

    #[test]
    fn a_prefix_that_grows_between_products_packs_its_new_keys() {
        // A live model's keys arrive token by token: each product sees a longer view, and the
        // partial panel packed from the shorter one must be packed again.
        let (queries, keys) = fixture(7, 40, 5);
        let mut packed = PackedKeys::new(5);
        for visible in [3, 17, 18, 33, 40] {
            let prefix = keys.slice(ndarray::s![..visible, ..]);
            let mut out = vec![f32::NAN; 7 * visible];
            scaled_product(queries.view(), prefix, &mut packed, visible, 0.5, &mut out);
            let want = brute(&queries, &keys, visible, 0.5);
            assert_eq!(out, want, "{visible} keys");
        }
    }
}
