//! kvtrace/1: round trips, and one test per validation rule of docs/trace-format.md, on
//! small files built here.

use crate::common;

use common::{meta, tensors, write_fixture, Shape};
use kvreplay_core::trace::{
    trace_bytes, write_trace, Extras, StorageDtype, TraceError, TraceReader, TraceWriter,
};
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

#[test]
fn f32_round_trip_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.safetensors");
    let shape = Shape::default();
    let layers = write_fixture(&path, shape, 1);
    let trace = TraceReader::open(&path).unwrap();
    let pass = common::fixture_pass(shape, 1, shape.prompt_len);
    let mut written = meta(shape);
    let chunks = r#"{"chunks":[[2,11,12],[11,20,12]]}"#;
    written.extra.insert("reconstruction".into(), chunks.into());
    assert_eq!(trace.meta(), &written);
    assert_eq!(trace.n_positions(), shape.prompt_len + shape.generated);
    assert!(trace.has_values());
    assert_eq!(
        trace.tokens().unwrap().to_vec(),
        (0..25).collect::<Vec<i64>>()
    );
    for (index, (q, k, v)) in layers.iter().enumerate() {
        let read = trace.layer(index).unwrap();
        assert_eq!(&read.q, q);
        assert_eq!(&read.k, k);
        assert_eq!(read.v.as_ref(), Some(v));
        assert_eq!(read.reconstruction.as_ref(), Some(&pass[index]));
    }
    let ids = trace.reconstruction_tokens().unwrap().unwrap();
    assert_eq!(ids.to_vec(), (0..24).collect::<Vec<i64>>());
}

/// A trace is shareable data: it gets the mode of any new file in its directory (safetensors'
/// own temporary file is 0600).
#[cfg(unix)]
#[test]
fn traces_get_the_mode_of_a_new_file() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
    let plain = dir.path().join("plain");
    std::fs::File::create(&plain).unwrap();
    let path = dir.path().join("t.safetensors");
    write_fixture(&path, Shape::default(), 1);
    assert_eq!(mode(&path), mode(&plain));
}

/// A trace is the same bytes whenever it is written (the header's keys in sorted order, not in a
/// hash map's random one), so re-captures can be compared by checksum.
#[test]
fn one_trace_is_always_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let written: Vec<Vec<u8>> = (0..4)
        .map(|index| {
            let path = dir.path().join(format!("t{index}.safetensors"));
            write_fixture(&path, Shape::default(), 1);
            std::fs::read(&path).unwrap()
        })
        .collect();
    assert!(written.iter().all(|bytes| bytes == &written[0]));
    let length = u64::from_le_bytes(written[0][..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&written[0][8..8 + length]).unwrap();
    let keys = [
        "\"format\"",
        "\"head_dim\"",
        "\"model\"",
        "\"n_heads\"",
        "\"prompt_len\"",
    ];
    let at: Vec<usize> = keys.iter().map(|key| header.find(key).unwrap()).collect();
    assert!(at.windows(2).all(|pair| pair[0] < pair[1]), "{header}");
}

#[test]
fn half_precision_round_trips_within_its_precision() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape::default();
    let layers = tensors(shape, 2);
    // f16 has an 11-bit significand (relative error <= 2^-11); bf16 an 8-bit one (<= 2^-8).
    for (storage, tolerance) in [
        (StorageDtype::F16, 1.0 / 2048.0),
        (StorageDtype::Bf16, 1.0 / 256.0),
    ] {
        let path = dir.path().join(format!("{storage:?}.safetensors"));
        let mut writer = TraceWriter::new(meta(shape), storage, (0..25).collect());
        for (q, k, _) in &layers {
            writer.push_layer(q.clone(), k.clone(), None);
        }
        writer.write(&path).unwrap();
        let trace = TraceReader::open(&path).unwrap();
        assert!(!trace.has_values());
        let read = trace.layer(1).unwrap();
        for (got, want) in read.q.iter().zip(layers[1].0.iter()) {
            assert!(
                (got - want).abs() <= want.abs() * tolerance,
                "{storage:?}: {got} vs {want}"
            );
        }
    }
}

