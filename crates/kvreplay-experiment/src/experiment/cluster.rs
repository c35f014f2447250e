//! A sweep across machines, as the CLI's `--status` and `--slurm` see it: which shards still
//! miss runs, and the Slurm job array (with its report job) that runs only those. The text each
//! returns is what the CLI prints.

use super::shard;
use super::slurm::{self, SlurmError, SlurmJob, SlurmOptions};
use super::{claim_results, Experiment, ExperimentError, SweepError};
use crate::export::{Format, Table};
use std::path::{Path, PathBuf};

/// Why a status or a submission failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// The experiment file is not valid.
    #[error(transparent)]
    Experiment(#[from] ExperimentError),
    /// Its traces or results could not be read (boxed: a sweep's error is large).
    #[error(transparent)]
    Sweep(Box<SweepError>),
    /// Slurm refused the scripts or is not here.
    #[error(transparent)]
    Slurm(#[from] SlurmError),
    /// No shards asked for.
    #[error("--tasks must be at least 1")]
    NoTasks,
    /// A script could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The failure.
        source: std::io::Error,
    },
}

impl From<SweepError> for ClusterError {
    fn from(error: SweepError) -> Self {
        Self::Sweep(Box::new(error))
    }
}

/// Where a Slurm submission keeps its scripts, logs and shard count.
fn slurm_dir(results_root: &Path, experiment: &Experiment) -> PathBuf {
    results_root.join(&experiment.name).join("slurm")
}

/// Runs done and missing per shard, as a table and what to do next. `tasks` defaults to the
/// count of the last submission, or 1.
pub fn status(
    path: &Path,
    results_root: &Path,
    tasks: Option<usize>,
) -> Result<String, ClusterError> {
    let experiment = Experiment::load(path)?;
    let traces = experiment.trace_files(None)?;
    let results = results_root.join(&experiment.name);
    let submitted = std::fs::read_to_string(slurm_dir(results_root, &experiment).join("tasks"))
        .ok()
        .and_then(|text| text.trim().parse::<usize>().ok());
    let count = tasks.or(submitted).unwrap_or(1);
    if count == 0 {
        return Err(ClusterError::NoTasks);
    }
    let shards = shard::status(&experiment, &traces, &results, count);
    let mut table = Table::new(["shard", "runs", "done", "missing"]);
    for status in &shards {
        table.push([
            status.shard.to_string(),
            status.runs.to_string(),
            (status.runs - status.missing.len()).to_string(),
            status.missing.len().to_string(),
        ]);
    }
    let missing: Vec<String> = shards
        .iter()
        .filter(|s| !s.missing.is_empty())
        .map(|s| s.shard.index.to_string())
        .collect();
    let next = if missing.is_empty() {
        format!(
            "Every run is stored: `kvreplay report {}` writes the report.",
            path.display()
        )
    } else {
        format!(
            "Shards with runs missing: {}. `kvreplay sweep {} --slurm --tasks {count}` submits \
             those only; `--shard I/{count}` runs one anywhere.",
            missing.join(", "),
            path.display()
        )
    };
    Ok(format!("{}\n{next}\n", table.render(Format::Markdown)))
}

/// Writes and submits the job array of the shards that miss runs and the report job after it
/// (or, with `dry_run`, returns the scripts instead). `binary` is the kvreplay the jobs run.
pub fn submit(
    path: &Path,
    results_root: &Path,
    options: &SlurmOptions,
    dry_run: bool,
    binary: PathBuf,
) -> Result<String, ClusterError> {
    if options.tasks == 0 {
        return Err(ClusterError::NoTasks);
    }
    if !dry_run && !slurm::sbatch_available() {
        return Err(SlurmError::NoSbatch.into());
    }
    let experiment = Experiment::load(path)?;
    let results = results_root.join(&experiment.name);
    claim_results(&results, path)?;
    // With every trace there, only the shards that miss runs are submitted; otherwise the tasks
    // capture what is missing (under a lock) and every shard runs.
    let tasks: Vec<usize> = match experiment.trace_files(None) {
        Ok(traces) => shard::status(&experiment, &traces, &results, options.tasks)
            .into_iter()
            .filter(|s| !s.missing.is_empty())
            .map(|s| s.shard.index)
            .collect(),
        Err(_) => (0..options.tasks).collect(),
    };
    if tasks.is_empty() {
        return Ok(format!(
            "Every run is stored: `kvreplay report {}` writes the report.\n",
            path.display()
        ));
    }
    let dir = slurm_dir(results_root, &experiment);
    let logs = dir.join("logs");
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| ClusterError::Io { path, source }
    };
    let job = SlurmJob {
        binary,
        workdir: std::env::current_dir().map_err(io(Path::new(".")))?,
        experiment: path.to_owned(),
        results: results_root.to_owned(),
        name: experiment.name.clone(),
    };
    let array = slurm::array_script(&job, options, &tasks, &logs);
    let report = slurm::report_script(&job, options, &logs);
    let (array_path, report_path) = (dir.join("sweep.sbatch"), dir.join("report.sbatch"));
    if dry_run {
        return Ok(format!(
            "# {}\n{array}\n# {}\n{report}",
            array_path.display(),
            report_path.display()
        ));
    }
    std::fs::create_dir_all(&logs).map_err(io(&logs))?;
    let count = format!("{}\n", options.tasks);
    for (file, text) in [
        (&array_path, &array),
        (&report_path, &report),
        (&dir.join("tasks"), &count),
    ] {
        crate::atomic::write(file, text.as_bytes()).map_err(io(file))?;
    }
    let array_job = slurm::submit(&array_path, None)?;
    let report_job = slurm::submit(&report_path, Some(&array_job))?;
    let shards: Vec<String> = tasks.iter().map(usize::to_string).collect();
    Ok(format!(
        "Submitted job array {array_job} (shards {} of {}) and report job {report_job} after it; \
         `kvreplay sweep {} --status` shows what is done.\n",
        shards.join(", "),
        options.tasks,
        path.display()
    ))
}
