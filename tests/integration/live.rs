//! Closed loop on the real model: a policy that keeps everything reproduces the full run exactly,
//! a live run chooses exactly what an open-loop replay of the same run's trace chooses, reruns are
//! bit-identical (on any number of threads), and masking evicted keys equals physically removing
//! them from the cache.

use crate::common;

use common::real_model as model;
use kvreplay::capture::{capture, CaptureOptions};
use kvreplay::live::{live, Batching, LiveSession, LiveStep};
use kvreplay::model::{CausalLm, KvCache, Recorder, Row};
use kvreplay::recipe::{BuiltPrompt, Recipe};
use kvreplay::replay::{
    replay, Granularity, Order, PolicyParams, Protocol, Timing, TimingSettings, Trigger,
};
use kvreplay::trace::{StorageDtype, TraceReader};

/// The shipped chat recipe: a 34-token prompt, "The capital of France is Paris."
fn capital() -> BuiltPrompt {
    let (recipe, base) = Recipe::load(std::path::Path::new("traces/capital.toml")).unwrap();
    recipe.build(model().tokenizer(), &[], &base).unwrap()
}

/// The chat recipe and the model's cache after its prompt.
fn prefilled_capital() -> (BuiltPrompt, KvCache) {
    let prompt = capital();
    let mut cache = KvCache::default();
    model().forward(&prompt.ids, &mut cache, None).unwrap();
    (prompt, cache)
}

fn snapkv(budget: usize) -> PolicyParams {
    PolicyParams {
        budget,
        window: 4,
        ..PolicyParams::default()
    }
}

#[test]
fn keeping_everything_reproduces_the_full_run_exactly() {
    let scratch = tempfile::tempdir().unwrap();
    let policy = snapkv(4096).check().unwrap();
    let report = live(model(), &capital(), &policy, 512, scratch.path()).unwrap();
    // Nothing is masked, so every logit is computed as in the full run: exactly equal.
    assert!(report
        .steps
        .iter()
        .all(|s| s.kl == 0.0 && s.top1 && s.logprob_lost == 0.0));
    assert_eq!(report.text, report.full_text);
    assert_eq!(report.full_text, "The capital of France is Paris.");
    assert!(report.answer_ok && report.full_answer_ok);
    assert!((report.open_loop.metric("retained_mass").unwrap() - 1.0).abs() < 1e-6);
    // Nothing is left in the scratch folder: the recording is held in memory and the prefill's
    // spill files are removed.
    let left: Vec<_> = std::fs::read_dir(scratch.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn live_choices_are_the_open_loop_replay_choices_and_reruns_are_identical() {
    let scratch = tempfile::tempdir().unwrap();
    let prompt = capital();
    let policy = snapkv(12).check().unwrap();
    let first = live(model(), &prompt, &policy, 512, scratch.path()).unwrap();
    // A lossy budget changes what the model does.
    assert!(first.kl > 0.0);
    // The open-loop replay of an f32 capture of the same recipe: the same kept sets and metrics.
    let options = CaptureOptions {
        storage: StorageDtype::F32,
        chunk: 512,
        recipe_name: "test".into(),
        model_id: "test".into(),
    };
    let captured = capture(
        model(),
        &prompt,
        &options,
        Recorder::default(),
        &mut |_, _| Ok(()),
    )
    .unwrap();
    let path = scratch.path().join("capital.safetensors");
    captured.write(&path).unwrap();
    // Bytes counted at 16 bits, as live mode counts its f32 recording.
    let trace = TraceReader::open(&path).unwrap().counting_elements_at(2);
    let mut open_loop = replay(&trace, &policy).unwrap();
    open_loop.trace = first.open_loop.trace.clone();
    assert_eq!(open_loop, first.open_loop);
    // Bit-identical rerun, with another chunk size for the prefill too.
    let again = live(model(), &prompt, &policy, 512, scratch.path()).unwrap();
    assert_eq!(again, first);
    // Several policies in one session (one replay pass) give each its own run's report.
    let session = LiveSession::start(model(), &prompt, 512, scratch.path()).unwrap();
    let other = || {
        PolicyParams {
            scorer: "knorm".into(),
            ..snapkv(12)
        }
        .check()
        .unwrap()
    };
    let both = session
        .run_many(&[snapkv(12).check().unwrap(), other()])
        .unwrap();
    assert_eq!(both[0], first);
    assert_eq!(both[1], session.run(&other()).unwrap());
    // An oracle reading future queries gets them from the full run: only under `prefill`.
    let oracle = PolicyParams {
        scorer: "oracle-static".into(),
        timing: Timing::Streaming,
        ..snapkv(12)
    };
    let err = live(
        model(),
        &prompt,
        &oracle.check().unwrap(),
        512,
        scratch.path(),
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("scorer `oracle-static` reads future queries"),
        "{err}"
    );
}

fn evicting_live(timing: Timing, order: Order, budget: usize) -> PolicyParams {
    let own = TimingSettings {
        order,
        ..TimingSettings::default()
    };
    PolicyParams {
        scorer: "true-query".into(),
        ..snapkv(budget)
    }
    .timed(timing, &own)
}

const EVICTING: [(Timing, Order); 4] = [
    (Timing::Streaming, Order::EvictFirst),
    (Timing::Streaming, Order::AttendFirst),
    (Timing::PrefillThenStream, Order::AttendFirst),
    (Timing::PerStep, Order::EvictFirst),
];

#[test]
fn evicting_timings_run_inside_the_model() {
    let scratch = tempfile::tempdir().unwrap();
    let prompt = capital();
    let session = LiveSession::start(model(), &prompt, 512, scratch.path()).unwrap();
    for (timing, order) in EVICTING {
        // Keeping everything: every mask is the causal mask, so every logit is the full run's.
        let whole = session
            .run(&evicting_live(timing, order, 4096).check().unwrap())
            .unwrap();
        assert!(
            whole.steps.iter().all(|s| s.kl == 0.0 && s.top1),
            "{timing:?}"
        );
        assert_eq!(whole.text, whole.full_text);
        assert!(whole.live_layers.iter().all(|&m| (m - 1.0).abs() < 1e-6));
        // A lossy budget: layer 0's vectors do not depend on any eviction, so its live kept
        // sets are the open-loop replay's and keep the same share of attention; the layers
        // after it see the drift.
        let policy = evicting_live(timing, order, 12).check().unwrap();
        let lossy = session.run(&policy).unwrap();
        assert!(lossy.kl > 0.0, "{timing:?}");
        let open_loop: Vec<f64> = lossy
            .open_loop
            .layers
            .iter()
            .map(|l| l.metrics["retained_mass"])
            .collect();
        assert!(
            (lossy.live_layers[0] - open_loop[0]).abs() < 1e-6,
            "{timing:?}: layer 0 live {} vs open loop {}",
            lossy.live_layers[0],
            open_loop[0]
        );
        let drift = lossy
            .live_layers
            .iter()
            .zip(&open_loop)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(drift > 1e-3, "{timing:?}: no drift ({drift})");
        // `streaming` evicts during the prompt: its first generated token is compared too.
        let expected = session_steps(&lossy) + usize::from(timing == Timing::Streaming);
        assert_eq!(lossy.steps.len(), expected);
        // Bit-identical rerun.
        assert_eq!(session.run(&policy).unwrap(), lossy);
    }
}

#[test]
fn a_sessions_runs_do_not_depend_on_the_thread_count() {
    // Several policies of one session run side by side: one worker thread or three, each
    // report is the one its policy gets alone.
    let scratch = tempfile::tempdir().unwrap();
    let session = LiveSession::start(model(), &capital(), 512, scratch.path()).unwrap();
    let mut policies = vec![snapkv(12).check().unwrap()];
    policies.extend(
        EVICTING
            .iter()
            .map(|&(timing, order)| evicting_live(timing, order, 12).check().unwrap()),
    );
    let run_on = |threads| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| session.run_many(&policies).unwrap())
    };
    let (one, three) = (run_on(1), run_on(3));
    assert_eq!(one, three);
    assert_eq!(three[2], session.run(&policies[2]).unwrap());
}