#[test]
fn unknown_metadata_keys_are_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.safetensors");
    let shape = Shape::default();
    let mut header = meta(shape);
    header
        .extra
        .insert("lab_notes".into(), "captured on a Tuesday".into());
    let mut writer = TraceWriter::new(header.clone(), StorageDtype::F32, (0..25).collect());
    for (q, k, v) in tensors(shape, 3) {
        writer.push_layer(q, k, Some(v));
    }
    writer.write(&path).unwrap();
    assert_eq!(
        TraceReader::open(&path).unwrap().meta().extra["lab_notes"],
        "captured on a Tuesday"
    );
}

/// Writes a safetensors file by hand, bypassing the writer's checks.
fn raw(
    path: &Path,
    metadata: &HashMap<String, String>,
    tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)],
) {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            (
                name.clone(),
                TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, Some(metadata.clone()), path).unwrap();
}

fn f32_bytes(count: usize, value: f32) -> Vec<u8> {
    (0..count).flat_map(|_| value.to_le_bytes()).collect()
}

/// A valid one-layer file (2 heads, 1 KV head, d 2, T 3, prompt 2) with `edit` applied.
fn case(
    edit: impl FnOnce(&mut HashMap<String, String>, &mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>),
) -> Result<TraceReader, TraceError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("case.safetensors");
    let mut metadata: HashMap<String, String> = [
        ("format", "kvtrace/1"),
        ("model", "m"),
        ("n_layers", "1"),
        ("n_heads", "2"),
        ("n_kv_heads", "1"),
        ("head_dim", "2"),
        ("prompt_len", "2"),
        ("rope", "post"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let mut tensors = vec![
        ("tokens".to_string(), Dtype::I32, vec![3], vec![0u8; 12]),
        (
            "layers.0.q".to_string(),
            Dtype::F32,
            vec![2, 3, 2],
            f32_bytes(12, 0.5),
        ),
        (
            "layers.0.k".to_string(),
            Dtype::F32,
            vec![1, 3, 2],
            f32_bytes(6, 0.5),
        ),
    ];
    edit(&mut metadata, &mut tensors);
    raw(&path, &metadata, &tensors);
    let reader = TraceReader::open(&path)?;
    reader.layer(0)?;
    Ok(reader)
}

fn message(result: Result<TraceReader, TraceError>) -> String {
    match result {
        Ok(_) => panic!("the case should have been rejected"),
        Err(err) => err.to_string(),
    }
}

#[test]
fn the_valid_case_is_valid() {
    case(|_, _| {}).unwrap();
}

#[test]
fn rule_format_missing_or_wrong() {
    assert!(message(case(|m, _| {
        m.remove("format");
    }))
    .contains("`format` is None"));
    assert!(message(case(|m, _| {
        m.insert("format".into(), "kvtrace/2".into());
    }))
    .contains("\"kvtrace/2\""));
}

#[test]
fn rule_required_keys() {
    let text = message(case(|m, _| {
        m.remove("head_dim");
    }));
    assert!(
        text.contains("`head_dim` is missing") && text.contains("case.safetensors"),
        "{text}"
    );
    assert!(message(case(|m, _| {
        m.insert("n_layers".into(), "two".into());
    }))
    .contains("`n_layers` = \"two\" is not a non-negative decimal integer"));
    assert!(message(case(|m, _| {
        m.insert("rope".into(), "pre".into());
    }))
    .contains("`rope`"));
}

#[test]
fn rule_grouped_query_heads() {
    let text = message(case(|m, _| {
        m.insert("n_kv_heads".into(), "3".into());
    }));
    assert!(
        text.contains("n_heads = 2 is not a positive multiple of n_kv_heads = 3"),
        "{text}"
    );
}

#[test]
fn rule_tensor_missing() {
    let text = message(case(|_, t| {
        t.retain(|(name, ..)| name != "layers.0.k");
    }));
    assert!(text.contains("tensor `layers.0.k` is missing"), "{text}");
}

#[test]
fn rule_dtype() {
    let text = message(case(|_, t| {
        t[2] = (
            "layers.0.k".into(),
            Dtype::F64,
            vec![1, 3, 2],
            vec![0u8; 48],
        );
    }));
    assert!(text.contains("`layers.0.k` has dtype F64"), "{text}");
    let text = message(case(|_, t| {
        t[0] = ("tokens".into(), Dtype::F32, vec![3], vec![0u8; 12]);
    }));
    assert!(
        text.contains("`tokens` has dtype F32, expected I32 or I64"),
        "{text}"
    );
}

#[test]
fn rule_shape_and_same_t() {
    let text = message(case(|_, t| {
        t[2] = (
            "layers.0.k".into(),
            Dtype::F32,
            vec![2, 3, 2],
            f32_bytes(12, 0.5),
        );
    }));
    assert!(
        text.contains("`layers.0.k` has shape [2, 3, 2], expected [1, 3, 2]"),
        "{text}"
    );
    let text = message(case(|_, t| {
        t[2] = (
            "layers.0.k".into(),
            Dtype::F32,
            vec![1, 4, 2],
            f32_bytes(8, 0.5),
        );
    }));
    assert!(text.contains("same T in every layer"), "{text}");
}

#[test]
fn rule_prompt_len_range() {
    assert!(message(case(|m, _| {
        m.insert("prompt_len".into(), "0".into());
    }))
    .contains("prompt_len = 0 is outside 1..=3"));
    assert!(message(case(|m, _| {
        m.insert("prompt_len".into(), "4".into());
    }))
    .contains("prompt_len = 4 is outside 1..=3"));
}

#[test]
fn rule_spans_inside_the_trace() {
    let text = message(case(|m, _| {
        m.insert(
            "spans".into(),
            r#"[{"name":"needle","start":1,"end":9}]"#.into(),
        );
    }));
    assert!(text.contains("span `needle` = [1, 9)"), "{text}");
    assert!(message(case(|m, _| {
        m.insert("spans".into(), "needle".into());
    }))
    .contains("not a JSON list"));
}

#[test]
fn rule_finite_values() {
    for bad in [f32::NAN, f32::INFINITY] {
        let text = message(case(|_, t| {
            let mut bytes = f32_bytes(12, 0.5);
            bytes[20..24].copy_from_slice(&bad.to_le_bytes());
            t[1] = ("layers.0.q".into(), Dtype::F32, vec![2, 3, 2], bytes);
        }));
        assert!(
            text.contains("`layers.0.q` holds a non-finite value") && text.contains("flat index 5"),
            "{text}"
        );
    }
}

#[test]
fn rule_truncated_and_broken_containers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.safetensors");
    write_fixture(&path, Shape::default(), 4);
    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() - 10]).unwrap();
    let text = TraceReader::open(&cut).unwrap_err().to_string();
    assert!(
        text.contains("cut.safetensors") && text.contains("truncated"),
        "{text}"
    );
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"this is not a safetensors file at all").unwrap();
    assert!(TraceReader::open(&junk)
        .unwrap_err()
        .to_string()
        .contains("rule: container"));
    let long_header = dir.path().join("long.safetensors");
    let mut header_beyond = 1_000_000u64.to_le_bytes().to_vec();
    header_beyond.extend_from_slice(b"{}");
    std::fs::write(&long_header, header_beyond).unwrap();
    assert!(TraceReader::open(&long_header)
        .unwrap_err()
        .to_string()
        .contains("rule: container"));
    let missing = TraceReader::open(dir.path().join("absent.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(
        missing.contains("absent.safetensors: cannot read trace"),
        "{missing}"
    );
}

