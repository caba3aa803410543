"""Tiered decoding on a GPU (docs/decode.md "Tiered decoding"): the compile runs on a thread while the
main thread decodes, captures new shapes and replays; the tokens stay those of the eager loop.

Run with ``pytest -m gpu -s tests/loading/decode/test_decode_tiers_gpu.py`` on a CUDA or XPU machine. The
tiny qwen3
in float32 (greedy logits far from ties: tests/loading/decode/test_decode_gpu.py checks the margin),
compiled with
inductor as the plan compiles it. The calls while the step is built cross new attention windows and
prompt buckets, so the first tier captures (CUDA: ``capture_error_mode="thread_local"``) while the
thread compiles. Each call's seconds and tiers are printed (timing is read, not asserted).
"""

from __future__ import annotations

import time

import pytest

from xpukit.loading.decode.attention import use_grouped_decode_attention
from xpukit.loading.decode.install import install_decode_loop
from xpukit.planning.device.decode import compile_settings

pytestmark = pytest.mark.gpu

PROMPTS = ["the quick brown fox", "a", "when the bell rings in the morning", "bread"]


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "xpu"


def _model(path, device):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    use_grouped_decode_attention(model)
    return model


def test_the_first_tier_serves_and_captures_while_the_step_compiles(tiny_model, tmp_path, record_property):
    import torch
    from transformers import AutoTokenizer

    device = _device()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.padding_side = "left"
    reference = _model(tiny_model, device)
    install_decode_loop(reference, max_cache_len=512, compile_options=None)
    model = _model(tiny_model, device)
    loop = install_decode_loop(
        model,
        max_cache_len=512,
        compile_options=compile_settings("default"),
        cache_dir=tmp_path,
        step_graphs=device == "cuda",
        tiered=True,
    )
    loop.window_smallest = 16  # windows of 16, 32, 64 … slots: new captures along the calls
    runs = []
    for round_ in range(12):
        batch = 1 + round_ % 3
        new = 8 + 12 * (round_ % 4)
        inputs = {k: v.to(device) for k, v in tok(PROMPTS[:batch], return_tensors="pt", padding=True).items()}
        want = reference.generate(**inputs, max_new_tokens=new, do_sample=False)
        start = time.perf_counter()
        got = model.generate(**inputs, max_new_tokens=new, do_sample=False)
        getattr(torch, device).synchronize()
        runs.append((round(time.perf_counter() - start, 3), batch, model.xpukit_last_decode["tiers"]))
        assert got.tolist() == want.tolist(), runs[-1]
        if round_ == 5:
            assert loop.tiers.wait(600), loop.tiers.events
    assert not loop.tiers.events
    assert all("compiled" in tiers for _, _, tiers in runs[-3:]), runs
    record_property("calls", runs)
    print("\ncalls (seconds, batch, tokens by tier):", runs)
    print("builds:", [(r["batch"], r.get("how"), r.get("seconds")) for r in loop.cache_records])
