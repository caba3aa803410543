"""The package layout is the architecture: facts → plan → act, and imports only point down.

Stages, lowest first (docs/index.md#architecture-facts--plan--act):

0. base: ``xpukit.errors``, ``xpukit._compat``, ``xpukit._environ``, ``xpukit.hub``,
   ``xpukit._platform`` (with ``xpukit._win32``), ``xpukit._partial``
1. ``xpukit.machine`` — what the machine is (facts, probe, profiles, precision); ``xpukit.sources``
   — the request's files read before planning (a trained adapter's)
2. ``xpukit.select`` (device selection) and ``xpukit.planning`` (deciding) — side by side, neither
   imports the other
3. ``xpukit.loading`` — carrying a plan out (``load_for_xpu``, LoRA, liger, the bitsandbytes fix)
4. ``xpukit.training`` — arguments for ``Trainer``
5. ``xpukit.demo``, ``xpukit.doctor`` — the applications
6. ``xpukit.cli`` — the command line
7. ``xpukit.__main__`` — ``python -m xpukit``

Inside ``xpukit.planning`` the sub-wings have their own order: the vocabulary and budgets at the
bottom, then ``planning.model`` (what the model is), ``planning.device`` (where it goes and how it
runs there), ``planning.training`` (how it trains), and the plan that gathers them on top.

The test reads every module's imports from its syntax tree (function-level and ``TYPE_CHECKING``
imports included) and fails on any import that points up, sideways between two wings, or that
closes a circle between modules (the circle is named).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "xpukit"

STAGES: dict[str, int] = {
    "xpukit.errors": 0,
    "xpukit._compat": 0,
    "xpukit._environ": 0,
    "xpukit._quiet": 0,
    "xpukit.hub": 0,
    "xpukit._platform": 0,
    "xpukit._win32": 0,
    "xpukit._partial": 0,
    "xpukit.machine": 1,
    "xpukit.sources": 1,
    "xpukit.select": 2,
    "xpukit.planning": 2,
    "xpukit.kernels": 2,
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


# Sub-wings of planning, lowest first (docs/index.md "Architecture: facts → plan → act").
PLANNING_LEVELS: dict[str, int] = {
    "xpukit.planning.budgets": 0,
    "xpukit.planning.vocabulary": 0,
    "xpukit.planning.model": 1,
    "xpukit.planning.device": 2,
    "xpukit.planning.training": 3,
    "xpukit.planning.loadplan": 4,
    "xpukit.planning.for_training": 4,
    "xpukit.planning.arguments": 4,
    "xpukit.planning.request": 5,
    "xpukit.planning.stage_values": 5,
    "xpukit.planning.stages": 6,
    "xpukit.planning.plan": 7,
}


def _planning_level(module: str) -> int | None:
    for prefix in sorted(PLANNING_LEVELS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return PLANNING_LEVELS[prefix]
    return None


def test_every_planning_module_has_a_level() -> None:
    names = [_module_name(p) for p in MODULES if _module_name(p).startswith("xpukit.planning.")]
    assert [n for n in names if _planning_level(n) is None] == [], "add them to PLANNING_LEVELS"


@pytest.mark.parametrize(
    "path", [p for p in MODULES if _module_name(p).startswith("xpukit.planning.")], ids=_module_name
)
def test_planning_sub_wings_point_down(path: Path) -> None:
    importer = _module_name(path)
    here = _planning_level(importer)
    wrong = []
    for line, target in _imports(path):
        there = _planning_level(target)
        if there is None or here is None or target.startswith(importer):
            continue
        same_wing = target.split(".")[:3] == importer.split(".")[:3]
        if there > here or (there == here and not same_wing and here > 0):
            wrong.append(f"line {line}: {target} (level {there}) from level {here}")
    assert wrong == [], f"{importer} imports up or sideways inside planning:\n" + "\n".join(wrong)


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in MODULES:
        name = _module_name(path)
        graph[name] = {t for _, t in _imports(path) if t != name and _is_module(t)}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle: the strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _cycle_path(graph: dict[str, set[str]], members: list[str]) -> str:
    # One concrete loop through the circle, for the message: a -> b -> ... -> a.
    inside = set(members)
    start = members[0]
    path, seen = [start], {start}
    node = start
    while True:
        nxt = sorted(t for t in graph[node] if t in inside)
        if start in nxt and len(path) > 1:
            return " -> ".join([*path, start])
        fresh = [t for t in nxt if t not in seen]
        if not fresh:
            return " -> ".join([*path, nxt[0]])
        node = fresh[0]
        path.append(node)
        seen.add(node)


def test_no_import_circles() -> None:
    graph = _graph()
    found = circles(graph)
    named = [f"{len(c)} modules: {_cycle_path(graph, c)}" for c in found]
    assert found == [], "import circles (type-only imports count too):\n" + "\n".join(named)


def test_the_circle_finder_names_a_circle() -> None:
    """Not vacuous: a two-module and a three-module circle are found, a chain is not."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert circles(graph) == [["a", "b"], ["c", "d", "e"]]
    assert _cycle_path(graph, ["c", "d", "e"]) == "c -> d -> e -> c"
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_type_only_imports_are_read(tmp_path: Path) -> None:
    fake = tmp_path / "typed.py"
    fake.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from xpukit.planning.loadplan import LoadPlan\n",
        encoding="utf-8",
    )
    assert _imports(fake) == [(3, "xpukit.planning.loadplan")]