#[test]
fn writer_refuses_inconsistent_layers() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape::default();
    let mut writer = TraceWriter::new(meta(shape), StorageDtype::F32, (0..25).collect());
    let (q, k, _) = tensors(shape, 5).remove(0);
    writer.push_layer(q, k, None);
    let path = dir.path().join("w.safetensors");
    let text = writer.write(&path).unwrap_err().to_string();
    assert!(
        text.contains("1 layers collected, header says n_layers = 2"),
        "{text}"
    );
    assert!(!path.exists());
}

#[test]
fn rule_layer_windows() {
    let reader = case(|m, _| {
        m.insert("layer_windows".into(), "[2]".into());
    })
    .unwrap();
    assert_eq!(reader.meta().windows, vec![2]);
    assert_eq!(reader.meta().window(0), 2);
    for bad in ["[2, 0]", "[-1]", "512", "[\"global\"]"] {
        let text = message(case(|m, _| {
            m.insert("layer_windows".into(), bad.into());
        }));
        assert!(
            text.contains("`layer_windows`")
                && text.contains("a JSON list of n_layers non-negative integers")
                && text.contains("case.safetensors"),
            "{bad}: {text}"
        );
    }
}

#[test]
fn layer_windows_round_trip_and_are_left_out_when_every_layer_is_global() {
    let dir = tempfile::tempdir().unwrap();
    let shape = common::Shape {
        n_layers: 3,
        ..Default::default()
    };
    let mut meta = common::meta(shape);
    for (windows, written) in [(vec![0, 0, 0], false), (vec![8, 0, 8], true)] {
        meta.windows = windows.clone();
        let path = dir.path().join("w.safetensors");
        let t = shape.prompt_len + shape.generated;
        let mut writer = TraceWriter::new(meta.clone(), StorageDtype::F32, (0..t as i64).collect());
        for (q, k, v) in common::tensors(shape, 3) {
            writer.push_layer(q, k, Some(v));
        }
        writer.write(&path).unwrap();
        let reader = TraceReader::open(&path).unwrap();
        assert_eq!(
            reader.meta().to_header().contains_key("layer_windows"),
            written
        );
        assert_eq!(
            (0..3).map(|l| reader.meta().window(l)).collect::<Vec<_>>(),
            windows
        );
    }
}

