"""Autograd functions for 4-bit projections with their LoRA adapters, in plain PyTorch.

For one projection with a 4-bit weight ``W`` (dequantised: ``dequant(W4)``) and an adapter ``A``
(``r × in``), ``B`` (``out × r``) with scale ``s`` (``lora_alpha / r``)::

    y  = x Wᵀ + s (x Aᵀ) Bᵀ
    dx = dy W + s (dy B) A        dA = s (dy B)ᵀ x        dB = s dyᵀ (x Aᵀ)

Each 4-bit weight is dequantised once in forward and once in backward, never saved; the LoRA term is
added in place (``addmm_`` with ``alpha=s``), so there is no separate clone, scale and add as in
peft's module path. Saved for backward: the input ``x`` (shared by the projections that read it) and
the small ``x Aᵀ`` (``tokens × r``).

- :func:`lora_linear`: one projection (``o_proj``).
- :func:`lora_shared_input`: several projections of one input (q/k/v): ``x`` is saved once and ``dx``
  is accumulated in one buffer.
- :func:`lora_gated_mlp`: ``down(act(gate(x)) * up(x))`` in one function, ``act`` SiLU (SwiGLU) or
  GELU, exact or tanh-approximated (GeGLU); ``gate`` and ``up`` are two projections, or the two
  halves of one stored ``gate_up_proj`` (Phi-3, GLM-4) with one adapter whose ``x Aᵀ`` they share.
  It saves ``x``, ``gate`` and ``up`` and recomputes ``act(gate) * up`` in backward (elementwise,
  cheap); peft's module path keeps ``gate``, ``act(gate)``, ``up`` and their product as well.
  Recomputing ``gate``/``up`` themselves would save two more ``tokens × intermediate`` tensors at the
  price of two dequantisations and two large matmuls, so it is not done.

A base layer's bias (GLM-4's q/k/v) is added to its output; it is frozen, so it has no gradient.

The gated step (``act(gate) * up`` and its backward) runs in liger-kernel's Triton kernels
(``liger_kernel.ops.swiglu`` for SiLU, ``liger_kernel.ops.geglu`` for tanh-approximated GELU: one
kernel each way; the backward writes the gradients of ``gate`` and ``up`` over their saved tensors,
so a function's backward can run only once) when ``liger=True`` and the tensors are on CUDA/XPU, and
in plain PyTorch otherwise (``liger=False``, the reference). liger computes it in fp32 and rounds
once; PyTorch rounds ``act(gate)`` before the product, so under bf16 the two differ by bf16 rounding.

Precision: the matmuls run in the base layer's compute dtype (bitsandbytes' ``compute_dtype``, bf16
under bf16) with autocast off inside. The adapters are cast to that dtype once per forward and the
casts are saved for backward; their gradients are returned in the adapters' own dtype. So with
peft's default fp32 adapters the master weights and AdamW state stay fp32 (small updates are not lost
to bf16 rounding) while the products are bf16 as under peft with autocast.

Every function is built on first use (:func:`_functions`), so importing this module needs no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeAlias

if TYPE_CHECKING:
    import torch
    from bitsandbytes.functional import QuantState

    # One projection as the autograd functions carry it: packed weight, quant state, scale, bias.
    _Spec: TypeAlias = tuple[torch.Tensor, QuantState, float, torch.Tensor | None]

__all__ = [
    "GATE_ACTIVATIONS",
    "Projection",
    "liger_gate_available",
    "lora_gated_mlp",
    "lora_linear",
    "lora_shared_input",
]

# The gating activations of :func:`lora_gated_mlp`.
GATE_ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


@dataclass(frozen=True, slots=True)
class Projection:
    """One 4-bit projection with its adapter: the frozen weight, the trainable ``A``/``B``, the scale,
    and the base layer's frozen bias (``None`` for none)."""

    weight: torch.Tensor  # bitsandbytes Params4bit (packed uint8)
    quant_state: QuantState
    lora_A: torch.Tensor  # r × in
    lora_B: torch.Tensor  # out × r
    scale: float
    bias: torch.Tensor | None = None


