"""The examples in the docstrings run on a CPU, offline, and print what they say.

Every module of ``src/xpukit`` whose docstrings carry ``>>>`` examples is found and run with
``doctest``, so the API pages (docs/api.md, built from these docstrings) never show an example that
does not run, and a new module's examples are checked without being listed anywhere.
"""

from __future__ import annotations

import contextlib
import doctest
import importlib
import importlib.util
import io
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def _modules_with_examples() -> list[str]:
    found = []
    for path in sorted((SRC / "xpukit").rglob("*.py")):
        if ">>> " in path.read_text(encoding="utf-8"):
            parts = list(path.relative_to(SRC).with_suffix("").parts)
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


MODULES = _modules_with_examples()
# Examples that load a model (transformers, peft): several seconds on a 2-core CPU.
_SLOW = {"xpukit.loading.load"}


def test_the_public_entry_points_carry_examples() -> None:
    for name in (
        "xpukit.planning.plan",
        "xpukit.select.devices",
        "xpukit.training.keywords",
        "xpukit._platform",
    ):
        assert name in MODULES


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW else n for n in MODULES]
)
def test_docstring_examples_run(name: str) -> None:
    if importlib.util.find_spec("deepspeed") is not None:
        # deepspeed prints "Setting accelerator to CPU" to stdout when first imported (peft imports it
        # during a LoRA load): import it here so that line is not taken for an example's output.
        with contextlib.redirect_stdout(io.StringIO()):
            importlib.import_module("deepspeed")
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    assert result.failed == 0, (
        f"{result.failed} of {result.attempted} examples in {name} failed (output above)"
    )