/// A trace written without values has none (no `v` tensor at all), and a writer given values for
/// some layers only refuses, naming the rule.
#[test]
fn values_are_all_or_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape::default();
    let t = shape.prompt_len + shape.generated;
    let layers = tensors(shape, 9);
    let mut without = TraceWriter::new(meta(shape), StorageDtype::F32, (0..t as i64).collect());
    let mut mixed = TraceWriter::new(meta(shape), StorageDtype::F32, (0..t as i64).collect());
    for (index, (q, k, v)) in layers.into_iter().enumerate() {
        without.push_layer(q.clone(), k.clone(), None);
        mixed.push_layer(q, k, (index == 0).then_some(v));
    }
    let path = dir.path().join("keys.safetensors");
    without.write(&path).unwrap();
    let reader = TraceReader::open(&path).unwrap();
    assert!(!reader.has_values());
    assert!(reader.layer(1).unwrap().v.is_none());
    let err = mixed
        .write(&dir.path().join("mixed.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("either every layer has v or none"), "{err}");
    assert!(!dir.path().join("mixed.safetensors").exists());
}

#[test]
fn rule_layer_rope_thetas() {
    let reader = case(|m, _| {
        m.insert("layer_rope_thetas".into(), "[10000.0]".into());
    })
    .unwrap();
    assert_eq!(reader.meta().rope_theta_of(0), Some(10_000.0));
    for bad in ["[1.0, 2.0]", "[0]", "[-5]", "10000"] {
        let text = message(case(|m, _| {
            m.insert("layer_rope_thetas".into(), bad.into());
        }));
        assert!(
            text.contains("`layer_rope_thetas`") && text.contains("positive finite numbers"),
            "{bad}: {text}"
        );
    }
}

/// The attention inputs of the one-layer case (d_model 3): `input` `[3, 3]`, the projections and
/// a bias on `q_proj`, each element its flat index plus `offset`.
fn attention_inputs(tensors: &mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>) {
    let counting = |offset: f32, shape: Vec<usize>| -> (Dtype, Vec<usize>, Vec<u8>) {
        let count: usize = shape.iter().product();
        let bytes = (0..count)
            .flat_map(|i| (offset + i as f32).to_le_bytes())
            .collect();
        (Dtype::F32, shape, bytes)
    };
    for (name, offset, shape) in [
        ("input", 0.0, vec![3, 3]),
        ("q_proj.weight", 100.0, vec![4, 3]),
        ("q_proj.bias", 200.0, vec![4]),
        ("k_proj.weight", 300.0, vec![2, 3]),
        ("v_proj.weight", 400.0, vec![2, 3]),
        ("o_proj.weight", 500.0, vec![3, 4]),
    ] {
        let (dtype, shape, bytes) = counting(offset, shape);
        tensors.push((format!("layers.0.{name}"), dtype, shape, bytes));
    }
}

/// KVzip's reconstruction pass on the case: one chunk repeating positions [0, 2) in 3 rows.
fn reconstruction_pass(
    meta: &mut HashMap<String, String>,
    tensors: &mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
) {
    meta.insert("reconstruction".into(), r#"{"chunks":[[0,2,3]]}"#.into());
    let floats = |count: usize| (0..count).flat_map(|i| (i as f32).to_le_bytes()).collect();
    tensors.push((
        "reconstruction.tokens".into(),
        Dtype::I64,
        vec![3],
        vec![0; 24],
    ));
    let q = ("layers.0.reconstruction.q", vec![2, 3, 2], floats(12));
    let k = ("layers.0.reconstruction.k", vec![1, 3, 2], floats(6));
    for (name, shape, bytes) in [q, k] {
        tensors.push((name.into(), Dtype::F32, shape, bytes));
    }
}

/// The reconstruction pass is one group, checked at open: its header key, its token ids and
/// every layer's rows, shaped by the header's chunks, in the trace's dtype.
#[test]
fn rule_reconstruction_pass() {
    let trace = case(reconstruction_pass).unwrap();
    let pass = trace.reconstruction().unwrap();
    assert_eq!((pass.start(), pass.cut(), pass.rows()), (0, 2, 3));
    let rows = trace.layer(0).unwrap().reconstruction.unwrap();
    assert_eq!((rows.q.dim(), rows.k[[0, 2, 1]]), ((2, 3, 2), 5.0));
    assert_eq!(trace.reconstruction_tokens().unwrap().unwrap().len(), 3);
    assert!(case(|_, _| {}).unwrap().reconstruction().is_none());
    for (edit, expected) in [
        (
            (|_: &mut HashMap<String, String>, t: &mut Vec<_>| {
                t.retain(|(name, ..): &(String, Dtype, Vec<usize>, Vec<u8>)| {
                    name != "layers.0.reconstruction.k"
                })
            }) as fn(&mut HashMap<String, String>, &mut Vec<_>),
            "`layers.0.reconstruction.k` is missing",
        ),
        (
            |m, _| {
                m.remove("reconstruction");
            },
            "`reconstruction.tokens` has shape [3], expected [] (rule: reconstruction pass",
        ),
        (
            |m, _| {
                m.insert("reconstruction".into(), r#"{"chunks":[[0,3,3]]}"#.into());
            },
            "repeats up to position 3, and the trace has 3",
        ),
        (
            |m, _| {
                m.insert("reconstruction".into(), r#"{"chunks":[[0,2,1]]}"#.into());
            },
            "runs at least as many rows as it repeats",
        ),
        (
            |m, _| {
                m.insert(
                    "reconstruction".into(),
                    r#"{"chunks":[[0,1,2],[0,2,1]]}"#.into(),
                );
            },
            "starts where the one before ends",
        ),
        (
            |m, _| {
                m.insert("reconstruction".into(), "[0, 2, 3]".into());
            },
            "metadata `reconstruction`: `reconstruction` must be {\"chunks\"",
        ),
        (
            |_, t| replace(t, "layers.0.reconstruction.q", Dtype::F16, vec![2, 3, 2]),
            "`layers.0.reconstruction.q` has shape [2, 3, 2], expected [2, 3, 2]",
        ),
        (
            |_, t| replace(t, "layers.0.reconstruction.q", Dtype::F32, vec![2, 4, 2]),
            "`layers.0.reconstruction.q` has shape [2, 4, 2], expected [2, 3, 2]",
        ),
    ] {
        let text = message(case(|m, t| {
            reconstruction_pass(m, t);
            edit(m, t);
        }));
        assert!(text.contains(expected), "{text}");
    }
}

/// Replaces tensor `name` of the case's tensors.
fn replace(
    tensors: &mut [(String, Dtype, Vec<usize>, Vec<u8>)],
    name: &str,
    dtype: Dtype,
    shape: Vec<usize>,
) {
    let count: usize = shape.iter().product();
    let slot = tensors.iter_mut().find(|(n, ..)| n == name).unwrap();
    *slot = (
        name.into(),
        dtype,
        shape,
        vec![0u8; count * dtype.bitsize() / 8],
    );
}

#[test]
fn attention_inputs_are_read_as_stored() {
    let trace = case(|_, t| attention_inputs(t)).unwrap();
    assert!(trace.has_inputs());
    assert_eq!(trace.d_model(), Some(3));
    let inputs = trace.layer(0).unwrap().inputs.unwrap();
    assert_eq!(inputs.hidden[[1, 2]], 5.0);
    let q = inputs.projection("q_proj");
    assert_eq!((q.weight.dim(), q.weight[[3, 1]]), ((4, 3), 110.0));
    assert_eq!(
        q.bias.as_ref().unwrap().to_vec(),
        vec![200.0, 201.0, 202.0, 203.0]
    );
    assert_eq!(inputs.projection("k_proj").weight[[1, 0]], 303.0);
    assert!(inputs.projection("k_proj").bias.is_none());
    assert_eq!(inputs.projection("o_proj").weight.dim(), (3, 4));
    let plain = case(|_, _| {}).unwrap();
    assert!(!plain.has_inputs() && plain.layer(0).unwrap().inputs.is_none());
}

#[test]
fn rule_attention_inputs() {
    let text = message(case(|_, t| {
        attention_inputs(t);
        t.retain(|(name, ..)| name != "layers.0.o_proj.weight");
    }));
    assert!(
        text.contains("`layers.0.o_proj.weight` is missing"),
        "{text}"
    );
    let text = message(case(|_, t| {
        attention_inputs(t);
        t.retain(|(name, ..)| name != "layers.0.input");
    }));
    assert!(
        text.contains("`layers.0.q_proj.weight`") && text.contains("one group"),
        "{text}"
    );
    let text = message(case(|_, t| {
        attention_inputs(t);
        replace(t, "layers.0.k_proj.weight", Dtype::F32, vec![4, 3]);
    }));
    assert!(
        text.contains("`layers.0.k_proj.weight` has shape [4, 3], expected [2, 3]"),
        "{text}"
    );
    let text = message(case(|_, t| {
        attention_inputs(t);
        replace(t, "layers.0.input", Dtype::F32, vec![4, 3]);
    }));
    assert!(
        text.contains("`layers.0.input` has shape [4, 3], expected [3, 3]"),
        "{text}"
    );
    let text = message(case(|_, t| {
        attention_inputs(t);
        replace(t, "layers.0.q_proj.bias", Dtype::F32, vec![3]);
    }));
    assert!(
        text.contains("`layers.0.q_proj.bias` has shape [3], expected [4]"),
        "{text}"
    );
    let text = message(case(|_, t| {
        attention_inputs(t);
        replace(t, "layers.0.v_proj.weight", Dtype::I32, vec![2, 3]);
    }));
    assert!(
        text.contains("`layers.0.v_proj.weight` has dtype I32, expected F16, BF16 or F32"),
        "{text}"
    );
    let text = message(case(|_, t| {
        attention_inputs(t);
        let slot = t.iter_mut().find(|(n, ..)| n == "layers.0.input").unwrap();
        slot.3[..4].copy_from_slice(&f32::NAN.to_le_bytes());
    }));
    assert!(
        text.contains("`layers.0.input` holds a non-finite value"),
        "{text}"
    );
}

/// The case's attention inputs with per-head q/k norms (`[head_dim]` = `[2]`) and their ε.
fn qk_norms(
    meta: &mut HashMap<String, String>,
    tensors: &mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
) {
    attention_inputs(tensors);
    meta.insert("qk_norm_eps".into(), "1e-6".into());
    for (name, offset) in [("q_norm", 600.0f32), ("k_norm", 700.0)] {
        let bytes = [offset, offset + 1.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        tensors.push((
            format!("layers.0.{name}.weight"),
            Dtype::F32,
            vec![2],
            bytes,
        ));
    }
}

#[test]
fn qk_norms_are_read_with_their_eps() {
    let trace = case(qk_norms).unwrap();
    let norms = trace.layer(0).unwrap().inputs.unwrap().weights.qk_norms;
    let norms = norms.expect("q/k norms");
    assert_eq!(
        (norms.q.to_vec(), norms.k.to_vec()),
        (vec![600.0, 601.0], vec![700.0, 701.0])
    );
    assert_eq!(norms.eps, 1e-6);
    assert_eq!(trace.qk_norm_eps(), Some(1e-6));
    let plain = case(|_, t| attention_inputs(t)).unwrap();
    assert_eq!(plain.qk_norm_eps(), None);
    assert!(plain
        .layer(0)
        .unwrap()
        .inputs
        .unwrap()
        .weights
        .qk_norms
        .is_none());
}

#[test]
fn rule_qk_norms() {
    type Edit = fn(&mut HashMap<String, String>, &mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>);
    let cases: [(Edit, &str); 6] = [
        (
            |m, t| {
                qk_norms(m, t);
                m.remove("qk_norm_eps");
            },
            "`qk_norm_eps`",
        ),
        (
            |m, t| {
                attention_inputs(t);
                m.insert("qk_norm_eps".into(), "1e-6".into());
            },
            "holds no q_norm/k_norm weights",
        ),
        (
            |m, t| {
                qk_norms(m, t);
                m.insert("qk_norm_eps".into(), "0".into());
            },
            "a positive finite number",
        ),
        (
            |m, t| {
                qk_norms(m, t);
                t.retain(|(name, ..)| name != "layers.0.k_norm.weight");
            },
            "`layers.0.k_norm.weight` is missing",
        ),
        (
            |m, t| {
                qk_norms(m, t);
                replace(t, "layers.0.q_norm.weight", Dtype::F32, vec![3]);
            },
            "`layers.0.q_norm.weight` has shape [3], expected [2]",
        ),
        (
            |m, t| {
                qk_norms(m, t);
                t.retain(|(name, ..)| name != "layers.0.input");
            },
            "one group",
        ),
    ];
    for (edit, expected) in cases {
        let text = message(case(edit));
        assert!(text.contains(expected), "{expected}: {text}");
    }
}

/// The writer's attention inputs read back as written: the hidden states in the trace's dtype
/// (f32 here: exact), the projections in F32 with the biases declared, and the per-head q/k
/// norms with their ε in the header where the model has them; a source whose shapes disagree
/// with the header fails the write and leaves no file.
#[test]
fn attention_inputs_round_trip_through_the_writer() {
    use kvreplay_core::trace::{
        write_trace, AttentionWeights, Extras, InputsSource, LayerInputs, Projection, QkNorms,
    };
    use ndarray::{Array1, Array2};
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape::default();
    let layers = tensors(shape, 3);
    let t = shape.prompt_len + shape.generated;
    let tokens: Vec<i64> = (0..t as i64).collect();
    let (d_model, q, kv) = (
        5,
        shape.n_heads * shape.head_dim,
        shape.n_kv_heads * shape.head_dim,
    );
    let inputs_of = |layer: usize, q_rows: usize, eps: Option<f32>| {
        let counting = |rows: usize, columns: usize, offset: usize| {
            Array2::from_shape_fn((rows, columns), |(r, c)| {
                (offset + layer * 1000 + r * columns + c) as f32
            })
        };
        let projection = |rows, columns, offset, bias: bool| Projection {
            weight: counting(rows, columns, offset),
            bias: bias.then(|| Array1::from_elem(rows, layer as f32 + 0.5)),
        };
        let norm = |offset: f32| Array1::from_shape_fn(shape.head_dim, |i| offset + i as f32);
        LayerInputs {
            hidden: counting(t, d_model, 0),
            weights: AttentionWeights {
                projections: [
                    projection(q_rows, d_model, 100, true),
                    projection(kv, d_model, 200, true),
                    projection(kv, d_model, 300, false),
                    projection(d_model, q, 400, false),
                ],
                qk_norms: eps.map(|eps| QkNorms {
                    q: norm(layer as f32 + 0.25),
                    k: norm(layer as f32 + 0.75),
                    eps,
                }),
            },
        }
    };
    let layer = |l: usize| {
        let (q, k, v) = layers[l].clone();
        Ok((q, k, Some(v)))
    };
    let meta = meta(shape);
    for eps in [None, Some(1e-6)] {
        let given = |l: usize| Ok(inputs_of(l, q, eps));
        let source = InputsSource {
            d_model,
            biases: [true, true, false, false],
            qk_norm_eps: eps,
            layer: &given,
        };
        let path = dir.path().join("inputs.safetensors");
        write_trace(
            &path,
            &meta,
            StorageDtype::F32,
            &tokens,
            (true, &layer),
            Extras {
                inputs: Some(&source),
                ..Extras::default()
            },
        )
        .unwrap();
        let trace = TraceReader::open(&path).unwrap();
        assert_eq!(trace.d_model(), Some(d_model));
        assert_eq!(
            trace.meta().extra.get("qk_norm_eps").map(String::as_str),
            eps.map(|_| "1e-6")
        );
        for l in 0..shape.n_layers {
            assert_eq!(trace.layer(l).unwrap().inputs, Some(inputs_of(l, q, eps)));
        }
        let wrong = |l: usize| Ok(inputs_of(l, q + 1, eps));
        let unlike = |l: usize| Ok(inputs_of(l, q, if l == 1 { None } else { eps }));
        let unnormed = |l: usize| Ok(inputs_of(l, q, None));
        type Given<'a> = &'a dyn Fn(usize) -> Result<LayerInputs, String>;
        let mut cases: Vec<(Given<'_>, &str)> = vec![(&wrong, "layers.0.q_proj.weight has shape")];
        if eps.is_some() {
            cases.push((&unlike, "layer 1's q/k norms"));
            cases.push((&unnormed, "layer 0's q/k norms"));
        }
        for (source_of, expected) in cases {
            let source = InputsSource {
                layer: source_of,
                ..source
            };
            let refused = dir.path().join("refused.safetensors");
            let message = write_trace(
                &refused,
                &meta,
                StorageDtype::F32,
                &tokens,
                (true, &layer),
                Extras {
                    inputs: Some(&source),
                    ..Extras::default()
                },
            )
            .unwrap_err()
            .to_string();
            assert!(message.contains(expected), "{message}");
            assert!(!refused.exists());
        }
    }
}

/// A trace built in memory is the bytes a file of it holds, and reads as that file does: a live
/// run's recording is held this way instead of in a scratch file.
#[test]
fn a_trace_in_memory_is_its_files_bytes_and_reads_alike() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape::default();
    let fixture_path = dir.path().join("fixture.safetensors");
    write_fixture(&fixture_path, shape, 1);
    let fixture = TraceReader::open(&fixture_path).unwrap();
    let layer = |index: usize| {
        let read = fixture.layer(index).map_err(|err| err.to_string())?;
        Ok((read.q, read.k, read.v))
    };
    let written = meta(shape);
    let tokens = fixture.tokens().unwrap().to_vec();
    let no_extras = || Extras {
        inputs: None,
        reconstruction: None,
    };
    let path = dir.path().join("t.safetensors");
    let storage = StorageDtype::F16;
    write_trace(
        &path,
        &written,
        storage,
        &tokens,
        (true, &layer),
        no_extras(),
    )
    .unwrap();
    let label = Path::new("a recording");
    let bytes = trace_bytes(
        label,
        &written,
        storage,
        &tokens,
        (true, &layer),
        no_extras(),
    )
    .unwrap();
    assert_eq!(bytes, std::fs::read(&path).unwrap());
    let file = TraceReader::open(&path).unwrap();
    let memory = TraceReader::from_bytes(label, Arc::new(bytes.clone())).unwrap();
    assert_eq!(memory.meta(), file.meta());
    assert_eq!(memory.path(), label);
    assert_eq!(memory.tokens().unwrap(), file.tokens().unwrap());
    for index in 0..written.n_layers {
        let (from_file, from_memory) = (file.layer(index).unwrap(), memory.layer(index).unwrap());
        assert_eq!(from_memory.q, from_file.q);
        assert_eq!(from_memory.k, from_file.k);
        assert_eq!(from_memory.v, from_file.v);
    }
    let cut = &bytes[..bytes.len() - 16];
    let err = TraceReader::from_bytes(label, Arc::new(cut.to_vec())).unwrap_err();
    assert!(err.to_string().starts_with("a recording"), "{err}");
}