/// Teacher-forced steps of a run that starts comparing at step 1.
fn session_steps(report: &kvreplay::live::LiveReport) -> usize {
    report.open_loop.layers[0].samples["retained_mass"][0].len() - 1
}

#[test]
fn batched_runs_are_the_runs_one_at_a_time_for_every_timing() {
    // The policies of a session decode as the rows of one forward pass, and those that evict
    // nothing while the prompt runs start from the full run's prefill: every report is, bit for
    // bit, the one its policy gets decoded alone after its own prefill, in batches of any size.
    let scratch = tempfile::tempdir().unwrap();
    let session = LiveSession::start(model(), &capital(), 512, scratch.path()).unwrap();
    let mut policies = vec![
        snapkv(12).check().unwrap(),
        evicting_live(Timing::PerStepPrompt, Order::EvictFirst, 12)
            .check()
            .unwrap(),
    ];
    for budget in [12, 20] {
        policies.extend(
            EVICTING
                .iter()
                .map(|&(timing, order)| evicting_live(timing, order, budget).check().unwrap()),
        );
    }
    // Compressions every 4 tokens, as kvpress's PrefillDecodingPress and DecodingPress run them.
    for (timing, order, trigger) in [
        (
            Timing::PrefillThenStream,
            Order::AttendFirst,
            Trigger::Growth,
        ),
        (Timing::Streaming, Order::EvictFirst, Trigger::Growth),
        (Timing::Decoding, Order::AttendFirst, Trigger::Steps),
    ] {
        let every_four = evicting_live(timing, order, 12)
            .with("interval", 4)
            .with("trigger", trigger.name());
        policies.push(every_four.check().unwrap());
    }
    // R-KV's schedule: its scorer, compressing at positions divisible by 4 along its own order.
    let rkv_schedule = PolicyParams {
        scorer: "rkv".into(),
        ..evicting_live(Timing::PrefillThenStream, Order::AttendFirst, 12)
    }
    .with("interval", 4)
    .with("trigger", "position");
    policies.push(rkv_schedule.check().unwrap());
    // Caches stored otherwise than captured, under every timing: quantized (the model's own
    // vectors recorded from its prefill, or from the full run's recording where it shares it),
    // and ThinK's pruned keys under a streaming timing.
    let plain_runs = policies.len();
    for &(timing, order) in &EVICTING {
        let quantized = PolicyParams {
            quantizer: "kivi".into(),
            ..evicting_live(timing, order, 20)
        };
        let quantized = quantized
            .with("bits", 2)
            .with("group_size", 4)
            .with("residual", 8);
        policies.push(quantized.check().unwrap());
    }
    let pruned = PolicyParams {
        channels: "think".into(),
        ..evicting_live(Timing::PrefillThenStream, Order::AttendFirst, 20)
    };
    policies.push(pruned.with("query_window", 8).check().unwrap());
    // CaM: kvpress's CAMPress schedule, the values of what each compression evicts merged into
    // the kept entries after it; the same policy merging nothing; and the same cache far from
    // its budget, never compressed.
    let decoding = PolicyParams {
        gqa: Granularity::Layer,
        ..evicting_live(Timing::Decoding, Order::AttendFirst, 12)
    }
    .with("interval", 4)
    .with("trigger", "steps");
    let cam = |decoding: &PolicyParams| {
        PolicyParams {
            merge: "cam".into(),
            ..decoding.clone()
        }
        .with("merge_budget", 4)
        .check()
        .unwrap()
    };
    let cam_at = policies.len();
    policies.push(cam(&decoding));
    policies.push(decoding.clone().check().unwrap());
    let whole = PolicyParams {
        budget: 4096,
        ..decoding
    };
    policies.push(cam(&whole));
    policies.push(whole.check().unwrap());
    let alone = session
        .run_batched(&policies, Batching::ONE_AT_A_TIME)
        .unwrap();
    let [merged, plain, never, uncompressed] = &alone[cam_at..cam_at + 4] else {
        unreachable!("four CaM runs")
    };
    assert_ne!(merged.steps, plain.steps, "the merges move the model");
    assert_eq!(
        merged.open_loop.layers[0].kv_bytes,
        plain.open_loop.layers[0].kv_bytes
    );
    assert_eq!(
        never.steps, uncompressed.steps,
        "nothing compressed, nothing merged"
    );
    assert_eq!(never.text, uncompressed.text);
    assert!(alone[..cam_at + 1].iter().all(|report| report.kl > 0.0));
    // Each quantized run differs from the same policy's plain run (budget 20: the EVICTING runs
    // after the first two and the four at 12).
    let plain_20 = &alone[2 + EVICTING.len()..2 + 2 * EVICTING.len()];
    for (stored, plain) in alone[plain_runs..].iter().zip(plain_20) {
        assert_ne!(stored.steps, plain.steps, "{}", stored.policy);
    }
    // Batched, a free run goes on from its teacher-forced state: a fixed cut's after the tokens
    // it agreed on with the full run (SnapKV at 12: all but the last), a streaming policy's that
    // agreed on all of them.
    let snapkv_12 = &alone[0];
    assert!(snapkv_12.steps[0].top1 && snapkv_12.text != snapkv_12.full_text);
    assert!(alone[2..cam_at].iter().any(|r| r.text == r.full_text));
    for rows in [None, Some(3)] {
        let batching = Batching {
            rows,
            ..Batching::BATCHED
        };
        let together = session.run_batched(&policies, batching).unwrap();
        assert_eq!(together, alone, "{batching:?}");
    }
}

