//! Figures of an experiment (plotters, PNG and SVG): retained mass against budget per method,
//! the per-layer budget schedules, and the per-layer entropy profile. Text is drawn with the
//! embedded DejaVu Sans (assets/DejaVuSans.ttf, Bitstream Vera licence), so plots render the same
//! on a machine without fonts.

use super::store::SweepError;
use plotters::prelude::*;
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

/// Draws `series` as lines into `<stem>.png` and `<stem>.svg`; returns the two paths.
pub(crate) fn line_chart(
    stem: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    log_x: bool,
) -> Result<Vec<PathBuf>, SweepError> {
    draw_both!(
        stem,
        (900, 560),
        draw(title, x_label, y_label, series, log_x, Mark::Lines)
    )
}

/// Draws `series` as dots (one colour per series) into `<stem>.png` and `<stem>.svg`.
pub(crate) fn scatter(
    stem: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> Result<Vec<PathBuf>, SweepError> {
    draw_both!(
        stem,
        (900, 560),
        draw(title, x_label, y_label, series, false, Mark::Dots)
    )
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
    let (y_min, y_max) = (y_min - pad, y_max + pad);
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60);
    let colours = [
        &BLUE,
        &RED,
        &GREEN,
        &MAGENTA,
        &CYAN,
        &BLACK,
        &RGBColor(255, 140, 0),
        &RGBColor(128, 0, 128),
        &RGBColor(139, 69, 19),
        &RGBColor(0, 128, 128),
        &RGBColor(128, 128, 128),
        &RGBColor(0, 0, 128),
        &RGBColor(107, 142, 35),
        &RGBColor(220, 20, 60),
    ];
    macro_rules! lines {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(x_label)
                .y_desc(y_label)
                .label_style(("sans-serif", 14))
                .draw()?;
            for (index, (name, points)) in series.iter().enumerate() {
                let colour = colours[index % colours.len()];
                let drawn = match mark {
                    Mark::Lines => chart.draw_series(LineSeries::new(
                        points.iter().copied(),
                        colour.stroke_width(2),
                    ))?,
                    Mark::Dots => chart.draw_series(
                        points
                            .iter()
                            .map(|&point| Circle::new(point, 3, colour.filled())),
                    )?,
                };
                drawn.label(name.as_str()).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(2))
                });
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 13))
                .position(match mark {
                    // Dots of high mass and low drift fill the lower right of a scatter.
                    Mark::Dots => SeriesLabelPosition::UpperRight,
                    Mark::Lines => SeriesLabelPosition::LowerRight,
                })
                .draw()?;
        }};
    }
    if log_x {
        lines!(builder.build_cartesian_2d((x_min..x_max).log_scale(), y_min..y_max)?);
    } else {
        lines!(builder.build_cartesian_2d(x_min..x_max, y_min..y_max)?);
    }
    area.present()?;
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
