"""The fused 4-bit LoRA path on a peft model (``lora={"fused": True}``).

:func:`apply_fused_lora` finds every decoder block of a ``PeftModel`` over a bitsandbytes 4-bit base
whose attention has ``q_proj``/``k_proj``/``v_proj``/``o_proj`` and whose MLP has
``gate_proj``/``up_proj``/``down_proj``, each a peft LoRA layer over ``bnb.nn.Linear4bit``, and routes
them through :mod:`xpukit.kernels.lora_ops`:

- q/k/v: ``q_proj``'s forward computes all three in one autograd function over the shared input and
  hands ``k`` and ``v`` to ``k_proj``/``v_proj`` when they are called next with the same tensor (the
  attention code between them is left as it is, whatever the family does there). Called with another
  tensor, they run peft's own path.
- ``o_proj``: one projection with its adapter.
- the MLP: its ``forward`` becomes ``down(silu(gate(x)) * up(x))`` in one autograd function, for the
  families whose MLP is exactly that (:data:`SWIGLU_MLP_TYPES`, with a SiLU activation).

The model stays a plain ``PeftModel``: only module ``forward`` attributes change, not parameters or
module names, so ``save_pretrained`` writes the same adapter files. Each patched forward checks on
every call that the adapter is still plain (one active adapter, not disabled, not merged, the same
LoRA modules in place) and otherwise calls the forward it replaced, so ``disable_adapter()``,
``merge_and_unload()`` and ``generate`` keep working.

liger-kernel (applied before peft, :mod:`xpukit.loading.training.liger`) patches the MLP's ``forward`` with
its SwiGLU; the fused MLP replaces that forward (the same arithmetic, with the adapters inside), so
on a fused MLP the fused path wins. liger's RMSNorm and fused linear cross-entropy are untouched.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from xpukit.errors import InvalidRequestError
from xpukit.kernels.lora_ops import (
    Projection,
    liger_swiglu_available,
    lora_linear,
    lora_shared_input,
    lora_swiglu_mlp,
)
from xpukit.planning.training.fused import SILU_NAMES, SWIGLU_MLP_TYPES, mlp_problem

__all__ = ["SWIGLU_MLP_TYPES", "apply_fused_lora", "fused_everywhere"]

logger = logging.getLogger(__name__)

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# Model types whose MLP forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)) (transformers'
# LlamaMLP and its copies in modeling_mistral, modeling_qwen2, modeling_qwen3).

_MARK = "_xpukit_fused_lora"


def apply_fused_lora(model: Any, *, insist: bool, liger: bool | None = None) -> list[str]:
    """Route the 4-bit LoRA projections of ``model``'s decoder blocks through the fused functions.

    Args:
        model: a ``PeftModel`` made by peft over a bitsandbytes 4-bit model.
        insist: raise instead of keeping peft's path when not every block can be fused.
        liger: the SwiGLU step of the fused MLP in liger-kernel's Triton kernels where they run
            (CUDA/XPU, liger-kernel installed); ``False`` keeps it in PyTorch (``lora={"liger": False}``).

    Returns:
        Notes: what was fused, and what kept peft's path with the reason.

    Raises:
        InvalidRequestError: ``insist`` and some block (or every block) could not be fused.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    kept: dict[str, list[str]] = defaultdict(list)
    blocks = [(n, m) for n, m in base.named_modules() if _is_block(m)]
    if not blocks:
        kept[f"no decoder block with self_attn and mlp in this {type(base).__name__}"].append("model")
    fused_attn = fused_mlp = 0
    plans: list[tuple[str, Any, Any]] = []
    for name, block in blocks:
        attn, mlp = block.self_attn, block.mlp
        done_attn, done_mlp = getattr(attn, _MARK, False), getattr(mlp, _MARK, False)
        fused_attn, fused_mlp = fused_attn + done_attn, fused_mlp + done_mlp  # a second call
        attn_problem = None if done_attn else _group_problem(attn, ATTENTION)
        mlp_problem = (
            None if done_mlp else _group_problem(mlp, MLP) or _mlp_shape_problem(mlp, config, model_type)
        )
        if attn_problem:
            kept[f"attention: {attn_problem}"].append(name)
        if mlp_problem:
            kept[f"MLP: {mlp_problem}"].append(name)
        plans.append(
            (name, None if attn_problem or done_attn else attn, None if mlp_problem or done_mlp else mlp)
        )
    if insist and (kept or not blocks):
        raise InvalidRequestError(
            f'lora={{"fused": True}} asked for the fused 4-bit LoRA path on this {type(base).__name__} '
            f"(model type {model_type!r}), but it cannot fuse {_kept_text(kept)}. The fused path needs "
            "q/k/v/o_proj and gate/up/down_proj (SiLU) as LoRA layers over bitsandbytes nf4 with "
            "lora_dropout=0, no DoRA, no bias and one active adapter. Use those settings, or "
            'lora={"fused": False} (peft\'s path) or leave "fused" out (automatic).'
        )
    for _, attn, mlp in plans:
        if attn is not None:
            _patch_attention(attn)
            fused_attn += 1
        if mlp is not None:
            _patch_mlp(mlp, liger=liger is not False)
            fused_mlp += 1
    notes = [_summary(len(blocks), fused_attn, fused_mlp, kept)]
    if fused_mlp and liger is not False and liger_swiglu_available():
        notes.append(
            "fused MLP: SwiGLU in liger-kernel's Triton kernels on CUDA/XPU (PyTorch elsewhere); "
            "it supersedes liger's SwiGLU MLP forward on these blocks"
        )
    logger.info("fused LoRA: %s", "; ".join(notes))
    return notes