#[test]
fn an_own_prefill_taken_over_from_the_full_run_is_the_prefill_from_position_0() {
    // Batched, a policy that evicts while the prompt runs takes the full run's cache up to the
    // first position where it hides anything and runs the prompt from there: in its chunk of
    // 512 when more than 64 of the chunk's rows remain (StreamingLLM at budgets 100 and 600,
    // H2O's true-query scores and a quantized cache at 600), else from the chunk's start (660:
    // ~40 rows left, which gemm would sum over the chunk's 700 keys in other depth blocks).
    // Every report is the one its policy gets with its own prefill from position 0.
    let prompt = ruler_needle(700);
    assert!(
        (690..=710).contains(&prompt.ids.len()),
        "{}",
        prompt.ids.len()
    );
    let scratch = tempfile::tempdir().unwrap();
    let session = LiveSession::start(model(), &prompt, 512, scratch.path()).unwrap();
    let streaming = |budget: usize| PolicyParams {
        scorer: "recency".into(),
        timing: Timing::Streaming,
        sinks: 4,
        ..snapkv(budget)
    };
    let mut policies: Vec<_> = [100, 600, 660]
        .into_iter()
        .map(|budget| streaming(budget).check().unwrap())
        .collect();
    let h2o = evicting_live(Timing::Streaming, Order::EvictFirst, 600);
    let quantized = PolicyParams {
        quantizer: "kivi".into(),
        ..streaming(600)
    };
    let quantized = quantized
        .with("bits", 2)
        .with("group_size", 4)
        .with("residual", 8);
    policies.extend([h2o.check().unwrap(), quantized.check().unwrap()]);
    let alone = session
        .run_batched(&policies, Batching::ONE_AT_A_TIME)
        .unwrap();
    assert!(alone.iter().all(|report| report.kl > 0.0));
    assert_eq!(session.run_many(&policies).unwrap(), alone);
}

#[test]
fn free_runs_resumed_from_the_teacher_forced_ones_are_the_free_runs_from_the_prompt_end() {
    // Batched, a free run goes on from its teacher-forced state after the tokens its greedy
    // choice shared with the full run's (its cache rewound there, a streaming policy's streams
    // as they were there) instead of running them again: the same tokens.
    let scratch = tempfile::tempdir().unwrap();
    let session = LiveSession::start(model(), &capital(), 512, scratch.path()).unwrap();
    let mut policies = Vec::new();
    for budget in [6, 8, 10, 12, 16] {
        for scorer in ["snapkv", "knorm", "tova", "recency"] {
            let cut = PolicyParams {
                scorer: scorer.into(),
                ..snapkv(budget)
            };
            policies.push(cut.check().unwrap());
        }
        let streaming = evicting_live(Timing::Streaming, Order::EvictFirst, budget);
        policies.push(streaming.check().unwrap());
    }
    for budget in [4, 5] {
        let streaming = evicting_live(Timing::Streaming, Order::EvictFirst, budget);
        policies.push(streaming.check().unwrap());
    }
    let from_prompt_end = Batching {
        resumed_free_runs: false,
        ..Batching::BATCHED
    };
    let rerun = session.run_batched(&policies, from_prompt_end).unwrap();
    assert_eq!(session.run_many(&policies).unwrap(), rerun);
    // Fixed cuts and streaming policies that went their own way after agreeing on the first
    // tokens, and a streaming policy that agreed on every token.
    let parted = |timing: &str| {
        let parted = rerun
            .iter()
            .filter(|r| r.policy.ends_with(timing) && r.steps[0].top1 && r.text != r.full_text);
        parted.count()
    };
    assert!(parted("@prefill") >= 5 && parted("@streaming") >= 2);
    // StreamingLLM at 4 parts at its first token: its free run starts at the prompt's end, from
    // its teacher-forced cache rewound there.
    assert!(rerun
        .iter()
        .any(|r| r.policy.ends_with("@streaming") && !r.steps[0].top1));
    assert!(rerun
        .iter()
        .any(|r| r.policy.ends_with("@streaming") && r.text == r.full_text));
}

#[test]
fn tokens_fed_in_one_pass_are_the_tokens_fed_one_at_a_time() {
    // A teacher-forced decode under a fixed eviction: two rows of 70 and 40 known tokens in one
    // `forward_steps` pass (more states than one output product takes) give every logit and the
    // cache of feeding each row's tokens one pass at a time, bit for bit.
    let model = model();
    let (prompt, prefilled) = prefilled_capital();
    let n = prompt.ids.len();
    let config = model.config();
    let evicted: kvreplay::model::Evicted = (0..config.n_layers)
        .map(|layer| {
            (0..config.n_heads)
                .map(|head| (1..n - 4).filter(|p| (p + layer + head) % 3 == 0).collect())
                .collect()
        })
        .collect();
    let tokens: [Vec<u32>; 2] = [
        (0..70).map(|i| 300 + 7 * i).collect(),
        (0..40).map(|i| 900 + 11 * i).collect(),
    ];
    let one_at_a_time: Vec<(Vec<Vec<f32>>, KvCache)> = tokens
        .iter()
        .map(|ids| {
            let (mut cache, mut mask) = (prefilled.clone(), evicted.clone());
            let logits = ids
                .iter()
                .map(|&id| {
                    model
                        .forward_masked(&[id], &mut cache, None, Some(&mut mask))
                        .unwrap()
                })
                .collect();
            (logits, cache)
        })
        .collect();
    let mut caches = [prefilled.clone(), prefilled.clone()];
    let mut masks = [evicted.clone(), evicted.clone()];
    let handed = std::sync::Mutex::new(Vec::new());
    {
        let mut rows: Vec<Row<'_, '_>> = caches
            .iter_mut()
            .zip(&mut masks)
            .zip(&tokens)
            .map(|((cache, mask), ids)| Row::new(ids, cache, Some(mask)))
            .collect();
        model
            .forward_steps(&mut rows, &|row, step, logits| {
                handed.lock().unwrap().push((row, step, logits.to_vec()));
            })
            .unwrap();
    }
    // Each step of each row handed over once, in whatever order.
    let mut handed = handed.into_inner().unwrap();
    handed.sort_by_key(|&(row, step, _)| (row, step));
    let mut got = [Vec::new(), Vec::new()];
    for (row, step, logits) in handed {
        assert_eq!(
            got[row].len(),
            step,
            "row {row}: step {step} handed over once"
        );
        got[row].push(logits);
    }
    for (row, (logits, cache)) in one_at_a_time.iter().enumerate() {
        assert!(got[row] == *logits, "row {row}: logits differ");
        assert_eq!(caches[row].len(), cache.len());
        for layer in [0, config.n_layers - 1] {
            assert_eq!(caches[row].keys(layer).unwrap(), cache.keys(layer).unwrap());
        }
    }
    // The eviction matters: unmasked, the first step's logits differ.
    let unmasked = model
        .forward(&tokens[0][..1], &mut prefilled.clone(), None)
        .unwrap();
    assert!(unmasked != one_at_a_time[0].0[0]);
}

