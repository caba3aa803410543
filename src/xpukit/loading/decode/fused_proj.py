"""Fused q/k/v and gate/up products for decoding: one read of their weights per layer.

A decode step at batch 1 reads every weight once; three products over one input (q, k, v) and two
(gate, up) each launch their own kernel, and the narrow ones (k/v, 4 096 → 1 024 on the Qwen3-8B
shape) run in split-K kernels with a reduction after them (docs/decode.md "Where a token's time
goes"). Fused at load, as gpt-fast lays its weights out, each group is one product over one
weight whose rows are the parts' rows (docs/decode-kernels.md "Fused projections"):

* the fused weight is a non-persistent buffer of the attention (``xpukit_qkv_weight``) or MLP
  (``xpukit_gate_up_weight``) module, so ``model.to()`` moves it and ``save_pretrained`` does not
  write it; the parts' parameters become row slices of it (views: no second copy of the weights),
  so their names, ``state_dict`` and every other caller keep working;
* plain float weights are concatenated; a torchao weight (a tensor subclass) is concatenated
  through its inner tensors, each along the dimension that row slicing (torchao's own
  ``aten.slice``) shows to be its rows, and kept only when the fused weight dequantizes to exactly
  the parts' values; any other weight (bitsandbytes) is left as it is, and the event says why;
* ``q_proj``'s forward computes q, k and v and hands k and v to ``k_proj``/``v_proj`` when they are
  called next with the same tensor (the attention code between them is left as it is); called with
  another tensor they compute their own slice. The MLP's forward becomes
  ``down_proj(act_fn(gate) * up)`` over the fused product, kept only where it equals the module's
  own forward on a probe input.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, TypeAlias, TypedDict

if TYPE_CHECKING:
    import torch

__all__ = [
    "FUSED_GROUP",
    "GATE_UP_BUFFER",
    "QKV_BUFFER",
    "FusedGroup",
    "FusedProjections",
    "Product",
    "concat_rows",
    "fuse_projections",
]

QKV_BUFFER = "xpukit_qkv_weight"
FUSED_GROUP = "xpukit_fused"  # the attention's/MLP's attribute holding its fused group (its ``linear``)
GATE_UP_BUFFER = "xpukit_gate_up_weight"
_QKV = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")
_READBACK_ROWS = 1024  # identity rows per product when a fused torchao weight is checked
_PROBE_ROWS = 8  # rows of the slice that shows which inner dimension of a torchao weight is its rows
_MLP_TOLERANCE = 5e-2  # relative error of the fused MLP against its own forward: rounding, not a wrong layout

# A product ``linear(x, weight, bias)`` over a fused weight: ``F.linear`` or xpukit's weight-only one.
Product: TypeAlias = "Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]"


class _Fused(TypedDict):
    attention: int
    mlp: int
    blocks: int


class FusedProjections(_Fused, total=False):
    """What :func:`fuse_projections` did: groups fused in the ``attention`` and the ``mlp`` of how many
    ``blocks``, and why groups were ``kept`` apart (each reason with how many)."""

    kept: dict[str, int]


def concat_rows(weights: list[torch.Tensor]) -> tuple[torch.Tensor | None, str | None]:
    """One weight whose rows are ``weights``' rows, in order, or ``(None, why not)``."""
    import torch

    first = weights[0]
    if any(type(w) is not type(first) or w.shape[1:] != first.shape[1:] for w in weights):
        return None, "the parts differ in type or input width"
    if any(w.dtype != first.dtype or w.device != first.device for w in weights):
        return None, "the parts differ in dtype or device"
    if type(first) in (torch.Tensor, torch.nn.Parameter):
        return torch.cat([w.detach() for w in weights]), None
    return _concat_subclass(torch, weights)


def _concat_subclass(
    torch: ModuleType, weights: list[torch.Tensor]
) -> tuple[torch.Tensor | None, str | None]:
    cls = type(weights[0])
    if not hasattr(cls, "__tensor_flatten__") or not hasattr(cls, "tensor_data_names"):
        return None, f"{cls.__name__} is not a torchao tensor"
    flat = [w.__tensor_flatten__() for w in weights]
    names, attrs = flat[0]
    rest = [{k: v for k, v in a.items() if k != "shape"} for _, a in flat]
    if any(n != names for n, _ in flat) or any(r != rest[0] for r in rest):
        return None, f"the parts' {cls.__name__} attributes differ"
    block = attrs.get("block_size")
    if block is not None and next(iter(block)) != 1:
        return None, f"{cls.__name__} groups span rows (block_size {block})"
    try:
        dims = _row_dims(weights[0], names)
        inner = {n: torch.cat([getattr(w, n) for w in weights], dim=dims[n]) for n in names}
        rows = sum(int(w.shape[0]) for w in weights)
        shape = torch.Size([rows, *weights[0].shape[1:]])
        if "shape" in attrs:
            attrs = {**attrs, "shape": list(shape) if isinstance(attrs["shape"], list) else shape}
        fused = cls.__tensor_unflatten__(inner, attrs, shape, None)
        exact = _same_products(torch, fused, weights)
    except Exception as exc:  # a layout whose slicing or construction does not follow these rules
        return None, f"{cls.__name__} did not concatenate ({type(exc).__name__}: {str(exc)[:100]})"
    if not exact:
        return None, f"{cls.__name__} concatenated does not compute its parts' products"
    return fused, None


