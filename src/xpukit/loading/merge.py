"""Carrying out a plan's ``merge``: the adapter merged into full-precision base weights at load.

:func:`xpukit.loading.load.carry_out` calls :func:`merge_kwargs` before ``from_pretrained`` and
:func:`merge_adapter` where it would otherwise attach the adapter. For
``"dequantized"`` the base is loaded in 4-bit exactly as ``quantize="4bit"`` training loads it,
then every 4-bit layer is dequantised with transformers' ``model.dequantize()`` (bitsandbytes'
``dequantize_4bit``); for ``"original"`` the checkpoint's weights are used as they are. Then peft's
``PeftModel.from_pretrained`` and ``merge_and_unload`` give a plain transformers model. The
decision is :func:`xpukit.planning.training.merge.plan_merge`
(docs/merging.md "Merging an adapter").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xpukit import _quiet
from xpukit.errors import InvalidRequestError
from xpukit.loading.bnb_cpu import restore_trainable_4bit_layout
from xpukit.loading.lora import apply_lora
from xpukit.planning.device.quant_configs import quantization_config
from xpukit.planning.device.quantization import require_bnb

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from xpukit.planning.loadplan import LoadPlan

__all__ = ["merge_adapter", "merge_kwargs"]


def merge_kwargs(plan: LoadPlan, kwargs: dict[str, object]) -> dict[str, object]:
    """``from_pretrained``'s keywords for the merge: the 4-bit config that rebuilds the trained-on base.

    Raises:
        MissingExtraError: ``"dequantized"`` needs bitsandbytes (``pip install "xpukit[quant]"``).
    """
    merge = plan.merge
    if merge is None or merge.quantization_config is None:
        return kwargs
    from xpukit._compat import require
    from xpukit.errors import MissingExtraError

    try:
        require_bnb("4bit")
    except MissingExtraError as exc:
        raise MissingExtraError(
            "merge=True (into the dequantised 4-bit base)",
            "bitsandbytes",
            "quant",
            found=exc.found,
            requirement=exc.requirement,
            detail="Or merge='original' for an adapter trained on the full-precision base.",
        ) from None
    require("peft", "merge=True")
    return {**kwargs, "quantization_config": quantization_config(merge.quantization_config)}


def merge_adapter(model: PreTrainedModel, plan: LoadPlan) -> tuple[PreTrainedModel, list[str]]:
    """Merge the plan's adapter into ``model`` (the loaded base); returns the plain model and notes.

    Raises:
        InvalidRequestError: the adapter does not fit the model (peft's message), or something of it
            was left unmerged.
    """
    import torch

    merge = plan.merge
    if merge is None or plan.lora is None:
        raise InvalidRequestError("merge_adapter: the plan has no merge (plan_load(..., merge=True)).")
    notes: list[str] = []
    dtype = getattr(torch, merge.dtype)
    if merge.base == "dequantized":
        # A layout repacked for CPU inference cannot be dequantised; only a restore is worth a note.
        notes += [n for n in restore_trainable_4bit_layout(model) if n.startswith("restored")]
        layers = _count(model, "Linear4bit")
        if layers == 0:
            raise InvalidRequestError(
                f"merge='dequantized': the base {plan.model!r} loaded with no 4-bit layer to dequantise. "
                "Fix: merge='original'."
            )
        with _quiet.quiet_transformers():  # its "modules are dequantized" warning: the note below says it
            model = model.dequantize(dtype=dtype)
        left = _count(model, "Linear4bit")
        if left:
            raise InvalidRequestError(f"merge='dequantized': {left} 4-bit layers were not dequantised.")
        notes.append(
            f"rebuilt the trained-on base: {layers} linear layers quantised to nf4 (double quantisation) "
            f"and dequantised to {merge.dtype} by bitsandbytes (transformers' model.dequantize)"
        )
    peft_model, loaded = apply_lora(
        model, plan.lora, compute_dtype=merge.dtype, quantized=False, device=plan.device
    )
    notes += loaded
    lora_layers = sum(1 for m in peft_model.modules() if hasattr(m, "lora_A") and len(m.lora_A) > 0)
    merged = peft_model.merge_and_unload()
    leftover = [n for n, m in merged.named_modules() if hasattr(m, "lora_A")]
    if leftover or hasattr(merged, "peft_config"):
        raise InvalidRequestError(
            f"merge: peft left {len(leftover)} LoRA layers unmerged ({', '.join(leftover[:3])}). Fix: "
            "merge='original', or report the adapter's adapter_config.json."
        )
    merged.eval()
    into = "the dequantised 4-bit base" if merge.base == "dequantized" else "the original weights"
    notes.append(
        f"merged {lora_layers} LoRA layers into {into} with peft's merge_and_unload on {merge.device} in "
        f"{merge.dtype}: a plain {type(merged).__name__}"
    )
    return merged, notes


def _count(model: torch.nn.Module, class_name: str) -> int:
    return sum(1 for m in model.modules() if type(m).__name__ == class_name)
