//! The command line, end to end on fixture traces: tables (insta snapshots), JSON, and errors
//! that name what is wrong and exit with code 2.

use crate::common;

use assert_cmd::Command;
use common::{write_fixture, Shape};
use predicates::str::contains;
use std::collections::BTreeMap;

fn fixture() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_fixture(
        &dir.path().join("fixture.safetensors"),
        Shape::default(),
        42,
    );
    dir
}

fn kvreplay(dir: &tempfile::TempDir) -> Command {
    let mut cmd = Command::cargo_bin("kvreplay").unwrap();
    cmd.current_dir(dir.path());
    cmd
}

fn stdout(cmd: &mut Command) -> String {
    let output = cmd.assert().success().get_output().stdout.clone();
    String::from_utf8(output).unwrap()
}

/// Runs `kvreplay args` in `dir` and requires exit 2 with `message` in its error.
/// The first data row of `kvreplay replay fixture.safetensors --budget BUDGET --format csv` with
/// `extra` flags, by column.
fn replay_row(dir: &tempfile::TempDir, budget: &str, extra: &[&str]) -> Vec<String> {
    let mut args = vec![
        "replay",
        "fixture.safetensors",
        "--budget",
        budget,
        "--format",
        "csv",
    ];
    args.extend_from_slice(extra);
    let out = stdout(kvreplay(dir).args(&args));
    out.lines()
        .nth(1)
        .unwrap()
        .split(',')
        .map(str::to_owned)
        .collect()
}

fn refused(dir: &tempfile::TempDir, args: &[&str], message: &str) {
    kvreplay(dir)
        .args(args)
        .assert()
        .code(2)
        .stderr(predicates::str::contains(message));
}

#[test]
fn replay_markdown_table() {
    let dir = fixture();
    let out = stdout(kvreplay(&dir).args([
        "replay",
        "fixture.safetensors",
        "--scorer",
        "true-query",
        "--timing",
        "streaming",
        "--budget",
        "8",
        "--window",
        "2",
        "--sinks",
        "1",
    ]));
    insta::assert_snapshot!(out);
}

#[test]
fn compare_presets_table() {
    let dir = fixture();
    let out = stdout(kvreplay(&dir).args([
        "compare",
        "fixture.safetensors",
        "--budget",
        "12",
        "--no-layers",
        "--presets",
        "snapkv,pyramidkv,h2o,streamingllm,h2o-adapted,oracle",
    ]));
    insta::assert_snapshot!(out);
}

/// A preset that reads tensors the trace lacks: left out of `compare`'s default list and named on
/// stderr with the capture option that records them; asked for by name, an error (exit 2) saying
/// the same; on a trace that has them, it runs.
#[test]
fn compare_leaves_out_a_preset_the_trace_cannot_run() {
    let dir = fixture();
    let shape = Shape::default();
    let t = shape.prompt_len + shape.generated;
    let mut writer = kvreplay::trace::TraceWriter::new(
        common::meta(shape),
        kvreplay::trace::StorageDtype::F32,
        (0..t as i64).collect(),
    );
    for (q, k, v) in common::tensors(shape, 42) {
        writer.push_layer(q, k, Some(v));
    }
    writer.write(&dir.path().join("bare.safetensors")).unwrap();
    let output = kvreplay(&dir)
        .args([
            "compare",
            "bare.safetensors",
            "--budget",
            "12",
            "--no-layers",
        ])
        .assert()
        .success()
        .get_output()
        .clone();
    let (out, err) = (
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    );
    assert!(
        err.contains("left out `defensivekv`") && err.contains("--attention-inputs"),
        "{err}"
    );
    assert!(
        out.contains("| snapkv-d (") && !out.contains("defensivekv"),
        "{out}"
    );
    let refused = kvreplay(&dir)
        .args(["compare", "bare.safetensors", "--presets", "defensivekv"])
        .assert()
        .code(2)
        .get_output()
        .stderr
        .clone();
    let refused = String::from_utf8(refused).unwrap();
    assert!(
        refused.contains("scorer `defensivekv`") && refused.contains("--attention-inputs"),
        "{refused}"
    );
    let ran = stdout(kvreplay(&dir).args([
        "compare",
        "fixture.safetensors",
        "--budget",
        "12",
        "--presets",
        "defensivekv",
        "--no-layers",
    ]));
    assert!(
        ran.contains("| defensivekv (flat/adakv+defensivekv@prefill)"),
        "{ran}"
    );
}

