"""The fused 4-bit LoRA path on a peft model (``lora={"fused": True}``), proven at load.

:func:`apply_fused_lora` finds every decoder block of a ``PeftModel`` over a bitsandbytes 4-bit base,
matches its attention and MLP to the plan's block shapes, and routes the matching LoRA projections
through :mod:`xpukit.kernels.lora_ops` (the patched forwards: :mod:`.fused_blocks`). Then it proves
each distinct block type: the first block of the type runs once on the fused path and once on
peft's, forward and LoRA gradients compared (:mod:`.fused_check`). A type that disagrees gets peft's
forwards back in all its blocks, and the measured difference goes into the notes (the plan's
events); with ``insist`` it is refused with it.

The model stays a plain ``PeftModel``: only module ``forward`` attributes change, not parameters or
module names, so ``save_pretrained`` writes the same adapter files.

liger-kernel (applied before peft, :mod:`xpukit.loading.training.liger`) patches the MLP's
``forward`` with its SwiGLU/GeGLU; the fused MLP replaces that forward (the same arithmetic, with the
adapters inside), so on a fused MLP the fused path wins. liger's RMSNorm and fused linear
cross-entropy are untouched.

A mixture-of-experts MLP (Qwen3-MoE, Mixtral) has no 4-bit projections to fuse: its expert weights
are 3-D parameters, which bitsandbytes leaves unquantised and peft adapts as parameters; it keeps
transformers' expert code with peft's adapters, and the notes say so. Its attention is fused.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from xpukit.errors import InvalidRequestError
from xpukit.kernels.lora_ops import liger_gate_available
from xpukit.loading.training.fused_blocks import (
    MARK,
    block_shape,
    group_problem,
    identify_activation,
    is_block,
    patch_attention,
    patch_mlp,
    shape_problem,
    unpatch,
)
from xpukit.loading.training.fused_check import block_key, check_blocks, describe
from xpukit.planning.training.fused import ATTENTION_SHAPES, MLP_SHAPES, BlockShape

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PreTrainedModel

__all__ = ["apply_fused_lora", "fused_everywhere"]

logger = logging.getLogger(__name__)

_ACT_WORDS = {"silu": "", "gelu_tanh": " with GELU (tanh)", "gelu": " with GELU"}


@dataclass(slots=True)
class _Block:
    name: str
    module: torch.nn.Module  # a decoder block: self_attn and mlp
    attention: BlockShape | None = None
    mlp: BlockShape | None = None
    act: str = "silu"
    experts: bool = False


def apply_fused_lora(
    model: PeftModel | PreTrainedModel, *, insist: bool, liger: bool | None = None, check: bool = True
) -> list[str]:
    """Route the 4-bit LoRA projections of ``model``'s decoder blocks through the fused functions.

    Args:
        model: a ``PeftModel`` made by peft over a bitsandbytes 4-bit model.
        insist: raise instead of keeping peft's path when a 4-bit LoRA projection cannot be fused or
            a block type's check disagrees.
        liger: the gated step of the fused MLP in liger-kernel's Triton kernels where they run
            (CUDA/XPU, liger-kernel installed); ``False`` keeps it in PyTorch (``lora={"liger": False}``).
        check: prove each newly fused block type against peft's block (docs/fused-lora.md "The
            load-time check"); ``False`` only for measuring the check itself.

    Returns:
        Notes: what was fused, what kept peft's path with the reason, and the check's measurements.

    Raises:
        InvalidRequestError: ``insist`` and some block could not be fused, or a check disagreed.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kept: dict[str, list[str]] = defaultdict(list)
    blocks = [_Block(n, m) for n, m in base.named_modules() if is_block(m)]
    if not blocks:
        kept[f"no decoder block with self_attn and mlp in this {type(base).__name__}"].append("model")
    new: list[_Block] = []
    for block in blocks:
        _classify(block, kept)
        parts = ((block.attention, block.module.self_attn), (block.mlp, block.module.mlp))
        if any(shape is not None and not getattr(part, MARK, False) for shape, part in parts):
            new.append(block)
    if insist and kept:
        raise InvalidRequestError(
            f'lora={{"fused": True}} asked for the fused 4-bit LoRA path on this {type(base).__name__} '
            f"(model type {_model_type(base)!r}), but it cannot fuse {_kept_text(kept)}. The fused path "
            "needs q/k/v/o_proj (or qkv_proj/o_proj) and gate/up/down_proj (or gate_up_proj/down_proj, "
            "SiLU or GELU) as LoRA layers over bitsandbytes nf4 with lora_dropout=0, no DoRA, no bias "
            'adapters and one active adapter. Use those settings, or lora={"fused": False} (peft\'s '
            'path) or leave "fused" out (automatic).'
        )
    liger_on = liger is not False
    for block in new:
        attn, mlp = block.module.self_attn, block.module.mlp
        if block.attention is not None and not getattr(attn, MARK, False):
            patch_attention(attn, block.attention)
        if block.mlp is not None and not getattr(mlp, MARK, False):
            patch_mlp(mlp, block.mlp, act=block.act, liger=liger_on)
    notes: list[str] = []
    if check and new:
        notes.append(_prove(base, new, blocks, insist, kept))
    notes.insert(0, _summary(blocks, kept))
    if liger_on and _gate_device(new) in ("cuda", "xpu") and liger_gate_available():
        # Only where the gated step really runs in liger's kernels (the blocks fused by this call
        # are on CUDA/XPU): on the CPU it runs in PyTorch whether liger-kernel is installed or not.
        notes.append(
            "fused MLP: SwiGLU/GeGLU (tanh) in liger-kernel's Triton kernels; it supersedes liger's "
            "MLP forward on these blocks"
        )
    logger.info("fused LoRA: %s", "; ".join(notes))
    return notes


