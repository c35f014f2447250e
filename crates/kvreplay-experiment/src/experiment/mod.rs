//! Declarative experiments: a TOML file in `experiments/` names traces (trace files, or recipes
//! captured on first use), a list of budgets, and policies whose list-valued settings expand to a
//! cartesian product (ChampSim's `--join product`). Every run has a deterministic id (a slug and a
//! hash of its normalised settings and of its trace's content), is written atomically to
//! `results/<experiment>/runs/<id>.json`, and is skipped when already there, so an interrupted
//! sweep resumes where it stopped. [`report`] turns the stored runs into tables with confidence
//! intervals, paired comparisons, Parquet/CSV rows and plots. With `closed_loop = true` every run
//! is also run live in the model ([`crate::live`]) and the report adds the [`calibration`] of
//! open-loop metrics against closed-loop outcomes.

mod budget;
pub mod calibration;
pub mod cluster;
mod drift;
mod error;
mod figures;
pub mod frames;
pub mod intervals;
mod protocols;
mod ranking;
pub mod report;
pub mod shard;
pub mod slurm;
mod spec;
pub mod stats;
mod store;
mod sweep;
#[cfg(test)]
mod testing;
mod traces;

pub use budget::Budget;
pub use error::SweepError;
pub use spec::{run_id, Comparison, Experiment, ExperimentError, PlannedRun};
pub use store::{claim_results, stored_runs, ClosedLoop, StoredReport, StoredRun};
pub use sweep::{run_sweep, SweepProgress};
pub use traces::{Capture, TraceEntry, TraceFile};
