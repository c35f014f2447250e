//! `kvreplay view` in a real browser: headless Chromium (Debian's `chromium`, which `.ci/run`
//! installs) opens the page the command writes for a fixture trace, renders it without a script
//! error, and the kept cells it decodes from its own data equal the library's kept masks, for a
//! one-shot policy and a streaming one compared with it.

use crate::common;

use assert_cmd::Command;
use common::{write_fixture, Shape};
use kvreplay::replay::{kept_masks, presets, PolicyParams};
use kvreplay::trace::TraceReader;
use predicates::prelude::PredicateBooleanExt;
use predicates::str::contains;
use std::path::{Path, PathBuf};

const PROMPT: usize = 40;

fn kvreplay(dir: &Path) -> Command {
    let mut cmd = Command::cargo_bin("kvreplay").unwrap();
    cmd.current_dir(dir);
    cmd
}

/// Debian's headless Chromium.
fn chromium() -> PathBuf {
    ["chromium", "chromium-browser"]
        .iter()
        .find_map(|name| which(name))
        .expect("the browser test needs Chromium: apt-get install chromium (.ci/run installs it)")
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| Path::new(dir).join(name))
        .find(|path| path.is_file())
}

/// Chromium's run of `url`, headless, with `extra` flags; its stdout.
fn browse(url: &str, extra: &[&str]) -> String {
    let output = std::process::Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
        ])
        .args(extra)
        .arg(url)
        .output()
        .expect("chromium runs");
    assert!(
        output.status.success(),
        "chromium: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// The kept cells the page decoded, per policy: (steps, layers, caches, bins, cells).
fn readback(dom: &str) -> Vec<serde_json::Value> {
    let start = dom
        .find("<pre id=\"readback\"")
        .expect("the readback element");
    let open = start + dom[start..].find('>').unwrap() + 1;
    let close = open + dom[open..].find("</pre>").unwrap();
    serde_json::from_str(&dom[open..close]).expect("the readback is JSON")
}

#[test]
fn the_page_renders_the_librarys_kept_sets() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape {
        prompt_len: PROMPT,
        generated: 6,
        ..Shape::default()
    };
    write_fixture(&dir.path().join("fixture.safetensors"), shape, 3);
    kvreplay(dir.path())
        .args([
            "view",
            "fixture.safetensors",
            "--scorer",
            "knorm",
            "--budget",
            "12",
        ])
        .args(["--compare", "h2o", "--out", "page.html"])
        .assert()
        .success()
        .stdout(contains("page.html: ").and(contains(" KiB")));
    let page = dir.path().join("page.html");
    let dom = browse(
        &format!("file://{}#readback", page.display()),
        &["--dump-dom"],
    );
    assert!(
        dom.contains("data-rendered=\"ok\""),
        "the page did not finish drawing"
    );
    assert!(!dom.contains("data-error"), "a script error");
    let trace = TraceReader::open(dir.path().join("fixture.safetensors")).unwrap();
    let knorm = PolicyParams {
        scorer: "knorm".into(),
        budget: 12,
        ..PolicyParams::default()
    };
    let h2o = presets::preset("h2o", 12).unwrap();
    let shown = readback(&dom);
    assert_eq!(shown.len(), 2);
    for ((params, per_step), page) in [(knorm, false), (h2o, true)].into_iter().zip(&shown) {
        let masks = kept_masks(
            &trace,
            &params.check().unwrap(),
            per_step,
            kvreplay::replay::Checkpoints::NONE,
        )
        .unwrap();
        let (layers, caches) = (masks.mask.shape()[0], masks.mask.shape()[1]);
        let steps = if per_step { shape.generated } else { 1 };
        assert_eq!(page["steps"], steps);
        assert_eq!(page["caches"], caches);
        assert_eq!(page["bins"]["size"], 1);
        let cells = page["cells"].as_array().unwrap();
        assert_eq!(cells.len(), steps * layers * caches * PROMPT);
        for (at, cell) in cells.iter().enumerate() {
            let (position, cache) = (at % PROMPT, at / PROMPT % caches);
            let (layer, step) = (at / PROMPT / caches % layers, at / PROMPT / caches / layers);
            let kept = match per_step {
                true => masks.mask[[layer, cache, step, position].as_slice()],
                false => masks.mask[[layer, cache, position].as_slice()],
            };
            assert_eq!(
                cell == 255,
                kept,
                "{} at {layer}, {cache}, {step}, {position}",
                page["label"]
            );
        }
    }
    // A screenshot of the page: a PNG of the window's size.
    let shot = dir.path().join("page.png");
    let flag = format!("--screenshot={}", shot.display());
    browse(
        &format!("file://{}", page.display()),
        &[&flag, "--window-size=1200,900"],
    );
    let png = std::fs::read(&shot).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let width = u32::from_be_bytes(png[16..20].try_into().unwrap());
    assert_eq!(width, 1200);
}

