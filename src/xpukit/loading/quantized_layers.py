"""How many linear layers a torchao load really quantized (acting records what ran).

torchao's weight-only configs skip a layer whose shape its kernel cannot take (an input width that is
not a multiple of the group size, for int4), and transformers keeps ``lm_head`` in the compute dtype.
On a 64-wide test model ``quantize="4bit"`` on the CPU quantized 2 of 14 linear layers while the plan
said "torchao int4"; the load now says how many (docs/planning.md "Quantization for inference").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xpukit.planning.vocabulary import LoadEvent

if TYPE_CHECKING:
    import torch

__all__ = ["quantized_layers_event"]


def quantized_layers_event(model: torch.nn.Module, what: str) -> LoadEvent:
    """A note of how many of ``model``'s linear layers hold torchao weights (``what``: the format)."""
    import torch

    linear = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    done = [name for name, m in linear if _is_torchao(getattr(m, "weight", None))]
    kept = [name.rsplit(".", 1)[-1] for name, _ in linear if name not in set(done)]
    text = f"{what}: {len(done)} of {len(linear)} linear layers quantized"
    if kept:
        kinds = sorted(set(kept))
        others = [k for k in kinds if k != "lm_head"]
        text += f"; kept in the compute dtype: {', '.join(kinds[:6])}{' …' if len(kinds) > 6 else ''}"
        if others:  # lm_head stays by transformers' choice; the rest by the kernel's shapes
            shaped = len([k for k in kept if k != "lm_head"])
            text += (
                f" ({shaped} layers of a shape the format's kernel cannot take, e.g. an input width that is "
                "not a multiple of the int4 group size)"
            )
    return LoadEvent(kind="applied", what="quantized_layers", actual=text)


def _is_torchao(weight: object) -> bool:
    """A torchao tensor subclass (its weights are not plain ``torch.Tensor``/``Parameter`` data)."""
    import torch

    if weight is None:
        return False
    data = getattr(weight, "data", weight)
    return type(data) is not torch.Tensor and type(data).__module__.startswith("torchao")
