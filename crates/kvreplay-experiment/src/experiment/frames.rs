//! Stored runs as polars DataFrames: one row per run (the columns of `runs.parquet`), one per run
//! and layer, and one per run, layer, query head and decode step. The report writes the first;
//! the Python package returns all three.

use super::store::{ClosedLoop, StoredRun};
use crate::replay::metrics;
use polars::prelude::*;
pub use polars::prelude::{DataFrame, PolarsError};

/// One row per run: id, trace, policy, budget, mean kept, KV entries (`kv_entries[i]` for run
/// `i`), every registered metric (NaN where it was not measured), the bytes held per layer (NaN
/// for runs stored before they were kept) and, when every run has them, the closed-loop columns.
pub fn runs_frame(runs: &[StoredRun], kv_entries: &[f64]) -> PolarsResult<DataFrame> {
    let text = |name: &str, pick: &dyn Fn(&StoredRun) -> String| {
        Column::new(name.into(), runs.iter().map(pick).collect::<Vec<_>>())
    };
    let mut columns = vec![
        text("id", &|r| r.id.clone()),
        text("trace", &|r| r.trace.clone()),
        text("policy", &|r| r.name.clone()),
        Column::new(
            "budget".into(),
            runs.iter()
                .map(|r| r.report.nominal_budget as u64)
                .collect::<Vec<_>>(),
        ),
        float("mean_kept", runs.iter().map(|r| r.report.mean_kept)),
        float("kv_entries", kv_entries.iter().copied()),
    ];
    columns.extend(metrics::REGISTRY.iter().map(|metric| {
        float(
            metric.id(),
            runs.iter()
                .map(|r| r.report.metric(metric.id()).unwrap_or(f64::NAN)),
        )
    }));
    // After the metrics, so that the columns before it keep their places.
    columns.push(float(
        "kv_bytes",
        runs.iter().map(|r| r.report.kv_bytes.unwrap_or(f64::NAN)),
    ));
    if runs.iter().all(|r| r.closed_loop.is_some()) {
        let closed: Vec<&ClosedLoop> = runs.iter().filter_map(|r| r.closed_loop.as_ref()).collect();
        columns.extend(closed_loop_columns(&closed));
    }
    DataFrame::new_infer_height(columns)
}

/// The closed-loop columns of `runs.parquet`.
fn closed_loop_columns(closed: &[&ClosedLoop]) -> Vec<Column> {
    let flag = |name: &str, pick: fn(&ClosedLoop) -> bool| {
        Column::new(
            name.into(),
            closed.iter().map(|c| pick(c)).collect::<Vec<_>>(),
        )
    };
    vec![
        float("kl", closed.iter().map(|c| c.kl)),
        float("top1", closed.iter().map(|c| c.top1)),
        float(
            "live_retained_mass",
            closed
                .iter()
                .map(|c| c.live_retained_mass.unwrap_or(f64::NAN)),
        ),
        float("logprob_lost", closed.iter().map(|c| c.logprob_lost)),
        flag("answer_ok", |c| c.answer_ok),
        float("answer_score", closed.iter().map(|c| c.answer_score())),
        flag("full_answer_ok", |c| c.full_answer_ok),
        float(
            "full_answer_score",
            closed.iter().map(|c| c.full_answer_score()),
        ),
        Column::new(
            "text".into(),
            closed.iter().map(|c| c.text.clone()).collect::<Vec<_>>(),
        ),
    ]
}

/// One row per run and layer it measured: id, policy, layer (its index among the measured
/// layers), the layer's budget, mean kept and bytes held (NaN for runs stored before they were
/// kept), and each metric's layer mean.
pub fn layers_frame(runs: &[StoredRun]) -> PolarsResult<DataFrame> {
    let rows: Vec<(&StoredRun, usize)> = runs
        .iter()
        .flat_map(|run| (0..run.report.layer_budgets.len()).map(move |layer| (run, layer)))
        .collect();
    let mut columns = identity_columns(rows.iter().map(|(run, _)| *run));
    columns.extend([
        Column::new(
            "layer".into(),
            rows.iter().map(|(_, l)| *l as u64).collect::<Vec<_>>(),
        ),
        Column::new(
            "budget".into(),
            rows.iter()
                .map(|(run, l)| run.report.layer_budgets[*l] as u64)
                .collect::<Vec<_>>(),
        ),
        float(
            "mean_kept",
            rows.iter().map(|(run, l)| run.report.layer_kept[*l]),
        ),
        float(
            "kv_bytes",
            rows.iter()
                .map(|(run, l)| run.report.layer_bytes.get(*l).copied().unwrap_or(f64::NAN)),
        ),
    ]);
    columns.extend(metric_ids(runs).into_iter().map(|id| {
        let values = rows.iter().map(|(run, l)| {
            run.report
                .layer_metrics
                .get(&id)
                .map_or(f64::NAN, |per_layer| per_layer[*l])
        });
        float(&id, values)
    }));
    DataFrame::new_infer_height(columns)
}

