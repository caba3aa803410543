"""Every ```python block of the README and docs/ runs on a CPU, offline, as a reader would run it;
so does every ``xpukit plan`` line on a built-in shape and every ``xpukit launch --dry-run`` line
with a named backend (the command lines that need no device, no model download and no script).

A page's blocks run in order in one fresh process (later blocks use what earlier ones made, as in
the text), in an empty working directory, with the Hub ids the pages use standing for the suite's
tiny Qwen3 (the same calls, a model that is built offline). A block that cannot run on a CPU says
so in the line right above it, ``<!-- not run: the reason -->``; that is the only way out, so a new
block is tested unless its page says why not. Steps and lengths are the pages' own, kept small.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The Hub ids the pages use, run as the tiny model: same architecture, built offline.
HUB_IDS = ("Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B")
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
_NOT_RUN = re.compile(r"<!-- not run: (.+?) -->\s*$")


def blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, why not run)`` for every python block of ``page``."""
    text = page.read_text(encoding="utf-8")
    out = []
    for m in _BLOCK.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _NOT_RUN.search(before)
        out.append((text.count("\n", 0, m.start()) + 1, m.group(1), skip.group(1) if skip else None))
    return out


PAGES_WITH_CODE = [p for p in PAGES if blocks(p)]


def test_every_skipped_block_says_why() -> None:
    assert PAGES_WITH_CODE, "no python blocks found: the pattern is wrong"
    for page in PAGES_WITH_CODE:
        for line, _, why in blocks(page):
            assert why is None or len(why) > 10, f"{page.name}:{line}: say why the block cannot run"


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: p.name)
def test_the_pages_code_runs(page: Path, demo_model: Path, tmp_path: Path) -> None:
    program = []
    for line, code, why in blocks(page):
        if why is not None:
            continue
        for hub_id in HUB_IDS:
            code = code.replace(repr(hub_id).replace("'", '"'), repr(str(demo_model)))
        program.append(f"# {page.name}:{line}\n{code}")
    if not program:
        pytest.skip(f"every block of {page.name} says why it cannot run on a CPU")
    script = tmp_path / "page.py"
    script.write_text("\n".join(program), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=280, env=env
    )
    assert proc.returncode == 0, f"{page.name}: a block failed\n{proc.stderr[-4000:]}"


_SHELL_BLOCK = re.compile(r"^```(?:console|bash|sh|shell)\n(.*?)^```$", re.S | re.M)


def command_lines() -> list[tuple[str, list[str]]]:
    """``(where, argv)`` of the documented ``xpukit`` lines that run anywhere, offline."""
    from xpukit.planning.model.reference_models import REFERENCE_CONFIGS

    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for block in _SHELL_BLOCK.finditer(text):
            body = block.group(1).replace("\\\n", " ")  # a command continued over lines is one line
            for n, line in enumerate(body.splitlines()):
                words = shlex.split(line.removeprefix("$ "), comments=True)
                if words[:1] != ["xpukit"] or len(words) < 3 or ">" in words:
                    continue
                runs_anywhere = (words[1] == "plan" and words[2].lower() in REFERENCE_CONFIGS) or (
                    words[1] == "launch" and "--dry-run" in words and "--backend" in words
                )
                if runs_anywhere:
                    where = f"{page.name}:{text.count(chr(10), 0, block.start()) + 2 + n}"
                    found.append((where, words[1:]))
    return found


def test_the_documented_command_lines_run() -> None:
    from xpukit.cli.main import main

    lines = command_lines()
    assert len(lines) >= 6, lines  # the pattern still finds the pages' plan and launch lines
    for where, argv in lines:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        assert code == 0, f"{where}: xpukit {shlex.join(argv)} exited {code}: {err.getvalue()[-2000:]}"