# Sub-wings of loading: the training-speed code and the decode code are side by side; neither
# imports the other, and neither imports the top of loading (load.py, lora.py) that calls them.
LOADING_SUB_WINGS = ("xpukit.loading.training", "xpukit.loading.decode")
LOADING_TOP = ("xpukit.loading.load", "xpukit.loading.lora")


@pytest.mark.parametrize(
    "path",
    [p for p in MODULES if _module_name(p).startswith(LOADING_SUB_WINGS)],
    ids=_module_name,
)
def test_loading_sub_wings_stay_apart(path: Path) -> None:
    importer = _module_name(path)
    own = next(w for w in LOADING_SUB_WINGS if importer.startswith(w))
    wrong = [
        f"line {line}: {target}"
        for line, target in _imports(path)
        if (target.startswith(LOADING_SUB_WINGS) and not target.startswith(own))
        or target.startswith(LOADING_TOP)
    ]
    assert wrong == [], f"{importer} imports a sibling sub-wing or the top of loading:\n" + "\n".join(wrong)


def test_loading_has_its_sub_wings() -> None:
    """The training-speed and decode modules live in their sub-wings, not loose in loading/."""
    loose = {p.stem for p in (PACKAGE / "loading").glob("*.py")}
    for moved in (
        "fused_lora",
        "layer_graphs",
        "liger",
        "chunked_loss",
        "offload",
        "decode_loop",
        "compile_cache",
    ):
        assert moved not in loose, f"loading/{moved}.py belongs in a sub-wing (CONTRIBUTING.md)"


# --- functions a reader can hold ------------------------------------------------------------------

MAX_BODY_LINES = 80
# Functions allowed a longer body, each with its reason (at most 3).
LONG_FUNCTIONS: dict[str, str] = {}


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from a function's first statement after its docstring to its last line."""
    body = node.body
    first = body[0] if body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        body = body[1:]
    return 0 if not body else (node.end_lineno or body[0].lineno) - body[0].lineno + 1


def _long_functions(path: Path, limit: int) -> dict[str, int]:
    out: dict[str, int] = {}
    module = _module_name(path) if path.is_relative_to(SRC) else path.stem
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body_lines(node) > limit:
            out[f"{module}.{node.name}"] = body_lines(node)
    return out


def test_no_function_body_is_longer_than_a_reader_can_hold() -> None:
    assert len(LONG_FUNCTIONS) <= 3, "the allow-list is for a few named exceptions"
    found: dict[str, int] = {}
    for path in MODULES:
        found.update(_long_functions(path, MAX_BODY_LINES))
    over = {name: n for name, n in found.items() if name not in LONG_FUNCTIONS}
    assert over == {}, (
        f"function bodies over {MAX_BODY_LINES} lines (docstring excluded): {over}. Split them into named "
        "steps (CONTRIBUTING.md)."
    )
    stale = set(LONG_FUNCTIONS) - set(found)
    assert stale == set(), f"no longer long, drop them from LONG_FUNCTIONS: {sorted(stale)}"


