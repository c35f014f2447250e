//! Figures of an experiment (plotters, PNG and SVG): retained mass against budget per method,
//! the per-layer budget schedules, and the per-layer entropy profile. Text is drawn with the
//! embedded DejaVu Sans (this crate's assets/DejaVuSans.ttf, Bitstream Vera licence), so plots render the same
//! on a machine without fonts.

use super::SweepError;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::{Path, PathBuf};
use std::sync::Once;

const FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

fn register_font() {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

/// One named line: (x, y) points.
pub(crate) type Series = (String, Vec<(f64, f64)>);

fn plot_error(path: &Path, err: impl std::fmt::Display) -> SweepError {
    SweepError::Io {
        path: path.to_owned(),
        detail: format!("cannot draw: {err}"),
    }
}

/// Draws a figure with `$draw(area, args...)` into `<stem>.png` and `<stem>.svg` and returns the
/// two paths (a macro: the drawing functions are generic over the backend).
macro_rules! draw_both {
    ($stem:expr, $size:expr, $draw:ident($($arg:expr),*)) => {{
        register_font();
        let png = $stem.with_extension("png");
        let svg = $stem.with_extension("svg");
        $draw(&BitMapBackend::new(&png, $size).into_drawing_area(), $($arg),*)
            .map_err(|e| plot_error(&png, e))?;
        $draw(&SVGBackend::new(&svg, $size).into_drawing_area(), $($arg),*)
            .map_err(|e| plot_error(&svg, e))?;
        Ok(vec![png, svg])
    }};
}

/// How a series is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mark {
    /// Joined by lines.
    Lines,
    /// One dot per point (a scatter plot).
    Dots,
}

/// The size of a chart's plot, without its legend panel.
const PLOT_SIZE: (u32, u32) = (900, 560);

/// The width of the legend panel to the right of a chart's plot, outside its data.
const LEGEND_WIDTH: u32 = 230;

/// matplotlib's default categorical palette (tab10), the one readers of the field's figures know.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// How series `index` is drawn: its colour, and which of three looks (lines: solid, dashed,
/// dotted; dots: circle, triangle, cross) sets it apart from the series that share its colour, so
/// that up to thirty series are told apart.
fn look(index: usize) -> (RGBColor, usize) {
    (PALETTE[index % PALETTE.len()], (index / PALETTE.len()) % 3)
}

/// The dash and gap (pixels) of a line of look `variant`: none for the first (solid).
fn dashes(variant: usize) -> Option<(u32, u32)> {
    [None, Some((10, 5)), Some((3, 4))][variant]
}

/// The mark of look `variant` at `at` (a data point in the plot, a pixel in the legend).
fn dot<DB: DrawingBackend, C: Clone + 'static>(
    at: C,
    colour: RGBColor,
    variant: usize,
) -> DynElement<'static, DB, C> {
    match variant {
        0 => Circle::new(at, 3, colour.filled()).into_dyn(),
        1 => TriangleMarker::new(at, 4, colour.filled()).into_dyn(),
        _ => Cross::new(at, 4, colour.stroke_width(2)).into_dyn(),
    }
}

/// Draws `series` as lines into `<stem>.png` and `<stem>.svg`; returns the two paths.
pub(crate) fn line_chart(
    stem: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    log_x: bool,
) -> Result<Vec<PathBuf>, SweepError> {
    let axes = Axes {
        title,
        x_label,
        y_label,
        log_x,
    };
    write_data(stem, &axes, series, Mark::Lines)?;
    draw_both!(
        stem,
        (PLOT_SIZE.0 + LEGEND_WIDTH, PLOT_SIZE.1),
        draw(title, x_label, y_label, series, log_x, Mark::Lines)
    )
}

/// Draws `series` as dots (one colour and mark per series) into `<stem>.png` and `<stem>.svg`.
pub(crate) fn scatter(
    stem: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> Result<Vec<PathBuf>, SweepError> {
    let axes = Axes {
        title,
        x_label,
        y_label,
        log_x: false,
    };
    write_data(stem, &axes, series, Mark::Dots)?;
    draw_both!(
        stem,
        (PLOT_SIZE.0 + LEGEND_WIDTH, PLOT_SIZE.1),
        draw(title, x_label, y_label, series, false, Mark::Dots)
    )
}

/// A chart's title, axis labels and x scale.
struct Axes<'a> {
    title: &'a str,
    x_label: &'a str,
    y_label: &'a str,
    log_x: bool,
}