#[test]
fn inspect_report() {
    let dir = fixture();
    let out = stdout(kvreplay(&dir).args(["inspect", "fixture.safetensors", "--window", "4"]));
    insta::assert_snapshot!(out);
}

#[test]
fn replay_json_has_the_documented_fields() {
    let dir = fixture();
    let out = stdout(kvreplay(&dir).args([
        "replay",
        "fixture.safetensors",
        "--budget",
        "10",
        "--format",
        "json",
    ]));
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    for key in ["retained_mass", "topk_recall", "output_error", "mean_kept"] {
        assert!(json[key].is_number(), "{key} missing in {out}");
    }
    let layers = json["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 2);
    // Each metric per query head and decode step.
    let samples = &layers[0]["samples"]["retained_mass"];
    assert_eq!(samples.as_array().unwrap().len(), 4);
    assert_eq!(samples[0].as_array().unwrap().len(), 5);
}

#[test]
fn csv_per_layer_rows() {
    let dir = fixture();
    let out = stdout(kvreplay(&dir).args([
        "replay",
        "fixture.safetensors",
        "--budget",
        "10",
        "--format",
        "csv",
    ]));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[0],
        "policy,layer,budget,mean kept,KV read/layer,KV held/layer,KiB/layer,retained mass,top-k recall,output error,value-weighted mass,value gap"
    );
    assert_eq!(lines.len(), 3);
}

/// `--quantizer` stores the kept entries quantized: the label names it and the bytes drop below
/// the plain cache's; a bit width or a group the scheme cannot take exits 2 naming the setting.
#[test]
fn a_quantized_cache_is_labelled_and_holds_fewer_bytes() {
    let dir = fixture();
    let csv = |extra: &[&str]| replay_row(&dir, "16", extra);
    let plain = csv(&[]);
    let kivi = csv(&[
        "--quantizer",
        "kivi",
        "--group-size",
        "4",
        "--residual",
        "4",
    ]);
    assert_eq!(kivi[0], "flat+snapkv@prefill kivi 2-bit");
    let kib = |row: &[String]| row[6].parse::<f64>().unwrap();
    assert!(kib(&kivi) < kib(&plain), "{kivi:?} vs {plain:?}");
    refused(
        &dir,
        &[
            "replay",
            "fixture.safetensors",
            "--quantizer",
            "kivi",
            "--bits",
            "3",
        ],
        "quantizer `kivi`: setting `bits` = 3: must be 2, 4 or 8",
    );
    refused(
        &dir,
        &[
            "replay",
            "fixture.safetensors",
            "--quantizer",
            "per-token",
            "--group-size",
            "3",
        ],
        "quantizer `per-token`: group_size 3 must divide the head size (4)",
    );
}

/// `--channels think` prunes key channels: the label names it and the bytes drop below the plain
/// cache's by the pruned channels (head size 4, half pruned: a quarter of each prompt entry's
/// elements, less a bit a channel); a ratio out of range, a setting of an unchosen rule and a
/// quantizer beside it exit 2 naming the rule.
#[test]
fn pruned_key_channels_are_labelled_and_hold_fewer_bytes() {
    let dir = fixture();
    let csv = |extra: &[&str]| replay_row(&dir, "16", extra);
    let plain = csv(&[]);
    let think = csv(&["--channels", "think", "--query-window", "4"]);
    assert_eq!(
        think[0],
        "flat+snapkv@prefill think 0.5 of key channels pruned"
    );
    let kib = |row: &[String]| row[6].parse::<f64>().unwrap();
    assert!(
        kib(&think) < kib(&plain) * 0.9 && kib(&think) > kib(&plain) * 0.7,
        "{think:?} vs {plain:?}"
    );
    refused(
        &dir,
        &[
            "replay",
            "fixture.safetensors",
            "--channels",
            "think",
            "--key-channel-ratio",
            "1",
        ],
        "channels `think`: setting `key_channel_ratio` = 1: must be in [0, 1)",
    );
    refused(
        &dir,
        &[
            "replay",
            "fixture.safetensors",
            "--key-channel-ratio",
            "0.5",
        ],
        "it is a setting of channels `think`",
    );
    refused(
        &dir,
        &[
            "replay",
            "fixture.safetensors",
            "--channels",
            "think",
            "--quantizer",
            "kivi",
        ],
        "quantizer `kivi` with channels `think` are not combined yet",
    );
}

