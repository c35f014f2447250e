//! The calibration report's drift section: the live attention beside the open-loop one. A
//! closed-loop run measures the live retained mass (each live query's share of its attention over
//! the whole live cache that its kept set holds, [`crate::live`]) beside the open-loop retained
//! mass of the same policy (the full run's queries over the full run's keys). Their difference,
//! layer by layer, is how far the model's own vectors moved once tokens were gone: what an
//! open-loop number cannot see. Runs stored before the live mass was measured are left out.

use super::figures::{line_chart, FigureFiles, Series};
use super::intervals::rank_interval;
use super::protocols::protocol;
use super::stats::spearman;
use super::store::prompts_of;
use super::store::StoredRun;
use super::SweepError;
use crate::export::{Format, Table};
use crate::replay::RETAINED_MASS;
use crate::trace::ranges;
use std::collections::BTreeSet;
use std::path::PathBuf;

/// A run's open-loop and live retained mass, per layer and overall, when both were measured.
struct Paired<'a> {
    run: &'a StoredRun,
    open: f64,
    live: f64,
    /// Per layer: live − open-loop.
    drift: Vec<f64>,
}

fn paired(run: &StoredRun) -> Option<Paired<'_>> {
    let closed = run.closed_loop.as_ref()?;
    let live_layers = closed.live_layers.as_ref()?;
    let open_layers = run.report.layer_metrics.get(RETAINED_MASS)?;
    if live_layers.len() != open_layers.len() {
        return None;
    }
    Some(Paired {
        run,
        open: run.report.metric(RETAINED_MASS)?,
        live: closed.live_retained_mass?,
        drift: live_layers
            .iter()
            .zip(open_layers)
            .map(|(l, o)| l - o)
            .collect(),
    })
}

/// The drift section and its figure (`drift.png`, `drift.svg`: mean live − open-loop retained
/// mass per layer, one line per policy); empty when no run has its live mass. Runs measure the
/// compressed layers only: `layers` gives their numbers in the model when that is not every layer
/// (a hybrid model's global layers), so tables and figures name the model's layers; a run that
/// compressed other layers (`layers = all`) is left out of the section.
pub(crate) fn section(
    names: &[String],
    runs: &[StoredRun],
    layers: Option<&[usize]>,
    files: &FigureFiles<'_>,
) -> Result<(String, Vec<PathBuf>), SweepError> {
    let pairs: Vec<Paired> = runs
        .iter()
        .filter_map(paired)
        .filter(|pair| layers.is_none_or(|layers| pair.drift.len() == layers.len()))
        .collect();
    if pairs.is_empty() {
        return Ok((String::new(), Vec::new()));
    }
    let which = match layers {
        Some(layers) if layers.first() != Some(&0) => format!(
            "Only layers {} (the global ones) are compressed and measured; a large drift",
            ranges(layers)
        ),
        _ => "Layer 0 cannot drift (its vectors come from the tokens alone); a large drift deeper in the model".to_string(),
    };
    let model_layer = |index: usize| layers.and_then(|l| l.get(index).copied()).unwrap_or(index);
    let mut out = format!(
        "\nLive attention drift: the live retained mass (each live query's share of its attention over the whole live cache that the policy let it see, mean over teacher-forced steps, heads and layers) beside the open-loop retained mass, mean over budgets and traces ({} runs). {which} is where open-loop numbers stop describing the run:\n\n",
        pairs.len()
    );
    let mut table = Table::new([
        "policy",
        "retained mass (open loop)",
        "retained mass (live)",
        "live − open",
        "largest drift (layer)",
    ]);
    let mut series: Vec<Series> = Vec::new();
    for name in names {
        let of: Vec<&Paired> = pairs.iter().filter(|p| &p.run.name == name).collect();
        if of.is_empty() {
            continue;
        }
        let n = of.len() as f64;
        let open = of.iter().map(|p| p.open).sum::<f64>() / n;
        let live = of.iter().map(|p| p.live).sum::<f64>() / n;
        let layers = of[0].drift.len();
        let per_layer: Vec<f64> = (0..layers)
            .map(|l| {
                of.iter()
                    .map(|p| p.drift.get(l).copied().unwrap_or(0.0))
                    .sum::<f64>()
                    / n
            })
            .collect();
        let (worst, value) = per_layer
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()).then(b.0.cmp(&a.0)))
            .map(|(l, &v)| (l, v))
            .unwrap_or((0, 0.0));
        table.push([
            name.clone(),
            format!("{open:.4}"),
            format!("{live:.4}"),
            format!("{:+.4}", live - open),
            format!("{value:+.4} ({})", model_layer(worst)),
        ]);
        series.push((
            name.clone(),
            per_layer
                .iter()
                .enumerate()
                .map(|(l, &d)| (model_layer(l) as f64, d))
                .collect(),
        ));
    }
    out += &table.render(Format::Markdown);
    out += &predictors(&pairs);
    let figures = line_chart(
        &files.stem("drift"),
        "live − open-loop retained mass per layer (mean over budgets and traces)",
        "layer",
        "retained mass, live − open loop",
        &series,
        false,
    )?;
    Ok((out, figures))
}