#[test]
fn bad_input_is_named_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    write_fixture(&dir.path().join("fixture.safetensors"), Shape::default(), 3);
    kvreplay(dir.path())
        .args(["view", "absent.safetensors", "--out", "page.html"])
        .assert()
        .code(2)
        .stderr(contains("absent.safetensors"));
    kvreplay(dir.path())
        .args([
            "view",
            "fixture.safetensors",
            "--scorer",
            "knorms",
            "--out",
            "page.html",
        ])
        .assert()
        .code(2)
        .stderr(contains("unknown scorer `knorms`"));
    assert!(!dir.path().join("page.html").exists());
}

#[test]
fn a_report_page_renders_its_tables_sorted_and_its_figures() {
    let dir = tempfile::tempdir().unwrap();
    let experiment = dir.path().join("results/quick");
    std::fs::create_dir_all(&experiment).unwrap();
    let markdown = "# quick\n\nTwo policies.\n\n| policy | mass |\n|---|---|\n| a | 0.25 [0.20, 0.30] |\n| b | 0.75 [0.70, 0.80] |\n| c | 0.5 |\n\nFiles: `mass.svg`.\n";
    std::fs::write(experiment.join("report.md"), markdown).unwrap();
    std::fs::write(
        experiment.join("mass.svg"),
        "<svg width=\"20\" height=\"20\"><circle r=\"5\"/></svg>",
    )
    .unwrap();
    kvreplay(dir.path())
        .args(["pages", "--results", "results"])
        .assert()
        .success()
        .stdout(contains("results: 1 report pages and index.html"));
    let page = experiment.join("report.html");
    let dom = browse(
        &format!("file://{}#sort=1", page.display()),
        &["--dump-dom"],
    );
    assert!(dom.contains("data-rendered=\"ok\"") && !dom.contains("data-error"));
    assert!(dom.contains("data-tables=\"1\"") && dom.contains("<circle r=\"5\""));
    // Sorted by mass, largest first: b, c, a.
    let at = |cell: &str| dom.find(cell).expect(cell);
    let (b, c, a) = (at("<td>b</td>"), at("<td>c</td>"), at("<td>a</td>"));
    assert!(b < c && c < a, "{dom}");
    // A chart with its data beside it is drawn from the data: a group per series.
    let data = r#"{"title": "t", "x_label": "budget", "y_label": "mass", "log_x": true, "mark": "lines",
        "series": [{"name": "one", "points": [[64, 0.5], [128, 0.6]]}, {"name": "two", "points": [[64, 0.7], [128, null]]}]}"#;
    std::fs::write(experiment.join("mass.json"), data).unwrap();
    kvreplay(dir.path())
        .args(["pages", "--results", "results"])
        .assert()
        .success();
    let dom = browse(&format!("file://{}", page.display()), &["--dump-dom"]);
    assert!(
        dom.contains("data-charts=\"1\"") && !dom.contains("data-error"),
        "{dom}"
    );
    assert!(dom.contains("data-series=\"one\"") && dom.contains("data-series=\"two\""));
    assert_eq!(dom.matches("<polyline").count(), 2);
    let index = dir.path().join("results/index.html");
    let dom = browse(&format!("file://{}", index.display()), &["--dump-dom"]);
    assert!(dom.contains("href=\"quick/report.html\"") && dom.contains("Two policies."));
}
