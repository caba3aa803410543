"""The package: version, `python -m xpukit`, extras with pins, and the release check CI runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_version_is_the_release() -> None:
    import xpukit

    assert PYPROJECT["project"]["version"] == "0.1.0"
    assert xpukit.__version__ in {"0.1.0", "0.0.0+unknown"}  # installed, or a bare source tree


def test_python_dash_m_runs_the_cli_without_making_import_heavier() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "xpukit", "--version"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.startswith("xpukit ")
    code = "import sys, xpukit; print('xpukit.__main__' in sys.modules or 'xpukit.cli' in sys.modules)"
    light = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert light.stdout.strip() == "False"


def test_docs_and_build_tools_are_extras_with_pins() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    pins = {
        line.split("==")[0].lower()
        for line in (ROOT / "constraints" / "dev.txt").read_text(encoding="utf-8").splitlines()
        if "==" in line and not line.startswith("#")
    }
    docs = [req.split(">")[0].split("[")[0] for req in extras["docs"]]
    assert docs == ["mkdocs", "mkdocs-material", "mkdocstrings"]
    assert "docs" in extras["dev"][0] and any(req.startswith("build") for req in extras["dev"])
    assert {*docs, "mkdocstrings-python", "build", "setuptools"} <= pins


def test_ci_runs_both_legs_then_the_release_check() -> None:
    lines = [
        line
        for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert lines == [
        "XPUKIT_TEST_SLOW=1 scripts/test -q",
        "scripts/test-newest -q",
        "exec scripts/check-package",
    ]
    # scripts/test leaves the slow tests out unless XPUKIT_TEST_SLOW=1 (CI's line above), and an `-m`
    # among the arguments comes after its filter (pytest keeps the last one: `scripts/test -m gpu`)
    test = (ROOT / "scripts" / "test").read_text(encoding="utf-8")
    assert 'marks=(-m "not slow")' in test and '"${XPUKIT_TEST_SLOW:-0}" = "1"' in test
    assert test.rstrip().endswith('"${marks[@]}" "$@"')
    newest = (ROOT / "scripts" / "test-newest").read_text(encoding="utf-8")
    # a fresh virtualenv, every extra, nothing pinned but the CPU torch
    assert 'rm -rf "$venv"' in newest and '-e "$root[all,liger,deepspeed,test]"' in newest
    assert "constraints/dev.txt" in newest and "-c " not in newest
    check = (ROOT / "scripts" / "check-package").read_text(encoding="utf-8")
    for step in ("python -m build", "--no-deps", "doctor --json", "mkdocs build --strict", 'cd "$work"'):
        assert step in check


def test_every_test_process_computes_on_one_thread() -> None:
    """tests/conftest.py: two pytest workers with a thread per core oversubscribe a 2-core machine,
    where OpenMP's spinning waits stall every small op (docs/benchmarks.md "Test suite"); children
    inherit the setting. A test that changes the count must put it back."""
    import torch

    assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1
