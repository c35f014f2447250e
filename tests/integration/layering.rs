//! The library's modules import each other without circles: no set of sibling modules under
//! `src/` names each other round (through `use super::…`, `crate::…` or a `super::…` path in
//! their code, tests left out). The modules are read from the source files; a path is resolved to
//! the module that defines what it names (through the `pub use` re-exports of a parent module),
//! and a reference between two modules counts between their ancestors that are siblings.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path, e.g. `["experiment", "report"]`.
type Module = Vec<String>;

fn source_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            source_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module a library source file defines (`None` for the binary's files).
fn module_of(src: &Path, file: &Path) -> Option<Module> {
    let relative = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Module = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts[0] == "main" || parts[0] == "cli" {
        return None;
    }
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    Some(parts)
}

/// The code of a file without its comments and its `#[cfg(test)] mod tests`.
fn code(file: &Path) -> String {
    let text = std::fs::read_to_string(file).unwrap();
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => &text,
    };
    text.lines()
        .map(|line| line.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The paths after `prefix` in `code`: `a::b::c` of `prefix a::b::c`, and each item of a
/// `prefix{a, b::c}` group.
fn paths_after(code: &str, prefix: &str) -> Vec<Vec<String>> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut paths = Vec::new();
    for (at, _) in code.match_indices(prefix) {
        if at > 0 && code[..at].ends_with(ident) {
            continue;
        }
        let rest = &code[at + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            for item in group_items(group) {
                let head = item.split('{').next().unwrap_or_default();
                let item: Vec<String> = head
                    .split("::")
                    .map(|s| s.trim().to_owned())
                    .filter(|s| !s.is_empty() && s.chars().all(ident))
                    .collect();
                if !item.is_empty() {
                    paths.push(item);
                }
            }
            continue;
        }
        let end = rest
            .find(|c: char| !(ident(c) || c == ':'))
            .unwrap_or(rest.len());
        let path: Vec<String> = rest[..end]
            .split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        if !path.is_empty() {
            paths.push(path);
        }
    }
    paths
}

/// The top-level items of a `{…}` group whose opening brace has been read.
fn group_items(group: &str) -> Vec<&str> {
    let (mut depth, mut start, mut items) = (1usize, 0, Vec::new());
    for (at, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 1 => {
                items.push(&group[start..at]);
                return items;
            }
            '}' => depth -= 1,
            ',' if depth == 1 => {
                items.push(&group[start..at]);
                start = at + 1;
            }
            _ => {}
        }
    }
    items
}

/// Edges between sibling modules.
fn edges(src: &Path) -> BTreeMap<Module, BTreeSet<Module>> {
    let mut files = Vec::new();
    source_files(src, &mut files);
    let modules: BTreeMap<Module, PathBuf> = files
        .iter()
        .filter_map(|file| module_of(src, file).map(|m| (m, file.clone())))
        .collect();
    // What a module re-exports from its submodules: `pub use sub::{A, B}` makes `module::A` a
    // name of `module::sub`.
    let mut reexported: BTreeMap<Module, Module> = BTreeMap::new();
    for (module, file) in &modules {
        let code = code(file);
        for visibility in ["pub use ", "pub(crate) use "] {
            for path in paths_after(&code, visibility) {
                let Some(sub) = path.first() else { continue };
                let sub: Module = module.iter().cloned().chain([sub.clone()]).collect();
                if !modules.contains_key(&sub) {
                    continue;
                }
                if let Some(name) = path.get(1) {
                    let named = module.iter().cloned().chain([name.clone()]).collect();
                    reexported.insert(named, sub.clone());
                }
            }
            for group in code.split(visibility).skip(1) {
                let Some((sub, rest)) = group.split_once("::{") else {
                    continue;
                };
                let sub: Module = module
                    .iter()
                    .cloned()
                    .chain([sub.trim().to_owned()])
                    .collect();
                if !modules.contains_key(&sub) {
                    continue;
                }
                for item in group_items(rest) {
                    let name = item
                        .split("::")
                        .next()
                        .unwrap_or_default()
                        .trim()
                        .to_owned();
                    let named = module.iter().cloned().chain([name]).collect();
                    reexported.insert(named, sub.clone());
                }
            }
        }
    }
    let mut graph: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (module, file) in &modules {
        let code = code(file);
        // `super::` names the parent module (for a `mod.rs`, its directory's parent).
        let base: Module = module[..module.len().saturating_sub(1)].to_vec();
        let mut targets: Vec<Module> = paths_after(&code, "crate::");
        for path in paths_after(&code, "super::") {
            targets.push(base.iter().cloned().chain(path).collect());
        }
        for target in targets {
            let Some(target) = (1..=target.len()).rev().find_map(|n| {
                let prefix = target[..n].to_vec();
                match reexported.get(&prefix) {
                    Some(defined) => Some(defined.clone()),
                    None => modules.contains_key(&prefix).then_some(prefix),
                }
            }) else {
                continue;
            };
            let common = module
                .iter()
                .zip(&target)
                .take_while(|(a, b)| a == b)
                .count();
            if common >= module.len() || common >= target.len() {
                continue; // an ancestor or a descendant
            }
            graph
                .entry(module[..=common].to_vec())
                .or_default()
                .insert(target[..=common].to_vec());
        }
    }
    graph
}

