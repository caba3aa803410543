"""Error hierarchy, missing-extra messages, and the promise that `import xpukit` stays light."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

import xpukit
from xpukit import _compat
from xpukit.errors import (
    DeviceSelectionError,
    DeviceUnavailableError,
    InvalidRequestError,
    MissingExtraError,
    PlanError,
    RuntimeAlreadyInitializedError,
    XpukitError,
)

HEAVY = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "kernels", "huggingface_hub")


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (InvalidRequestError, ValueError),
        (DeviceSelectionError, ValueError),
        (MissingExtraError, ImportError),
        (DeviceUnavailableError, RuntimeError),
        (RuntimeAlreadyInitializedError, RuntimeError),
        (PlanError, RuntimeError),
    ],
)
def test_every_error_is_an_xpukit_error_and_its_builtin(cls: type[Exception], builtin: type) -> None:
    assert issubclass(cls, XpukitError) and issubclass(cls, builtin)


def test_public_names_are_sorted_and_exported() -> None:
    assert xpukit.__all__ == sorted(xpukit.__all__, key=str.lower) or xpukit.__all__ == sorted(xpukit.__all__)
    for name in xpukit.__all__:
        assert hasattr(xpukit, name), name


def test_missing_extra_names_the_pip_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compat, "installed_version", lambda package: None)
    with pytest.raises(MissingExtraError, match=r'pip install "xpukit\[quant\]"') as info:
        _compat.require("bitsandbytes", 'quantize="4bit"')
    assert 'quantize="4bit" needs bitsandbytes>=0.48' in str(info.value)
    assert info.value.extra == "quant"


def test_too_old_extra_names_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compat, "installed_version", lambda package: "0.47.0")
    monkeypatch.setattr(_compat, "is_installed", lambda module: True)
    with pytest.raises(MissingExtraError, match=r"0\.47\.0 is installed, but bitsandbytes>=0\.48") as info:
        _compat.require("bitsandbytes", "4-bit on XPU")
    assert 'pip install "bitsandbytes>=0.48"' in str(info.value)


def test_require_returns_the_installed_version() -> None:
    assert _compat.require("peft", "lora=True") == _compat.installed_version("peft")


def _fresh_python(body: str, result: str = "None") -> tuple[Any, list[str]]:
    """Run ``body`` in a new interpreter; the JSON value of the expression ``result`` there, and the
    :data:`HEAVY` modules that were imported."""
    heavy = f"[m for m in {HEAVY!r} if m in sys.modules]"
    code = f"import sys, json\n{body}\nprint(json.dumps([{result}, {heavy}]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    value, imported = json.loads(out.stdout)
    return value, imported


def test_import_xpukit_imports_nothing_heavy() -> None:
    body = (
        "import xpukit, xpukit.cli.main\n"
        "import xpukit.doctor.checks, xpukit.machine.profiles, xpukit.machine.precision"
    )
    assert _fresh_python(body)[1] == []


def test_every_public_module_imports_nothing_heavy() -> None:
    """Importing any xpukit module (not calling it) must stay torch-free."""
    body = (
        "import pkgutil, importlib, xpukit\n"
        "mods = [m.name for m in pkgutil.walk_packages(xpukit.__path__, 'xpukit.')]\n"
        "for m in mods: importlib.import_module(m)"
    )
    mods, heavy = _fresh_python(body, "sorted(mods)")
    assert len(mods) > 5
    assert heavy == []


def test_cli_help_lists_commands_without_heavy_imports() -> None:
    body = (
        "import contextlib, io\n"
        "from xpukit.cli.main import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])"
    )
    text, heavy = _fresh_python(body, "buf.getvalue()")
    assert all(command in text for command in ("doctor", "plan", "launch", "demo"))
    assert heavy == []


def test_plan_cli_checks_every_argument_before_heavy_imports() -> None:
    # `xpukit plan qwen3-8b --train 4x` took 5 s (transformers, torch, peft) to say the syntax is wrong.
    bad = [
        ["--train", "4x"],
        ["--train", "0x512"],
        ["--rank", "0/0"],
        ["--rank", "3/2"],
        ["--dtype", "fp8"],
        ["--assume", "rtx-9090"],
        ["--max-memory", "0=lots"],
        ["--strategy", "zz"],
        ["--quantize", "3bit"],
        ["--headroom", "much"],
        ["--device", "gpu"],
    ]
    body = (
        "import contextlib, io\n"
        "from xpukit.cli.main import main\n"
        "out = []\n"
        f"for extra in {bad!r}:\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        out.append([main(['plan', 'qwen3-8b', *extra]), err.getvalue()])\n"
        "listed = io.StringIO()\n"
        "with contextlib.redirect_stdout(listed):\n"
        "    out.append([main(['plan', '--assume', 'list']), listed.getvalue()])"
    )
    results, heavy = _fresh_python(body, "out")
    assert heavy == []
    *errors, (listed_code, listed) = results
    for extra, (code_, err) in zip(bad, errors, strict=True):
        assert code_ == 1 and err.startswith("xpukit plan: error:"), (extra, err)
    assert "torchrun" not in errors[2][1] and "R one of 0..W-1" in errors[2][1]
    assert listed_code == 0 and "arc-b580" in listed and "max-1550" in listed


def test_cli_error_is_one_line_with_exit_1() -> None:
    code = (
        "import sys\n"
        "from xpukit.cli import main as m\n"
        "from xpukit.errors import InvalidRequestError\n"
        "def boom(args): raise InvalidRequestError('bad thing; fix: do X')\n"
        "p = m.build_parser\n"
        "def patched():\n"
        "    parser = p()\n"
        "    parser.set_defaults(command='boom', run=boom)\n"
        "    return parser\n"
        "m.build_parser = patched\n"
        "sys.exit(m.main([]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stderr.strip() == "xpukit boom: error: bad thing; fix: do X"


def test_a_package_installed_later_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """After `%pip install X` (the fix a MissingExtraError names) the next call must see X."""
    from importlib import metadata

    answers = iter([metadata.PackageNotFoundError("late-package"), "1.0"])

    def version(name: str) -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(_compat.metadata, "version", version)
    assert _compat.installed_version("late-package") is None
    assert _compat.installed_version("late-package") == "1.0"
    assert _compat.installed_version("late-package") == "1.0"  # found versions are cached