/// `--merge similarity` folds the evicted values into kept ones: the label names it, the bytes and
/// retained mass are the plain run's and the output error moves; a merge under a timing other than
/// `prefill`, a setting out of range and a quantizer beside it exit 2 naming the rule. The same
/// for `--merge cam` under kvpress's CAMPress schedule.
#[test]
fn merged_values_are_labelled_and_hold_the_same_bytes() {
    let dir = fixture();
    let csv = |extra: &[&str]| replay_row(&dir, "12", extra);
    let plain = csv(&[]);
    let merged = csv(&["--merge", "similarity"]);
    assert_eq!(merged[0], "flat+snapkv@prefill merging by similarity");
    // KiB/layer, retained mass the same; output error not.
    assert_eq!((&merged[6], &merged[7]), (&plain[6], &plain[7]));
    assert_ne!(merged[9], plain[9]);
    refused(
        &dir,
        &[
            "replay",
            "fixture.safetensors",
            "--merge",
            "similarity",
            "--timing",
            "streaming",
            "--scorer",
            "tova",
        ],
        "merge `similarity` folds what the one cut at the prompt's end evicts: use --timing prefill",
    );
    refused(
        &dir,
        &[
            "replay",
            "fixture.safetensors",
            "--merge",
            "similarity",
            "--merge-fraction",
            "0",
        ],
        "merge `similarity`: setting `merge_fraction` = 0: must be in (0, 1]",
    );
    refused(
        &dir,
        &[
            "replay",
            "fixture.safetensors",
            "--merge",
            "similarity",
            "--quantizer",
            "kivi",
        ],
        "are not combined yet",
    );
    // CaM merges at the compressions made while decoding: kvpress's CAMPress schedule runs,
    // the same bytes and mass as without it; a one-shot timing or a merge budget of 0 exit 2.
    let cam = [
        "--scorer",
        "knorm",
        "--timing",
        "decoding",
        "--order",
        "attend-first",
        "--interval",
        "2",
        "--trigger",
        "steps",
        "--gqa",
        "layer",
    ];
    let plain = csv(&cam);
    let cam_merged = csv(&[&cam[..], &["--merge", "cam", "--merge-budget", "4"]].concat());
    assert_eq!(
        cam_merged[0],
        "flat+knorm@decoding every 2 tokens merging by cam"
    );
    assert_eq!((&cam_merged[6], &cam_merged[7]), (&plain[6], &plain[7]));
    assert_ne!(cam_merged[9], plain[9]);
    refused(
        &dir,
        &["replay", "fixture.safetensors", "--merge", "cam"],
        "merge `cam` folds what the compressions made while decoding evict: use --timing decoding, prefill-then-stream or streaming",
    );
    refused(
        &dir,
        &[
            &["replay", "fixture.safetensors"][..],
            &cam,
            &["--merge", "cam", "--merge-budget", "0"],
        ]
        .concat(),
        "merge `cam`: setting `merge_budget` = 0: must be at least 1",
    );
}

