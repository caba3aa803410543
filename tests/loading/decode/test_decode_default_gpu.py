"""fast_decode="auto" on a GPU: a quantized load to run takes the fast path, and a second process is warm.

Run with ``pytest -m gpu -s tests/loading/decode/test_decode_default_gpu.py`` on a CUDA (or XPU) machine
with torchao
(``xpukit[serve]``); a few minutes, most of it the compiles of the first process. The model is the
tiny qwen3 widened so torchao's int4 groups divide every projection, in bfloat16. Greedy tokens are
compared with the same weights' plain ``generate`` (``fast_decode=False``) along the steps whose top
two logits are at least ``MIN_MARGIN`` apart, on the first tier's call and on the compiled tier's
(docs/decode.md "Tiered decoding"). The second-process test checks that the second process loads the
compiled step saved by the first (no dynamo trace) and prints each call's seconds and tiers (timing is
read, not asserted: bench/bench_decode.py measures it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

MIN_MARGIN = 0.125  # as tests/loading/decode/test_serve_quant_gpu.py: bf16 rounding may swap a closer tie


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "xpu"


@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_a_quantized_load_to_run_is_fast_by_default(wide_model: Path, bits: str) -> None:
    import torch

    from xpukit import load_for_xpu

    device = _device()
    ids = torch.arange(3, 3 + 7 * 12, 7).remainder(1000).unsqueeze(0).to(device)
    plain = load_for_xpu(str(wide_model), quantize=bits, fast_decode=False)
    with torch.no_grad():
        want = plain.generate(
            ids, max_new_tokens=16, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
    del plain
    model = load_for_xpu(str(wide_model), quantize=bits)  # nothing else asked
    decision = model.xpukit_plan.decision("fast_decode")
    assert decision.source == "auto" and decision.value["compile"] in {"default", "reduce-overhead"}
    fused = (
        next(e for e in model.xpukit_plan.events if e.what == "fused_projections")
        if model.xpukit_plan.decode.fused_projections
        else None
    )
    if fused is not None:  # planned where the format slices by rows: CUDA int4 and int8, XPU int8
        assert fused.kind == "applied" and fused.actual["attention"] == fused.actual["blocks"], fused
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=16, do_sample=False)  # tiered: the first tier serves
        first_tiers = model.xpukit_last_decode["tiers"]
        assert model.xpukit_decode_loop.tiers.wait(600), model.xpukit_decode_loop.tiers.events
        compiled = model.generate(ids, max_new_tokens=16, do_sample=False)
    last = model.xpukit_last_decode
    assert last["loop"] == "xpukit" and last["compiled"] and last["step_graphs"] == (device == "cuda")
    assert last["tiers"] == {"prefill": 1, "compiled": 15}, (first_tiers, last)
    top = torch.stack(want.scores, 1).topk(2, -1).values[0]
    steps = int(((top[:, 0] - top[:, 1]) >= MIN_MARGIN).long().cumprod(0).sum())
    assert steps >= 4, f"the model's greedy path is too close to ties to compare ({steps} steps)"
    start = ids.shape[1]
    for out in (got, compiled):
        assert out[:, start : start + steps].tolist() == want.sequences[:, start : start + steps].tolist()


_CHILD = textwrap.dedent(
    """
    import json, sys, time, torch
    from xpukit.loading.load import load_for_xpu
    start = time.perf_counter()
    model = load_for_xpu(sys.argv[1], quantize=sys.argv[2])
    loaded = time.perf_counter() - start
    device = model.device
    ids = torch.arange(3, 99, 3).remainder(1000).unsqueeze(0).to(device)
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=32, do_sample=False)
    getattr(torch, device.type).synchronize()
    first = time.perf_counter() - start
    first_tiers = model.xpukit_last_decode["tiers"]
    start = time.perf_counter()
    built = model.xpukit_decode_loop.tiers.wait(600)  # the step is saved for the next process
    ready = time.perf_counter() - start
    model.generate(ids, max_new_tokens=32, do_sample=False)
    counters = torch._dynamo.utils.counters
    print(json.dumps({"load_s": loaded, "first_call_s": first, "first_tiers": first_tiers, "built": built,
                      "ready_after_s": ready, "last": model.xpukit_last_decode,
                      "cache": model.xpukit_decode_loop.cache_records,
                      "graphs": counters["stats"]["unique_graphs"],
                      "inductor": dict(counters["inductor"])}))
    """
)


@pytest.mark.parametrize("bits", ["4bit"])
def test_a_second_process_finds_the_default_path_in_the_compile_cache(
    wide_model: Path, tmp_path: Path, bits: str, record_property: Any
) -> None:
    def child(name: str) -> dict[str, Any]:
        # A fresh inductor and triton cache per process: only xpukit's cache can carry graphs over.
        env = dict(
            os.environ,
            XPUKIT_CACHE_DIR=str(tmp_path / "xpukit"),
            TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{name}"),
            TRITON_CACHE_DIR=str(tmp_path / f"triton-{name}"),
        )
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(wide_model), bits],
            env=env,
            capture_output=True,
            text=True,
            timeout=540,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = child("first")
    [record] = first["cache"]
    assert first["built"] and record["how"] == "compiled" and record["saved"] is True, record
    assert first["last"]["tiers"] == {"prefill": 1, "compiled": 31}
    second = child("second")
    [record] = second["cache"]
    assert second["built"] and record["how"] == "loaded", record
    assert second["graphs"] == 0  # loaded ahead-of-time: dynamo traced nothing
    assert second["last"]["tiers"] == {"prefill": 1, "compiled": 31}
    seconds = {
        name: {k: round(run[k], 2) for k in ("load_s", "first_call_s", "ready_after_s")}
        | {"first_tiers": run["first_tiers"], "built_s": run["cache"][0].get("seconds")}
        for name, run in (("first", first), ("second", second))
    }
    record_property("first_call", seconds)
    print(f"\n{bits} default load, 32 new tokens, first call by tier and the build: {seconds}")
