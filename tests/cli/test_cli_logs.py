"""Only xpukit's words under xpukit's name (cli/logs.py): other libraries' records are quiet, shown
under their own names with --verbose, and become xpukit's notes where they matter to the plan."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from xpukit.cli.logs import command_logging, notes_for
from xpukit.cli.main import main

BNB_RECORD = "Failed to load CPU gemm_4bit_forward from kernels-community: not in the local cache"


def _emit() -> None:
    logging.getLogger("xpukit.planning.test").warning("ours")
    logging.getLogger("bitsandbytes.backends.cpu.ops").warning(BNB_RECORD)
    logging.getLogger("kernels.hf_hub").warning("Skipping publisher trust check for 'x/y'")


def test_quiet_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    with command_logging(verbose=False) as collected:
        _emit()
    err = capsys.readouterr().err
    assert "xpukit: WARNING: ours" in err
    assert "gemm_4bit_forward" not in err and "publisher trust" not in err
    assert [r.name for r in collected.records] == ["bitsandbytes.backends.cpu.ops", "kernels.hf_hub"]


def test_verbose_shows_them_under_their_own_names(capsys: pytest.CaptureFixture[str]) -> None:
    with command_logging(verbose=True):
        _emit()
        logging.getLogger("xpukit.planning.test").info("a decision")
    err = capsys.readouterr().err
    assert "xpukit: INFO: a decision" in err
    assert f"bitsandbytes.backends.cpu.ops: WARNING: {BNB_RECORD}" in err
    assert "kernels.hf_hub: WARNING: Skipping publisher trust check" in err
    assert "xpukit: WARNING: Skipping" not in err and "xpukit: WARNING: Failed" not in err


def test_logging_is_restored_after_the_command() -> None:
    root, ours = logging.getLogger(), logging.getLogger("xpukit")
    before = (root.level, list(root.handlers), ours.level, ours.propagate, list(ours.handlers))
    with command_logging(verbose=True):
        assert root.handlers != before[1]
    assert (root.level, list(root.handlers), ours.level, ours.propagate, list(ours.handlers)) == before


def _plan(backend: str, quantization: str | None) -> SimpleNamespace:
    return SimpleNamespace(device=SimpleNamespace(backend=backend), quantization=quantization)


def test_a_record_that_matters_becomes_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    from xpukit import _quiet

    # Only this test's records: an earlier test of the process may have imported bitsandbytes under
    # quieted imports, whose real records the process keeps (_quiet.collected()).
    monkeypatch.setattr(_quiet, "collected", lambda: [])
    with command_logging(verbose=False) as collected:
        _emit()
    [note] = notes_for(collected.records, _plan("cpu", "4bit"))
    assert note.startswith("bitsandbytes could not load its optimised CPU 4-bit kernel")
    assert notes_for(collected.records, _plan("xpu", "4bit")) == []  # the CPU kernel is not used
    assert notes_for(collected.records, _plan("cpu", None)) == []  # nothing 4-bit on the CPU
    assert notes_for([], _plan("cpu", "4bit")) == []


def test_plan_prints_the_note_and_json_carries_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import xpukit.planning.plan as planner

    real = planner.plan_load

    def plan_load(*args: object, **kwargs: object) -> object:
        _emit()  # as bitsandbytes does when peft imports it during planning
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "plan_load", plan_load)
    assert main(["plan", "qwen3-0.6b", "--assume", "cpu", "--quantize", "4bit"]) == 0
    out, err = capsys.readouterr()
    assert "Notes (from other libraries' warnings" in out and "optimised CPU 4-bit kernel" in out
    assert "gemm_4bit_forward" not in err
    assert main(["plan", "qwen3-0.6b", "--assume", "arc-b580", "--json"]) == 0
    assert '"notes": []' in capsys.readouterr().out


def test_the_cli_prints_no_other_librarys_warning_as_its_own() -> None:
    """The reported case: LoRA planning imports peft, which imports bitsandbytes and kernels."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "xpukit", "plan", "qwen3-8b", "--assume", "arc-b580", "--train", "4x512"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    foreign = [
        line
        for line in result.stderr.splitlines()
        if line.startswith("xpukit: WARNING:") and ("kernels-community" in line or "trust check" in line)
    ]
    assert foreign == []