/// `--heads duo` needs a calibration trace of the same model, a ratio in [0, 1], a known scoring,
/// protection and the `prefill` timing: each refusal exits 2 naming the rule; calibrated on the
/// trace itself it runs.
#[test]
fn duo_heads_are_refused_without_what_they_need() {
    let dir = fixture();
    let duo = |extra: &[&'static str]| -> Vec<&'static str> {
        let mut args = vec![
            "replay",
            "fixture.safetensors",
            "--heads",
            "duo",
            "--sinks",
            "1",
        ];
        args.extend_from_slice(extra);
        args
    };
    refused(&dir, &duo(&[]), "head split `duo`: setting `calibration` = its default: must be the path of a kvtrace/1 file");
    refused(
        &dir,
        &duo(&["--calibration", "missing.safetensors"]),
        "the calibration trace cannot be read",
    );
    refused(
        &dir,
        &duo(&[
            "--calibration",
            "fixture.safetensors",
            "--head-compression-ratio",
            "1.5",
        ]),
        "must be in [0, 1]: the share of the KV heads made streaming heads",
    );
    refused(
        &dir,
        &duo(&["--calibration", "fixture.safetensors", "--scores", "oracle"]),
        "must be `on-the-fly`",
    );
    refused(
        &dir,
        &duo(&[
            "--calibration",
            "fixture.safetensors",
            "--timing",
            "streaming",
            "--scorer",
            "tova",
        ]),
        "head split `duo` splits the heads once, at the prompt's end: use --timing prefill",
    );
    write_fixture(
        &dir.path().join("other.safetensors"),
        Shape {
            n_layers: 3,
            ..Shape::default()
        },
        1,
    );
    refused(
        &dir,
        &duo(&["--calibration", "other.safetensors"]),
        "it must come from the same model",
    );
    let out = stdout(kvreplay(&dir).args(duo(&[
        "--calibration",
        "fixture.safetensors",
        "--format",
        "csv",
    ])));
    assert!(
        out.lines()
            .nth(1)
            .unwrap()
            .starts_with("flat/duo+snapkv@prefill"),
        "{out}"
    );
}

/// `compare --bytes --quantizer --bits` sets a budget in bytes and a quantizer over every preset:
/// a 4-bit cache keeps more tokens in the same bytes.
#[test]
fn compare_sets_bytes_and_a_quantizer_over_every_preset() {
    let dir = fixture();
    let budgets = |extra: &[&str]| -> Vec<(String, usize)> {
        let mut args = vec!["compare", "fixture.safetensors", "--presets", "snapkv,tova"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--format", "json", "--no-layers"]);
        let out: serde_json::Value =
            serde_json::from_str(&stdout(kvreplay(&dir).args(&args))).unwrap();
        out.as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["policy"].as_str().unwrap().to_owned(),
                    r["nominal_budget"].as_u64().unwrap() as usize,
                )
            })
            .collect()
    };
    let plain = budgets(&["--bytes", "1/2"]);
    let quantized = budgets(&[
        "--bytes",
        "1/2",
        "--quantizer",
        "per-token",
        "--bits",
        "4",
        "--group-size",
        "4",
    ]);
    assert_eq!(
        plain[0].0,
        "snapkv (flat+snapkv@prefill at 0.5 of the bytes)"
    );
    assert_eq!(
        quantized[1].0,
        "tova (flat+tova@prefill-then-stream per-token 4-bit at 0.5 of the bytes)"
    );
    for (plain, quantized) in plain.iter().zip(&quantized) {
        assert!(quantized.1 > plain.1, "{plain:?} vs {quantized:?}");
    }
}

