//! The report's rows as data: one row per run, written as Parquet and CSV (polars).

use super::*;

pub(super) fn write_frames(
    runs: &[StoredRun],
    traces: &[TraceFile],
    results: &Path,
) -> Result<Vec<PathBuf>, SweepError> {
    let column = |name: &str, values: Vec<f64>| Column::new(name.into(), values);
    let mut columns = vec![
        Column::new(
            "id".into(),
            runs.iter().map(|r| r.id.clone()).collect::<Vec<_>>(),
        ),
        Column::new(
            "trace".into(),
            runs.iter().map(|r| r.trace.clone()).collect::<Vec<_>>(),
        ),
        Column::new(
            "policy".into(),
            runs.iter().map(|r| r.name.clone()).collect::<Vec<_>>(),
        ),
        Column::new(
            "budget".into(),
            runs.iter()
                .map(|r| r.report.nominal_budget as u64)
                .collect::<Vec<_>>(),
        ),
        column(
            "mean_kept",
            runs.iter().map(|r| r.report.mean_kept).collect(),
        ),
        column(
            "kv_entries",
            runs.iter().map(|r| kv_entries(r, traces)).collect(),
        ),
    ];
    columns.extend(metrics::REGISTRY.iter().map(|metric| {
        let values = runs
            .iter()
            .map(|r| r.report.metric(metric.id()).unwrap_or(f64::NAN))
            .collect();
        column(metric.id(), values)
    }));
    if runs.iter().all(|r| r.closed_loop.is_some()) {
        let closed: Vec<&ClosedLoop> = runs.iter().filter_map(|r| r.closed_loop.as_ref()).collect();
        columns.extend([
            column("kl", closed.iter().map(|c| c.kl).collect()),
            column("top1", closed.iter().map(|c| c.top1).collect()),
            column(
                "live_retained_mass",
                closed
                    .iter()
                    .map(|c| c.live_retained_mass.unwrap_or(f64::NAN))
                    .collect(),
            ),
            column(
                "logprob_lost",
                closed.iter().map(|c| c.logprob_lost).collect(),
            ),
            Column::new(
                "answer_ok".into(),
                closed.iter().map(|c| c.answer_ok).collect::<Vec<_>>(),
            ),
            column(
                "answer_score",
                closed.iter().map(|c| c.answer_score()).collect(),
            ),
            Column::new(
                "full_answer_ok".into(),
                closed.iter().map(|c| c.full_answer_ok).collect::<Vec<_>>(),
            ),
            column(
                "full_answer_score",
                closed.iter().map(|c| c.full_answer_score()).collect(),
            ),
            Column::new(
                "text".into(),
                closed.iter().map(|c| c.text.clone()).collect::<Vec<_>>(),
            ),
        ]);
    }
    let mut frame = DataFrame::new_infer_height(columns).map_err(|e| SweepError::Io {
        path: results.to_owned(),
        detail: e.to_string(),
    })?;
    let mut written = Vec::new();
    for (extension, parquet) in [("parquet", true), ("csv", false)] {
        let path = results.join(format!("runs.{extension}"));
        let mut bytes: Vec<u8> = Vec::new();
        let outcome = if parquet {
            ParquetWriter::new(&mut bytes)
                .finish(&mut frame)
                .map(|_| ())
        } else {
            CsvWriter::new(&mut bytes).finish(&mut frame)
        };
        outcome.map_err(|e| SweepError::Io {
            path: path.clone(),
            detail: e.to_string(),
        })?;
        write_atomically(&path, &bytes)?;
        written.push(path);
    }
    Ok(written)
}