#[test]
fn a_chunked_prompt_equals_feeding_it_token_by_token() {
    // A prompt chunk runs layer by layer, each layer's streams taking the chunk's positions one
    // at a time: the same choices as feeding the tokens one by one. Only the order of float sums
    // in the model's matrix products differs (1e-4 on logits; KL agrees to 1e-4).
    let scratch = tempfile::tempdir().unwrap();
    let prompt = capital();
    let whole = LiveSession::start(model(), &prompt, 512, scratch.path()).unwrap();
    let single = LiveSession::start(model(), &prompt, 1, scratch.path()).unwrap();
    for (timing, order) in EVICTING {
        let policy = evicting_live(timing, order, 12).check().unwrap();
        let (a, b) = (whole.run(&policy).unwrap(), single.run(&policy).unwrap());
        assert_eq!(a.text, b.text, "{timing:?}");
        for (x, y) in a.steps.iter().zip(&b.steps) {
            assert!(
                (x.kl - y.kl).abs() < 1e-4,
                "{timing:?}: {} vs {}",
                x.kl,
                y.kl
            );
            assert_eq!(x.top1, y.top1);
        }
        for (x, y) in a.live_layers.iter().zip(&b.live_layers) {
            assert!((x - y).abs() < 1e-4, "{timing:?}: live mass {x} vs {y}");
        }
    }
}

/// RULER's single needle (number key and value, noise haystack) at ~300 tokens: a prompt with a
/// `question` span that needs no essays.
fn needle_with_question() -> BuiltPrompt {
    ruler_needle(300)
}

/// RULER's single needle (number key and value, noise haystack) at about `tokens` tokens.
fn ruler_needle(tokens: usize) -> BuiltPrompt {
    let recipe = Recipe::parse(
        &format!("kind = \"ruler-niah\"\nprompt_tokens = {tokens}\ntype_haystack = \"noise\"\ntype_needle_k = \"numbers\"\ngenerate = 12\n"),
        std::path::Path::new("needle.toml"),
    )
    .unwrap();
    recipe
        .build(model().tokenizer(), &[], std::path::Path::new("."))
        .unwrap()
}

fn question_agnostic(scorer: &str, budget: usize) -> PolicyParams {
    PolicyParams {
        scorer: scorer.into(),
        budget,
        sinks: 4,
        protocol: Protocol::QuestionAgnostic,
        ..PolicyParams::default()
    }
}

#[test]
fn question_agnostic_live_keeping_the_context_is_the_full_run() {
    // Nothing is evicted, but the question is run again over the context's cache: the same
    // numbers up to the order of float sums in the question's forward pass.
    let prompt = needle_with_question();
    let scratch = tempfile::tempdir().unwrap();
    let session = LiveSession::start(model(), &prompt, 512, scratch.path()).unwrap();
    let policy = question_agnostic("recency", 4096).check().unwrap();
    let report = session.run(&policy).unwrap();
    assert_eq!(report.text, report.full_text);
    assert!(
        report.steps.iter().all(|s| s.kl < 1e-6 && s.top1),
        "{:?}",
        report.steps
    );
    // The same under the timings that stream or re-select after the cut: their streams are fed
    // the context and run the question as their first decode steps.
    for timing in [Timing::PrefillThenStream, Timing::PerStepPrompt] {
        let streaming = PolicyParams {
            timing,
            ..question_agnostic("recency", 4096)
        };
        let streamed = session.run(&streaming.check().unwrap()).unwrap();
        assert_eq!(streamed.steps, report.steps, "{timing:?}");
        assert_eq!(streamed.text, report.text, "{timing:?}");
    }
    let in_prompt = PolicyParams {
        protocol: Protocol::QuestionInPrompt,
        ..question_agnostic("recency", 4096)
    };
    let in_prompt = session.run(&in_prompt.check().unwrap()).unwrap();
    assert_eq!(
        report.steps.len(),
        in_prompt.steps.len() + 1,
        "the first token is compared too: the question ran under the policy"
    );
}

#[test]
fn question_agnostic_live_is_the_question_run_over_the_surviving_context() {
    // Recency with 4 sinks at budget 32 keeps the same context positions in every layer and
    // head: the first 4 and the 28 before the question. Running the question over a cache that
    // holds only those (and the question itself) must give the live run's first logits, whose KL
    // against the full prefill's is the run's step 0.
    let model = model();
    let prompt = needle_with_question();
    let cut = prompt
        .spans
        .iter()
        .find(|s| s.name == "question")
        .unwrap()
        .start;
    let scratch = tempfile::tempdir().unwrap();
    let session = LiveSession::start(model, &prompt, 512, scratch.path()).unwrap();
    let report = session
        .run(&question_agnostic("recency", 32).check().unwrap())
        .unwrap();
    let mut cache = KvCache::default();
    let full = model.forward(&prompt.ids, &mut cache, None).unwrap();
    let mut context = KvCache::default();
    model
        .forward(&prompt.ids[..cut], &mut context, None)
        .unwrap();
    let kept: Vec<usize> = (0..4).chain(cut - 28..cut).collect();
    let mut survivors = context.retain(&kept).unwrap();
    let removed = model
        .forward(&prompt.ids[cut..], &mut survivors, None)
        .unwrap();
    let by_hand = kvreplay::live::compare_step(&full, &removed, 0);
    assert!(
        (by_hand.kl - report.steps[0].kl).abs() < 1e-4 * report.steps[0].kl.max(1e-3),
        "by hand {} against live {}",
        by_hand.kl,
        report.steps[0].kl
    );
    assert!(
        report.steps[0].kl > 1e-3,
        "the evicted context moves the answer"
    );
}

#[test]
fn masking_evicted_keys_equals_removing_them() {
    // Evict the same positions in every layer and head: the masked forward over the full cache
    // and the plain forward over a cache holding only the survivors must agree (the survivors
    // keep their rotation either way, and the new token gets position n in both). Only the order
    // of float sums differs: tolerance 1e-4 on logits of magnitude ~20.
    let model = model();
    let (prompt, cache) = prefilled_capital();
    let n = prompt.ids.len();
    let evicted: Vec<usize> = (3..n - 6).filter(|p| p % 3 != 0).collect();
    let kept: Vec<usize> = (0..n).filter(|p| !evicted.contains(p)).collect();
    let config = model.config();
    let mut per_head = vec![vec![evicted.clone(); config.n_heads]; config.n_layers];
    let mut masked_cache = cache.clone();
    let masked = model
        .forward_masked(&[504], &mut masked_cache, None, Some(&mut per_head))
        .unwrap();
    let mut pruned = cache.retain(&kept).unwrap();
    assert_eq!(pruned.len(), kept.len());
    let removed = model.forward(&[504], &mut pruned, None).unwrap();
    let worst = masked
        .iter()
        .zip(&removed)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-4, "masked and removed differ by {worst}");
    let unmasked = model.forward(&[504], &mut cache.clone(), None).unwrap();
    let moved = masked
        .iter()
        .zip(&unmasked)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        moved > 1e-2,
        "evicting {} positions moves the logits ({moved})",
        evicted.len()
    );
}

