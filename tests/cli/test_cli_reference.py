"""docs/cli.md is the parser's own --help: regenerate it with `python -m xpukit.cli.reference`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from xpukit.cli import reference
from xpukit.cli.main import SUBCOMMANDS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_cli_page_matches_the_parser() -> None:
    assert PAGE.read_text(encoding="utf-8") == reference.render(), (
        "docs/cli.md is out of date: run `python -m xpukit.cli.reference`"
    )


def test_every_subcommand_and_option_is_on_the_page() -> None:
    text = reference.render()
    for name in SUBCOMMANDS:
        assert f"## `xpukit {name}`" in text
    assert "--shell {posix,powershell,cmd}" in text  # a recent option, as argparse prints it


def test_generator_writes_the_file(tmp_path: Path) -> None:
    out = tmp_path / "cli.md"
    proc = subprocess.run(
        [sys.executable, "-m", "xpukit.cli.reference", str(out)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert out.read_text(encoding="utf-8") == reference.render()


def test_python_dash_m_is_the_same_cli() -> None:
    runs = [
        subprocess.run([*prefix, "launch", "--help"], capture_output=True, text=True, timeout=60)
        for prefix in ([sys.executable, "-m", "xpukit"], [sys.executable, "-m", "xpukit.cli.main"])
    ]
    assert runs[0].returncode == runs[1].returncode == 0
    assert runs[0].stdout == runs[1].stdout and "--devices SPEC" in runs[0].stdout
