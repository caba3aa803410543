"""torchao int4/int8 on a GPU: the plan's format loads, stays close to bf16, and fast_decode keeps tokens.

Run with ``pytest -m gpu tests/loading/decode/test_serve_quant_gpu.py`` on a CUDA or XPU machine with torchao
(``xpukit[serve]``). The model is the tiny qwen3 widened so torchao's int4 groups (128) divide every
projection; it runs in bfloat16, the dtype tinygemm (CUDA) takes. Greedy tokens of the quantized
fast path are compared with the same quantized model's plain ``generate`` only along steps whose
logits are far from ties (checked first), so equal tokens mean equal paths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

# bf16 on a GPU: the two paths' logits differ by rounding (~1e-2); a step closer than this to a tie
# could flip either way, so the comparison stops before the first such step.
MIN_MARGIN = 0.125
FORMATS = {
    ("cuda", "4bit"): ("torchao int4 (tile_packed_to_4d)", "Int4TilePackedTo4dTensor"),
    ("xpu", "4bit"): ("torchao int4 (plain_int32)", "Int4PlainInt32Tensor"),
    ("cuda", "8bit"): ("torchao int8", "Int8Tensor"),
    ("xpu", "8bit"): ("torchao int8", "Int8Tensor"),
}


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "xpu"


def _ids(device: str) -> Any:
    import torch

    return torch.arange(3, 3 + 7 * 12, 7).remainder(1000).unsqueeze(0).to(device)


@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_quantized_fast_path_on_the_gpu(wide_model: Path, bits: str) -> None:
    import torch

    from xpukit import load_for_xpu

    device = _device()
    label, tensor = FORMATS[(device, bits)]
    plain = load_for_xpu(str(wide_model), device=device, dtype="bfloat16", quantize=bits)
    assert plain.xpukit_plan.decision("quantization").value == label
    assert type(plain.model.layers[0].mlp.down_proj.weight).__name__ == tensor
    reference = load_for_xpu(str(wide_model), device=device, dtype="bfloat16")
    with torch.no_grad():
        got, want = plain(_ids(device)).logits[0, -1].float(), reference(_ids(device)).logits[0, -1].float()
    assert float((got - want).norm() / want.norm()) < (0.3 if bits == "4bit" else 0.05)

    new = 16
    with torch.no_grad():
        out = plain.generate(
            _ids(device),
            max_new_tokens=new,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    top = torch.stack(out.scores, 1)[0].float().topk(2, -1).values
    clear = int(((top[:, 0] - top[:, 1]) > MIN_MARGIN).long().cumprod(0).sum())
    assert clear >= 4, "the model's greedy path is too close to ties to compare"
    fast = load_for_xpu(
        str(wide_model), device=device, dtype="bfloat16", quantize=bits, fast_decode=True, warmup=True
    )
    decision = fast.xpukit_plan.decision("fast_decode")
    assert decision.value["compile"] == ("reduce-overhead" if device == "cuda" else False)
    tokens = fast.generate(_ids(device), max_new_tokens=new, do_sample=False)
    prompt = _ids(device).shape[1]
    assert tokens[0, : prompt + clear].tolist() == out.sequences[0, : prompt + clear].tolist()