/// `--interval N` spaces a streaming policy's evictions (the label says so, and how `--trigger`
/// places them: by steps after a cut to the budget as by growth); under a one-shot timing, with CAKE's ordered cache, or at 0, it exits 2 naming
/// the rule, as does a trigger without an interval and a budget in bytes that the protected
/// window alone exceeds.
#[test]
fn an_interval_is_labelled_and_refused_where_it_means_nothing() {
    let dir = fixture();
    let tova_every_4 = |trigger: &str| {
        stdout(kvreplay(&dir).args([
            "replay",
            "fixture.safetensors",
            "--scorer",
            "tova",
            "--timing",
            "prefill-then-stream",
            "--interval",
            "4",
            "--trigger",
            trigger,
            "--budget",
            "10",
            "--format",
            "csv",
        ]))
    };
    let out = tova_every_4("growth");
    assert!(
        out.contains("flat+tova@prefill-then-stream every 4,"),
        "{out}"
    );
    refused(
        &dir,
        &["replay", "fixture.safetensors", "--interval", "4"],
        "interval 4 spaces a streaming eviction: use --timing streaming, prefill-then-stream or decoding",
    );
    let cake = [
        "--scorer",
        "cake",
        "--timing",
        "prefill-then-stream",
        "--interval",
        "4",
    ];
    refused(
        &dir,
        &[&["replay", "fixture.safetensors"][..], &cake].concat(),
        "scorer `cake` with interval 4 keeps its own cache order through single evictions",
    );
    refused(
        &dir,
        &["replay", "fixture.safetensors", "--interval", "0"],
        "timing `prefill`: setting `interval` = 0: must be at least 1",
    );
    // After a cut to the budget, counting the generated tokens is the cache's growth.
    let by_steps = tova_every_4("steps");
    let row = |csv: &str, label: &str| csv.lines().nth(1).unwrap().replacen(label, "", 1);
    assert!(by_steps.contains("flat+tova@prefill-then-stream every 4 tokens,"));
    assert_eq!(
        row(&by_steps, "flat+tova@prefill-then-stream every 4 tokens"),
        row(&out, "flat+tova@prefill-then-stream every 4")
    );
    let by_position = tova_every_4("position");
    assert!(
        by_position.contains("flat+tova@prefill-then-stream at positions divisible by 4,"),
        "{by_position}"
    );
    refused(
        &dir,
        &[
            "replay",
            "fixture.safetensors",
            "--scorer",
            "tova",
            "--trigger",
            "position",
            "--timing",
            "prefill-then-stream",
        ],
        "trigger `position` places the compressions an interval makes: give an interval above 1",
    );
    refused(
        &dir,
        &["replay", "fixture.safetensors", "--bytes", "1/2000"],
        "bytes 0.0005: a cache of 8 tokens (the protected sinks and window, or one) already holds",
    );
}

/// `--layers all` on a trace whose first layer slides over 6 positions: one CSV row per layer
/// instead of the global layer's alone; a value that is not a choice exits 2 naming them.
#[test]
fn layers_all_compresses_the_sliding_window_layers_too() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape::default();
    common::write_windowed(
        &dir.path().join("hybrid.safetensors"),
        shape,
        &common::tensors(shape, 7),
        vec![6, 0],
    );
    let rows = |layers: &str| {
        let out = stdout(kvreplay(&dir).args([
            "replay",
            "hybrid.safetensors",
            "--budget",
            "4",
            "--window",
            "2",
            "--layers",
            layers,
            "--format",
            "csv",
        ]));
        out.lines()
            .skip(1)
            .map(|line| line.split(',').nth(1).unwrap().to_owned())
            .collect::<Vec<String>>()
    };
    assert_eq!(rows("global"), vec!["1"]);
    assert_eq!(rows("all"), vec!["0", "1"]);
    kvreplay(&dir)
        .args(["replay", "hybrid.safetensors", "--layers", "sliding"])
        .assert()
        .code(2)
        .stderr(contains("[possible values: global, all]"));
}

#[test]
fn unknown_names_list_the_valid_ones() {
    let dir = fixture();
    kvreplay(&dir)
        .args(["replay", "fixture.safetensors", "--scorer", "h3o"])
        .assert()
        .code(2)
        .stderr(contains(
            "unknown scorer `h3o`; valid: key-proxy, true-query, snapkv",
        ));
    kvreplay(&dir)
        .args(["replay", "fixture.safetensors", "--allocator", "pyramids"])
        .assert()
        .code(2)
        .stderr(contains(
            "unknown allocator `pyramids`; valid: flat, pyramid, pyramid-kvpress, pyramid-taper",
        ));
    kvreplay(&dir)
        .args([
            "compare",
            "fixture.safetensors",
            "--presets",
            "snapkv,quasar",
        ])
        .assert()
        .code(2)
        .stderr(contains("unknown preset `quasar`"));
    kvreplay(&dir)
        .args(["replay", "fixture.safetensors", "--order", "attend-first"])
        .assert()
        .code(2)
        .stderr(contains(
            "order `attend-first` orders a streaming eviction: use --timing streaming, prefill-then-stream or decoding",
        ));
    kvreplay(&dir)
        .args([
            "replay",
            "fixture.safetensors",
            "--scorer",
            "cake",
            "--timing",
            "streaming",
        ])
        .assert()
        .code(2)
        .stderr(contains(
            "scorer `cake` (timings: prefill, prefill-then-stream) is not defined for this timing",
        ));
}

