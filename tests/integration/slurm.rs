//! Sweeps split into shards: shards cover every run once and merge into the single-machine
//! report byte for byte; a real one-node Slurm cluster (`ci/slurm-local.sh`) runs a job array
//! with a task that fails, and resubmitting what `--status` says is missing completes it.

use crate::common;

use assert_cmd::Command;
use common::{write_fixture, Shape};
use predicates::str::contains;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const EXPERIMENT: &str = r#"
description = "shard fixture"
traces = ["fixture.safetensors"]
budgets = [6, 10, 14]

[[policy]]
name = "snapkv"
preset = "snapkv"
window = 2

[[policy]]
name = "tq"
scorer = "true-query"
timing = ["prefill", "streaming"]
window = 2
"#;

/// A directory with the fixture trace and the experiment `e.toml`.
fn setup() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_fixture(&dir.path().join("fixture.safetensors"), Shape::default(), 5);
    std::fs::write(dir.path().join("e.toml"), EXPERIMENT).unwrap();
    dir
}

fn kvreplay(dir: &Path) -> Command {
    let mut cmd = Command::cargo_bin("kvreplay").unwrap();
    cmd.current_dir(dir);
    cmd
}

fn read(path: PathBuf) -> Vec<u8> {
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The run ids stored under `dir`'s results.
fn stored(dir: &Path) -> Vec<String> {
    let mut ids: Vec<String> = std::fs::read_dir(dir.join("results/e/runs"))
        .map(|entries| {
            entries
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|name| name.ends_with(".json"))
                .collect()
        })
        .unwrap_or_default();
    ids.sort();
    ids
}

/// The report, rows and table of a single-machine sweep of the fixture.
fn single_machine() -> (tempfile::TempDir, Vec<String>) {
    let dir = setup();
    kvreplay(dir.path())
        .args(["sweep", "e.toml"])
        .assert()
        .success();
    let ids = stored(dir.path());
    assert_eq!(ids.len(), 9);
    (dir, ids)
}

fn same_report(a: &Path, b: &Path) {
    for file in ["report.md", "runs.csv", "runs.parquet"] {
        assert!(
            read(a.join("results/e").join(file)) == read(b.join("results/e").join(file)),
            "{file} differs between the sharded and the single-machine sweep"
        );
    }
}

#[test]
fn shards_cover_every_run_once_and_merge_into_the_same_report() {
    let (single, all) = single_machine();
    let sharded = setup();
    let mut seen = Vec::new();
    for index in 0..3 {
        let before = stored(sharded.path());
        kvreplay(sharded.path())
            .args(["sweep", "e.toml", "--shard", &format!("{index}/3")])
            .assert()
            .success()
            .stdout("");
        let after = stored(sharded.path());
        let new: Vec<String> = after
            .into_iter()
            .filter(|id| !before.contains(id))
            .collect();
        assert!(!new.is_empty(), "shard {index} ran nothing");
        assert!(
            new.iter().all(|id| !seen.contains(id)),
            "two shards ran one run"
        );
        seen.extend(new);
    }
    seen.sort();
    assert_eq!(seen, all);
    // Every shard is done; the merged report equals the single machine's, byte for byte.
    kvreplay(sharded.path())
        .args(["sweep", "e.toml", "--status", "--tasks", "3"])
        .assert()
        .success()
        .stdout(contains("| 1/3"))
        .stdout(contains("Every run is stored"));
    kvreplay(sharded.path())
        .args(["report", "e.toml"])
        .assert()
        .success();
    same_report(sharded.path(), single.path());
    // A shard run again does nothing.
    kvreplay(sharded.path())
        .args(["sweep", "e.toml", "--shard", "2/3"])
        .assert()
        .success()
        .stderr(contains("shard 2/3: 0 runs done"));
}

