"""Other libraries' import-time messages stay behind verbose (xpukit/_quiet.py): proved with a fake
noisy library in a fresh interpreter, and with the real ones (whatever they print) on a 4-bit plan
and CPU load of a tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# A stand-in for a library that speaks on import in every way one can: a bare logger (Python's
# last-resort handler prints it), a logger with its own handler, print on both streams, a warning.
FAKE = """
import logging, sys, warnings
logging.getLogger("deepspeed.fake").warning("FAKE-LOG bare logger")
own = logging.getLogger("deepspeed.own")
own.addHandler(logging.StreamHandler(sys.stdout))
own.propagate = False
own.warning("FAKE-OWN own handler")
print("FAKE-PRINT stdout")
print("FAKE-PRINT stderr", file=sys.stderr)
warnings.warn("FAKE-WARN deprecated", FutureWarning)
"""

SCRIPT = """
import logging, sys, warnings
import xpukit._quiet as q
filters, out, err = list(warnings.filters), sys.stdout, sys.stderr
call = logging.Logger.callHandlers
with q.quiet_imports():
    import deepspeed
assert (list(warnings.filters), sys.stdout, sys.stderr) == (filters, out, err)
assert logging.Logger.callHandlers is call and q._FINDER not in sys.meta_path
print("COLLECTED", len(q.collected()))
logging.getLogger("deepspeed.own").warning("AFTER own handler")  # the library's later messages show
"""


def _run(code: str, tmp_path: Path, *, verbose: bool) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(SRC)]), "HF_HUB_OFFLINE": "1"}
    env.pop("XPUKIT_VERBOSE", None)
    if verbose:
        env["XPUKIT_VERBOSE"] = "1"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.mark.parametrize("verbose", [False, True])
def test_a_noisy_import_is_quiet_unless_verbose(tmp_path: Path, verbose: bool) -> None:
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text(FAKE)
    done = _run(SCRIPT, tmp_path, verbose=verbose)
    assert done.returncode == 0, done.stderr
    both = done.stdout + done.stderr
    marks = ("FAKE-LOG", "FAKE-OWN", "FAKE-PRINT stdout", "FAKE-PRINT stderr", "FAKE-WARN")
    said = [m for m in marks if m in both]
    if verbose:
        assert len(said) == 5 and "COLLECTED 0" in done.stdout
    else:
        assert said == [] and "COLLECTED 5" in done.stdout
    # The handler the library made during the quiet import writes to the real stdout afterwards.
    assert "AFTER own handler" in done.stdout


REAL = """
import json, sys
from importlib.util import find_spec
import xpukit
from xpukit import _quiet
tiny, lora = sys.argv[1], sys.argv[2] == "1"
xpukit.plan_load(tiny, quantize="4bit", lora=lora, device="cpu")
model = xpukit.load_for_xpu(tiny, quantize="4bit", lora=lora, device="cpu")
notes = [e.actual for e in model.xpukit_plan.events if e.what == "kernels"]
said = [r.getMessage().splitlines()[0][:60] for r in _quiet.collected()]
heavy = [m for m in ("peft", "bitsandbytes", "torchao") if m in sys.modules]
with open(sys.argv[3], "w") as f:
    json.dump({"notes": notes, "collected": said, "imported": heavy}, f)
"""


def test_4bit_plan_and_cpu_load_print_nothing_from_other_libraries(tiny_model: Path, tmp_path: Path) -> None:
    lora = find_spec("bitsandbytes") is not None and find_spec("peft") is not None
    if not lora and find_spec("torchao") is None:
        pytest.skip("a 4-bit CPU load needs bitsandbytes + peft (QLoRA) or torchao")
    quiet, loud = tmp_path / "quiet.json", tmp_path / "loud.json"
    code = REAL.replace("sys.argv[1]", repr(str(tiny_model)))
    code = code.replace("sys.argv[2]", repr("1" if lora else "0"))
    done = _run(code.replace("sys.argv[3]", repr(str(quiet))), tmp_path, verbose=False)
    assert done.returncode == 0, done.stderr
    facts = json.loads(quiet.read_text())
    assert done.stdout == ""
    # Only xpukit's own note may show (bitsandbytes' slower CPU path, once) — nothing else.
    shown = [line for line in done.stderr.splitlines() if line.strip()]
    assert all(line in facts["notes"] for line in shown), shown
    assert len(shown) <= 1
    loud_run = _run(code.replace("sys.argv[3]", repr(str(loud))), tmp_path, verbose=True)
    assert loud_run.returncode == 0, loud_run.stderr
    # What the quiet run collected, the verbose run shows (whatever the installed libraries say).
    for message in facts["collected"]:
        assert message.strip()[:40] in loud_run.stdout + loud_run.stderr, message
    assert json.loads(loud.read_text())["collected"] == []
