"""xpukit never turns on ``trust_remote_code`` (or transformers' ``allow_all_kernels``) itself
(docs/security.md §1).

Two proofs: a scan of every module's syntax tree for a true value given to either flag, and the
keyword arguments that really reach ``from_pretrained``, over plans of every kind.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, ClassVar

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "xpukit"
FLAGS = ("trust_remote_code", "allow_all_kernels")


def _truthy_constant(node: ast.AST | None) -> bool:
    """A literal that is true (``True``, ``1``, ``"yes"``): the only way to turn a flag on by itself."""
    return isinstance(node, ast.Constant) and bool(node.value)


def flag_settings(tree: ast.AST) -> list[tuple[int, str]]:
    """Every place a flag gets a true literal: keyword, dict entry, assignment, setdefault/update."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg in FLAGS and _truthy_constant(node.value):
            found.append((node.value.lineno, f"{node.arg}=True"))
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value in FLAGS and _truthy_constant(value):
                    found.append((key.lineno, f"{{{key.value!r}: True}}"))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                name = (
                    target.slice.value
                    if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant)
                    else target.attr
                    if isinstance(target, ast.Attribute)
                    else target.id
                    if isinstance(target, ast.Name)
                    else None
                )
                if name in FLAGS and _truthy_constant(node.value):
                    found.append((node.lineno, f"{name} = True"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"setdefault", "__setitem__"}
            and len(node.args) == 2
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in FLAGS
            and _truthy_constant(node.args[1])
        ):
            found.append((node.lineno, f"{node.func.attr}({node.args[0].value!r}, True)"))
    return found


def test_no_module_sets_trust_remote_code() -> None:
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 40
    offenders = [
        f"{path.relative_to(SRC)}:{line}: {what}"
        for path in files
        for line, what in flag_settings(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not offenders, offenders


@pytest.mark.parametrize(
    ("code", "caught"),
    [
        ("f(trust_remote_code=True)", True),
        ("kw = {'trust_remote_code': True}", True),
        ("kw['trust_remote_code'] = True", True),
        ("kw.setdefault('allow_all_kernels', True)", True),
        ("self.trust_remote_code = 1", True),
        ("f(trust_remote_code=trust_remote_code)", False),
        ("f(trust_remote_code=bool(kwargs.get('trust_remote_code', False)))", False),
        ("f(trust_remote_code=False)", False),
    ],
)
def test_the_scan_finds_what_it_looks_for(code: str, caught: bool) -> None:
    assert bool(flag_settings(ast.parse(code))) is caught


class _Stop(Exception):
    """Raised by the fake model class once it has seen from_pretrained's keywords."""


class _Recorder:
    seen: ClassVar[list[dict[str, Any]]] = []

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        cls.seen.append(kwargs)
        raise _Stop


@pytest.mark.parametrize(
    ("request_", "facts"),
    [
        ({}, None),
        ({"quantize": "4bit", "lora": True, "seed": 3}, None),
        ({"dtype": "bfloat16", "attn": "eager", "kernels": False}, None),
        ({"quantize": "auto", "lora": {"r": 4}}, "h100"),
        ({"attn": "flash_attention_2", "kernels": True}, "max-1550"),
        ({"max_memory": {0: "8GiB", "cpu": "64GiB"}}, "arc-b580"),
    ],
)
def test_from_pretrained_never_gets_trust_remote_code_unless_asked(
    tiny_model: Path, request_: dict[str, Any], facts: str | None
) -> None:
    from xpukit.loading.load import carry_out
    from xpukit.planning.plan import plan_load

    plan = plan_load(tiny_model, facts=facts, **request_)
    for flag in FLAGS:
        assert flag not in plan.from_pretrained_kwargs()
        assert flag not in plan.to_dict()["from_pretrained_kwargs"]
    if facts is None:  # this machine: what really reaches from_pretrained
        _Recorder.seen.clear()
        with pytest.raises(_Stop):
            carry_out(plan, model_class=_Recorder)
        (kwargs,) = _Recorder.seen
        assert not set(FLAGS) & set(kwargs), kwargs


@pytest.mark.parametrize("value", [True, False])
def test_a_users_trust_remote_code_goes_through_unchanged(tiny_model: Path, value: bool) -> None:
    from xpukit.planning.plan import plan_load

    plan = plan_load(tiny_model, device="cpu", trust_remote_code=value)
    assert plan.from_pretrained_kwargs()["trust_remote_code"] is value