#[test]
fn bad_shards_missing_sbatch_and_a_results_directory_of_another_experiment_exit_2() {
    let dir = setup();
    for bad in ["3/3", "0/0", "1"] {
        kvreplay(dir.path())
            .args(["sweep", "e.toml", "--shard", bad])
            .assert()
            .code(2)
            .stderr(contains("0 ≤ I < N"));
    }
    kvreplay(dir.path())
        .env("PATH", "/nonexistent")
        .args(["sweep", "e.toml", "--slurm"])
        .assert()
        .code(2)
        .stderr(contains("`sbatch` was not found"));
    // --dry-run needs no sbatch and prints both scripts.
    kvreplay(dir.path())
        .env("PATH", "/nonexistent")
        .args(["sweep", "e.toml", "--slurm", "--tasks", "2", "--dry-run"])
        .assert()
        .success()
        .stdout(contains("#SBATCH --array=0,1"))
        .stdout(contains("--shard \"$SLURM_ARRAY_TASK_ID/2\""))
        .stdout(contains("report 'e.toml' --results 'results'"));
    kvreplay(dir.path())
        .args(["sweep", "e.toml"])
        .assert()
        .success();
    std::fs::create_dir(dir.path().join("other")).unwrap();
    std::fs::write(dir.path().join("other/e.toml"), EXPERIMENT).unwrap();
    let before = stored(dir.path());
    kvreplay(dir.path())
        .args(["sweep", "other/e.toml"])
        .assert()
        .code(2)
        .stderr(contains(
            "holds the runs of `e.toml`, not of `other/e.toml`",
        ));
    assert_eq!(stored(dir.path()), before, "nothing stored is lost");
}

/// A one-node Slurm cluster for one test, stopped when dropped.
struct Cluster {
    dir: tempfile::TempDir,
}

impl Cluster {
    fn start() -> Self {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("ci/slurm-local.sh");
        let run = |args: &[&str]| {
            let out = std::process::Command::new(&script)
                .args(args)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "ci/slurm-local.sh {args:?}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        };
        run(&["install"]);
        let dir = tempfile::tempdir().unwrap();
        run(&["start", dir.path().to_str().unwrap()]);
        Cluster { dir }
    }

    fn conf(&self) -> PathBuf {
        self.dir.path().join("slurm.conf")
    }

    /// Waits until no job is queued or running.
    fn wait_idle(&self) {
        let started = Instant::now();
        loop {
            let out = std::process::Command::new("squeue")
                .env("SLURM_CONF", self.conf())
                .args(["-h", "-o", "%i %T %r"])
                .output()
                .unwrap();
            let queue = String::from_utf8_lossy(&out.stdout).into_owned();
            if out.status.success() && queue.trim().is_empty() {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "jobs still queued: {queue}"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("ci/slurm-local.sh");
        let _ = std::process::Command::new(script)
            .args(["stop", self.dir.path().to_str().unwrap()])
            .status();
    }
}

#[test]
fn a_slurm_array_with_a_failed_task_is_resubmitted_and_merges_into_the_same_report() {
    let (single, _) = single_machine();
    // Which runs shard 1 of 3 owns: run it alone in a scratch copy.
    let scratch = setup();
    kvreplay(scratch.path())
        .args(["sweep", "e.toml", "--shard", "1/3"])
        .assert()
        .success();
    let of_shard_1 = stored(scratch.path());
    let cluster = Cluster::start();
    let dir = setup();
    // The injected fault: a directory where one of shard 1's runs must be stored, so its rename
    // fails and the task exits non-zero (as a full or read-only disk would).
    let blocked = dir.path().join("results/e/runs").join(&of_shard_1[0]);
    std::fs::create_dir_all(&blocked).unwrap();
    kvreplay(dir.path())
        .env("SLURM_CONF", cluster.conf())
        .args(["sweep", "e.toml", "--slurm", "--tasks", "3"])
        .assert()
        .success()
        .stdout(contains("(shards 0, 1, 2 of 3)"));
    cluster.wait_idle();
    // Shards 0 and 2 are stored; shard 1 failed, so the report job never ran.
    assert!(!dir.path().join("results/e/report.md").exists());
    kvreplay(dir.path())
        .args(["sweep", "e.toml", "--status"])
        .assert()
        .success()
        .stdout(contains("Shards with runs missing: 1."));
    let logs = std::fs::read_dir(dir.path().join("results/e/slurm/logs"))
        .unwrap()
        .count();
    assert!(logs >= 3, "one log per task");
    // Fix the fault and resubmit: only shard 1 runs, then the report.
    std::fs::remove_dir(&blocked).unwrap();
    kvreplay(dir.path())
        .env("SLURM_CONF", cluster.conf())
        .args(["sweep", "e.toml", "--slurm", "--tasks", "3"])
        .assert()
        .success()
        .stdout(contains("(shards 1 of 3)"));
    cluster.wait_idle();
    same_report(dir.path(), single.path());
    kvreplay(dir.path())
        .env("SLURM_CONF", cluster.conf())
        .args(["sweep", "e.toml", "--slurm", "--tasks", "3"])
        .assert()
        .success()
        .stdout(contains("Every run is stored"));
}
