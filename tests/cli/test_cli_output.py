"""``--json``: standard output is xpukit's JSON alone (cli/output.py); other libraries' words go to stderr."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xpukit.cli.output import emit_json, reserved_stdout


def test_prints_handlers_and_descriptor_writes_go_to_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    """The three ways a library reaches stdout, arranged: a logging handler made on ``sys.stdout``
    before the command (DeepSpeed's, when it was imported earlier), a handler made during it, a
    ``print`` and a write to file descriptor 1 (a C extension)."""
    before = logging.getLogger("xpukit-test-chatty-before")
    before.addHandler(logging.StreamHandler(sys.stdout))
    during = logging.getLogger("xpukit-test-chatty-during")
    try:
        with reserved_stdout(True):
            before.warning("Setting accelerator to CPU")
            during.addHandler(logging.StreamHandler(sys.stdout))
            during.warning("a handler made during the command")
            print("a print")
            sys.stdout.flush()
            os.write(1, b"a write to descriptor 1\n")
            emit_json({"ok": True})
        out, err = capfd.readouterr()
        assert json.loads(out) == {"ok": True}
        for line in ("Setting accelerator", "made during", "a print", "descriptor 1"):
            assert line in err
        print("after")  # everything is back
        before.warning("back on stdout")
        assert capfd.readouterr().out == "after\nback on stdout\n"
    finally:
        before.handlers.clear()
        during.handlers.clear()


def test_without_json_nothing_changes(capfd: pytest.CaptureFixture[str]) -> None:
    with reserved_stdout(False):
        print("plain")
        emit_json([1])
    assert capfd.readouterr().out == "plain\n[\n  1\n]\n"


def _json_stdout(*argv: str) -> object:
    """Run ``xpukit ARGV`` in a fresh process (where DeepSpeed, if installed, is imported during the
    command and logs to stdout) and parse its stdout as JSON."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "xpukit.cli.main", *argv], capture_output=True, text=True, env=env, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize(
    "argv",
    [
        ("doctor", "--json"),
        ("plan", "qwen3-0.6b", "--assume", "arc-b580", "--json"),
        ("launch", "--devices", "all", "--backend", "xpu", "--dry-run", "--json", "--", "python", "x.py"),
    ],
    ids=["doctor", "plan", "launch"],
)
def test_every_json_command_prints_json_alone(argv: tuple[str, ...]) -> None:
    # merge --json: tests/loading/test_merge.py::test_cli_dtype_json_and_tokenizer_from_the_adapter; demo
    # --json trains, and goes through the same reserved_stdout in cli/main.py.
    assert isinstance(_json_stdout(*argv), dict)


def test_plan_json_of_a_local_model(tiny_model: Path) -> None:
    data = _json_stdout("plan", str(tiny_model), "--json")
    assert isinstance(data, dict) and data["from_pretrained_kwargs"]["use_kernels"] is False
