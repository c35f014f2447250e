//! The needle grid: per policy, the share of the needle's attention kept, by context length and depth (tables and heatmaps).

use super::*;

/// Per policy, the share of the needle's full-attention mass that survives at `budget`, as a
/// depth × length table and heatmap (the PyramidKV paper's figure 5 layout).
pub(super) fn needle_section(
    experiment: &Experiment,
    runs: &[StoredRun],
    grid: &[NeedleCell],
    budget: usize,
    files: &FigureFiles<'_>,
) -> Result<String, SweepError> {
    let mut lengths: Vec<usize> = grid.iter().map(|c| c.length).collect();
    lengths.sort_unstable();
    lengths.dedup();
    let mut depths: Vec<f64> = grid.iter().map(|c| c.depth).collect();
    depths.sort_by(f64::total_cmp);
    depths.dedup();
    let mut out = format!(
        "\nNeedle survival at budget {budget}: share of the needle's full-attention mass the kept set holds (mean over layers, heads and decode steps), by context length and needle depth:\n"
    );
    let mut figures = Vec::new();
    for name in experiment.policy_names() {
        let mut values = vec![vec![f64::NAN; lengths.len()]; depths.len()];
        for cell in grid {
            let trace = cell.trace.display().to_string();
            if let Some(run) = find_run(runs, &name, Budget::Tokens(budget), &trace) {
                if let Some((_, _, kept, full)) = run.report.spans.iter().find(|s| s.0 == "needle")
                {
                    let row = depths
                        .iter()
                        .position(|d| *d == cell.depth)
                        .expect("listed");
                    let column = lengths
                        .iter()
                        .position(|l| *l == cell.length)
                        .expect("listed");
                    values[row][column] = if *full > 0.0 { kept / full } else { 0.0 };
                }
            }
        }
        let mut headers = vec![format!("{name}: depth \\ length")];
        headers.extend(lengths.iter().map(|l| l.to_string()));
        let mut table = Table::with_headers(headers);
        for (row, depth) in depths.iter().enumerate().rev() {
            let mut cells = vec![format!("{depth}%")];
            cells.extend(values[row].iter().map(|v| {
                if v.is_nan() {
                    "—".to_string()
                } else {
                    format!("{v:.3}")
                }
            }));
            table.push(cells);
        }
        out += "\n";
        out += &table.render(Format::Markdown);
        figures.extend(heatmap(
            &files.stem(&format!("needle_{}", slug(&name))),
            &format!("{name}: needle mass kept at budget {budget}"),
            &lengths.iter().map(|l| l.to_string()).collect::<Vec<_>>(),
            &depths.iter().map(|d| format!("{d}%")).collect::<Vec<_>>(),
            &values,
            "context length (prompt tokens)",
            "needle depth",
        )?);
    }
    out += &format!(
        "\nFigures: {}.\n",
        figures
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "png"))
            .map(|p| format!("`{}`", p.file_name().unwrap_or_default().to_string_lossy()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(out)
}
