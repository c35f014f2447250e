//! The bench's two grids against the NumPy references it times them with, on a fixture trace:
//! the policies of each name agree on both sides (the bench refuses to time a grid whose
//! retained mass differs from its reference's by more than its tolerance). The NumPy is the
//! test environment's (`KVREPLAY_HF_PYTHON`, which `.ci/run` makes) or the bench's own venv.

use crate::common;

use common::{write_fixture, Shape};
use kvreplay::bench;
use kvreplay::trace::TraceReader;

fn python() -> std::path::PathBuf {
    let given = std::env::var_os("KVREPLAY_HF_PYTHON").map(Into::into);
    bench::numpy_python(given).expect("a Python with NumPy")
}

#[test]
fn the_bench_grids_agree_with_their_numpy_references() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fixture.safetensors");
    write_fixture(&path, Shape::default(), 7);
    let trace = TraceReader::open(&path).unwrap();
    let python = python();
    let budgets = [13, 17];
    let (reports, _) =
        bench::replay_grid(&trace, &budgets, kvreplay::replay::Checkpoints::NONE).unwrap();
    assert_eq!(reports.len(), bench::GRID_POLICIES.len() * budgets.len());
    let grid = bench::numpy_grid(&python, &path, &budgets, &reports).unwrap();
    assert!(grid.worst_difference <= bench::NUMPY_TOLERANCE, "{grid:?}");
    let (reports, _) =
        bench::oneshot_grid(&trace, &budgets, kvreplay::replay::Checkpoints::NONE).unwrap();
    assert_eq!(reports.len(), bench::ONESHOT_POLICIES.len() * budgets.len());
    let oneshot = bench::oneshot_numpy(&python, &path, &budgets, &reports).unwrap();
    assert!(
        oneshot.worst_difference <= bench::NUMPY_TOLERANCE,
        "{oneshot:?}"
    );
}

/// No grid name shadows a preset: a name the bench shares with `kvreplay compare` is that
/// preset, at every budget.
#[test]
fn grid_names_that_are_presets_are_the_presets() {
    let names = bench::GRID_POLICIES
        .iter()
        .chain(&bench::ONESHOT_POLICIES)
        .chain(&bench::LONG_POLICIES);
    for name in names {
        if kvreplay::replay::presets::NAMES.contains(name) {
            for budget in [64, 128] {
                assert_eq!(
                    bench::oneshot_policy(name, budget).unwrap(),
                    kvreplay::replay::presets::preset(name, budget).unwrap(),
                    "{name}"
                );
            }
        }
    }
}
