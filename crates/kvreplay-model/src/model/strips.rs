//! A weight's columns in strips: the layout in which the batched decode's chain products read a
//! weight's strips of columns, each strip's rows one after another (a [`Weight`](super::weight)
//! makes it once).

/// The columns of a weight `[k, n]` in strips `width` wide: strip `s`'s `k` rows of `width`
/// consecutive columns from `s · width` on, one after another; the columns past the last whole
/// strip are not copied.
pub(crate) struct Strips {
    data: Vec<f32>,
    k: usize,
    width: usize,
}

impl Strips {
    /// The strips of `w`'s rows (`stride` apart, `k` of them, `n` columns).
    pub(crate) fn of(w: &[f32], stride: usize, (k, n): (usize, usize), width: usize) -> Self {
        let strips = n / width;
        let mut data = Vec::with_capacity(strips * k * width);
        for strip in 0..strips {
            append_strip(&w[strip * width..], (stride, k), width, &mut data);
        }
        Self { data, k, width }
    }

    /// The strip starting at `column` (a multiple of the width), its rows `width` apart; `None`
    /// past the last whole strip.
    pub(crate) fn strip(&self, column: usize) -> Option<(&[f32], usize)> {
        assert_eq!(column % self.width, 0, "a strip starts at column {column}");
        let at = column / self.width * self.k * self.width;
        (at < self.data.len()).then(|| (&self.data[at..][..self.k * self.width], self.width))
    }

    /// The strips' width.
    pub(crate) fn width(&self) -> usize {
        self.width
    }
}

/// Appends to `out` the first `columns` columns of the `k` rows of `w` (`stride` apart), one row
/// after another.
pub(crate) fn append_strip(
    w: &[f32],
    (stride, k): (usize, usize),
    columns: usize,
    out: &mut Vec<f32>,
) {
    for depth in 0..k {
        out.extend_from_slice(&w[depth * stride..][..columns]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_strip_holds_its_columns_row_after_row() {
        // 3 rows of 7 columns, 9 apart: two strips of 3 columns, the seventh column left out.
        let w: Vec<f32> = (0..27).map(|i| i as f32).collect();
        let strips = Strips::of(&w, 9, (3, 7), 3);
        assert_eq!(strips.width(), 3);
        let (first, stride) = strips.strip(0).unwrap();
        assert_eq!(stride, 3);
        assert_eq!(first, [0., 1., 2., 9., 10., 11., 18., 19., 20.]);
        let (second, _) = strips.strip(3).unwrap();
        assert_eq!(second, [3., 4., 5., 12., 13., 14., 21., 22., 23.]);
        assert!(strips.strip(6).is_none());
    }
}