/// Which predicts the closed-loop KL better: the open-loop or the live retained mass? Per
/// protocol, since the open-loop mass counts other queries under each.
fn predictors(pairs: &[Paired]) -> String {
    let protocols: BTreeSet<&str> = pairs.iter().map(|p| protocol(p.run)).collect();
    let mut out = String::new();
    for &name in &protocols {
        let of: Vec<&Paired> = pairs.iter().filter(|p| protocol(p.run) == name).collect();
        let kl: Vec<f64> = of
            .iter()
            .map(|p| p.run.closed_loop.as_ref().map_or(f64::NAN, |c| c.kl))
            .collect();
        let open: Vec<f64> = of.iter().map(|p| p.open).collect();
        let live: Vec<f64> = of.iter().map(|p| p.live).collect();
        let prompts = prompts_of(of.iter().map(|p| p.run));
        let under = match protocols.len() {
            1 => String::new(),
            _ => format!(" under {name}"),
        };
        out += &format!(
            "\nSpearman ρ with the closed-loop KL over the same {}{under} (95% cluster-bootstrap interval over prompts, as above): open-loop retained mass {}, live retained mass {}.",
            prompts.describe(),
            rank_interval(&open, &kl, &prompts, spearman, 2000),
            rank_interval(&live, &kl, &prompts, spearman, 2001),
        );
    }
    out + " The live mass is measured inside the closed loop, so it is a diagnosis, not a prediction; where it correlates much better, the open-loop numbers lose their order to the drift.\n"
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experiment::testing::closed_run as run;

    #[test]
    fn drift_by_hand() {
        let dir = tempfile::tempdir().unwrap();
        // Policy a: open (0.9, 0.8), live (0.9, 0.6) and (0.9, 0.7) on two runs: drift per layer
        // (0, -0.2) and (0, -0.1), mean (0, -0.15); open 0.85, live (0.75 + 0.8) / 2 = 0.775.
        // Policy b has no live mass: left out.
        let runs = vec![
            run("a", [0.9, 0.8], Some([0.9, 0.6]), 1.0),
            run("a", [0.9, 0.8], Some([0.9, 0.7]), 0.5),
            run("b", [0.5, 0.5], None, 2.0),
        ];
        let names = vec!["a".to_string(), "b".to_string()];
        let row_of_a = |text: &str| -> Vec<String> {
            text.lines()
                .find(|line| line.starts_with("| a "))
                .expect("a row for policy a")
                .split('|')
                .map(str::trim)
                .filter(|cell| !cell.is_empty())
                .map(str::to_owned)
                .collect()
        };
        let files = FigureFiles::under(dir.path());
        let (text, figures) = section(&names, &runs, None, &files).unwrap();
        assert_eq!(
            row_of_a(&text),
            ["a", "0.8500", "0.7750", "-0.0750", "-0.1500 (1)"]
        );
        assert!(text.contains("Layer 0 cannot drift"), "{text}");
        assert!(!text.contains("| b "), "{text}");
        assert!(text.contains("over the same 1 prompt, 2 runs"), "{text}");
        assert_eq!(figures.len(), 2);
        assert!(figures.iter().all(|f| f.is_file()));
        // A hybrid model's two compressed layers are its layers 5 and 11: the table names them.
        let (text, _) = section(&names, &runs, Some(&[5, 11]), &files).unwrap();
        assert_eq!(row_of_a(&text)[4], "-0.1500 (11)");
        assert!(
            text.contains("Only layers 5, 11 (the global ones)"),
            "{text}"
        );
    }

    #[test]
    fn no_live_mass_no_section() {
        let dir = tempfile::tempdir().unwrap();
        let runs = vec![run("b", [0.5, 0.5], None, 2.0)];
        let (text, figures) = section(
            &["b".to_string()],
            &runs,
            None,
            &FigureFiles::under(dir.path()),
        )
        .unwrap();
        assert!(text.is_empty() && figures.is_empty());
    }
}