#[test]
fn bad_parameters_exit_2_with_the_rule() {
    let dir = fixture();
    for (args, expected) in [
        (vec!["--budget", "0"], "`budget` = 0: must be at least 1"),
        (
            vec!["--budget", "many"],
            "--budget: `many` is not a whole number of tokens",
        ),
        (vec!["--top-k=-3"], "--top-k: `-3` is not a whole number"),
        (
            vec!["--budget", "5", "--sinks", "4", "--window", "2"],
            "budget 5 is below sinks 4 + window 2",
        ),
        (
            vec!["--kernel", "4"],
            "scorer `snapkv`: setting `kernel` = 4: must be odd",
        ),
        (
            vec!["--allocator", "pyramid", "--beta=-1"],
            "allocator `pyramid`: setting `beta` = -1: must be a positive finite number",
        ),
        (
            vec!["--allocator", "pyramid", "--beta", "NaN"],
            "setting `beta` = NaN: expected f64",
        ),
        (
            vec!["--heads", "adakv", "--alpha", "1.5"],
            "head split `adakv`: setting `alpha` = 1.5: must be in [0, 1]",
        ),
        (
            vec!["--heads", "threshold", "--threshold", "inf"],
            "head split `threshold`: setting `threshold` = inf: expected f64",
        ),
        (
            vec!["--heads", "threshold", "--scorer", "knorm", "--window", "0"],
            "head split `threshold` may leave a cache only its protected positions, which may be nothing",
        ),
        (
            vec!["--allocator", "pyramid-taper", "--beta", "0.5"],
            "steepness must be a finite number >= 1",
        ),
        (
            vec!["--pool", "median"],
            "scorer `snapkv`: setting `pool` = median: expected `avg` or `max`",
        ),
        // A setting the chosen methods do not take names them, what they take, and its owners.
        (
            vec!["--beta", "2"],
            "setting `beta` is not taken by allocator `flat` (no settings), scorer `snapkv` (kernel, pool, agg), head split `uniform` (no settings) or timing `prefill` (order, interval, trigger); it is a setting of allocator `pyramid`, allocator `pyramid-kvpress`, allocator `pyramid-taper`",
        ),
        (
            vec!["--scorer", "recency", "--agg", "max"],
            "setting `agg` is not taken by",
        ),
        // Old spellings name the new one.
        (
            vec!["--scorer", "oracle-per-step"],
            "scorer `oracle-per-step` was renamed: the per-step oracle is the `tova` scorer under `--timing per-step`",
        ),
        (
            vec!["--timing", "streaming"],
            "scorer `snapkv` (timings: prefill) is not defined for this timing",
        ),
        (
            vec!["--window", "30", "--budget", "40"],
            "window 30 + sinks 0 is longer than the prompt (20 tokens)",
        ),
    ] {
        let mut full = vec!["replay", "fixture.safetensors"];
        full.extend(args);
        kvreplay(&dir)
            .args(&full)
            .assert()
            .code(2)
            .stderr(contains(expected));
    }
}

/// A method's boolean setting is given as `true` or `false` on the command line (it was read as
/// text and refused), as docs/policies.md writes KVzip's settings.
#[test]
fn boolean_settings_are_given_as_flags() {
    let dir = fixture();
    let replay = |normalize: &str| {
        let args = [
            "replay",
            "fixture.safetensors",
            "--allocator",
            "global",
            "--heads",
            "adakv",
            "--alpha",
            "0",
            "--normalize",
            normalize,
        ];
        kvreplay(&dir).args(args).assert()
    };
    let ran = replay("false").success().get_output().stdout.clone();
    assert!(
        String::from_utf8(ran)
            .unwrap()
            .contains("global/adakv+snapkv@prefill"),
        "the policy's label"
    );
    replay("true").success();
    replay("maybe")
        .code(2)
        .stderr(contains("setting `normalize` = maybe: expected a boolean"));
}