/// A scratch directory holding the shipped chat recipe.
fn with_capital_recipe() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::copy(
        root.join("traces/capital.toml"),
        dir.path().join("capital.toml"),
    )
    .unwrap();
    dir
}

/// A recipe of `samples = 5` is five prompts: the sweep captures each sample's trace, runs every
/// policy on each, and the report's intervals rest on the five prompts.
#[test]
fn a_sampled_recipe_sweeps_every_sample_as_a_prompt() {
    model();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("vt.toml"),
        "kind = \"ruler-niah\"\nprompt_tokens = 300\ntype_haystack = \"noise\"\ngenerate = 8\nsamples = 5\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("s.toml"),
        "description = \"sampled\"\ntraces = [\"vt.toml\"]\nbudgets = [48]\nclosed_loop = true\n\
         [[policy]]\nname = \"snapkv\"\npreset = \"snapkv\"\n[[policy]]\nname = \"recency\"\nscorer = \"recency\"\n",
    )
    .unwrap();
    let assert = assert_cmd::Command::cargo_bin("kvreplay")
        .unwrap()
        .current_dir(dir.path())
        .args(["sweep", "s.toml"])
        .assert()
        .success();
    let report = String::from_utf8(assert.get_output().stdout.clone()).unwrap();
    let traces: Vec<std::path::PathBuf> = (0..5)
        .map(|k| dir.path().join(format!("vt.samples/s00{k}.safetensors")))
        .collect();
    assert!(traces.iter().all(|t| t.is_file()), "{report}");
    assert!(!dir.path().join("vt.safetensors").exists());
    // Five prompts, each its own key and number: the samples' prompt texts differ.
    let texts: std::collections::BTreeSet<String> = traces
        .iter()
        .map(|t| kvreplay::trace::TraceReader::open(t).unwrap().meta().extra["prompt_text"].clone())
        .collect();
    assert_eq!(texts.len(), 5);
    assert!(report.contains("of 5 prompts, 10 runs"), "{report}");
    assert!(report.contains("): `chat` on 5.\n"), "{report}");
    assert!(
        report.contains("Student t over the per-prompt means of 5 prompts;"),
        "{report}"
    );
}

#[test]
fn a_closed_loop_sweep_stores_outcomes_and_reports_the_calibration() {
    model();
    let dir = with_capital_recipe();
    std::fs::write(
        dir.path().join("c.toml"),
        r#"
description = "closed-loop fixture"
traces = ["capital.toml"]
budgets = [8, 24]
closed_loop = true

[[policy]]
name = "snapkv"
preset = "snapkv"
window = 4

[[policy]]
name = "recency"
scorer = "recency"
window = 4
"#,
    )
    .unwrap();
    let assert = assert_cmd::Command::cargo_bin("kvreplay")
        .unwrap()
        .current_dir(dir.path())
        .args(["sweep", "c.toml"])
        .assert()
        .success();
    let report = String::from_utf8(assert.get_output().stdout.clone()).unwrap();
    assert!(report.contains("Closed loop: the policy holds the model's real KV cache"));
    assert!(report.contains("Rank correlations between open-loop metrics and closed-loop outcomes"));
    let csv = std::fs::read_to_string(dir.path().join("results/c/runs.csv")).unwrap();
    assert!(csv
        .lines()
        .next()
        .unwrap()
        .ends_with(
            "kl,top1,live_retained_mass,logprob_lost,answer_ok,answer_score,full_answer_ok,full_answer_score,text"
        ));
    assert_eq!(csv.lines().count(), 5);
    assert!(dir.path().join("results/c/calibration.png").is_file());
    // Every run measured its live attention: the drift section and its figure are there.
    assert!(report.contains("Live attention drift"), "{report}");
    assert!(
        report.contains("over the same 1 prompt, 4 runs"),
        "{report}"
    );
    assert!(dir.path().join("results/c/drift.png").is_file());
    // A closed-loop experiment on a trace file is refused.
    std::fs::write(
        dir.path().join("bad.toml"),
        "description = \"x\"\ntraces = [\"capital.safetensors\"]\nbudgets = [8]\nclosed_loop = true\n[[policy]]\nname = \"a\"\npreset = \"snapkv\"\n",
    )
    .unwrap();
    assert_cmd::Command::cargo_bin("kvreplay")
        .unwrap()
        .current_dir(dir.path())
        .args(["sweep", "bad.toml"])
        .assert()
        .code(2)
        .stderr(predicates::str::contains(
            "every entry of `traces` must be a recipe",
        ));
}

/// A policy whose error shows only while it runs fails alone: the sweep stores the others, keeps
/// its error under `failed/` and exits 2 naming it; a sweep run again retries only it.
#[test]
fn a_policy_that_fails_while_running_fails_alone() {
    model();
    let dir = with_capital_recipe();
    // The chat recipe has no question span, which the question-agnostic cut needs.
    std::fs::write(
        dir.path().join("c.toml"),
        "traces = [\"capital.toml\"]\nbudgets = [8]\nclosed_loop = true\n\
         [[policy]]\nname = \"snapkv\"\npreset = \"snapkv\"\nwindow = 4\n\
         [[policy]]\nname = \"agnostic\"\npreset = \"snapkv\"\nwindow = 4\n\
         protocol = \"question-agnostic\"\n",
    )
    .unwrap();
    let sweep = || {
        assert_cmd::Command::cargo_bin("kvreplay")
            .unwrap()
            .current_dir(dir.path())
            .args(["sweep", "c.toml"])
            .assert()
            .code(2)
    };
    let failed = sweep();
    let message = String::from_utf8(failed.get_output().stderr.clone()).unwrap();
    assert!(
        message
            .contains("1 of 2 runs failed (the others are stored); the first: policy `agnostic`"),
        "{message}"
    );
    let results = dir.path().join("results/c");
    let names = |sub: &str| -> Vec<String> {
        std::fs::read_dir(results.join(sub))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    };
    let stored = names("runs");
    assert!(
        stored.len() == 1 && stored[0].starts_with("snapkv-"),
        "{stored:?}"
    );
    let errors = names("failed");
    assert!(
        errors.len() == 1 && errors[0].starts_with("agnostic-"),
        "{errors:?}"
    );
    let error = std::fs::read_to_string(results.join("failed").join(&errors[0])).unwrap();
    assert!(error.contains("has no `question` span"), "{error}");
    let again = sweep();
    let message = String::from_utf8(again.get_output().stderr.clone()).unwrap();
    assert!(message.contains("1 of 1 runs failed"), "{message}");
}