/// The strongly connected components of more than one module (Tarjan).
fn circles(graph: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    struct Walk<'g> {
        graph: &'g BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<&'g Module, usize>,
        low: BTreeMap<&'g Module, usize>,
        stack: Vec<&'g Module>,
        found: Vec<Vec<Module>>,
    }
    impl<'g> Walk<'g> {
        fn visit(&mut self, node: &'g Module) {
            let n = self.index.len();
            self.index.insert(node, n);
            self.low.insert(node, n);
            self.stack.push(node);
            for next in self.graph.get(node).into_iter().flatten() {
                if !self.index.contains_key(next) {
                    self.visit(next);
                    let low = self.low[node].min(self.low[next]);
                    self.low.insert(node, low);
                } else if self.stack.contains(&next) {
                    let low = self.low[node].min(self.index[next]);
                    self.low.insert(node, low);
                }
            }
            if self.low[node] == self.index[node] {
                let mut component = Vec::new();
                while let Some(top) = self.stack.pop() {
                    component.push(top.clone());
                    if top == node {
                        break;
                    }
                }
                if component.len() > 1 {
                    self.found.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        found: Vec::new(),
    };
    for node in graph.keys() {
        if !walk.index.contains_key(node) {
            walk.visit(node);
        }
    }
    walk.found
}

/// The workspace's crates, lowest first, with their directories: a crate may depend only on the
/// crates before it.
const CRATES: [(&str, &str); 5] = [
    ("kvreplay-core", "crates/kvreplay-core"),
    ("kvreplay-model", "crates/kvreplay-model"),
    ("kvreplay-experiment", "crates/kvreplay-experiment"),
    ("kvreplay", "."),
    ("kvreplay-python", "python"),
];

/// What the pure core must not depend on: the command line, the models, data frames, plots,
/// progress bars.
const NOT_IN_THE_CORE: [&str; 7] = [
    "clap",
    "candle-core",
    "polars",
    "plotters",
    "tokenizers",
    "indicatif",
    "pyo3",
];

/// What the models must not depend on: the command line, data frames, plots, progress bars
/// (experiments, reports and the command line are built above them).
const NOT_IN_THE_MODELS: [&str; 5] = ["clap", "polars", "plotters", "indicatif", "pyo3"];

/// What the experiments and reports must not depend on: the command line, progress bars, Python
/// (the command line above them shows progress; the binding builds on the command line's crate).
const NOT_IN_THE_EXPERIMENTS: [&str; 3] = ["clap", "indicatif", "pyo3"];

#[test]
fn no_import_circles_between_sibling_modules() {
    for (name, dir) in CRATES {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir).join("src");
        let graph = edges(&src);
        assert!(
            !graph.is_empty(),
            "{name}: the module graph was not read: {graph:?}"
        );
        let found: Vec<String> = circles(&graph)
            .iter()
            .map(|component| {
                let names: Vec<String> = component.iter().map(|m| m.join("::")).collect();
                names.join(" <-> ")
            })
            .collect();
        assert!(
            found.is_empty(),
            "{name}: import circles: {}",
            found.join("; ")
        );
    }
}

/// The names in a Cargo.toml's `[dependencies]` table.
fn dependencies(dir: &str) -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(dir)
        .join("Cargo.toml");
    let manifest: toml::Table = std::fs::read_to_string(&path).unwrap().parse().unwrap();
    manifest
        .get("dependencies")
        .and_then(|d| d.as_table())
        .map(|table| table.keys().cloned().collect())
        .unwrap_or_default()
}

