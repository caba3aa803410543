"""The default merge is the trained model: it merges in the dtype the adapter was trained in.

A QLoRA adapter is trained for a few steps on the tiny Qwen3 (``load_for_xpu(..., quantize="4bit",
lora=..., dtype="bfloat16")`` + ``training_args`` + ``Trainer``, on the CPU), once on the base saved
in float32 and once on the base saved in bfloat16. ``xpukit merge``'s engine with no dtype must then
write a model whose logits, over every position of 64 sequences of 16 tokens, are as close to the
trained ``PeftModel``'s as ``load_for_xpu(base, lora=adapter, merge=True, dtype="bfloat16")``'s
are (and ``merge=True`` with no dtype plans that dtype too). Merged in the
float32 base's own dtype instead, the mean |Δlogit| is several times larger and the argmax agrees
less (docs/merging.md "Merging an adapter").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0}
SEQS, POSITIONS = 64, 16


def _windows(path: Path) -> Any:
    """The corpus as SEQS windows of POSITIONS tokens: every position a real token, no padding."""
    from transformers import AutoTokenizer

    from xpukit.demo.tiny import corpus_lines

    ids = AutoTokenizer.from_pretrained(path)("\n".join(corpus_lines()), return_tensors="pt")["input_ids"]
    return ids[0, : SEQS * POSITIONS].reshape(SEQS, POSITIONS)


def _train(base: Path, out: Path, windows: Any) -> Any:
    """A few steps of QLoRA computing in bf16; the adapter (and its base record) saved to ``out``."""
    from transformers import Trainer, default_data_collator

    from xpukit import load_for_xpu, training_args

    model = load_for_xpu(base, device="cpu", dtype="bfloat16", quantize="4bit", lora=LORA, seed=0)
    data = [{"input_ids": w, "labels": w, "attention_mask": w * 0 + 1} for w in windows[:24]]
    args = training_args(
        model,
        output_dir=str(out / "run"),
        max_steps=3,
        per_device_train_batch_size=8,
        learning_rate=3e-2,
        save_strategy="no",
        report_to=[],
        logging_strategy="no",
        disable_tqdm=True,
    )
    assert args.bf16  # the trained model computes in bf16
    Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator).train()
    model.save_pretrained(out / "adapter")
    for module in model.modules():  # bitsandbytes' CPU repacking off: the kernel training used
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model.eval()


def _logits(model: Any, windows: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(input_ids=windows).logits.float()


def _closeness(logits: Any, trained: Any) -> tuple[float, float]:
    """Mean |Δlogit| and argmax agreement over every position."""
    delta = (logits - trained).abs().mean().item()
    agree = (logits.argmax(-1) == trained.argmax(-1)).float().mean().item()
    return delta, agree


@pytest.mark.parametrize(
    "saved",
    ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)],  # the same either way
)
def test_default_merge_is_the_trained_model(
    saved: str, tiny_model: Path, bf16_base: Path, tmp_path: Path
) -> None:
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from xpukit import load_for_xpu, plan_load
    from xpukit.loading.save_merged import save_merged

    base = tiny_model if saved == "float32" else bf16_base
    windows = _windows(base)
    trained = _logits(_train(base, tmp_path, windows), windows)

    result = save_merged(base, tmp_path / "adapter", tmp_path / "merged")  # what `xpukit merge` runs
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    default = _closeness(_logits(merged, windows), trained)
    adapter = str(tmp_path / "adapter")
    in_process = load_for_xpu(base, device="cpu", dtype="bfloat16", lora=adapter, merge=True)
    reference = _closeness(_logits(in_process, windows), trained)
    assert default[0] <= reference[0] * 1.05 + 1e-6, (default, reference)
    assert default[1] >= reference[1] - 1 / (SEQS * POSITIONS), (default, reference)
    assert default[1] > 0.95, default  # it learned something, and the merge kept it
    assert (result.dtype, result.dtype_from) == ("bfloat16", "record")
    assert result.dtype_reason.startswith("the dtype the adapter was trained in (bfloat16), recorded with it")
    # load_for_xpu(merge=True) follows the record too, whatever the device's own dtype.
    assert plan_load(base, device="cpu", lora=adapter, merge=True).dtype == "bfloat16"