/// An experiment's essential work counts one prefill for the full run and one per run that evicts
/// while the prompt runs, every run's teacher-forced and free-running steps, and the multiply-adds
/// of each as counted by hand from the model's shape; `kvreplay bench --essential` prints it, and
/// refuses an open-loop experiment.
#[test]
fn an_experiments_essential_work_counts_its_prefills_and_decode_steps() {
    model();
    let dir = with_capital_recipe();
    let experiment = "traces = [\"capital.toml\"]\nbudgets = [8, 24]\nclosed_loop = true\n\
         [[policy]]\nname = \"snapkv\"\npreset = \"snapkv\"\nwindow = 4\n\
         [[policy]]\nname = \"streamingllm\"\npreset = \"streamingllm\"\n";
    std::fs::write(dir.path().join("c.toml"), experiment).unwrap();
    let bench = |file: &str| {
        assert_cmd::Command::cargo_bin("kvreplay")
            .unwrap()
            .current_dir(dir.path())
            .args(["bench", "--essential", file])
            .assert()
    };
    let printed = bench("c.toml").success();
    let table = String::from_utf8(printed.get_output().stdout.clone()).unwrap();
    let prompt = capital();
    let row = format!(
        "capital.safetensors ({}, {} prompt tokens): 4 live runs, 3 prefills, 32 decode steps a run",
        model().spec().name,
        prompt.ids.len()
    );
    assert!(table.contains(&row), "{table}");
    assert!(
        table.contains("c.toml: 4 live runs on 1 recipes, 3 prefills"),
        "{table}"
    );

    // The same experiment, its recipe named by its full path, through the library.
    let recipe = dir.path().join("capital.toml");
    let path = dir.path().join("absolute.toml");
    let absolute = experiment.replace("capital.toml", &recipe.display().to_string());
    std::fs::write(&path, absolute).unwrap();
    let parsed = kvreplay::experiment::Experiment::load(&path).unwrap();
    let traces = parsed.trace_files(None).unwrap();
    let (work, peak) = kvreplay::bench::experiment_work((&path, &parsed), &traces).unwrap();
    assert!(peak > 0.0);
    let spec = model().spec();
    let weights = model().weight_products_per_token().unwrap();
    let (n, steps) = (prompt.ids.len(), 32);
    let attention = |position: usize| {
        (2 * spec.n_heads * spec.head_dim * spec.n_layers * (position + 1)) as f64
    };
    let prefill: f64 = weights.output as f64
        + (0..n)
            .map(|t| weights.blocks as f64 + attention(t))
            .sum::<f64>();
    let row: f64 = (n..n + steps)
        .map(|t| (weights.blocks + weights.output) as f64 + attention(t))
        .sum();
    let (prefills, decode) = work[0].multiply_adds.unwrap();
    assert!(
        ((prefills - 3.0 * prefill) / prefills).abs() < 1e-12,
        "{prefills} {prefill}"
    );
    assert!(
        ((decode - 4.0 * row) / decode).abs() < 1e-12,
        "{decode} {row}"
    );

    std::fs::write(
        dir.path().join("open.toml"),
        experiment.replace("closed_loop = true", "closed_loop = false"),
    )
    .unwrap();
    bench("open.toml").code(2).stderr(predicates::str::contains(
        "open.toml: `closed_loop` is not true: the essential work counts an experiment's live runs",
    ));
}

/// The capital recipe's kept prompt positions under `recency` with 4 sinks at a budget of 16:
/// the sinks and the last 12, in every layer and head.
fn recency_16(prompt_len: usize) -> (PolicyParams, Vec<usize>) {
    let params = PolicyParams {
        scorer: "recency".into(),
        budget: 16,
        sinks: 4,
        ..PolicyParams::default()
    };
    (params, (0..4).chain(prompt_len - 12..prompt_len).collect())
}

/// What a stored cache holds, rebuilt by brute force for the brute-force run below.
enum ByHand {
    /// The open-loop quantizing cache per (layer, KV head), its rows written from the model's
    /// cache as they arrive; every held row rewritten at every step.
    Quantized(kvreplay::replay::quantizer::Scheme),
    /// ThinK at the cut: `pruned` channels chosen from the last `window` prompt queries.
    Think { pruned: usize, window: usize },
    /// kvpress's merge at the cut.
    Merged(kvreplay::replay::merge::ValueMerge),
}

/// The teacher-forced steps of `prompt` with the positions not in `kept` masked in every layer
/// and head and the cache stored as `by_hand` says, one `forward_masked` call per token, the
/// stored rows rewritten by hand before each.
fn stored_by_hand(prompt: &BuiltPrompt, kept: &[usize], by_hand: &ByHand) -> Vec<LiveStep> {
    use kvreplay::model::{Evicted, Rewrite};
    use ndarray::{s, Array3, ArrayView2, Axis};
    let model = model();
    let spec = model.spec();
    let (n_layers, n_kv, group) = (
        spec.n_layers,
        spec.n_kv_heads,
        spec.n_heads / spec.n_kv_heads,
    );
    let prompt_len = prompt.ids.len();
    let mut recorder = Recorder::default();
    let mut full = KvCache::default();
    let prefill_logits = model
        .forward(&prompt.ids, &mut full, Some(&mut recorder))
        .unwrap();
    let mut cache = full.with_room(64).unwrap();
    let mut logits = Vec::new();
    let tokens = model
        .decode_greedy(
            &mut full,
            &prefill_logits,
            prompt.generate,
            None,
            None,
            &mut |l| {
                logits.push(l.to_vec());
                Ok(())
            },
        )
        .unwrap();
    let gone: Vec<usize> = (0..prompt_len).filter(|j| !kept.contains(j)).collect();
    let evicted: Evicted = vec![vec![gone.clone(); spec.n_heads]; n_layers];
    let rewrite =
        |cache: &mut KvCache, layer: usize, rows: &[usize], kv: (Array3<f32>, Array3<f32>)| {
            let pick = |a: &Array3<f32>| a.select(Axis(1), rows);
            let rewrite = Rewrite {
                positions: rows.to_vec(),
                keys: pick(&kv.0),
                values: pick(&kv.1),
            };
            cache.overwrite(layer, &rewrite).unwrap();
        };
    // At the cut: ThinK's and the merge's prompt entries.
    for layer in 0..n_layers {
        let (mut keys, mut values) = (cache.keys(layer).unwrap(), cache.values(layer).unwrap());
        match by_hand {
            ByHand::Think { pruned, window } => {
                let q = recorder.layer(layer).unwrap().0;
                for kv in 0..n_kv {
                    let queries: Vec<ArrayView2<f32>> = (kv * group..(kv + 1) * group)
                        .map(|head| q.slice(s![head, prompt_len - window..prompt_len, ..]))
                        .collect();
                    let channels = kvreplay::replay::channels::lowest_channels(
                        &queries,
                        keys.slice(s![kv, ..prompt_len, ..]),
                        kept,
                        *pruned,
                    );
                    for c in channels {
                        keys.slice_mut(s![kv, ..prompt_len, c]).fill(0.0);
                    }
                }
            }
            ByHand::Merged(merge) => {
                for kv in 0..n_kv {
                    let merged = merge.merged(
                        keys.slice(s![kv, .., ..]),
                        values.slice(s![kv, .., ..]),
                        (kept, &gone),
                    );
                    for (&j, value) in kept.iter().zip(merged) {
                        values
                            .slice_mut(s![kv, j, ..])
                            .assign(&ndarray::Array1::from(value));
                    }
                }
            }
            ByHand::Quantized(_) => {}
        }
        rewrite(&mut cache, layer, kept, (keys, values));
    }
    let capacity = prompt_len + tokens.len();
    let mut quantized: Vec<Vec<kvreplay::replay::quantizer::QuantizedCache>> = match by_hand {
        ByHand::Quantized(scheme) => (0..n_layers)
            .map(|_| {
                (0..n_kv)
                    .map(|_| {
                        kvreplay::replay::quantizer::QuantizedCache::unwritten(
                            *scheme,
                            capacity,
                            spec.head_dim,
                        )
                    })
                    .collect()
            })
            .collect(),
        _ => Vec::new(),
    };
    let mut steps = Vec::new();
    for (t, &token) in tokens.iter().enumerate() {
        let position = prompt_len + t;
        let held: Vec<usize> = kept.iter().copied().chain(prompt_len..=position).collect();
        for (layer, caches) in quantized.iter_mut().enumerate() {
            let (keys, values) = (cache.keys(layer).unwrap(), cache.values(layer).unwrap());
            // The entries that arrived since the last step, as the model wrote them.
            let arrived = if t == 0 {
                0..prompt_len
            } else {
                position - 1..position
            };
            for (kv, stored) in caches.iter_mut().enumerate() {
                for j in arrived.clone() {
                    stored.write(j, keys.slice(s![kv, j, ..]), values.slice(s![kv, j, ..]));
                }
                stored.step(&held, position);
            }
            let rows = &held[..held.len() - 1];
            let (mut keys, mut values) = (keys, values);
            for (kv, stored) in caches.iter().enumerate() {
                for &j in rows {
                    keys.slice_mut(s![kv, j, ..]).assign(&stored.keys().row(j));
                    values
                        .slice_mut(s![kv, j, ..])
                        .assign(&stored.values().unwrap().row(j));
                }
            }
            rewrite(&mut cache, layer, rows, (keys, values));
        }
        let step = model
            .forward_masked(&[token], &mut cache, None, Some(&mut evicted.clone()))
            .unwrap();
        if let Some(&next) = tokens.get(t + 1) {
            steps.push(kvreplay::live::compare_step(&logits[t], &step, next));
        }
    }
    steps
}