#[test]
fn no_crate_depends_on_one_above_it_and_the_core_stays_pure() {
    for (index, (name, dir)) in CRATES.iter().enumerate() {
        let dependencies = dependencies(dir);
        for (above, _) in &CRATES[index..] {
            assert!(
                !dependencies.contains(&above.to_string()),
                "{name} depends on {above}, a crate at or above it"
            );
        }
        if index > 0 {
            let (below, _) = CRATES[index - 1];
            assert!(
                dependencies.contains(&below.to_string()),
                "{name} builds on {below}"
            );
        }
    }
    let core = dependencies(CRATES[0].1);
    for heavy in NOT_IN_THE_CORE {
        assert!(
            !core.contains(&heavy.to_string()),
            "the core depends on {heavy}"
        );
    }
    let models = dependencies(CRATES[1].1);
    for above in NOT_IN_THE_MODELS {
        assert!(
            !models.contains(&above.to_string()),
            "the models depend on {above}"
        );
    }
    let experiments = dependencies(CRATES[2].1);
    for above in NOT_IN_THE_EXPERIMENTS {
        assert!(
            !experiments.contains(&above.to_string()),
            "the experiments depend on {above}"
        );
    }
}

#[test]
fn a_circle_is_found() {
    let module = |name: &str| vec!["experiment".to_owned(), name.to_owned()];
    let mut graph = BTreeMap::new();
    graph.insert(module("store"), BTreeSet::from([module("shard")]));
    graph.insert(module("shard"), BTreeSet::from([module("store")]));
    graph.insert(module("report"), BTreeSet::from([module("store")]));
    let found = circles(&graph);
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].len(), 2);
}

#[test]
fn paths_are_read_from_use_lines_and_code() {
    let code = "use super::{figures::{a, b}, stats::mean};\nlet x = crate::trace::read(p);";
    assert_eq!(paths_after(code, "crate::"), vec![vec!["trace", "read"]]);
    let supers = paths_after(code, "super::");
    assert!(supers.contains(&vec!["figures".to_owned()]), "{supers:?}");
    assert!(
        supers.contains(&vec!["stats".to_owned(), "mean".to_owned()]),
        "{supers:?}"
    );
}

/// The core's own suites build no model: it takes the test kit without its `models` feature, and
/// the kit needs the models' crate only under that feature.
#[test]
fn the_cores_suites_build_without_the_models() {
    let manifest = |dir: &str| -> toml::Table {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(dir)
            .join("Cargo.toml");
        std::fs::read_to_string(path).unwrap().parse().unwrap()
    };
    let core = manifest(CRATES[0].1);
    let kit = &core["dev-dependencies"]["kvreplay-testkit"];
    assert!(kit.get("features").is_none(), "the core's kit: {kit}");
    let testkit = manifest("crates/kvreplay-testkit");
    let model = &testkit["dependencies"]["kvreplay-model"];
    assert_eq!(model.get("optional").and_then(|o| o.as_bool()), Some(true));
    assert_eq!(
        testkit["features"]["models"].as_array().unwrap()[0].as_str(),
        Some("dep:kvreplay-model")
    );
}