/// One row per run, layer, query head and decode step: each metric's sample there (the
/// samples confidence intervals and paired tests are computed over).
pub fn samples_frame(runs: &[StoredRun]) -> PolarsResult<DataFrame> {
    let ids = metric_ids(runs);
    let mut rows: Vec<(&StoredRun, [usize; 3])> = Vec::new();
    for run in runs {
        let Some(first) = ids.iter().find_map(|id| run.report.samples.get(id)) else {
            continue;
        };
        for (layer, heads) in first.iter().enumerate() {
            for (head, steps) in heads.iter().enumerate() {
                rows.extend((0..steps.len()).map(|step| (run, [layer, head, step])));
            }
        }
    }
    let mut columns = identity_columns(rows.iter().map(|(run, _)| *run));
    for (axis, name) in ["layer", "head", "step"].iter().enumerate() {
        columns.push(Column::new(
            (*name).into(),
            rows.iter()
                .map(|(_, at)| at[axis] as u64)
                .collect::<Vec<_>>(),
        ));
    }
    columns.extend(ids.into_iter().map(|id| {
        let values = rows.iter().map(|(run, [layer, head, step])| {
            run.report
                .samples
                .get(&id)
                .map_or(f64::NAN, |samples| samples[*layer][*head][*step])
        });
        float(&id, values)
    }));
    DataFrame::new_infer_height(columns)
}

/// The `id` and `policy` of each row's run.
fn identity_columns<'a>(rows: impl Iterator<Item = &'a StoredRun> + Clone) -> Vec<Column> {
    vec![
        Column::new(
            "id".into(),
            rows.clone().map(|r| r.id.clone()).collect::<Vec<_>>(),
        ),
        Column::new(
            "policy".into(),
            rows.map(|r| r.name.clone()).collect::<Vec<_>>(),
        ),
    ]
}

/// The registered metrics any of `runs` measured, in registry order.
fn metric_ids(runs: &[StoredRun]) -> Vec<String> {
    metrics::REGISTRY
        .iter()
        .map(|metric| metric.id().to_owned())
        .filter(|id| runs.iter().any(|r| r.report.layer_metrics.contains_key(id)))
        .collect()
}

fn float(name: &str, values: impl Iterator<Item = f64>) -> Column {
    Column::new(name.into(), values.collect::<Vec<f64>>())
}

/// `frame` as Parquet bytes.
pub fn parquet_bytes(frame: &mut DataFrame) -> PolarsResult<Vec<u8>> {
    let mut bytes = Vec::new();
    ParquetWriter::new(&mut bytes).finish(frame)?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experiment::testing::closed_run;

    #[test]
    fn one_row_per_run_layer_and_sample() {
        let mut runs = [
            closed_run("a", [0.5, 0.7], Some([0.4, 0.6]), 0.1),
            closed_run("b", [0.9, 0.8], None, 0.2),
        ];
        // Two layers of two heads; the steps differ so the rows' order shows.
        let samples = vec![
            vec![vec![0.1, 0.2], vec![0.3, 0.4]],
            vec![vec![0.5, 0.6], vec![0.7, 0.8]],
        ];
        for run in &mut runs {
            run.report.samples = [("retained_mass".to_string(), samples.clone())].into();
        }
        let frame = runs_frame(&runs, &[10.0, 20.0]).unwrap();
        assert_eq!(frame.height(), 2);
        assert_eq!(frame.column("kl").unwrap().f64().unwrap().get(1), Some(0.2));
        assert_eq!(
            frame.column("kv_entries").unwrap().f64().unwrap().get(0),
            Some(10.0)
        );
        let layers = layers_frame(&runs).unwrap();
        let per_run = runs[0].report.layer_budgets.len();
        assert_eq!(layers.height(), 2 * per_run);
        let mass = layers.column("retained_mass").unwrap().f64().unwrap();
        assert_eq!(
            mass.get(1),
            Some(runs[0].report.layer_metrics["retained_mass"][1])
        );
        let samples = samples_frame(&runs).unwrap();
        let count: usize = runs
            .iter()
            .map(|r| {
                r.report.samples["retained_mass"]
                    .iter()
                    .flatten()
                    .map(Vec::len)
                    .sum::<usize>()
            })
            .sum();
        assert_eq!(samples.height(), count);
        let at =
            |name: &str, row: usize| samples.column(name).unwrap().get(row).unwrap().to_string();
        // Row 5: run a, layer 1, head 0, step 1.
        assert_eq!(
            [
                at("layer", 5),
                at("head", 5),
                at("step", 5),
                at("retained_mass", 5)
            ],
            ["1", "0", "1", "0.6"]
        );
        let bytes = parquet_bytes(&mut samples.clone()).unwrap();
        let back = ParquetReader::new(std::io::Cursor::new(bytes))
            .finish()
            .unwrap();
        assert!(back.equals_missing(&samples));
    }
}