def test_the_length_rule_sees_a_long_body(tmp_path: Path) -> None:
    lines = "\n".join(f"    x{i} = {i}" for i in range(MAX_BODY_LINES + 1))
    (tmp_path / "long.py").write_text(f'def f():\n    """Doc."""\n{lines}\n\ndef g():\n    return 1\n')
    assert _long_functions(tmp_path / "long.py", MAX_BODY_LINES) == {"long.f": MAX_BODY_LINES + 1}


# Planning decides from facts; reading them is machine/'s and sources/'s (docs/index.md "Architecture:
# facts → plan → act"): the config and adapter files (sources/model_config.py, adapter_files.py,
# gathered by planning/request.py), the Hub kernels' cache and reachability (sources/hub_access.py,
# a facts object the deciders are given), transformers' source (machine/library_source.py).
_IO_MODULES = ("huggingface_hub", "requests", "urllib", "xpukit.hub")
_IO_CALLS = {"open", "read_text", "read_bytes", "write_text", "write_bytes", "getenv", "getsource"}


def _reads(tree: ast.AST) -> list[str]:
    """What in a module's syntax tree reads from outside: I/O calls, os.environ, I/O libraries."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            if name in _IO_CALLS:
                found.append(f"{name}() on line {node.lineno}")
        elif isinstance(node, ast.Attribute) and node.attr in {"environ", "environb"}:
            found.append(f"os.{node.attr} on line {node.lineno}")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"import {n} on line {node.lineno}" for n in names if n.startswith(_IO_MODULES)]
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("xpukit.sources"):
                found += [f"{a.name} on line {node.lineno}" for a in node.names if a.name.startswith("read")]
    return found


def test_planning_reads_nothing_itself() -> None:
    """No open(), os.environ, huggingface_hub, requests or urllib under planning/: the request
    (planning/request.py) is the one that gathers the model's config and a trained adapter's files,
    through xpukit/sources/."""
    reading = {}
    for path in MODULES:
        name = _module_name(path)
        if name.startswith("xpukit.planning.") and name != "xpukit.planning.request":
            found = _reads(ast.parse(path.read_text(encoding="utf-8")))
            if found:
                reading[name] = found
    assert reading == {}


def test_the_reading_rule_sees_a_read() -> None:
    code = "import os\nfrom urllib import request\ndef f(p):\n    return open(p).read(), os.environ['X']\n"
    found = _reads(ast.parse(code))
    assert sorted(f.split(" on")[0] for f in found) == ["import urllib", "open()", "os.environ"]


def test_the_formatter_is_on_everywhere() -> None:
    """No formatter skip or off marker in the code: ruff format lays every line out, and a body the
    formatter makes too long is split into named steps instead (CONTRIBUTING.md)."""
    root = SRC.parent
    markers = ("# fmt: " + "skip", "# fmt: " + "off")  # spelled apart: this file holds no marker
    found = [
        f"{path.relative_to(root)}:{number}"
        for folder in ("src", "tests", "bench", "examples")
        for path in sorted((root / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if any(marker in line for marker in markers)
    ]
    assert found == [], f"formatter switched off at {found}"


def test_the_tests_mirror_the_code() -> None:
    """Tests live in folders named as the package they test (``tests/loading/decode/`` for
    ``xpukit.loading.decode``); ``tests/project/`` holds the checks of the repository itself."""
    tests = SRC.parent / "tests"
    assert sorted(p.name for p in tests.glob("test_*.py")) == [], "a test file at the top of tests/"
    for path in sorted(tests.rglob("test_*.py")):
        folder = path.parent.relative_to(tests)
        if folder.parts[:1] == ("project",):
            continue
        package = SRC / "xpukit" / folder
        assert (package / "__init__.py").is_file(), f"{path.relative_to(tests)}: no package xpukit/{folder}"


def test_no_bench_file_is_over_450_lines() -> None:
    """A bench reads as one measurement (CONTRIBUTING.md "A new bench variant"); shared parts live in
    the ``bench/_*.py`` helpers."""
    bench = SRC.parent / "bench"
    long = {p.name: n for p in sorted(bench.glob("*.py")) if (n := len(p.read_text().splitlines())) > 450}
    assert long == {}, f"bench files over 450 lines: {long}"


def test_every_bench_realrun_variant_changes_something() -> None:
    """Each ``xpukit-*`` variant of bench_realrun is in one of its settings tables (or is the plain
    call, or names its trainer in the code): a variant whose entry was renamed away would otherwise
    run the plain call under its name. And every table entry is a variant the command line takes."""
    import ast

    tree = ast.parse((SRC.parent / "bench" / "bench_realrun.py").read_text())
    found: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign) and isinstance(node.value, ast.Dict | ast.Tuple):
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            keys = node.value.keys if isinstance(node.value, ast.Dict) else node.value.elts
            names = {k.value for k in keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            found[target.id if isinstance(target, ast.Name) else ""] = names
    variants = {v for v in found["VARIANTS"] if v.startswith("xpukit")}
    tables = set().union(
        *(found[name] for name in ("XPUKIT_LOAD", "XPUKIT_GRAPHS", "XPUKIT_ARGS", "XPUKIT_ENV"))
    )
    assert variants - tables == {"xpukit", "xpukit-sft"}
    assert tables <= variants


# Where a bare ``Any`` is still the honest type (each commented at its place): keyword arguments
# handed on whole to a function or dataclass that checks them, a transformers config's untyped
# fields, and a decision's value, whose type is each decision's own.
ANY_ALLOWED = {
    "xpukit.loading.load:load_for_xpu:**keywords",
    "xpukit.planning.plan:plan_load:**keywords",
    "xpukit.planning.loadplan:with_events:**changes",
    "xpukit.planning.vocabulary:Decision:value",
    "xpukit.demo.tiny:build_tiny_model:**config_overrides",
}


def _bare_any(tree: ast.AST, module: str) -> list[str]:
    """Every parameter, return or field annotated with a bare ``Any``, as ``module:owner:name``."""

    def is_any(node: ast.expr | None) -> bool:
        return (isinstance(node, ast.Name) and node.id == "Any") or (
            isinstance(node, ast.Attribute) and node.attr == "Any"
        )

    found: list[str] = []
    for owner in ast.walk(tree):
        if isinstance(owner, ast.FunctionDef | ast.AsyncFunctionDef):
            a = owner.args
            named = [*a.posonlyargs, *a.args, *a.kwonlyargs]
            found += [f"{module}:{owner.name}:{p.arg}" for p in named if is_any(p.annotation)]
            found += [f"{module}:{owner.name}:*{p.arg}" for p in [a.vararg] if p and is_any(p.annotation)]
            found += [f"{module}:{owner.name}:**{p.arg}" for p in [a.kwarg] if p and is_any(p.annotation)]
            if is_any(owner.returns):
                found.append(f"{module}:{owner.name}:return")
        elif isinstance(owner, ast.ClassDef | ast.Module):
            name = owner.name if isinstance(owner, ast.ClassDef) else "<module>"
            for node in owner.body:
                if isinstance(node, ast.AnnAssign) and is_any(node.annotation):
                    found.append(f"{module}:{name}:{ast.unparse(node.target)}")
    return found


def test_any_is_kept_for_what_is_really_untyped() -> None:
    """The code says what it takes and returns (``torch.Tensor``, the plan's dataclasses, ``Literal``s,
    ``TypedDict``s, ``Protocol``s); a bare ``Any`` only where a value is really untyped (listed above)."""
    found = {
        item
        for path in sorted(PACKAGE.rglob("*.py"))
        for item in _bare_any(ast.parse(path.read_text(encoding="utf-8")), _module_name(path))
    }
    assert found - ANY_ALLOWED == set(), f"new bare Any annotations: {sorted(found - ANY_ALLOWED)}"
    assert ANY_ALLOWED - found == set(), f"typed now, off the list: {sorted(ANY_ALLOWED - found)}"


def test_the_any_rule_sees_each_kind_of_annotation() -> None:
    code = (
        "import typing\nclass C:\n    v: Any\n"
        "def f(a: Any, *b: typing.Any, c: int = 0, **d: Any) -> Any: ...\n"
        "def g(x: list[Any]) -> int: ...\n"
    )
    found = sorted(_bare_any(ast.parse(code), "m"))
    assert found == ["m:C:v", "m:f:**d", "m:f:*b", "m:f:a", "m:f:return"]