def _gate_device(new: list[_Block]) -> str | None:
    """The device type of the first MLP this call fused (``None``: it fused no MLP)."""
    for block in new:
        if block.mlp is not None:
            weight = getattr(block.module.mlp, block.mlp.projections[-1]).get_base_layer().weight
            return str(weight.device.type)
    return None


def fused_everywhere(model: PeftModel | PreTrainedModel) -> bool:
    """Whether every decoder block of ``model`` runs its attention and MLP on the fused path."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    blocks = [m for _, m in base.named_modules() if is_block(m)]
    return bool(blocks) and all(
        getattr(b.self_attn, MARK, False) and getattr(b.mlp, MARK, False) for b in blocks
    )


def _classify(block: _Block, kept: dict[str, list[str]]) -> None:
    """Set the block's fusable shapes; record in ``kept`` what keeps peft's path and why."""
    attn, mlp = block.module.self_attn, block.module.mlp
    shape = block_shape(attn, ATTENTION_SHAPES)
    if getattr(attn, MARK, False):
        block.attention = shape
    elif shape is None:
        kept[f"attention: {shape_problem(attn, ATTENTION_SHAPES)}"].append(block.name)
    elif (problem := group_problem(attn, shape.projections)) is not None:
        kept[f"attention: {problem}"].append(block.name)
    else:
        block.attention = shape
    shape = block_shape(mlp, MLP_SHAPES)
    if getattr(mlp, MARK, False):
        block.mlp = shape
        return
    if shape is None:
        if hasattr(mlp, "experts"):
            block.experts = True
        else:
            kept[f"MLP: {shape_problem(mlp, MLP_SHAPES)}"].append(block.name)
        return
    problem = group_problem(mlp, shape.projections)
    act, why = identify_activation(mlp)
    if problem is None and act is None:
        problem = why
    if problem is not None:
        kept[f"MLP: {problem}"].append(block.name)
        return
    block.mlp, block.act = shape, str(act)


def _prove(
    base: PreTrainedModel, new: list[_Block], blocks: list[_Block], insist: bool, kept: dict[str, list[str]]
) -> str:
    """Check each newly fused block type; unfuse the types that disagree (recorded in ``kept``), or
    refuse them (``insist``)."""
    groups: dict[str, list[tuple[str, torch.nn.Module]]] = defaultdict(list)
    for block in new:
        groups[block_key(block.module)].append((block.name, block.module))
    checks = check_blocks(base, dict(groups), _compute_dtype(new[0]))
    bad = [c for c in checks if not c.agrees]
    for c in bad:
        for name, module in groups[c.kind]:
            unpatch(module)
            kept["the load-time check: the fused block differs from peft's"].append(name)
            for block in blocks:
                if block.name == name:
                    block.attention = block.mlp = None
    if insist and bad:
        raise InvalidRequestError(
            f'lora={{"fused": True}} asked for the fused 4-bit LoRA path, but on this model it does not '
            f"compute what peft's modules compute: {describe(bad)}. Use lora={{\"fused\": False}} (peft's "
            'path) or leave "fused" out (the blocks that agree are fused, the others keep peft\'s path).'
        )
    back = "".join(f"; kept peft's path for {c.kind}" for c in bad)
    return "fused LoRA check: " + describe(checks) + back


def _compute_dtype(block: _Block) -> torch.dtype | None:
    attn = block.module.self_attn
    part, shape = (attn, block.attention) if block.attention is not None else (block.module.mlp, block.mlp)
    assert shape is not None
    base = getattr(part, shape.projections[0]).get_base_layer()
    dtype: torch.dtype | None = base.compute_dtype or base.weight.quant_state.dtype
    return dtype  # None: bitsandbytes takes the input's


def _model_type(base: object) -> str | None:
    model_type: str | None = getattr(getattr(base, "config", None), "model_type", None)
    return model_type


def _words(shape: BlockShape) -> str:
    names = [p.removesuffix("_proj") for p in shape.projections]
    return ", ".join(["/".join(names[:-1]), names[-1]]) if shape.part == "attention" else "/".join(names)


def _summary(blocks: list[_Block], kept: dict[str, list[str]]) -> str:
    n = len(blocks)
    attn = [b for b in blocks if b.attention is not None]
    mlp = [b for b in blocks if b.mlp is not None]
    aw = _words(attn[0].attention) if attn and attn[0].attention else "q/k/v, o"
    mw = (_words(mlp[0].mlp) + _ACT_WORDS.get(mlp[0].act, "")) if mlp and mlp[0].mlp else "gate/up/down"
    if len(attn) == len(mlp) == n > 0:
        head = f"fused LoRA: {n} decoder blocks ({aw}, {mw})"
    elif attn or mlp:
        head = (
            f"fused LoRA: attention ({aw}) in {len(attn)} and MLP ({mw}) in {len(mlp)} of {n} decoder blocks"
        )
    else:
        head = "fused LoRA: nothing fused"
    experts = [b for b in blocks if b.experts]
    if experts:
        head += (
            f"; the MLP of {len(experts)} blocks is a mixture of experts: transformers' expert code with "
            "peft's adapters on the unquantised 3-D expert weights (no 4-bit projections to fuse)"
        )
    return head + (f"; kept peft's path for {_kept_text(kept)}" if kept else "")


def _kept_text(kept: dict[str, list[str]]) -> str:
    parts = []
    for reason, names in kept.items():
        where = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"
        parts.append(f"{where} ({reason})")
    return "; ".join(parts)
