//! A sweep as a Slurm job array: an sbatch script whose tasks each run one shard
//! (`kvreplay sweep EXP --shard $SLURM_ARRAY_TASK_ID/N`), and a report job that runs
//! `kvreplay report EXP` once every task has succeeded (`afterok`). Slurm distributes; kvreplay
//! shards and merges. The runs land in the same results directory, so it must be on a filesystem
//! every node shares.

use std::path::{Path, PathBuf};
use std::process::Command;

/// What the sbatch scripts ask of Slurm.
#[derive(Debug, Clone, Default)]
pub struct SlurmOptions {
    /// Array tasks (shards).
    pub tasks: usize,
    /// `--partition`, when given.
    pub partition: Option<String>,
    /// `--time`, when given (Slurm's formats, e.g. `2:00:00`).
    pub time: Option<String>,
    /// `--cpus-per-task`, when given.
    pub cpus: Option<usize>,
}

/// The command lines and paths the scripts run with.
#[derive(Debug, Clone)]
pub struct SlurmJob {
    /// The kvreplay binary (absolute).
    pub binary: PathBuf,
    /// The directory the jobs run in (absolute).
    pub workdir: PathBuf,
    /// The experiment file, as given (relative to `workdir` or absolute).
    pub experiment: PathBuf,
    /// The results root, as given.
    pub results: PathBuf,
    /// The experiment's name (job names and log files).
    pub name: String,
}

fn quote(path: &Path) -> String {
    let text = path.display().to_string();
    format!("'{}'", text.replace('\'', r"'\''"))
}

fn directives(job: &SlurmJob, options: &SlurmOptions, logs: &Path) -> String {
    let mut lines = vec![
        "#!/usr/bin/env bash".to_string(),
        format!("#SBATCH --chdir={}", job.workdir.display()),
    ];
    if let Some(partition) = &options.partition {
        lines.push(format!("#SBATCH --partition={partition}"));
    }
    if let Some(time) = &options.time {
        lines.push(format!("#SBATCH --time={time}"));
    }
    if let Some(cpus) = options.cpus {
        lines.push(format!("#SBATCH --cpus-per-task={cpus}"));
    }
    lines.push(format!("#SBATCH --output={}/%x-%A_%a.out", logs.display()));
    lines.join("\n") + "\n"
}

/// The array script: task `t` of the listed `tasks` runs shard `t` of `options.tasks`.
pub fn array_script(
    job: &SlurmJob,
    options: &SlurmOptions,
    tasks: &[usize],
    logs: &Path,
) -> String {
    let list: Vec<String> = tasks.iter().map(usize::to_string).collect();
    let threads = options
        .cpus
        .map(|cpus| format!("export RAYON_NUM_THREADS={cpus}\n"))
        .unwrap_or_default();
    format!(
        "{}#SBATCH --job-name=kvreplay-{}\n#SBATCH --array={}\nset -euo pipefail\n{threads}exec {} sweep {} --results {} --shard \"$SLURM_ARRAY_TASK_ID/{}\"\n",
        directives(job, options, logs),
        job.name,
        list.join(","),
        quote(&job.binary),
        quote(&job.experiment),
        quote(&job.results),
        options.tasks,
    )
}

/// The report script, run after every task of the array succeeded: `kvreplay report` writes
/// the report, runs.csv/parquet and plots into the results directory (and prints the report to
/// the job's log).
pub fn report_script(job: &SlurmJob, options: &SlurmOptions, logs: &Path) -> String {
    let options = SlurmOptions {
        cpus: None,
        ..options.clone()
    };
    format!(
        "{}#SBATCH --job-name=kvreplay-{}-report\nset -euo pipefail\nexec {} report {} --results {}\n",
        directives(job, &options, logs),
        job.name,
        quote(&job.binary),
        quote(&job.experiment),
        quote(&job.results),
    )
}

/// Why a submission failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SlurmError {
    /// `sbatch` is not installed here.
    #[error("`sbatch` was not found on PATH: submit from a Slurm login node, or pass --dry-run to print the scripts")]
    NoSbatch,
    /// `sbatch` refused the script.
    #[error("sbatch {script}: {detail}")]
    Refused {
        /// The script.
        script: PathBuf,
        /// What sbatch said.
        detail: String,
    },
}

/// Submits `script` with `sbatch --parsable` (after job `after` succeeded, when given) and
/// returns the job id.
pub fn submit(script: &Path, after: Option<&str>) -> Result<String, SlurmError> {
    let mut command = Command::new("sbatch");
    command.arg("--parsable");
    if let Some(job) = after {
        command.arg(format!("--dependency=afterok:{job}"));
    }
    let output = command.arg(script).output().map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => SlurmError::NoSbatch,
        _ => SlurmError::Refused {
            script: script.to_owned(),
            detail: e.to_string(),
        },
    })?;
    if !output.status.success() {
        return Err(SlurmError::Refused {
            script: script.to_owned(),
            detail: String::from_utf8_lossy(&output.stderr).trim().to_string(),
        });
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    // `--parsable` prints `id` or `id;cluster`.
    Ok(stdout
        .trim()
        .split(';')
        .next()
        .unwrap_or_default()
        .to_string())
}

/// Whether `sbatch` can be run here.
pub fn sbatch_available() -> bool {
    Command::new("sbatch").arg("--version").output().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scripts_run_the_shards_and_the_report_after_them() {
        let job = SlurmJob {
            binary: "/opt/kv replay/kvreplay".into(),
            workdir: "/work/exp".into(),
            experiment: "experiments/grid.toml".into(),
            results: "results".into(),
            name: "grid".into(),
        };
        let options = SlurmOptions {
            tasks: 3,
            partition: Some("cpu".into()),
            time: Some("1:00:00".into()),
            cpus: Some(4),
        };
        let logs = Path::new("results/grid/slurm");
        let array = array_script(&job, &options, &[0, 2], logs);
        assert!(array.contains("#SBATCH --array=0,2\n"), "{array}");
        assert!(array.contains(
            "#SBATCH --partition=cpu\n#SBATCH --time=1:00:00\n#SBATCH --cpus-per-task=4\n"
        ));
        assert!(array.contains("export RAYON_NUM_THREADS=4\n"));
        assert!(array.ends_with(
            "exec '/opt/kv replay/kvreplay' sweep 'experiments/grid.toml' --results 'results' --shard \"$SLURM_ARRAY_TASK_ID/3\"\n"
        ));
        let report = report_script(&job, &options, logs);
        assert!(report.ends_with(
            "exec '/opt/kv replay/kvreplay' report 'experiments/grid.toml' --results 'results'\n"
        ));
        assert!(!report.contains("--cpus-per-task"));
    }
}