#[test]
fn bad_traces_exit_2_naming_the_file() {
    let dir = fixture();
    std::fs::write(dir.path().join("junk.safetensors"), b"junk").unwrap();
    kvreplay(&dir)
        .args(["replay", "junk.safetensors"])
        .assert()
        .code(2)
        .stderr(contains("junk.safetensors: not a valid safetensors file"));
    kvreplay(&dir)
        .args(["replay", "."])
        .assert()
        .code(2)
        .stderr(contains(
            ".: cannot read trace: is a directory, not a trace file",
        ));
    kvreplay(&dir)
        .args(["inspect", "absent.safetensors"])
        .assert()
        .code(2)
        .stderr(contains("absent.safetensors: cannot read trace"));
}

#[test]
fn missing_assets_say_how_to_fetch() {
    let dir = fixture();
    std::fs::write(
        dir.path().join("r.toml"),
        "kind = \"chat\"\nmessage = \"hi\"\ngenerate = 1\n",
    )
    .unwrap();
    kvreplay(&dir)
        .env("KVREPLAY_HOME", dir.path().join("empty-home"))
        .env("KVREPLAY_PYTHON", "/nonexistent/python3")
        .args(["capture", "--recipe", "r.toml"])
        .assert()
        .code(2)
        .stderr(contains("cannot run `/nonexistent/python3 -m pip`"));
}

#[test]
fn bad_recipes_name_the_field() {
    let dir = fixture();
    std::fs::write(
        dir.path().join("r.toml"),
        "kind = \"niah\"\nprompt_tokens = 2000\n",
    )
    .unwrap();
    kvreplay(&dir)
        .args(["capture", "--recipe", "r.toml"])
        .assert()
        .code(2)
        .stderr(contains(
            "r.toml: invalid recipe: missing field `depth_percent`",
        ));
    std::fs::write(
        dir.path().join("v.toml"),
        "kind = \"ruler-vt\"\nprompt_tokens = 1000\nnum_hops = 0\n",
    )
    .unwrap();
    kvreplay(&dir)
        .args(["capture", "--recipe", "v.toml"])
        .assert()
        .code(2)
        .stderr(contains("v.toml: field `num_hops`: must be at least 1"));
    std::fs::write(dir.path().join("k.toml"), "kind = \"haystack\"\n").unwrap();
    kvreplay(&dir)
        .args(["capture", "--recipe", "k.toml"])
        .assert()
        .code(2)
        .stderr(contains("unknown variant `haystack`"));
}

#[test]
fn live_mode_refuses_what_it_cannot_run_before_loading_anything() {
    let dir = fixture();
    kvreplay(&dir)
        .args(["live", "--recipe", "fixture.safetensors"])
        .assert()
        .code(2)
        .stderr(contains(
            "fixture.safetensors: live mode runs the model on a recipe (a .toml file), not on a trace",
        ));
    std::fs::write(
        dir.path().join("r.toml"),
        "kind = \"chat\"\nmessage = \"hi\"\ngenerate = 4\n",
    )
    .unwrap();
    kvreplay(&dir)
        .args([
            "live",
            "--recipe",
            "r.toml",
            "--scorer",
            "oracle-static",
            "--timing",
            "streaming",
        ])
        .assert()
        .code(2)
        .stderr(contains(
            "live mode: scorer `oracle-static` reads future queries, which live mode takes from the full run under the `prefill` timing only, not `streaming`",
        ));
    for (axis, method) in [
        ("--quantizer", "kivi"),
        ("--channels", "think"),
        ("--merge", "similarity"),
    ] {
        kvreplay(&dir)
            .args(["live", "--recipe", "r.toml", axis, method, "--gqa", "query-head"])
            .assert()
            .code(2)
            .stderr(contains(format!(
                "live mode: {} `{method}` runs live on one cache per KV head (`gqa = kv-head` or `layer`), which the query heads of a group share; under `gqa = query-head` each would store its own, which is replayed only",
                &axis[2..]
            )));
    }
    kvreplay(&dir)
        .args([
            "live",
            "--recipe",
            "r.toml",
            "--protocol",
            "question-agnostic",
            "--timing",
            "streaming",
            "--scorer",
            "true-query",
        ])
        .assert()
        .code(2)
        .stderr(contains(
            "moves the prompt-end cut before the question: use --timing prefill, prefill-then-stream or per-step-prompt",
        ));
}

