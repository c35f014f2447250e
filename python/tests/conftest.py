"""Fixtures: one real trace, captured once per session from SmolLM2-135M-Instruct on a ~600-token
needle-in-a-haystack prompt (the assets are fetched into $KVREPLAY_HOME on first use, as the Rust
tests fetch them), and the command line built beside the package, for comparing the two."""

import os
import pathlib
import shutil
import subprocess

import pytest

import kvreplay

RECIPE = """\
kind = "niah"
prompt_tokens = 600
depth_percent = 50.0
needle = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
question = "What is the best thing to do in San Francisco?"
answer = "Dolores Park"
generate = 8
"""

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def recipe(tmp_path_factory):
    path = tmp_path_factory.mktemp("recipe") / "niah-600.toml"
    path.write_text(RECIPE)
    return path


@pytest.fixture(scope="session")
def trace_path(recipe):
    return kvreplay.capture(recipe).path


@pytest.fixture(scope="session")
def trace(trace_path):
    return kvreplay.Trace(trace_path)


@pytest.fixture(scope="session")
def cli():
    """The `kvreplay` binary of the same build ($CARGO_TARGET_DIR/debug, as `cargo test` left it)."""
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    binary = target / "debug" / "kvreplay"
    if not binary.exists():
        subprocess.run(["cargo", "build", "--bin", "kvreplay"], cwd=ROOT, check=True)
    return str(binary)


def run_cli(cli, *args):
    """The command line's exit code, stdout and stderr."""
    done = subprocess.run([cli, *map(str, args)], capture_output=True, text=True)
    return done.returncode, done.stdout, done.stderr