def fused_everywhere(model: Any) -> bool:
    """Whether every decoder block of ``model`` runs its attention and MLP on the fused path."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    blocks = [m for _, m in base.named_modules() if _is_block(m)]
    return bool(blocks) and all(
        getattr(b.self_attn, _MARK, False) and getattr(b.mlp, _MARK, False) for b in blocks
    )


def _summary(n_blocks: int, fused_attn: int, fused_mlp: int, kept: dict[str, list[str]]) -> str:
    if fused_attn == fused_mlp == n_blocks > 0:
        head = f"fused LoRA: {n_blocks} decoder blocks (q/k/v, o, gate/up/down)"
    elif fused_attn or fused_mlp:
        head = (
            f"fused LoRA: attention (q/k/v, o) in {fused_attn} and MLP (gate/up/down) in {fused_mlp} "
            f"of {n_blocks} decoder blocks"
        )
    else:
        head = "fused LoRA: nothing fused"
    return head + (f"; kept peft's path for {_kept_text(kept)}" if kept else "")


def _kept_text(kept: dict[str, list[str]]) -> str:
    parts = []
    for reason, names in kept.items():
        where = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"
        parts.append(f"{where} ({reason})")
    return "; ".join(parts)


def _is_block(module: Any) -> bool:
    import torch

    return isinstance(getattr(module, "self_attn", None), torch.nn.Module) and isinstance(
        getattr(module, "mlp", None), torch.nn.Module
    )


def _group_problem(parent: Any, names: tuple[str, ...]) -> str | None:
    """Why these projections of ``parent`` cannot be fused (``None`` when all can)."""
    missing = [n for n in names if getattr(parent, n, None) is None]
    if missing:
        present = sorted(n for n, _ in parent.named_children())
        return f"unknown block shape: no {'/'.join(missing)} (has {', '.join(present) or 'nothing'})"
    if any(getattr(getattr(parent, n), _MARK, False) for n in names):
        return "a projection is already fused in another block"
    problems = {n: _projection_problem(getattr(parent, n)) for n in names}
    bad = {n: p for n, p in problems.items() if p}
    if not bad:
        return None
    first = next(iter(bad.values()))
    return f"{'/'.join(bad)}: {first}"


def _projection_problem(layer: Any) -> str | None:
    """Why one projection cannot take the fused path; ``None`` when it can."""
    import torch
    from peft.tuners.lora import LoraLayer

    if not isinstance(layer, LoraLayer):
        return "not adapted (not in target_modules)"
    import bitsandbytes as bnb

    base = layer.get_base_layer()
    if isinstance(base, bnb.nn.Linear8bitLt):
        return "8-bit bitsandbytes weights (the fused path is 4-bit only)"
    if not isinstance(base, bnb.nn.Linear4bit):
        return f"base layer is {type(base).__name__}, not bitsandbytes 4-bit"
    state = getattr(base.weight, "quant_state", None)
    if state is None:
        return "4-bit weight without a quant_state"
    if state.quant_type != "nf4":
        return f"{state.quant_type} quantisation (the fused path is nf4)"
    if getattr(state, "packing_format_for_cpu", False):
        return "weights repacked for bitsandbytes' CPU inference kernel"
    if base.bias is not None:
        return "the base layer has a bias"
    if layer.merged:
        return "adapters merged into the base weights"
    if layer.disable_adapters:
        return "adapters disabled"
    active = list(layer.active_adapters)
    if len(active) != 1:
        return f"{len(active)} active adapters (the fused path takes one)"
    adapter = active[0]
    if adapter not in layer.lora_A:
        return f"active adapter {adapter!r} has no LoRA weights here"
    if layer.use_dora.get(adapter) or adapter in getattr(layer, "lora_variant", {}):
        return "DoRA (use_dora) or another LoRA variant"
    if getattr(layer, "lora_bias", {}).get(adapter):
        return "bias adapters (lora_bias)"
    if not isinstance(layer.lora_dropout[adapter], torch.nn.Identity):
        return "lora_dropout > 0 (peft applies dropout to the adapter input)"
    return None


def _mlp_shape_problem(mlp: Any, config: Any, model_type: str | None) -> str | None:
    import torch

    problem = mlp_problem(model_type)
    if problem is not None:
        return problem
    act, act_fn = getattr(config, "hidden_act", None), getattr(mlp, "act_fn", None)
    if act not in SILU_NAMES or not callable(act_fn):
        return f"activation {act!r}, not SiLU"
    probe = torch.linspace(-4, 4, 9)  # act_fn's class differs by version (nn.SiLU, SiLUActivation)
    with torch.no_grad():
        if not torch.allclose(act_fn(probe), torch.nn.functional.silu(probe)):
            return f"activation module {type(act_fn).__name__} does not compute SiLU"
    return None


def _still_plain(layer: Any) -> bool:
    """The runtime half of :func:`_projection_problem`: what can change after patching."""
    return (
        not layer.disable_adapters
        and not layer.merged
        and len(layer.active_adapters) == 1
        and layer.active_adapters[0] == layer._xpukit_adapter
        and not getattr(layer.get_base_layer().weight.quant_state, "packing_format_for_cpu", False)
    )


def _projection(layer: Any) -> Any:
    adapter = layer._xpukit_adapter
    weight = layer.get_base_layer().weight
    return Projection(
        weight=weight,
        quant_state=weight.quant_state,
        lora_A=layer.lora_A[adapter].weight,
        lora_B=layer.lora_B[adapter].weight,
        scale=float(layer.scaling[adapter]),
    )


def _compute_dtype(layer: Any, x: Any) -> Any:
    base = layer.get_base_layer()
    return getattr(base, "compute_dtype", None) or x.dtype


def _prepare(layer: Any) -> None:
    layer._xpukit_adapter = next(iter(layer.active_adapters))
    object.__setattr__(layer, _MARK, True)


class _FusedQKV:
    """q_proj computes q, k and v; k_proj and v_proj take theirs when called with the same input."""

    def __init__(self, attn: Any) -> None:
        self.attn = attn
        self.layers = tuple(getattr(attn, n) for n in ATTENTION[:3])
        self.original = tuple(layer.forward for layer in self.layers)
        self.pending: list[Any] | None = None  # [input, k, v] from the last q_proj call

    def q_forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        self.pending = None
        if args or kwargs or not all(_still_plain(layer) for layer in self.layers):
            return self.original[0](x, *args, **kwargs)
        q, k, v = lora_shared_input(
            x, tuple(_projection(layer) for layer in self.layers), _compute_dtype(self.layers[0], x)
        )
        self.pending = [x, k, v]
        return q

    def k_forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return self._take(1, x, args, kwargs)

    def v_forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return self._take(2, x, args, kwargs)

    def _take(self, i: int, x: Any, args: Any, kwargs: Any) -> Any:
        pending = self.pending
        if pending is not None and pending[0] is x and pending[i] is not None and not args and not kwargs:
            out = pending[i]
            pending[i] = None
            if pending[1] is None and pending[2] is None:
                self.pending = None
            return out
        return self.original[i](x, *args, **kwargs)


class _FusedLinear:
    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self.original = layer.forward

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not _still_plain(self.layer):
            return self.original(x, *args, **kwargs)
        return lora_linear(x, _projection(self.layer), _compute_dtype(self.layer, x))


class _FusedMLP:
    def __init__(self, mlp: Any, liger: bool) -> None:
        self.mlp, self.liger = mlp, liger
        self.layers = tuple(getattr(mlp, n) for n in MLP)
        self.original = mlp.forward  # the class's, or liger's SwiGLU forward on this instance

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        same = all(getattr(self.mlp, n) is layer for n, layer in zip(MLP, self.layers, strict=True))
        if args or kwargs or not same or not all(_still_plain(layer) for layer in self.layers):
            return self.original(x, *args, **kwargs)
        gate, up, down = (_projection(layer) for layer in self.layers)
        return lora_swiglu_mlp(x, gate, up, down, _compute_dtype(self.layers[0], x), liger=self.liger)


def _patch_attention(attn: Any) -> None:
    for name in ATTENTION:
        _prepare(getattr(attn, name))
    qkv = _FusedQKV(attn)
    attn.q_proj.forward = qkv.q_forward
    attn.k_proj.forward = qkv.k_forward
    attn.v_proj.forward = qkv.v_forward
    attn.o_proj.forward = _FusedLinear(attn.o_proj).forward
    object.__setattr__(attn, _MARK, True)


def _patch_mlp(mlp: Any, *, liger: bool) -> None:
    for name in MLP:
        _prepare(getattr(mlp, name))
    mlp.forward = _FusedMLP(mlp, liger).forward
    object.__setattr__(mlp, _MARK, True)
