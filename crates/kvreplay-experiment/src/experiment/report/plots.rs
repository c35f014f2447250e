//! The report's figures of stored runs: retained mass against budget, and the budget schedules.

use super::*;

/// The retained-mass-vs-budget and per-layer schedule figures; returns their files.
pub(super) fn figures_of_runs(
    experiment: &Experiment,
    names: &[String],
    runs: &[StoredRun],
    trace_names: &[String],
    mass_series: &[Series],
    files: &FigureFiles<'_>,
) -> Result<Vec<PathBuf>, SweepError> {
    let mut figures = line_chart(
        &files.stem("retained_mass_vs_budget"),
        &format!("{}: retained attention mass", experiment.name),
        experiment.budgets[0].axis_title(),
        "mean retained mass",
        mass_series,
        true,
    )?;
    let middle = experiment.budgets[experiment.budgets.len() / 2];
    let schedules: Vec<Series> = names
        .iter()
        .filter_map(|name| find_run(runs, name, middle, &trace_names[0]).map(|r| (name, r)))
        .map(|(name, run)| {
            let points = run
                .report
                .layer_kept
                .iter()
                .enumerate()
                .map(|(l, k)| (l as f64, *k))
                .collect();
            (name.clone(), points)
        })
        .collect();
    figures.extend(line_chart(
        &files.stem("schedules"),
        &format!("mean kept tokens per layer at budget {middle}"),
        "layer",
        "mean kept tokens per cache",
        &schedules,
        false,
    )?);
    Ok(figures)
}
