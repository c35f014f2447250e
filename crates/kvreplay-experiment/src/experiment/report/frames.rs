//! The report's rows as data: one row per run, written as Parquet and CSV (polars).

use super::*;
use crate::experiment::frames::runs_frame;

pub(super) fn write_frames(
    runs: &[StoredRun],
    traces: &[TraceFile],
    results: &Path,
) -> Result<Vec<PathBuf>, SweepError> {
    let kv: Vec<f64> = runs.iter().map(|r| kv_entries(r, traces)).collect();
    let mut frame = runs_frame(runs, &kv).map_err(|e| SweepError::Io {
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
