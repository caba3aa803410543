"""xpukit's weight-only products installed on a loaded model for decoding (docs/decode-kernels.md
"Weight-only products").

Every plain ``Linear`` whose weight the planned kernel reads (:func:`xpukit.kernels.woq.kernel_of`)
gets a forward that calls :func:`~xpukit.kernels.woq.weight_only_linear` with the layer's current
weight and bias (read at each call, so a swapped weight is used as it is); every fused q/k/v or gate/up group
(:mod:`xpukit.loading.decode.fused_proj`) gets it as its product. Before anything is installed each
such weight is checked once: its product with a random row through xpukit's kernel against torchao's
own product, within bf16 rounding. One weight that differs, or triton missing, and nothing is
installed: the load records a fallback with the reason (all layers or none, never half).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

from xpukit.kernels.woq import kernel_of, register, weight_only_linear
from xpukit.loading.decode.fused_proj import FUSED_GROUP, GATE_UP_BUFFER, QKV_BUFFER

if TYPE_CHECKING:
    import torch

    from xpukit.loading.decode.fused_proj import FusedGroup, Product

__all__ = ["WeightOnlyProducts", "install_weight_only_products", "remove_weight_only_products"]

_TOLERANCE = 2e-2  # relative error against torchao's product: bf16 rounding of the sum, not a wrong layout
_MARK = "xpukit_weight_only"  # a layer whose forward xpukit replaced


class WeightOnlyProducts(TypedDict, total=False):
    """What :func:`install_weight_only_products` did: how many plain ``layers`` and fused ``groups``
    it serves, or why it ``kept`` torchao's product everywhere."""

    layers: int
    groups: int
    kept: str


class _Product:
    """A ``Linear``'s forward through xpukit's weight-only product (its weight read at each call)."""

    def __init__(self, layer: torch.nn.Linear, product: Product) -> None:
        self.layer, self.product = layer, product

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.layer.weight, self.layer.bias)


def _targets(
    model: torch.nn.Module, kernel: str
) -> tuple[list[tuple[str, torch.nn.Linear]], list[tuple[str, FusedGroup, torch.Tensor]]]:
    """The plain layers and the fused groups whose weights ``kernel`` reads."""
    import torch

    layers: list[tuple[str, torch.nn.Linear]] = []
    groups: list[tuple[str, FusedGroup, torch.Tensor]] = []
    parts: set[int] = set()
    for name, module in model.named_modules():
        group: FusedGroup | None = module.__dict__.get(FUSED_GROUP)
        if group is not None:
            parts |= {id(layer) for layer in group.layers}  # computed by the group's one product
            weight = getattr(module, QKV_BUFFER, None)
            weight = weight if weight is not None else getattr(module, GATE_UP_BUFFER, None)
            if weight is not None and kernel_of(weight) == kernel:
                groups.append((name, group, weight))
        if type(module) is torch.nn.Linear and kernel_of(module.weight) == kernel:
            layers.append((name, module))
    return [(n, m) for n, m in layers if id(m) not in parts], groups


def _check(name: str, weight: torch.Tensor, devices: tuple[str, ...]) -> str | None:
    """``None`` when xpukit's product of ``weight`` with a random row matches torchao's."""
    import torch

    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        dtype = weight.dtype if weight.dtype in (torch.bfloat16, torch.float16) else torch.float32
        if type(weight).__name__ == "Int4TilePackedTo4dTensor":
            dtype = torch.bfloat16  # tinygemm takes bf16 inputs only
        x = torch.randn(1, int(weight.shape[1])).to(device=weight.qdata.device, dtype=dtype)
        want = torch.nn.functional.linear(x, weight).float()
        got = weight_only_linear(x, weight, devices=devices).float()
    err = float((got - want).norm() / want.norm().clamp_min(1e-12))
    return None if err <= _TOLERANCE else f"{name}: xpukit's product differed from torchao's by {err:.1e}"


def install_weight_only_products(
    model: torch.nn.Module, kernel: str = "int8", *, devices: tuple[str, ...] = ("cuda", "xpu")
) -> WeightOnlyProducts:
    """Route ``model``'s quantized products that ``kernel`` reads through it.

    Args:
        model: the loaded model (after the projections were fused, when they were).
        kernel: the plan's kernel (``int8``; ``int4`` reads tinygemm's layout, which no plan takes).
        devices: the device types the kernel serves (the tests add ``cpu``).

    Returns:
        ``{"layers": n, "groups": n}`` when installed, or ``{"kept": why}`` when nothing was.
    """
    from xpukit.kernels.nf4 import triton_available

    layers, groups = _targets(model, kernel)
    if not layers and not groups:
        return {"kept": f"no layers whose weights xpukit's {kernel} kernel reads"}
    weights = [(n, m.weight) for n, m in layers] + [(n, w) for n, _, w in groups]
    where = {w.qdata.device.type for _, w in weights}
    if not where <= set(devices):
        return {"kept": f"weights on {', '.join(sorted(where))}; xpukit's kernel serves {', '.join(devices)}"}
    if where & {"cuda", "xpu"} and not triton_available():
        return {"kept": "triton does not import, and xpukit's kernel is written in Triton"}
    register()
    for name, weight in weights:
        why = _check(name, weight, devices)
        if why is not None:
            return {"kept": why}
    product = weight_only_linear if devices == ("cuda", "xpu") else _with_devices(devices)
    for _, layer in layers:
        layer.forward = _Product(layer, product)
        setattr(layer, _MARK, True)
    for _, group, _ in groups:
        group.linear = product
    return {"layers": len(layers), "groups": len(groups)}


def _with_devices(devices: tuple[str, ...]) -> Product:
    def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return weight_only_linear(x, weight, bias, devices=devices)

    return product


def remove_weight_only_products(model: torch.nn.Module) -> int:
    """Undo :func:`install_weight_only_products` (the benchmark's comparison); returns how many."""
    undone = 0
    for module in model.modules():
        if module.__dict__.pop(_MARK, False):
            module.__dict__.pop("forward", None)
            undone += 1
        group: FusedGroup | None = module.__dict__.get(FUSED_GROUP)
        if group is not None and group.linear is not None:
            group.linear = None
            undone += 1
    return undone