class _Ctx(Protocol):
    """What the functions keep on autograd's context between forward and backward."""

    saved_tensors: tuple[torch.Tensor, ...]
    needs_input_grad: tuple[bool, ...]
    specs: tuple[_Spec, ...]
    dtype: torch.dtype
    x_shape: torch.Size
    x_dtype: torch.dtype
    adapter_dtypes: list[torch.dtype]
    act: str
    liger: bool

    def save_for_backward(self, *tensors: torch.Tensor) -> None: ...


class _Functions(NamedTuple):
    """The autograd functions, built on first use (:func:`_functions`)."""

    SharedInput: type[torch.autograd.Function]
    GatedMLP: type[torch.autograd.Function]


def _specs(projs: tuple[Projection, ...]) -> tuple[_Spec, ...]:
    return tuple((p.weight, p.quant_state, float(p.scale), p.bias) for p in projs)


def lora_linear(x: torch.Tensor, proj: Projection, dtype: torch.dtype) -> torch.Tensor:
    """``x Wᵀ + s (x Aᵀ) Bᵀ`` for one projection; returned in ``x``'s dtype."""
    (out,) = lora_shared_input(x, (proj,), dtype)
    return out


def lora_shared_input(
    x: torch.Tensor, projs: tuple[Projection, ...], dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """The projections of one input (q, k, v), each with its adapter; outputs in ``x``'s dtype."""
    adapters = [t for p in projs for t in (p.lora_A, p.lora_B)]
    return tuple(_functions().SharedInput.apply(x, dtype, _specs(projs), *adapters))


def lora_gated_mlp(
    x: torch.Tensor,
    gate_up: tuple[Projection, ...],
    down: Projection,
    dtype: torch.dtype,
    *,
    act: str = "silu",
    liger: bool = False,
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` with the adapters; returned in ``x``'s dtype.

    ``gate_up``: ``(gate, up)``, or ``(gate_up,)`` whose output's first half is ``gate`` and second
    half ``up`` (transformers' ``chunk(2, dim=-1)``). ``act``: one of :data:`GATE_ACTIVATIONS`.
    ``liger``: run the gated step in liger-kernel's Triton kernels where they can run (module
    docstring); PyTorch otherwise.
    """
    if act not in GATE_ACTIVATIONS or len(gate_up) not in (1, 2):
        raise ValueError(
            f"lora_gated_mlp: act={act!r} ({GATE_ACTIVATIONS}), {len(gate_up)} input projections"
        )
    projs = (*gate_up, down)
    adapters = [t for p in projs for t in (p.lora_A, p.lora_B)]
    use_liger = liger and x.device.type in ("cuda", "xpu") and act != "gelu" and liger_gate_available()
    out: torch.Tensor = _functions().GatedMLP.apply(x, dtype, _specs(projs), act, use_liger, *adapters)
    return out


@functools.cache
def liger_gate_available() -> bool:
    """Whether liger-kernel's SwiGLU and GeGLU kernels import (they need triton)."""
    try:
        from liger_kernel.ops.geglu import geglu_backward, geglu_forward  # noqa: F401
        from liger_kernel.ops.swiglu import swiglu_backward, swiglu_forward  # noqa: F401
    except Exception:  # not installed, no triton, or another layout of liger
        return False
    return True


def _act_mul(gate: torch.Tensor, up: torch.Tensor, act: str, liger: bool) -> torch.Tensor:
    """``act(gate) * up``."""
    if liger:
        if act == "silu":
            from liger_kernel.ops.swiglu import swiglu_forward

            return swiglu_forward(gate, up)[2]
        from liger_kernel.ops.geglu import geglu_forward

        return geglu_forward(gate, up)[2]
    import torch

    if act == "silu":
        return torch.nn.functional.silu(gate).mul_(up)
    return torch.nn.functional.gelu(gate, approximate="tanh" if act == "gelu_tanh" else "none").mul_(up)


def _act_mul_backward(
    gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor, act: str, liger: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``act(gate) * up`` for ``dh``; liger's kernels overwrite ``gate`` and ``up``."""
    if liger:
        if act == "silu":
            from liger_kernel.ops.swiglu import swiglu_backward

            d_gate, d_up = swiglu_backward(gate, up, dh)
        else:
            from liger_kernel.ops.geglu import geglu_backward

            d_gate, d_up = geglu_backward(gate, up, dh)
        return d_gate, d_up
    import torch

    if act != "silu":
        approximate = "tanh" if act == "gelu_tanh" else "none"
        d_up = dh * torch.nn.functional.gelu(gate, approximate=approximate)
        d_gate = torch.ops.aten.gelu_backward(dh.mul_(up), gate, approximate=approximate)
        return d_gate, d_up
    sig = torch.sigmoid(gate)
    silu = gate * sig
    d_up = dh * silu
    del silu
    # d silu(g) / dg = sig * (1 + g * (1 - sig))
    d_gate = dh.mul_(up).mul_(torch.rsub(sig, 1).mul_(gate).add_(1).mul_(sig))
    return d_gate, d_up


def _dequant(weight: torch.Tensor, quant_state: QuantState, dtype: torch.dtype) -> torch.Tensor:
    from xpukit.kernels.nf4 import dequantize_nf4

    w = dequantize_nf4(weight, quant_state)
    return w if w.dtype == dtype else w.to(dtype)  # bitsandbytes' MatMul4Bit casts the same way


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * (a @ b)`` as one GEMM (``beta=0``: the empty input is ignored, NaNs included)."""
    import torch

    return torch.addmm(a.new_empty(a.shape[0], b.shape[1]), a, b, beta=0, alpha=scale)


def _gate_up_parts(n_in: int, out_features: int) -> tuple[tuple[int, slice], tuple[int, slice]]:
    """Where ``gate`` and ``up`` come from: (input projection, its output rows)."""
    if n_in == 2:
        return (0, slice(None)), (1, slice(None))
    half = out_features // 2
    return (0, slice(0, half)), (0, slice(half, None))


@functools.cache
def _functions() -> _Functions:
    """Define the autograd functions (needs torch; built once) from the pieces below."""
    import torch

    class SharedInput(torch.autograd.Function):  # type: ignore[misc]
        """Projections of one input with their adapters (:func:`lora_shared_input`)."""

        @staticmethod
        def forward(
            ctx: _Ctx, x: torch.Tensor, dtype: torch.dtype, specs: tuple[_Spec, ...], *adapters: torch.Tensor
        ) -> tuple[torch.Tensor, ...]:
            return _shared_forward(ctx, x, dtype, specs, adapters)

        @staticmethod
        def backward(ctx: _Ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
            return _shared_backward(ctx, grads)

    class GatedMLP(torch.autograd.Function):  # type: ignore[misc]
        """``down(act(gate(x)) * up(x))`` with the adapters (:func:`lora_gated_mlp`)."""

        @staticmethod
        def forward(
            ctx: _Ctx,
            x: torch.Tensor,
            dtype: torch.dtype,
            specs: tuple[_Spec, ...],
            act: str,
            liger: bool,
            *adapters: torch.Tensor,
        ) -> torch.Tensor:
            return _gated_forward(ctx, x, dtype, specs, act, liger, adapters)

        @staticmethod
        def backward(ctx: _Ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            return _gated_backward(ctx, grad)

    return _Functions(SharedInput=SharedInput, GatedMLP=GatedMLP)


def _shared_forward(
    ctx: _Ctx,
    x: torch.Tensor,
    dtype: torch.dtype,
    specs: tuple[_Spec, ...],
    adapters: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, ...]:
    """Each projection of ``x``: the 4-bit product plus the scaled LoRA term; saves ``x`` and ``x Aᵀ``."""
    import torch

    with torch.autocast(x.device.type, enabled=False):
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        cast = [t.to(dtype) for t in adapters]
        outs, lora_in = [], []
        for i, (weight, quant_state, scale, bias) in enumerate(specs):
            a, b = cast[2 * i], cast[2 * i + 1]
            y = x2 @ _dequant(weight, quant_state, dtype).t()
            if bias is not None:
                y.add_(bias.to(dtype))
            xa = x2 @ a.t()
            y.addmm_(xa, b.t(), alpha=scale)
            outs.append(y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype))
            lora_in.append(xa)
    ctx.save_for_backward(x2, *cast, *lora_in)
    ctx.specs, ctx.dtype, ctx.x_shape, ctx.x_dtype = specs, dtype, x.shape, x.dtype
    ctx.adapter_dtypes = [t.dtype for t in adapters]
    return tuple(outs)


def _shared_backward(ctx: _Ctx, grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
    """The adapters' gradients per projection, and ``dx`` accumulated in one buffer."""
    import torch

    n = len(ctx.specs)
    x2, *rest = ctx.saved_tensors
    cast, lora_in = rest[: 2 * n], rest[2 * n :]
    need_x = ctx.needs_input_grad[0]
    adapter_grads: list[torch.Tensor | None] = []
    dx = None
    with torch.autocast(x2.device.type, enabled=False):
        for i, (weight, quant_state, scale, _) in enumerate(ctx.specs):
            a, b = cast[2 * i], cast[2 * i + 1]
            grad = grads[i]
            if grad is None:  # an output that was not used
                adapter_grads += [None, None]
                continue
            dy = grad.reshape(-1, b.shape[0]).to(ctx.dtype)
            dyb = dy @ b
            adapter_grads.append(_scaled_mm(dyb.t(), x2, scale).to(ctx.adapter_dtypes[2 * i]))
            adapter_grads.append(_scaled_mm(dy.t(), lora_in[i], scale).to(ctx.adapter_dtypes[2 * i + 1]))
            if need_x:
                w = _dequant(weight, quant_state, ctx.dtype)
                dx = dy @ w if dx is None else dx.addmm_(dy, w)
                dx.addmm_(dyb, a, alpha=scale)
    if dx is not None:
        dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
    return (dx, None, None, *adapter_grads)


def _gate_and_up(
    x2: torch.Tensor,
    cast: list[torch.Tensor],
    specs: tuple[_Spec, ...],
    dtype: torch.dtype,
    xas: list[torch.Tensor],
) -> list[torch.Tensor]:
    """``gate(x)`` and ``up(x)`` with their LoRA terms (two projections, or the halves of one)."""
    n_in = len(specs) - 1
    halves: list[torch.Tensor] = []
    w, held = x2, -1  # the dequantised weight of input projection `held`
    for i, rows in _gate_up_parts(n_in, cast[1].shape[0]):
        weight, quant_state, scale, bias = specs[i]
        if held != i:
            w, held = _dequant(weight, quant_state, dtype), i
        y = x2 @ w[rows].t()
        if bias is not None:
            y.add_(bias[rows].to(dtype))
        y.addmm_(xas[i], cast[2 * i + 1][rows].t(), alpha=scale)
        halves.append(y)
    del w
    return halves


def _gated_forward(
    ctx: _Ctx,
    x: torch.Tensor,
    dtype: torch.dtype,
    specs: tuple[_Spec, ...],
    act: str,
    liger: bool,
    adapters: tuple[torch.Tensor, ...],
) -> torch.Tensor:
    """``down(act(gate) * up)`` with the adapters; saves ``x``, ``gate``, ``up`` and the ``x Aᵀ``."""
    import torch

    n_in = len(specs) - 1
    with torch.autocast(x.device.type, enabled=False):
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        cast = [t.to(dtype) for t in adapters]
        xas = [x2 @ cast[2 * i].t() for i in range(n_in)]
        gate, up = _gate_and_up(x2, cast, specs, dtype, xas)
        h = _act_mul(gate, up, act, liger)
        wd4, qd, sd, bias_d = specs[-1]
        ad, bd = cast[-2], cast[-1]
        y = h @ _dequant(wd4, qd, dtype).t()
        if bias_d is not None:
            y.add_(bias_d.to(dtype))
        ha = h @ ad.t()
        y.addmm_(ha, bd.t(), alpha=sd)
    ctx.save_for_backward(x2, gate, up, ha, *xas, *cast)
    ctx.specs, ctx.dtype, ctx.x_shape, ctx.x_dtype = specs, dtype, x.shape, x.dtype
    ctx.adapter_dtypes, ctx.act, ctx.liger = [t.dtype for t in adapters], act, liger
    return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)


def _gate_up_backward(
    ctx: _Ctx,
    x2: torch.Tensor,
    xas: list[torch.Tensor],
    cast: list[torch.Tensor],
    d_halves: tuple[torch.Tensor, torch.Tensor],
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The gate and up adapters' gradients and ``dx``, from the gradients of ``gate`` and ``up``."""
    import torch

    n_in = len(ctx.specs) - 1
    grads: list[torch.Tensor] = []
    dx: torch.Tensor | None = None
    parts = _gate_up_parts(n_in, cast[1].shape[0])
    for i in range(n_in):
        weight, quant_state, scale, _ = ctx.specs[i]
        a, b = cast[2 * i], cast[2 * i + 1]
        mine = [(d, rows) for d, (j, rows) in zip(d_halves, parts, strict=True) if j == i]
        dab = mine[0][0] @ b[mine[0][1]]  # the halves of a gate_up_proj share x Aᵀ: dA sums
        for d, rows in mine[1:]:
            dab.addmm_(d, b[rows])
        d_b = [_scaled_mm(d.t(), xas[i], scale) for d, _ in mine]
        grads += [_scaled_mm(dab.t(), x2, scale), d_b[0] if len(d_b) == 1 else torch.cat(d_b)]
        if ctx.needs_input_grad[0]:
            w = _dequant(weight, quant_state, ctx.dtype)
            for d, rows in mine:
                dx = d @ w[rows] if dx is None else dx.addmm_(d, w[rows])
            assert dx is not None
            dx.addmm_(dab, a, alpha=scale)
    return grads, dx


def _gated_backward(ctx: _Ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The down adapter's gradients, ``act(gate) * up`` recomputed, then gate's and up's (and ``dx``)."""
    import torch

    n_in = len(ctx.specs) - 1
    x2, gate, up, ha, *rest = ctx.saved_tensors
    xas, cast = rest[:n_in], rest[n_in:]
    wd4, qd, sd, _ = ctx.specs[-1]
    ad, bd = cast[-2], cast[-1]
    with torch.autocast(x2.device.type, enabled=False):
        dy = grad.reshape(-1, bd.shape[0]).to(ctx.dtype)
        dyb = dy @ bd
        d_ad = _scaled_mm(dyb.t(), _act_mul(gate, up, ctx.act, ctx.liger), sd)  # h, recomputed
        d_bd = _scaled_mm(dy.t(), ha, sd)
        dh = dy @ _dequant(wd4, qd, ctx.dtype)
        dh.addmm_(dyb, ad, alpha=sd)
        d_halves = _act_mul_backward(gate, up, dh, ctx.act, ctx.liger)
        del dh
        grads, dx = _gate_up_backward(ctx, x2, xas, cast, d_halves)
    grads += [d_ad, d_bd]
    adapter_grads = [g.to(dt) for g, dt in zip(grads, ctx.adapter_dtypes, strict=True)]
    if dx is not None:
        dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
    return (dx, None, None, None, None, *adapter_grads)
