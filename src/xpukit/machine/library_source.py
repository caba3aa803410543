"""The installed transformers' source, read as facts: its classes' attributes without importing them,
and the keywords its ``from_pretrained`` takes.

Planning decides from these answers (:mod:`xpukit.planning.model.decoder_layout`,
:func:`xpukit.planning.arguments.check_keywords`) and reads no file itself; each answer is read once
per process, when first asked, like the installed versions of :mod:`xpukit._compat`.

Class attributes:

Importing ``transformers.models.<type>.modeling_<type>`` imports ``transformers.modeling_utils`` and,
through transformers' quantizers, torchao: seconds on a small CPU, for a plan that needs a handful of
literals the class body states (``_supports_sdpa = True``, ``_no_split_modules = [...]``) and the
names in its Hub-kernel decorators. This module parses the installed files with :mod:`ast`
(docs/planning.md "Model facts from the config alone"); what the source does not state as a literal
is reported missing, and the caller then builds the model instead.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from typing import Any, Final

__all__ = ["MISSING", "ModuleSource", "from_pretrained_keywords", "module_source", "pretrained_defaults"]

MISSING: Final[object] = object()  # an attribute the source does not state as a literal


def _transformers_dir() -> Path | None:
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


class ModuleSource:
    """The top-level classes and functions of one parsed source file."""

    def __init__(self, tree: ast.Module) -> None:
        self.classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        self.functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        self.assigns: dict[str, ast.expr] = {}
        for node in tree.body:
            target, value = _assigned(node)
            if target is not None and value is not None:
                self.assigns[target] = value

    def attribute(self, class_name: str, attr: str) -> object:
        """A class attribute's literal value, looked up through the bases defined in this file.

        Returns :data:`MISSING` when neither the class nor its bases here assign it (the value then
        comes from a base elsewhere), or when the assigned value is not a literal.
        """
        node = self.classes.get(class_name)
        if node is None:
            return MISSING
        for statement in node.body:
            target, value = _assigned(statement)
            if target == attr and value is not None:
                try:
                    return ast.literal_eval(value)
                except ValueError:
                    return MISSING
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in self.classes:
                found = self.attribute(base.id, attr)
                if found is not MISSING:
                    return found
        return MISSING

    def decorator_names(self, node: ast.ClassDef | ast.FunctionDef, decorator: str) -> list[Any]:
        """The arguments of every ``@decorator(...)`` on a class or function (names or literals)."""
        out: list[Any] = []
        for dec in node.decorator_list:
            if isinstance(dec, ast.Call) and isinstance(dec.func, ast.Name) and dec.func.id == decorator:
                for arg in dec.args:
                    if isinstance(arg, ast.Constant):
                        out.append(arg.value)
                    elif isinstance(arg, ast.Name):
                        out.append(arg)
                    elif isinstance(arg, (ast.List, ast.Tuple)):
                        out.extend(a for a in arg.elts if isinstance(a, ast.Name))
        return out

    def kernel_names(self, class_name: str) -> set[str] | None:
        """Hub-kernel names a class registers: its ``use_kernel_forward_from_hub`` name and those of
        the functions its ``use_kernelized_func`` names; ``None`` when the class is not in the file."""
        node = self.classes.get(class_name)
        if node is None:
            return None
        names = {n for n in self.decorator_names(node, "use_kernel_forward_from_hub") if isinstance(n, str)}
        for ref in self.decorator_names(node, "use_kernelized_func"):
            func = self.functions.get(ref.id) if isinstance(ref, ast.Name) else None
            if func is None:
                return None  # a function defined elsewhere: not read here
            names.update(
                n for n in self.decorator_names(func, "use_kernel_forward_from_hub") if isinstance(n, str)
            )
        return names

    def mapping_entry(self, mapping: str, key: str) -> str | None:
        """The class name a module-level dict literal maps ``key`` to (``ACT2CLS["silu"]``)."""
        value = self.assigns.get(mapping)
        if not isinstance(value, ast.Dict):
            return None
        for k, v in zip(value.keys, value.values, strict=True):
            if isinstance(k, ast.Constant) and k.value == key:
                if isinstance(v, ast.Tuple) and v.elts:
                    v = v.elts[0]
                if isinstance(v, ast.Name):
                    return v.id
                if isinstance(v, ast.Attribute):
                    return v.attr
        return None


def _assigned(statement: ast.stmt) -> tuple[str | None, ast.expr | None]:
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
        target = statement.targets[0]
        return (target.id if isinstance(target, ast.Name) else None), statement.value
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
        return statement.target.id, statement.value
    return None, None


@functools.cache
def module_source(relative: str) -> ModuleSource | None:
    """The parsed ``transformers/<relative>`` (``models/qwen3/modeling_qwen3.py``), or ``None``."""
    root = _transformers_dir()
    path = None if root is None else root / relative
    if path is None or not path.is_file():
        return None
    try:
        return ModuleSource(ast.parse(path.read_text(encoding="utf-8")))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


@functools.cache
def pretrained_defaults() -> ModuleSource | None:
    """``PreTrainedModel``'s own class attributes (the defaults a model class does not override).

    Only the class header and the attribute block before its first method are parsed: the whole of
    ``modeling_utils.py`` takes 0.14 s to parse on a 2-core CPU, this part a few milliseconds.
    """
    root = _transformers_dir()
    path = None if root is None else root / "modeling_utils.py"
    if path is None or not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    start = text.find("\nclass PreTrainedModel(")
    if start < 0:
        return None
    lines = text[start + 1 :].splitlines()
    body = [lines[0]]
    for line in lines[1:]:
        if line.startswith(("    def ", "    @", "class ", "def ")):
            break
        body.append(line)
    try:
        return ModuleSource(ast.parse("\n".join(body)))
    except SyntaxError:
        return None


@functools.cache
def from_pretrained_keywords() -> tuple[frozenset[str], frozenset[str]] | None:
    """What this transformers' ``from_pretrained`` (``PreTrainedModel``'s and the Auto classes') takes:
    ``(accepted, named)``. ``named``: the signatures and the ``kwargs.pop("...")`` keys, offered as
    "did you mean"; ``accepted`` adds every identifier-like string in their bodies (keys popped in a
    loop, such as the ignored ``low_cpu_mem_usage``), so a keyword transformers takes is never refused.
    ``None`` when the source cannot be read: then nothing is checked.
    """
    import inspect
    import re
    import textwrap

    from transformers import PreTrainedModel
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    named: set[str] = set()
    accepted: set[str] = set()
    for method in (PreTrainedModel.from_pretrained, _BaseAutoModelClass.from_pretrained):
        try:
            source = textwrap.dedent(inspect.getsource(method))
        except (OSError, TypeError):
            return None
        named |= set(inspect.signature(method).parameters) | set(
            re.findall(r"kwargs\.pop\(\s*[\"'](\w+)", source)
        )
        accepted |= {
            node.value
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier()
        }
    named -= {"kwargs", "model_args", "pretrained_model_name_or_path"}
    return frozenset(named | accepted), frozenset(k for k in named if not k.startswith("_"))