/// Live on a quantized, channel-pruned or merged cache: the model runs over what the cache
/// stores, and its teacher-forced steps are, bit for bit, those of a brute force that rewrites
/// every held entry of the model's cache by hand before each token (the open-loop quantizing
/// cache fed the model's own vectors; ThinK's channels and kvpress's merge computed at the cut
/// from the model's own prompt). Batched or one at a time, the reports are the same; at 16 bits
/// the quantizer stores the cache as captured and the run is the plain one.
#[test]
fn stored_caches_run_live_as_a_brute_force_rewrites_them() {
    use kvreplay::replay::merge::ValueMerge;
    use kvreplay::replay::quantizer::{Grouping, Scheme};
    let prompt = capital();
    let (plain, kept) = recency_16(prompt.ids.len());
    let with = |axis: &str, name: &str, settings: &[(&str, f64)]| {
        let mut params = plain.clone();
        match axis {
            "quantizer" => params.quantizer = name.into(),
            "channels" => params.channels = name.into(),
            _ => params.merge = name.into(),
        }
        for &(key, value) in settings {
            params = match key {
                "key_channel_ratio" | "similarity_threshold" => params.with(key, value),
                _ => params.with(key, value as u64),
            };
        }
        params
    };
    let kivi = with(
        "quantizer",
        "kivi",
        &[("bits", 2.0), ("group_size", 4.0), ("residual", 8.0)],
    );
    let per_token = with(
        "quantizer",
        "per-token",
        &[("bits", 4.0), ("group_size", 16.0), ("residual", 2.0)],
    );
    let think = with(
        "channels",
        "think",
        &[("key_channel_ratio", 0.5), ("query_window", 8.0)],
    );
    let merged = with("merge", "similarity", &[("similarity_threshold", 0.0)]);
    let cases = [
        (
            kivi,
            ByHand::Quantized(Scheme {
                bits: 2,
                group_size: 4,
                residual: 8,
                keys: Grouping::PerChannel,
                values: Grouping::PerToken,
            }),
        ),
        (
            per_token,
            ByHand::Quantized(Scheme {
                bits: 4,
                group_size: 16,
                residual: 2,
                keys: Grouping::PerToken,
                values: Grouping::PerToken,
            }),
        ),
        (
            think,
            ByHand::Think {
                pruned: 32,
                window: 8,
            },
        ),
        (
            merged,
            ByHand::Merged(ValueMerge {
                similarity_threshold: 0.0,
                merge_fraction: 1.0,
            }),
        ),
    ];
    let scratch = tempfile::tempdir().unwrap();
    let session = LiveSession::start(model(), &prompt, 512, scratch.path()).unwrap();
    let policies: Vec<_> = cases
        .iter()
        .map(|(params, _)| params.clone().check().unwrap())
        .collect();
    let reports = session.run_many(&policies).unwrap();
    let plain_report = session.run(&plain.clone().check().unwrap()).unwrap();
    for (((_, by_hand), policy), report) in cases.iter().zip(&policies).zip(&reports) {
        let label = policy.label();
        assert_eq!(
            report.steps,
            stored_by_hand(&prompt, &kept, by_hand),
            "{label}"
        );
        assert_ne!(report.steps, plain_report.steps, "{label} changes the run");
    }
    assert_eq!(
        session
            .run_batched(&policies, Batching::ONE_AT_A_TIME)
            .unwrap(),
        reports
    );
    let at_16 = PolicyParams {
        quantizer: "kivi".into(),
        ..plain
    }
    .with("bits", 16)
    .check()
    .unwrap();
    assert_eq!(session.run(&at_16).unwrap().steps, plain_report.steps);
}