/// `docs/methods.md` is what `kvreplay methods` prints, so every method, setting and metric is
/// described once, in its declaration.
#[test]
fn committed_methods_listing_is_current() {
    let committed =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/methods.md")).unwrap();
    let listed = stdout(Command::cargo_bin("kvreplay").unwrap().arg("methods"));
    assert!(
        committed == listed,
        "docs/methods.md differs from `kvreplay methods`: regenerate it with \
         `cargo run --release -- methods > docs/methods.md`"
    );
}

/// The method added through `docs/adding-a-method.md` (its file and one registry line) is
/// replayed from the command line, named in its help and listed.
#[test]
fn a_method_added_through_the_guide_runs_end_to_end() {
    let dir = fixture();
    let out = stdout(kvreplay(&dir).args([
        "replay",
        "fixture.safetensors",
        "--scorer",
        "observed-attention",
        "--timing",
        "streaming",
        "--budget",
        "8",
        "--window",
        "2",
        "--no-layers",
    ]));
    assert!(out.contains("flat+observed-attention@streaming"), "{out}");
    let help = stdout(kvreplay(&dir).args(["replay", "--help"]));
    assert!(help.contains("observed-attention"), "{help}");
    let methods = stdout(kvreplay(&dir).arg("methods"));
    assert!(methods.contains("### `observed-attention`"), "{methods}");
}

/// The rows of the first Markdown table in `text` whose header starts with `| policy`, by
/// policy: column name → cell.
fn policy_table(text: &str) -> BTreeMap<String, BTreeMap<String, String>> {
    let cells = |line: &str| -> Vec<String> {
        let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
        inner
            .split('|')
            .map(|cell| cell.trim().to_owned())
            .collect()
    };
    let mut lines = text
        .lines()
        .skip_while(|line| !line.starts_with("| policy"));
    let header = cells(lines.next().expect("a policy table"));
    lines
        .skip(1)
        .take_while(|line| line.starts_with('|'))
        .map(|line| {
            let row = cells(line);
            let named = header.iter().cloned().zip(row.iter().cloned()).collect();
            (row[0].clone(), named)
        })
        .collect()
}

/// The README's demo table is a cut of `docs/demo.md`'s full one: every row and column it shows
/// holds the same cell there, and it shows every preset the demo does not leave out.
#[test]
fn the_readme_demo_rows_are_docs_demo_rows() {
    let read = |path: &str| {
        std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR"))).unwrap()
    };
    let (readme, demo) = (
        policy_table(&read("README.md")),
        policy_table(&read("docs/demo.md")),
    );
    let demo_text = read("docs/demo.md");
    for name in kvreplay::replay::presets::NAMES {
        let shown = readme
            .keys()
            .any(|policy| policy.starts_with(&format!("{name} (")));
        let left_out = demo_text.contains(&format!("left out `{name}`"));
        assert!(
            shown != left_out,
            "preset {name}: the README shows every preset the demo runs, docs/demo.md names the ones it leaves out"
        );
    }
    for (policy, row) in &readme {
        let full = demo
            .get(policy)
            .unwrap_or_else(|| panic!("{policy} not in docs/demo.md"));
        for (column, cell) in row {
            assert_eq!(
                full.get(column),
                Some(cell),
                "{policy}, {column}: README {cell}, docs/demo.md {:?}",
                full.get(column)
            );
        }
    }
}

/// Ctrl-C stops `kvreplay bench` where it stands (between measurements, after a replay's layer or
/// the model's chunk or token): exit 130 and a message, no table printed. Before, the signal
/// killed it. The trace is long enough (4,096 positions) that the bench is under way when the
/// signal comes a second in.
#[test]
fn ctrl_c_stops_a_bench() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape {
        n_layers: 6,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 32,
        prompt_len: 4096,
        generated: 64,
    };
    write_fixture(&dir.path().join("long.safetensors"), shape, 3);
    let args = [
        "bench",
        "long.safetensors",
        "--no-numpy",
        "--capture-tokens",
        "0",
    ];
    let child = common::spawn_kvreplay(dir.path(), &args);
    let started = std::time::Instant::now();
    let output = common::interrupt_when(child, || started.elapsed().as_secs() >= 1);
    assert!(output.stdout.is_empty(), "no table");
}