/// Writes a chart's data beside its pictures, `<stem>.json`, which a report page draws as an
/// interactive chart (values on hover, series toggled from the legend).
fn write_data(
    stem: &Path,
    axes: &Axes<'_>,
    series: &[Series],
    mark: Mark,
) -> Result<(), SweepError> {
    let data = serde_json::json!({
        "title": axes.title,
        "x_label": axes.x_label,
        "y_label": axes.y_label,
        "log_x": axes.log_x,
        "mark": if mark == Mark::Dots { "dots" } else { "lines" },
        "series": series
            .iter()
            .map(|(name, points)| serde_json::json!({"name": name, "points": points}))
            .collect::<Vec<_>>(),
    });
    let path = stem.with_extension("json");
    super::store::write_atomically(&path, data.to_string().as_bytes())
}

/// The smallest and largest x and y over every point (x widened where it is one value, y padded
/// by 5% so that no point sits on the frame).
fn bounds(series: &[Series]) -> ((f64, f64), (f64, f64)) {
    let points = series.iter().flat_map(|(_, p)| p.iter());
    let (mut x_min, mut x_max, mut y_min, mut y_max) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, y) in points {
        x_min = x_min.min(*x);
        x_max = x_max.max(*x);
        y_min = y_min.min(*y);
        y_max = y_max.max(*y);
    }
    if x_min >= x_max {
        x_max = x_min + 1.0;
    }
    let pad = ((y_max - y_min) * 0.05).max(1e-3);
    ((x_min, x_max), (y_min - pad, y_max + pad))
}

fn draw<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    log_x: bool,
    mark: Mark,
) -> Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    area.fill(&WHITE)?;
    let (plot, legend) = area.split_horizontally(PLOT_SIZE.0);
    let ((x_min, x_max), (y_min, y_max)) = bounds(series);
    let mut builder = ChartBuilder::on(&plot);
    builder
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60);
    macro_rules! lines {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(x_label)
                .y_desc(y_label)
                .label_style(("sans-serif", 14))
                .draw()?;
            for (index, (_, points)) in series.iter().enumerate() {
                let (colour, variant) = look(index);
                let points = points.iter().copied();
                let line = colour.stroke_width(2);
                match (mark, dashes(variant)) {
                    (Mark::Lines, None) => {
                        chart.draw_series(LineSeries::new(points, line))?;
                    }
                    (Mark::Lines, Some((dash, gap))) => {
                        chart.draw_series(DashedLineSeries::new(points, dash, gap, line))?;
                    }
                    (Mark::Dots, _) => {
                        chart.draw_series(points.map(|p| dot(p, colour, variant)))?;
                    }
                }
            }
        }};
    }
    if log_x {
        lines!(builder.build_cartesian_2d((x_min..x_max).log_scale(), y_min..y_max)?);
    } else {
        lines!(builder.build_cartesian_2d(x_min..x_max, y_min..y_max)?);
    }
    draw_legend(&legend, series, mark)?;
    area.present()?;
    Ok(())
}

/// The series' names in a panel beside the plot, each after a sample of its line or mark.
fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    series: &[Series],
    mark: Mark,
) -> Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    let height = area.dim_in_pixel().1 as i32;
    let (top, bottom) = (44, 48);
    let row = match series.len() {
        0 => return Ok(()),
        n => ((height - top - bottom) / n as i32).clamp(8, 20),
    };
    for (index, (name, _)) in series.iter().enumerate() {
        let (colour, variant) = look(index);
        let y = top + row * index as i32 + row / 2;
        let line = colour.stroke_width(2);
        let sample = [(4, y), (28, y)];
        match (mark, dashes(variant)) {
            (Mark::Lines, None) => area.draw(&PathElement::new(sample, line))?,
            (Mark::Lines, Some((dash, gap))) => {
                for dashed in DashedLineSeries::new(sample, dash, gap, line) {
                    area.draw(&dashed)?;
                }
            }
            (Mark::Dots, _) => area.draw(&dot((16, y), colour, variant))?,
        }
        let style = ("sans-serif", row.min(14) as f64)
            .into_font()
            .into_text_style(area)
            .pos(Pos::new(HPos::Left, VPos::Center));
        area.draw(&Text::new(name.clone(), (36, y), style))?;
    }
    Ok(())
}

/// A heatmap of `values[row][column]` in [0, 1] (rows bottom to top), each cell labelled with its
/// value, into `<stem>.png` and `<stem>.svg`.
pub(crate) fn heatmap(
    stem: &Path,
    title: &str,
    columns: &[String],
    rows: &[String],
    values: &[Vec<f64>],
    x_label: &str,
    y_label: &str,
) -> Result<Vec<PathBuf>, SweepError> {
    draw_both!(
        stem,
        (720, 560),
        draw_heatmap(title, columns, rows, values, x_label, y_label)
    )
}