/// Under the question-agnostic protocol, the timings that stream or re-select after the cut run
/// live: each policy's report with its own prefill (the context in its own chunks under its
/// streams, then the question) is the one it gets with the full run's context shared (its streams
/// fed the recorded context, the question run over the context's cache), batched: the same texts
/// and top-1 choices, KL and lost log-probability within 1e-4 (relative above 1). Not bit for
/// bit: alone, the context's forward pass is chunked at the cut, where the full run's chunk held
/// the question too, which moves the last bits of its sums.
#[test]
fn question_agnostic_streams_run_live_the_same_shared_or_alone() {
    let prompt = needle_with_question();
    let scratch = tempfile::tempdir().unwrap();
    let session = LiveSession::start(model(), &prompt, 512, scratch.path()).unwrap();
    let policies: Vec<_> = [Timing::PrefillThenStream, Timing::PerStepPrompt]
        .into_iter()
        .flat_map(|timing| {
            ["recency", "true-query"].map(|scorer| {
                PolicyParams {
                    timing,
                    ..question_agnostic(scorer, 32)
                }
                .check()
                .unwrap()
            })
        })
        .collect();
    let together = session.run_many(&policies).unwrap();
    let alone = session
        .run_batched(&policies, Batching::ONE_AT_A_TIME)
        .unwrap();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-4 * a.abs().max(b.abs()).max(1.0);
    let prefill = session
        .run(&question_agnostic("recency", 32).check().unwrap())
        .unwrap();
    for (shared, own) in together.iter().zip(&alone) {
        let policy = &shared.policy;
        assert_eq!(shared.text, own.text, "{policy}");
        assert_eq!(shared.open_loop, own.open_loop, "{policy}");
        assert_eq!(shared.steps.len(), own.steps.len(), "{policy}");
        for (a, b) in shared.steps.iter().zip(&own.steps) {
            assert!(
                a.top1 == b.top1 && close(a.kl, b.kl),
                "{policy}: {a:?} {b:?}"
            );
            assert!(
                close(a.logprob_lost, b.logprob_lost),
                "{policy}: {a:?} {b:?}"
            );
        }
        assert!(shared.steps[0].kl > 1e-3, "{policy}: the context is cut");
        assert_eq!(shared.steps.len(), prefill.steps.len(), "{policy}");
    }
    // Re-running is bit for bit.
    assert_eq!(session.run_many(&policies).unwrap(), together);
}

/// DefensiveKV reads each layer's attention inputs: run live, the session records them with the
/// model's projections, and keeps what a replay of an f32 capture with `--attention-inputs`
/// keeps.
#[test]
fn a_policy_reading_attention_inputs_runs_live_as_it_replays() {
    model();
    let dir = tempfile::tempdir().unwrap();
    let recipe = dir.path().join("n.toml");
    std::fs::write(
        &recipe,
        "kind = \"ruler-niah\"\nprompt_tokens = 300\ntype_haystack = \"noise\"\ngenerate = 8\n",
    )
    .unwrap();
    let policy = kvreplay::replay::presets::preset("defensivekv", 64)
        .unwrap()
        .check()
        .unwrap();
    let policies = std::slice::from_ref(&policy);
    let recording = (512, dir.path());
    let reports =
        kvreplay::live::run_recipe(&recipe, policies, recording, kvreplay::stop::NEVER).unwrap();
    let live_report = &reports[0][0];
    assert!(
        live_report.kl > 0.0,
        "64 tokens of ~300 change what the model does"
    );
    let out = dir.path().join("n.safetensors");
    let storing = (StorageDtype::F32, 512, true);
    let mut models = Default::default();
    kvreplay::capture::capture_recipe(&recipe, &out, storing, &mut models, &mut |_, _| Ok(()))
        .unwrap();
    let trace = TraceReader::open(&out).unwrap().counting_elements_at(2);
    let mut open_loop = replay(&trace, &policy).unwrap();
    open_loop.trace = live_report.open_loop.trace.clone();
    assert_eq!(open_loop, live_report.open_loop);
}

/// An experiment with a policy that reads the attention inputs captures its recipes with them,
/// open loop (the trace captured first) and closed loop (the trace written from the live runs):
/// DefensiveKV runs beside SnapKV, and each trace holds the inputs.
#[test]
fn an_experiment_reading_attention_inputs_captures_them() {
    model();
    for closed_loop in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("n.toml"),
            "kind = \"ruler-niah\"\nprompt_tokens = 300\ntype_haystack = \"noise\"\ngenerate = 8\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("e.toml"),
            format!(
                "traces = [\"n.toml\"]\nbudgets = [64]\nclosed_loop = {closed_loop}\n\
                 [[policy]]\nname = \"defensivekv\"\npreset = \"defensivekv\"\n\
                 [[policy]]\nname = \"snapkv\"\npreset = \"snapkv\"\n"
            ),
        )
        .unwrap();
        let assert = assert_cmd::Command::cargo_bin("kvreplay")
            .unwrap()
            .current_dir(dir.path())
            .args(["sweep", "e.toml"])
            .assert();
        let output = assert.get_output();
        let report = String::from_utf8_lossy(&output.stdout).into_owned();
        let errors = String::from_utf8_lossy(&output.stderr).into_owned();
        assert!(
            output.status.success(),
            "closed loop {closed_loop}: {errors}"
        );
        let trace = TraceReader::open(dir.path().join("n.safetensors")).unwrap();
        assert!(trace.has_inputs(), "closed loop {closed_loop}");
        let runs = std::fs::read_dir(dir.path().join("results/e/runs")).unwrap();
        assert_eq!(runs.count(), 2, "{report}");
    }
}

/// A live run asks whether to stop in its open-loop pass (after each layer at least) and at each
/// chunk of a policy's own prefill (here: streaming), not only while it decodes, so a stop while
/// the policies are replayed or prefill ends the run there: in sessions of smaller chunks the
/// streaming policy is asked more often, where a one-shot policy (sharing the full run's
/// prefill) is asked as often.
#[test]
fn a_live_run_asks_its_stop_in_its_replay_and_own_prefills() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let scratch = tempfile::tempdir().unwrap();
    let prompt = capital();
    let streaming = evicting_live(Timing::Streaming, Order::EvictFirst, 12)
        .check()
        .unwrap();
    let one_shot = snapkv(12).check().unwrap();
    // Questions asked while each policy runs, in a session of prefill chunks of `chunk` tokens.
    let questions = |chunk: usize| -> Vec<usize> {
        let asked = AtomicUsize::new(0);
        let counting = || {
            asked.fetch_add(1, Ordering::Relaxed);
            Ok(())
        };
        let session =
            LiveSession::start_stopping((model(), &counting), &prompt, chunk, scratch.path())
                .unwrap();
        assert!(session.prefills_on_its_own(&streaming));
        assert!(!session.prefills_on_its_own(&one_shot));
        [&one_shot, &streaming]
            .map(|policy| {
                let before = asked.load(Ordering::Relaxed);
                session.run(policy).unwrap();
                asked.load(Ordering::Relaxed) - before
            })
            .to_vec()
    };
    let (whole, small) = (questions(512), questions(8));
    eprintln!("stop asked (one-shot, streaming): chunks of 512 {whole:?}, of 8 {small:?}");
    assert_eq!(
        small[0], whole[0],
        "the one-shot policy has no prefill of its own"
    );
    let layers = model().spec().n_layers;
    assert!(
        whole[0] > layers,
        "{whole:?}: the open-loop pass asks after each of {layers} layers"
    );
    assert!(small[1] > whole[1], "{small:?} against {whole:?}");
}