def _same_products(torch: ModuleType, fused: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """The fused weight's product with the identity (its values, read back through its own kernel;
    packed int4 formats have no ``dequantize``) equals the parts' side by side, exactly."""
    width = int(fused.shape[1])
    for start in range(0, width, _READBACK_ROWS):
        eye = torch.eye(width, dtype=fused.dtype, device=fused.device)[start : start + _READBACK_ROWS]
        with torch.no_grad():
            got = torch.nn.functional.linear(eye, fused)
            want = torch.cat([torch.nn.functional.linear(eye, w) for w in weights], dim=-1)
        if not torch.equal(got, want):
            return False
    return True


def _row_dims(weight: torch.Tensor, names: list[str]) -> dict[str, int]:
    """For each inner tensor, the dimension that a slice of the weight's first rows shortens."""
    if weight.shape[0] <= _PROBE_ROWS:
        raise ValueError(f"{weight.shape[0]} rows: too few to find the row dimensions")
    part = weight[:_PROBE_ROWS]
    dims = {}
    for name in names:
        full, sliced = getattr(weight, name).shape, getattr(part, name).shape
        changed = [d for d, (a, b) in enumerate(zip(full, sliced, strict=True)) if a != b]
        if len(changed) != 1:
            raise ValueError(f"{name}: rows along {changed or 'no'} dimensions")
        dims[name] = changed[0]
    return dims


def fuse_projections(model: torch.nn.Module) -> FusedProjections:
    """Fuse q/k/v and gate/up in every decoder block of ``model`` where the weights allow it.

    Returns:
        What was done: ``{"attention": n, "mlp": n, "blocks": n}`` plus ``"kept"`` (why groups
        stayed apart, each with how many) when some did.
    """
    import torch

    done = {"attention": 0, "mlp": 0, "blocks": 0}
    kept: dict[str, int] = {}
    checked: dict[type, str | None] = {}
    for module in model.modules():
        attn, mlp = getattr(module, "self_attn", None), getattr(module, "mlp", None)
        if not isinstance(attn, torch.nn.Module) or not isinstance(mlp, torch.nn.Module):
            continue
        done["blocks"] += 1
        for kind, why in (("attention", _fuse_attention(attn)), ("mlp", _fuse_mlp(mlp, checked))):
            if why is None:
                done[kind] += 1
            else:
                kept[f"{kind}: {why}"] = kept.get(f"{kind}: {why}", 0) + 1
    report: FusedProjections = {"attention": done["attention"], "mlp": done["mlp"], "blocks": done["blocks"]}
    if kept:
        report["kept"] = kept
    return report


def _linears(
    parent: torch.nn.Module, names: tuple[str, ...]
) -> tuple[list[torch.nn.Linear] | None, str | None]:
    import torch

    layers = [getattr(parent, n, None) for n in names]
    if any(layer is None for layer in layers):
        return None, f"no {'/'.join(names)}"
    if any(type(layer) is not torch.nn.Linear for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        return None, f"{'/'.join(kinds)} layers (plain Linear layers only)"
    found = [layer for layer in layers if layer is not None]
    if len({layer.bias is None for layer in found}) > 1:
        return None, "bias on some parts only"
    return found, None


def _install_fused(
    parent: torch.nn.Module, layers: list[torch.nn.Linear], buffer: str
) -> tuple[list[int], str | None]:
    """Register the fused weight (and bias) on ``parent``; the parts' parameters become its slices."""
    import torch

    fused, why = concat_rows([layer.weight for layer in layers])
    if fused is None:
        return [], why
    sizes = [int(layer.weight.shape[0]) for layer in layers]
    parent.register_buffer(buffer, fused, persistent=False)
    if layers[0].bias is not None:
        bias = torch.cat([layer.bias.detach() for layer in layers])
        parent.register_buffer(buffer.replace("weight", "bias"), bias, persistent=False)
    start = 0
    for layer, size in zip(layers, sizes, strict=True):
        layer.weight = torch.nn.Parameter(fused[start : start + size], requires_grad=False)
        if layer.bias is not None:
            layer.bias = torch.nn.Parameter(
                getattr(parent, buffer.replace("weight", "bias"))[start : start + size], requires_grad=False
            )
        start += size
    return sizes, None


def _fuse_attention(attn: torch.nn.Module) -> str | None:
    layers, why = _linears(attn, _QKV)
    if layers is None:
        return why
    sizes, why = _install_fused(attn, layers, QKV_BUFFER)
    if why is not None:
        return why
    fused = _FusedQKV(attn, layers, sizes)
    setattr(attn, FUSED_GROUP, fused)
    for layer, forward in zip(layers, (fused.q_forward, fused.k_forward, fused.v_forward), strict=True):
        layer.forward = forward
    return None


def _fuse_mlp(mlp: torch.nn.Module, checked: dict[type, str | None]) -> str | None:
    layers, why = _linears(mlp, _GATE_UP)
    if layers is None:
        return why
    if not callable(getattr(mlp, "act_fn", None)) or getattr(mlp, "down_proj", None) is None:
        return "no act_fn/down_proj"
    original = mlp.forward
    sizes, why = _install_fused(mlp, layers, GATE_UP_BUFFER)
    if why is not None:
        return why
    fused = _FusedMLP(mlp, layers, sizes)
    if type(mlp) not in checked:
        checked[type(mlp)] = _probe(original, fused.forward, layers[0].weight)
    if checked[type(mlp)] is not None:
        return checked[type(mlp)]
    mlp.forward = fused.forward
    setattr(mlp, FUSED_GROUP, fused)
    return None


def _probe(
    original: Callable[[torch.Tensor], torch.Tensor],
    fused: Callable[[torch.Tensor], torch.Tensor],
    weight: torch.Tensor,
) -> str | None:
    """``None`` when the fused MLP computes what the module's own forward does on a random input."""
    import torch

    dtype = getattr(weight, "dtype", torch.float32)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        x = torch.randn(2, 3, int(weight.shape[1])).to(device=weight.device, dtype=dtype)
        want, got = original(x).float(), fused(x).float()
    err = float((got - want).norm() / want.norm().clamp_min(1e-12))
    if not err <= _MLP_TOLERANCE:
        return f"its forward is not down_proj(act_fn(gate) * up) (a probe differed by {err:.1e})"
    return None


class _FusedQKV:
    """q_proj computes q, k and v; k_proj and v_proj take theirs when called with the same input."""

    def __init__(self, attn: torch.nn.Module, layers: list[torch.nn.Linear], sizes: list[int]) -> None:
        self.attn, self.layers, self.sizes = attn, layers, sizes
        self.pending: list[torch.Tensor | None] | None = None  # [input, k, v] from the last q_proj call
        self.linear: Product | None = None  # the product over the fused weight; None: F.linear

    def q_forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch

        bias = getattr(self.attn, QKV_BUFFER.replace("weight", "bias"), None)
        linear = self.linear or torch.nn.functional.linear
        q, k, v = linear(x, getattr(self.attn, QKV_BUFFER), bias).split(self.sizes, -1)
        self.pending = [x, k, v]
        return q

    def k_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._take(1, x)

    def v_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._take(2, x)

    def _take(self, i: int, x: torch.Tensor) -> torch.Tensor:
        pending = self.pending
        if pending is not None and pending[0] is x and pending[i] is not None:
            out = pending[i]
            pending[i] = None
            if pending[1] is None and pending[2] is None:
                self.pending = None
            return out
        import torch

        layer = self.layers[i]
        return (self.linear or torch.nn.functional.linear)(x, layer.weight, layer.bias)


class _FusedMLP:
    """``down_proj(act_fn(gate) * up)`` with gate and up from one product."""

    def __init__(self, mlp: torch.nn.Module, layers: list[torch.nn.Linear], sizes: list[int]) -> None:
        self.mlp, self.layers, self.sizes = mlp, layers, sizes  # layers: gate_proj, up_proj
        self.linear: Product | None = None  # the product over the fused weight; None: F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch

        mlp = self.mlp
        bias = getattr(mlp, GATE_UP_BUFFER.replace("weight", "bias"), None)
        linear = self.linear or torch.nn.functional.linear
        gate, up = linear(x, getattr(mlp, GATE_UP_BUFFER), bias).split(self.sizes, -1)
        return mlp.down_proj(mlp.act_fn(gate) * up)


# A fused group, as ``FUSED_GROUP`` holds it on its attention or MLP module.
FusedGroup: TypeAlias = _FusedQKV | _FusedMLP