/// Red (0) through yellow to green (1); grey where there is no value.
fn colour(value: f64) -> RGBColor {
    if value.is_nan() {
        return RGBColor(200, 200, 200);
    }
    let v = value.clamp(0.0, 1.0);
    let (r, g) = if v < 0.5 {
        (1.0, 2.0 * v)
    } else {
        (2.0 * (1.0 - v), 1.0)
    };
    RGBColor((r * 220.0) as u8 + 20, (g * 200.0) as u8 + 30, 60)
}

fn draw_heatmap<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    columns: &[String],
    rows: &[String],
    values: &[Vec<f64>],
    x_label: &str,
    y_label: &str,
) -> Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    area.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(
            (0..columns.len()).into_segmented(),
            (0..rows.len()).into_segmented(),
        )?;
    let name_of = |names: &[String], value: &SegmentValue<usize>| match value {
        SegmentValue::CenterOf(index) => names.get(*index).cloned().unwrap_or_default(),
        _ => String::new(),
    };
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .x_labels(columns.len())
        .y_labels(rows.len())
        .x_label_formatter(&|x| name_of(columns, x))
        .y_label_formatter(&|y| name_of(rows, y))
        .label_style(("sans-serif", 14))
        .draw()?;
    for (row, cells) in values.iter().enumerate() {
        for (column, value) in cells.iter().enumerate() {
            chart.draw_series(std::iter::once(Rectangle::new(
                [
                    (SegmentValue::Exact(column), SegmentValue::Exact(row)),
                    (
                        SegmentValue::Exact(column + 1),
                        SegmentValue::Exact(row + 1),
                    ),
                ],
                colour(*value).filled(),
            )))?;
            let label = if value.is_nan() {
                "n/a".to_string()
            } else {
                format!("{value:.2}")
            };
            chart.draw_series(std::iter::once(Text::new(
                label,
                (SegmentValue::CenterOf(column), SegmentValue::CenterOf(row)),
                ("sans-serif", 15).into_font(),
            )))?;
        }
    }
    area.present()?;
    Ok(())
}

/// Where a report's figures go: `<dir>/<stem><suffix>.{png,svg}`, the suffix naming the model
/// when a report has one part per model.
pub(crate) struct FigureFiles<'a> {
    pub(crate) dir: &'a Path,
    pub(crate) suffix: String,
}

impl<'a> FigureFiles<'a> {
    /// Figures straight under `dir`, no suffix.
    pub(crate) fn under(dir: &'a Path) -> Self {
        Self {
            dir,
            suffix: String::new(),
        }
    }

    /// The stem of figure `name`.
    pub(crate) fn stem(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}{}", self.suffix))
    }
}

/// `name` with every character but ASCII letters and digits turned into `_`.
pub(crate) fn slug(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn thirty_series_are_drawn_thirty_ways() {
        let looks: HashSet<_> = (0..30)
            .map(|index| {
                let (colour, variant) = look(index);
                (colour.0, colour.1, colour.2, variant)
            })
            .collect();
        assert_eq!(looks.len(), 30);
    }

    #[test]
    fn the_legend_sits_beside_the_plot_and_names_every_series() {
        let dir = tempfile::tempdir().unwrap();
        let series: Vec<Series> = (0..22)
            .map(|i| {
                let points = (1..=4)
                    .map(|b| (b as f64 * 64.0, i as f64 + b as f64))
                    .collect();
                (format!("policy-{i}"), points)
            })
            .collect();
        for (name, mark) in [("lines", Mark::Lines), ("dots", Mark::Dots)] {
            let stem = dir.path().join(name);
            let files = match mark {
                Mark::Lines => line_chart(&stem, "t", "x", "y", &series, true),
                Mark::Dots => scatter(&stem, "t", "x", "y", &series),
            }
            .unwrap();
            let png = std::fs::read(&files[0]).unwrap();
            // The PNG header's width and height (big-endian, after the signature and IHDR tag).
            let width = u32::from_be_bytes(png[16..20].try_into().unwrap());
            let height = u32::from_be_bytes(png[20..24].try_into().unwrap());
            assert_eq!((width, height), (PLOT_SIZE.0 + LEGEND_WIDTH, PLOT_SIZE.1));
            let svg = std::fs::read_to_string(&files[1]).unwrap();
            for (name, _) in &series {
                assert!(svg.contains(&format!("\n{name}\n")), "{name} in the legend");
            }
        }
    }
}
