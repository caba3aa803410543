"""bitsandbytes' CPU repacking of 4-bit weights, and how xpukit undoes it (docs/known-issues.md
"bitsandbytes: CPU repacking of 4-bit weights").

On a CPU with avx512_bf16, ``Linear4bit.forward`` repacks its weight into a CPU-only layout on the
first eval-mode, no-grad forward (e.g. ``generate()``). That layout has no autograd kernel: LoRA
layers trained on top of it get exactly zero gradients for q/k/v/gate/up, while the loss still falls
a little, so nobody notices. :func:`restore_trainable_4bit_layout` undoes the repacking and turns it
off for the layers of a model that is about to be trained.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from xpukit.errors import DeviceUnavailableError

if TYPE_CHECKING:
    import torch
    from bitsandbytes.nn import Linear4bit

__all__ = ["keep_trained_4bit_numerics", "restore_trainable_4bit_layout"]


def restore_trainable_4bit_layout(model: torch.nn.Module) -> list[str]:
    """Undo bitsandbytes' CPU inference repacking and keep it from happening again.

    ``Linear4bit.forward`` repacks its weight for ``gemv_4bit`` on the first eval-mode, no-grad
    forward on an avx512_bf16 CPU (bitsandbytes 0.48+). Training through that layout gives zero
    input gradients. The inverse is bitsandbytes' own ``_convert_weight_packed_for_cpu_inverse``
    (what ``Params4bit.cuda()/.xpu()`` and ``_save_to_state_dict`` use); its absmax is bf16-rounded,
    as in bitsandbytes' own save path.
    """
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return []  # no bitsandbytes layer can exist without the module imported
    linear4bit = bnb.nn.Linear4bit
    restored = 0
    for name, module in model.named_modules():
        if not isinstance(module, linear4bit):
            continue
        state = getattr(module.weight, "quant_state", None)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            try:
                _unpack_cpu_weight(module)
            except Exception as exc:  # a private bitsandbytes API: refuse loudly rather than train on zeros
                raise DeviceUnavailableError(
                    f"The 4-bit layer {name} was repacked by bitsandbytes for CPU inference (an eval-mode "
                    f"forward such as generate() ran before LoRA was applied) and could not be restored "
                    f"({type(exc).__name__}: {exc}). Training it would give zero LoRA gradients. Fix: "
                    "load the model fresh and apply LoRA before any generate()/eval forward."
                ) from exc
            restored += 1
    guarded = _no_cpu_repacking(model, linear4bit)
    notes = []
    if restored:
        notes.append(
            f"restored {restored} 4-bit weights that bitsandbytes had repacked for CPU inference "
            "(their layout has no backward: LoRA gradients would have been zero)"
        )
    if guarded:
        notes.append(
            f"turned off bitsandbytes' CPU inference repacking on {guarded} 4-bit layers so that "
            "evaluation or generate() during training cannot break the gradients"
        )
    return notes


def keep_trained_4bit_numerics(model: torch.nn.Module) -> list[str]:
    """A trained adapter loaded to run on a 4-bit base: no CPU repacking, so it computes as it trained.

    The repacked layout rounds each block's scale to bf16 (docs/known-issues.md "bitsandbytes: CPU
    repacking of 4-bit weights"): on the tiny models that alone moved 2 % of the argmaxes away from
    the model the adapter trained in (docs/training.md "Loading an adapter").
    """
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return []
    guarded = _no_cpu_repacking(model, bnb.nn.Linear4bit)
    if not guarded:
        return []
    return [
        f"turned off bitsandbytes' CPU inference repacking on {guarded} 4-bit layers: its bf16-rounded "
        "scales are not the weights the adapter trained on"
    ]


def _no_cpu_repacking(model: torch.nn.Module, linear4bit: type[Linear4bit]) -> int:
    """Turn bitsandbytes' CPU repacking off on every 4-bit layer on the CPU; how many it was on for."""
    guarded = 0
    for module in model.modules():
        if not isinstance(module, linear4bit):
            continue
        if getattr(module, "support_avx512bf16_for_cpu", False) and module.weight.device.type == "cpu":
            # The flag only gates the repacking in forward(); off, eval forwards (generate, Trainer
            # evaluation) use the ordinary dequantise path and training keeps working after them.
            module.support_avx512bf16_for_cpu = False
            guarded += 1
    return guarded


def _unpack_cpu_weight(module: Linear4bit) -> None:
    import torch
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

    weight = module.weight
    state = weight.quant_state
    was_nested = bool(getattr(state, "original_nested", state.nested))
    data, state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
    if not was_nested and state.absmax.dim() == 2:
        # The inverse (bitsandbytes 0.50.2) restores absmax only for double-quantised states; a plain
        # one stays in the repacked [K/blocksize, N] bf16 layout. Back to the flat fp32 vector.
        state.absmax = state.absmax.T.reshape(-1).to(torch.float32)
    weight.data = data
    weight.quant_state = state
    if getattr(module, "quant_state", None) is not None:
        module.quant_state = state
