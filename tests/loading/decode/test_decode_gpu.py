"""xpukit's decode loop compiled on a GPU: the same tokens as eager, one graph, CUDA graphs, warm caches.

Run with ``scripts/test -m gpu`` (or ``pytest -m gpu tests/loading/decode/test_decode_gpu.py``) on a CUDA
or XPU
machine. The model is the tiny qwen3 in float32, whose greedy logits are checked to be far from ties
first (``MIN_MARGIN``), so equal tokens mean equal loops. On CUDA the step is compiled with
``mode="reduce-overhead"`` (CUDA graphs), on XPU with ``mode="default"`` (docs/decode.md "XPU").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from xpukit.loading.decode.attention import use_grouped_decode_attention
from xpukit.loading.decode.buckets import prompt_length, window_length
from xpukit.loading.decode.install import install_decode_loop
from xpukit.planning.device.decode import compile_settings

pytestmark = pytest.mark.gpu

PROMPTS = ["the quick brown fox", "a", "when the bell rings in the morning", "bread"]
NEW = 24
MIN_MARGIN = 1e-3  # float32 compiled vs eager differ by ~1e-5 in the logits


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "xpu"


def _mode(device: str) -> str:
    return "reduce-overhead" if device == "cuda" else "default"


def _model(path, device):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.padding_side = "left"
    return tok


def _inputs(tokenizer, prompts, device):
    return {k: v.to(device) for k, v in tokenizer(prompts, return_tensors="pt", padding=True).items()}


@pytest.mark.parametrize("step_graphs", [True, False], ids=["own-step-graph", "inductor-graphs"])
def test_compiled_step_gives_the_eager_tokens_without_recompiling(
    tiny_model, tokenizer, tmp_path, step_graphs
):
    import torch

    device = _device()
    if step_graphs and device != "cuda":
        pytest.skip("xpukit captures its own decode step graph on CUDA only")
    eager = _model(tiny_model, device)
    install_decode_loop(eager, max_cache_len=256, compile_options=None)
    compiled = _model(tiny_model, device)
    if step_graphs:  # what fast_decode runs on CUDA: grouped attention over windows, captured prefills
        use_grouped_decode_attention(compiled)
    loop = install_decode_loop(
        compiled,
        max_cache_len=256,
        compile_options=compile_settings("default" if step_graphs else _mode(device)),
        cache_dir=tmp_path,
        step_graphs=step_graphs,
    )
    loop.window_smallest = 16  # windows of 32 and 64 slots in one call (a 16-token prompt bucket)
    calls: list[tuple[int, int]] = []  # (batch, prompt tokens) of every compiled call
    torch._dynamo.reset()
    reference = _model(tiny_model, device)
    counters = torch._dynamo.utils.counters
    for batch in (1, 4):
        inputs = _inputs(tokenizer, PROMPTS[:batch], device)
        with torch.no_grad():
            scored = reference.generate(
                **inputs,
                max_new_tokens=NEW,
                do_sample=False,
                cache_implementation="static",
                disable_compile=True,
                output_scores=True,
                return_dict_in_generate=True,
            )
        top = torch.stack(scored.scores, 1).topk(2, -1).values
        assert (top[..., 0] - top[..., 1]).min().item() > MIN_MARGIN
        want = eager.generate(**inputs, max_new_tokens=NEW, do_sample=False)
        assert want.tolist() == scored.sequences.tolist()  # the loop, eager, is transformers' result
        got = compiled.generate(**inputs, max_new_tokens=NEW, do_sample=False)
        calls.append(tuple(inputs["input_ids"].shape))
        assert compiled.xpukit_last_decode["compiled"] is True
        assert got.tolist() == want.tolist()
    graphs = counters["stats"]["unique_graphs"]
    skips = counters["inductor"]["cudagraph_skips"]
    for prompts in (PROMPTS[2:3], PROMPTS[1:2]):  # other prompt lengths, batch 1 again
        inputs = _inputs(tokenizer, prompts, device)
        want = eager.generate(**inputs, max_new_tokens=NEW, do_sample=False)
        assert compiled.generate(**inputs, max_new_tokens=NEW, do_sample=False).tolist() == want.tolist()
        calls.append(tuple(inputs["input_ids"].shape))
    assert counters["stats"]["unique_graphs"] == graphs  # no recompile for a new prompt length
    assert counters["graph_break"] == {} or sum(counters["graph_break"].values()) == 0
    if device == "cuda" and not step_graphs:
        assert counters["inductor"]["cudagraph_skips"] == skips == 0  # the step was captured
    if step_graphs:
        keys, captures, replays = _expected_graphs(calls)
        assert set(loop.step_graphs._graphs) == keys
        assert loop.step_graphs.stats == {
            "captures": captures,
            "replays": replays,
            "dropped": 0,
            "uncaptured_while_building": 0,
        }
    assert loop.graphs == {(1, "greedy"), (4, "greedy")}
    # Sampling compiles its own step and stays seeded.
    inputs = _inputs(tokenizer, PROMPTS[:4], device)
    torch.manual_seed(0)
    first = compiled.generate(**inputs, max_new_tokens=8, do_sample=True, top_k=5)
    torch.manual_seed(0)
    assert compiled.generate(**inputs, max_new_tokens=8, do_sample=True, top_k=5).tolist() == first.tolist()
    assert compiled.generate(**inputs, max_new_tokens=8, do_sample=True, top_k=5).tolist() != first.tolist()


def _expected_graphs(calls: list[tuple[int, int]]) -> tuple[set[Any], int, int]:
    """The captures a run of ``calls`` makes: per call, the prefill of its prompt bucket, then a step
    per new token in its window; a key's first run is a warm run, its second captures and replays,
    every later one replays."""
    seen: dict[Any, int] = {}
    for batch, tokens in calls:
        bucket = prompt_length(tokens, 256 - NEW)
        keys = [((batch, 256), "prefill-greedy", bucket)]
        keys += [((batch, 256), "greedy", window_length(bucket + i, 256, 16)) for i in range(1, NEW)]
        for key in keys:
            seen[key] = seen.get(key, 0) + 1
    captured = {key for key, runs in seen.items() if runs >= 2}
    return captured, len(captured), sum(runs - 1 for runs in seen.values())


_CHILD = textwrap.dedent(
    """
    import json, sys, time, torch
    from xpukit.loading.load import load_for_xpu
    start = time.perf_counter()
    model = load_for_xpu(sys.argv[1], fast_decode=True, warmup=True)
    warm = next(e.actual for e in model.xpukit_plan.events if e.what == "warmup")
    counters = torch._dynamo.utils.counters
    print(json.dumps({"load_and_warmup_s": time.perf_counter() - start, "warmup": warm,
                      "graphs": counters["stats"]["unique_graphs"],
                      "inductor": dict(counters["inductor"]), "aot": dict(counters["aot_autograd"])}))
    """
)


def test_a_second_process_loads_the_compile_cache(tiny_model, tmp_path):
    env = dict(os.environ, XPUKIT_CACHE_DIR=str(tmp_path / "xpukit"))

    def child(name):
        # A fresh inductor and triton cache per process: only xpukit's cache can carry graphs over.
        run_env = env | {
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{name}"),
            "TRITON_CACHE_DIR": str(tmp_path / f"triton-{name}"),
        }
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(tiny_model)],
            env=run_env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    # fast_decode=True is tiered (docs/decode.md "Tiered decoding"): the warm-up waits for the compiled
    # step, built ahead of time and saved; a second process loads it whole: dynamo traces nothing.
    first = child("first")
    [record] = first["warmup"]["compile_cache"]
    assert first["warmup"]["compiled"] is True and record["how"] == "compiled" and record["saved"] is True
    second = child("second")
    [record] = second["warmup"]["compile_cache"]
    assert record["how"] == "loaded", record
    assert second["graphs"] == 0 and second["inductor"].get("fxgraph_cache_miss", 0) == 0
