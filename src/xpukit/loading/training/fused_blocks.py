"""The fused 4-bit LoRA path on one decoder block: what it can take, and the patched forwards.

A block's attention and MLP are matched to the plan's block shapes
(:data:`xpukit.planning.training.fused.ATTENTION_SHAPES`, :data:`~xpukit.planning.training.fused.MLP_SHAPES`)
by their children's names, and each shape's projections are routed through
:mod:`xpukit.kernels.lora_ops`:

- q/k/v: ``q_proj``'s forward computes all three in one autograd function over the shared input and
  hands ``k`` and ``v`` to ``k_proj``/``v_proj`` when they are called next with the same tensor (the
  attention code between them, q/k norms, RoPE or none, multipliers, is left as it is). Called with
  another tensor, they run peft's own path. A stored ``qkv_proj`` and ``o_proj``: one projection each.
- the MLP: its ``forward`` becomes ``down(act(gate(x)) * up(x))`` in one autograd function, with
  ``gate``/``up`` two projections or the halves of a stored ``gate_up_proj``, and ``act`` the one its
  activation module computes (identified on a probe: SiLU, tanh-approximated GELU or GELU).

Only module ``forward`` attributes change, never parameters or module names. Each patched forward
checks on every call that the adapter is still plain (one active adapter, not disabled, not merged,
the same LoRA modules in place) and otherwise calls the forward it replaced, so
``disable_adapter()``, ``merge_and_unload()`` and ``generate`` keep working; ``peft_path(block)``
makes a block run peft's path (the load-time check compares the two), and :func:`unpatch` restores
the forwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from xpukit.kernels.lora_ops import Projection, lora_gated_mlp, lora_linear, lora_shared_input
from xpukit.planning.training.fused import ATTENTION_SHAPES, MLP_SHAPES, BlockShape

if TYPE_CHECKING:
    import torch
    from peft.tuners.lora import LoraLayer

__all__ = [
    "MARK",
    "block_shape",
    "group_problem",
    "identify_activation",
    "is_block",
    "patch_attention",
    "patch_mlp",
    "peft_path",
    "unpatch",
]

MARK = "_xpukit_fused_lora"
_PATCH = "_xpukit_fused_patch"  # the patch object on each module whose forward it replaced
_REPLACED = "_xpukit_replaced_forward"  # the instance forward it replaced (None: the class's)
_ACT_ATTRS = ("act_fn", "activation_fn")


def is_block(module: torch.nn.Module) -> bool:
    import torch

    return isinstance(getattr(module, "self_attn", None), torch.nn.Module) and isinstance(
        getattr(module, "mlp", None), torch.nn.Module
    )


def block_shape(parent: torch.nn.Module, shapes: tuple[BlockShape, ...]) -> BlockShape | None:
    """The first shape whose projections are all children of ``parent``."""
    return next((s for s in shapes if all(getattr(parent, n, None) is not None for n in s.projections)), None)


def shape_problem(parent: torch.nn.Module, shapes: tuple[BlockShape, ...]) -> str:
    wanted = " or ".join("/".join(s.projections) for s in shapes)
    present = sorted(n for n, _ in parent.named_children())
    return f"unknown block shape: no {wanted} (has {', '.join(present) or 'nothing'})"


def group_problem(parent: torch.nn.Module, names: tuple[str, ...]) -> str | None:
    """Why these projections of ``parent`` cannot be fused (``None`` when all can)."""
    if any(getattr(getattr(parent, n), MARK, False) for n in names):
        return "a projection is already fused in another block"
    problems = {n: _projection_problem(getattr(parent, n)) for n in names}
    bad = {n: p for n, p in problems.items() if p}
    if not bad:
        return None
    first = next(iter(bad.values()))
    return f"{'/'.join(bad)}: {first}"


def _projection_problem(layer: torch.nn.Module) -> str | None:
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
    if base.bias is not None and base.bias.requires_grad:
        return "the base layer's bias is trained"
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


def identify_activation(mlp: torch.nn.Module) -> tuple[str | None, str]:
    """The gating activation ``mlp``'s activation module computes (a name of
    :data:`xpukit.kernels.lora_ops.GATE_ACTIVATIONS`), told on a probe, and the words for a note."""
    import torch

    act_fn = next((getattr(mlp, a) for a in _ACT_ATTRS if callable(getattr(mlp, a, None))), None)
    if act_fn is None:
        return None, f"no activation module ({' or '.join(_ACT_ATTRS)})"
    probe = torch.linspace(-6, 6, 49)  # the module's class differs by version (nn.SiLU, SiLUActivation)
    candidates = {
        "silu": torch.nn.functional.silu,
        "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
        "gelu": torch.nn.functional.gelu,
    }
    with torch.no_grad():
        got = act_fn(probe)
        for name, fn in candidates.items():
            if torch.allclose(got, fn(probe), rtol=1e-6, atol=1e-6):
                return name, ""
    return None, f"activation module {type(act_fn).__name__} computes none of SiLU, GELU, GELU (tanh)"


def _still_plain(layer: LoraLayer) -> bool:
    """The runtime half of :func:`_projection_problem`: what can change after patching."""
    return (
        not layer.disable_adapters
        and not layer.merged
        and len(layer.active_adapters) == 1
        and layer.active_adapters[0] == layer._xpukit_adapter
        and not getattr(layer.get_base_layer().weight.quant_state, "packing_format_for_cpu", False)
    )


def _projection(layer: LoraLayer) -> Projection:
    adapter = layer._xpukit_adapter
    base = layer.get_base_layer()
    return Projection(
        weight=base.weight,
        quant_state=base.weight.quant_state,
        lora_A=layer.lora_A[adapter].weight,
        lora_B=layer.lora_B[adapter].weight,
        scale=float(layer.scaling[adapter]),
        bias=base.bias,
    )


def _compute_dtype(layer: LoraLayer, x: torch.Tensor) -> torch.dtype:
    base = layer.get_base_layer()
    dtype: torch.dtype = getattr(base, "compute_dtype", None) or x.dtype
    return dtype


class _Patch:
    """Replaces the ``forward`` of some modules; ``bypass`` makes them call what they replaced."""

    def __init__(self, modules: tuple[torch.nn.Module, ...]) -> None:
        self.bypass = False
        self.original: tuple[Callable[..., torch.Tensor], ...] = tuple(m.forward for m in modules)


class _FusedQKV(_Patch):
    """q_proj computes q, k and v; k_proj and v_proj take theirs when called with the same input."""

    def __init__(self, attn: torch.nn.Module) -> None:
        self.layers: tuple[LoraLayer, ...] = tuple(getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj"))
        super().__init__(self.layers)
        # [input, k, v] from the last q_proj call (k and v: None once taken)
        self.pending: list[torch.Tensor | None] | None = None

    def q_forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        self.pending = None
        if self.bypass or args or kwargs or not all(_still_plain(layer) for layer in self.layers):
            return self.original[0](x, *args, **kwargs)
        q, k, v = lora_shared_input(
            x, tuple(_projection(layer) for layer in self.layers), _compute_dtype(self.layers[0], x)
        )
        self.pending = [x, k, v]
        return q

    def k_forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return self._take(1, x, args, kwargs)

    def v_forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return self._take(2, x, args, kwargs)

    def _take(
        self, i: int, x: torch.Tensor, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> torch.Tensor:
        pending = self.pending
        out = pending[i] if pending is not None else None
        if pending is not None and pending[0] is x and out is not None and not args and not kwargs:
            pending[i] = None
            if pending[1] is None and pending[2] is None:
                self.pending = None
            return out
        return self.original[i](x, *args, **kwargs)


class _FusedLinear(_Patch):
    def __init__(self, layer: LoraLayer) -> None:
        super().__init__((layer,))
        self.layer = layer

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if self.bypass or args or kwargs or not _still_plain(self.layer):
            return self.original[0](x, *args, **kwargs)
        return lora_linear(x, _projection(self.layer), _compute_dtype(self.layer, x))


class _FusedMLP(_Patch):
    def __init__(self, mlp: torch.nn.Module, shape: BlockShape, act: str, liger: bool) -> None:
        super().__init__((mlp,))  # the class's forward, or liger's SwiGLU forward on this instance
        self.mlp, self.names, self.act, self.liger = mlp, shape.projections, act, liger
        self.layers: tuple[LoraLayer, ...] = tuple(getattr(mlp, n) for n in self.names)

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        same = all(getattr(self.mlp, n) is layer for n, layer in zip(self.names, self.layers, strict=True))
        if self.bypass or args or kwargs or not same or not all(_still_plain(m) for m in self.layers):
            return self.original[0](x, *args, **kwargs)
        *gate_up, down = (_projection(layer) for layer in self.layers)
        dtype = _compute_dtype(self.layers[0], x)
        return lora_gated_mlp(x, tuple(gate_up), down, dtype, act=self.act, liger=self.liger)


def _install(
    patch: _Patch, modules: tuple[torch.nn.Module, ...], forwards: tuple[Callable[..., torch.Tensor], ...]
) -> None:
    for module, forward in zip(modules, forwards, strict=True):
        object.__setattr__(module, _REPLACED, module.__dict__.get("forward"))  # None: the class's
        module.forward = forward
        object.__setattr__(module, _PATCH, patch)


def _prepare(layer: LoraLayer) -> None:
    layer._xpukit_adapter = next(iter(layer.active_adapters))
    object.__setattr__(layer, MARK, True)


def patch_attention(attn: torch.nn.Module, shape: BlockShape) -> None:
    for name in shape.projections:
        _prepare(getattr(attn, name))
    if shape is ATTENTION_SHAPES[0]:
        qkv = _FusedQKV(attn)
        _install(qkv, qkv.layers, (qkv.q_forward, qkv.k_forward, qkv.v_forward))
    for name in shape.projections:
        layer = getattr(attn, name)
        if getattr(layer, _PATCH, None) is None:
            linear = _FusedLinear(layer)
            _install(linear, (layer,), (linear.forward,))
    object.__setattr__(attn, MARK, True)


def patch_mlp(mlp: torch.nn.Module, shape: BlockShape, *, act: str, liger: bool) -> None:
    assert shape in MLP_SHAPES
    for name in shape.projections:
        _prepare(getattr(mlp, name))
    fused = _FusedMLP(mlp, shape, act, liger)
    _install(fused, (mlp,), (fused.forward,))
    object.__setattr__(mlp, MARK, True)


def _patched(block: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, _Patch]]:
    for module in block.modules():
        patch = module.__dict__.get(_PATCH)
        if patch is not None:
            yield module, patch


@contextlib.contextmanager
def peft_path(block: torch.nn.Module) -> Iterator[None]:
    """Within: ``block``'s patched modules call the forwards they replaced (peft's path)."""
    patches = {id(p): p for _, p in _patched(block)}.values()
    for patch in patches:
        patch.bypass = True
    try:
        yield
    finally:
        for patch in patches:
            patch.bypass = False


def unpatch(block: torch.nn.Module) -> None:
    """Restore the forwards of ``block``'s patched modules (the fused path off for this block)."""
    for module in block.modules():
        if module.__dict__.pop(_PATCH, None) is not None:
            replaced = module.__dict__.pop(_REPLACED, None)
            if replaced is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = replaced
        module.__dict__.pop(MARK, None)
