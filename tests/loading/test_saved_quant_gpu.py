"""Quantized checkpoints for CUDA and XPU, written and loaded on such a GPU.

Run with ``pytest -m gpu tests/loading/test_saved_quant_gpu.py`` on a CUDA or XPU machine with torchao
(``xpukit[serve]``). torch packs tile-packed int4 (CUDA) and plain_int32 int4 (XPU) with an operator
of that device only, so these formats are written where they run: ``xpukit merge --quantize int4``
(for this machine's family) writes the packed weights, ``load_for_xpu`` and transformers'
``from_pretrained`` load them without quantizing again, with the same logits as the full-precision
merge quantized at load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

FORMATS = {
    ("cuda", "int4"): ("torchao int4 (tile_packed_to_4d)", "Int4TilePackedTo4dTensor"),
    ("xpu", "int4"): ("torchao int4 (plain_int32)", "Int4PlainInt32Tensor"),
    ("cuda", "int8"): ("torchao int8", "Int8Tensor"),
    ("xpu", "int8"): ("torchao int8", "Int8Tensor"),
}


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "xpu"


@pytest.mark.parametrize("bits", ["int4", "int8"])
def test_a_quantized_merge_loads_as_written_on_the_gpu(
    wide_model: Path, tmp_path: Path, perturbed_adapter: Any, monkeypatch: pytest.MonkeyPatch, bits: str
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from xpukit import load_for_xpu
    from xpukit.loading.save_merged import save_merged

    device = _device()
    label, tensor = FORMATS[(device, bits)]
    perturbed_adapter(wide_model, tmp_path / "adapter", quantize=None)
    common = {"dtype": "bfloat16", "merge": "original", "device": device}
    save_merged(str(wide_model), tmp_path / "adapter", tmp_path / "full", **common)
    result = save_merged(str(wide_model), tmp_path / "adapter", tmp_path / "q", quantize=bits, **common)
    assert result.quantized is not None and result.quantized["on_disk"], result.quantized
    assert result.quantized["format"] == label and result.quantized["for"] == device
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["xpukit_quantized"]["for"] == device and "xpukit_quantize" not in config

    kind = {"int4": "4bit", "int8": "8bit"}[bits]
    at_load = load_for_xpu(str(tmp_path / "full"), device=device, dtype="bfloat16", quantize=kind)
    assert at_load.xpukit_plan.decision("quantization").value == label

    import torchao.quantization as tq

    def no_quantizing(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a saved checkpoint was quantized again at load")

    for cls in (tq.Int4TilePackedTo4dTensor, tq.Int4PlainInt32Tensor, tq.Int8Tensor):
        monkeypatch.setattr(cls, "from_hp", classmethod(no_quantizing))
    saved = load_for_xpu(str(tmp_path / "q"), device=device)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "q", device_map=device)
    assert saved.xpukit_plan.decision("quantization").value == label
    for model in (saved, plain):
        assert type(model.model.layers[0].mlp.down_proj.weight).__name__ == tensor
    ids = torch.arange(3, 3 + 7 * 12, 7).remainder(1000).unsqueeze(0).to(device)
    with torch.no_grad():
        want = at_load(ids).logits.float()
        assert torch.equal(saved(ids).logits.float(), want)  # the same packed weights, the same plan
        got = plain(ids).logits.float()  # transformers alone: no fused projections, bf16 rounding apart
    assert float((got - want).norm() / want.norm()) < 2e-2
