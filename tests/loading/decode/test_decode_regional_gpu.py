"""Regional compilation of xpukit's decode step on a GPU (docs/decode-kernels.md "Regional compilation").

Run with ``pytest -m gpu tests/loading/decode/test_decode_regional_gpu.py`` on a CUDA or XPU machine. A
6-layer
tiny qwen3 in float32, whose greedy logits are checked to be far from ties first (``MIN_MARGIN``),
loaded with ``fast_decode="regional"`` and with ``fast_decode=True``: the same tokens as plain
``generate``, one decoder layer compiled once (``fast_decode=True`` is tiered: its first call is the
first tier's, the whole step built on a thread). Each load's first call is recorded in the test's
output, not asserted: timing belongs in bench/.
"""

from __future__ import annotations

import time

import pytest

from xpukit.loading.load import load_for_xpu

pytestmark = pytest.mark.gpu

LAYERS = 6
NEW = 16
PROMPTS = ["the quick brown fox", "when the bell rings in the morning", "x y"]
MIN_MARGIN = 1e-3  # float32 compiled against eager: ~1e-5 apart in the logits


@pytest.fixture(scope="module")
def deep_model(tiny_model_factory):
    return tiny_model_factory("qwen3", num_hidden_layers=LAYERS)


def test_regional_gives_plain_tokens_and_compiles_one_layer(deep_model, capsys):
    import torch
    from torch._dynamo.utils import counters
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(deep_model)
    tok.padding_side = "left"
    plain = load_for_xpu(deep_model, dtype="float32", fast_decode=False)
    inputs = {k: v.to(plain.device) for k, v in tok(PROMPTS, return_tensors="pt", padding=True).items()}
    with torch.no_grad():
        ref = plain.generate(
            **inputs, max_new_tokens=NEW, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
    top = torch.stack(ref.scores, 1).topk(2, -1).values
    assert (top[..., 0] - top[..., 1]).min().item() > MIN_MARGIN
    want = ref.sequences.tolist()
    firsts = {}
    for asked in ("regional", True):
        torch._dynamo.reset()
        counters.clear()
        model = load_for_xpu(deep_model, dtype="float32", fast_decode=asked)
        assert model.xpukit_plan.decode.regional == (asked == "regional")
        start = time.perf_counter()
        got = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
        firsts[str(asked)] = round(time.perf_counter() - start, 2)
        assert got.tolist() == want
        assert model.xpukit_last_decode["loop"] == "xpukit" and model.xpukit_last_decode["compiled"]
        assert model.xpukit_last_decode.get("regional", False) == (asked == "regional")
        loop = model.xpukit_decode_loop
        if asked == "regional":  # compiled in its first call: one layer's graph
            assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]
        else:  # tiered: the first call was the first tier's; the whole step is built on a thread
            assert loop.tiered and loop.tiers.wait(600), loop.tiers.events
        assert model.generate(**inputs, max_new_tokens=NEW, do_sample=False).tolist() == want
        assert not counters["recompiles"]
    with capsys.disabled():
        said = "regional: with its compile; True: tiered"
        print(f"\nfirst generate() ({LAYERS} layers, batch 3; {said}): {firsts}")
