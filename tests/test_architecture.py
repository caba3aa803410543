"""The package layout is the architecture: facts → plan → act, and imports only point down.

Stages, lowest first (docs/index.md#architecture-facts--plan--act):

0. base: ``xpukit.errors``, ``xpukit._compat``, ``xpukit._environ``, ``xpukit.hub``,
   ``xpukit._platform``
1. ``xpukit.machine`` — what the machine is (facts, probe, profiles, precision)
2. ``xpukit.select`` (device selection) and ``xpukit.planning`` (deciding) — side by side, neither
   imports the other
3. ``xpukit.loading`` — carrying a plan out (``load_for_xpu``, LoRA, liger, the bitsandbytes fix)
4. ``xpukit.training`` — arguments for ``Trainer``
5. ``xpukit.demo``, ``xpukit.doctor`` — the applications
6. ``xpukit.cli`` — the command line
7. ``xpukit.__main__`` — ``python -m xpukit``

The test reads every module's imports from its syntax tree (function-level and ``TYPE_CHECKING``
imports included) and fails on any import that points up, or sideways between two wings.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "xpukit"

STAGES: dict[str, int] = {
    "xpukit.errors": 0,
    "xpukit._compat": 0,
    "xpukit._environ": 0,
    "xpukit.hub": 0,
    "xpukit._platform": 0,
    "xpukit.machine": 1,
    "xpukit.select": 2,
    "xpukit.planning": 2,
    "xpukit.loading": 3,
    "xpukit.training": 4,
    "xpukit.demo": 5,
    "xpukit.doctor": 5,
    "xpukit.cli": 6,
    "xpukit.__main__": 7,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _wing(module: str) -> str | None:
    """The stage entry a module belongs to (``xpukit.planning.plan`` → ``xpukit.planning``)."""
    for prefix in sorted(STAGES, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    return None


def _is_module(name: str) -> bool:
    path = SRC / Path(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("xpukit")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("xpukit"):
            for alias in node.names:  # `from xpukit.planning import plan` imports a module
                sub = f"{node.module}.{alias.name}"
                found.append((node.lineno, sub if _is_module(sub) else node.module))
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_stage() -> None:
    names = [_module_name(p) for p in MODULES if p != PACKAGE / "__init__.py"]
    homeless = [name for name in names if _wing(name) is None]
    assert homeless == [], f"modules outside every stage (add them to STAGES and docs/index.md): {homeless}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_imports_point_down(path: Path) -> None:
    importer = _module_name(path)
    here = _wing(importer)
    if here is None:  # the package root: it imports only xpukit.errors eagerly (test_errors_and_imports)
        return
    wrong = []
    for line, target in _imports(path):
        there = _wing(target)
        if target == "xpukit" or there is None or there == here:
            continue  # the package root (``__version__``), or inside the same wing
        if STAGES[there] > STAGES[here]:
            wrong.append(f"line {line}: {target} (stage {STAGES[there]}) from stage {STAGES[here]}")
        elif STAGES[there] == STAGES[here] > 0:  # the base modules may use each other
            wrong.append(f"line {line}: {target} is a sibling wing of {here}")
    assert wrong == [], f"{importer} imports upward or sideways:\n" + "\n".join(wrong)


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """The rule is not vacuous: an import from planning into loading is found."""
    fake = tmp_path / "bad.py"
    fake.write_text("def f():\n    from xpukit.loading.load import load_for_xpu\n", encoding="utf-8")
    [(line, target)] = _imports(fake)
    assert (line, target) == (2, "xpukit.loading.load")
    assert STAGES[_wing(target) or ""] > STAGES["xpukit.planning"]
