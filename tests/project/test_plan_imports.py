"""`xpukit plan` reads a config, not modeling code: what it imports, checked in a fresh interpreter.

Structural, not timed (the times are bench/bench_plan.py --cli's): planning a built-in shape or a
local model directory of a family written from its config (docs/planning.md "Model facts from the
config alone") imports no transformers modeling code, and so neither peft, bitsandbytes nor torchao.
A model of another family is still built on the meta device, which shows the check sees the import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# Runs the CLI in-process for each argument list and prints, after each, the heavy modules loaded so
# far. transformers.models.auto.modeling_auto holds the Auto classes' name tables only (which class
# a model_type maps to) and imports no model code.
RUNNER = """
import contextlib, io, json, sys
from xpukit.cli.main import main

def heavy():
    return sorted(
        m for m in sys.modules
        if m in ("transformers.modeling_utils", "peft", "bitsandbytes", "torchao")
        or (m.startswith("transformers.models.") and ".modeling_" in m
            and m != "transformers.models.auto.modeling_auto")
    )

seen = []
for args in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(args)
    seen.append({"args": args, "code": code, "heavy": heavy()})
print(json.dumps(seen))
"""


def test_plan_imports_no_modeling_code(tiny_models: Mapping[str, Path]) -> None:
    cases = [
        ["plan", str(tiny_models["qwen3"])],  # on this machine, whatever it is: a tiny model fits
        ["plan", "qwen3-8b", "--assume", "max-1550"],  # recorded hardware: fits whatever this host has
        ["plan", str(tiny_models["llama"]), "--quantize", "4bit", "--json"],
        ["plan", str(tiny_models["gemma"]), "--dtype", "float16"],
        ["plan", "llama-3.1-70b", "--assume", "max-1550x2", "--rank", "1/2", "--strategy", "fsdp"],
        ["plan", str(tiny_models["gpt2"])],  # not written from its config: built on the meta device
    ]
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1"}
    env.pop("XPUKIT_VERBOSE", None)
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert [s["code"] for s in seen] == [0] * len(cases), seen
    for step in seen[:-1]:
        assert step["heavy"] == [], step
    assert "transformers.modeling_utils" in seen[-1]["heavy"], seen[-1]
    assert "transformers.models.gpt2.modeling_gpt2" in seen[-1]["heavy"], seen[-1]
