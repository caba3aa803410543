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
- :func:`lora_swiglu_mlp`: ``down(silu(gate(x)) * up(x))`` in one function. It saves ``x``, ``gate``
  and ``up`` and recomputes ``silu(gate) * up`` in backward (elementwise, cheap); peft's module path
  keeps ``gate``, ``silu(gate)``, ``up`` and their product as well. Recomputing ``gate``/``up``
  themselves would save two more ``tokens × intermediate`` tensors at the price of two dequantisations
  and two large matmuls, so it is not done.

The SwiGLU elementwise step (``silu(gate) * up`` and its backward) runs in liger-kernel's Triton
kernels (``liger_kernel.ops.swiglu``: one kernel each way; the backward writes the gradients of
``gate`` and ``up`` over their saved tensors, so a function's backward can run only once) when
``liger=True`` and the tensors are on CUDA/XPU, and in plain PyTorch otherwise (``liger=False``, the
reference). liger computes it in fp32 and rounds once; PyTorch rounds ``silu(gate)`` before the
product, so under bf16 the two differ by bf16 rounding.

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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["Projection", "liger_swiglu_available", "lora_linear", "lora_shared_input", "lora_swiglu_mlp"]


@dataclass(frozen=True, slots=True)
class Projection:
    """One 4-bit projection with its adapter: the frozen weight, the trainable ``A``/``B``, the scale."""

    weight: Any  # bitsandbytes Params4bit (packed uint8)
    quant_state: Any
    lora_A: torch.Tensor  # r × in
    lora_B: torch.Tensor  # out × r
    scale: float


def lora_linear(x: torch.Tensor, proj: Projection, dtype: torch.dtype) -> torch.Tensor:
    """``x Wᵀ + s (x Aᵀ) Bᵀ`` for one projection; returned in ``x``'s dtype."""
    (out,) = lora_shared_input(x, (proj,), dtype)
    return out


def lora_shared_input(
    x: torch.Tensor, projs: tuple[Projection, ...], dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """The projections of one input (q, k, v), each with its adapter; outputs in ``x``'s dtype."""
    adapters = [t for p in projs for t in (p.lora_A, p.lora_B)]
    specs = tuple((p.weight, p.quant_state, float(p.scale)) for p in projs)
    return tuple(_functions().SharedInput.apply(x, dtype, specs, *adapters))


def lora_swiglu_mlp(
    x: torch.Tensor,
    gate: Projection,
    up: Projection,
    down: Projection,
    dtype: torch.dtype,
    *,
    liger: bool = False,
) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` with the three adapters; returned in ``x``'s dtype.

    ``liger``: run the SwiGLU step in liger-kernel's Triton kernels where they can run (module
    docstring); PyTorch otherwise.
    """
    adapters = [t for p in (gate, up, down) for t in (p.lora_A, p.lora_B)]
    specs = tuple((p.weight, p.quant_state, float(p.scale)) for p in (gate, up, down))
    use_liger = liger and x.device.type in ("cuda", "xpu") and liger_swiglu_available()
    out: torch.Tensor = _functions().SwiGLU.apply(x, dtype, specs, use_liger, *adapters)
    return out


@functools.cache
def liger_swiglu_available() -> bool:
    """Whether liger-kernel's SwiGLU kernels import (they need triton)."""
    try:
        from liger_kernel.ops.swiglu import swiglu_backward, swiglu_forward  # noqa: F401
    except Exception:  # not installed, no triton, or another layout of liger
        return False
    return True


def _silu_mul(gate: torch.Tensor, up: torch.Tensor, liger: bool) -> torch.Tensor:
    if liger:
        from liger_kernel.ops.swiglu import swiglu_forward

        return swiglu_forward(gate, up)[2]
    import torch

    return torch.nn.functional.silu(gate).mul_(up)


def _silu_mul_backward(
    gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor, liger: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``silu(gate) * up`` for ``dh``; liger's kernel overwrites ``gate`` and ``up``."""
    if liger:
        from liger_kernel.ops.swiglu import swiglu_backward

        d_gate, d_up = swiglu_backward(gate, up, dh)
        return d_gate, d_up
    import torch

    sig = torch.sigmoid(gate)
    silu = gate * sig
    d_up = dh * silu
    del silu
    # d silu(g) / dg = sig * (1 + g * (1 - sig))
    d_gate = dh.mul_(up).mul_(torch.rsub(sig, 1).mul_(gate).add_(1).mul_(sig))
    return d_gate, d_up


def _dequant(weight: Any, quant_state: Any, dtype: torch.dtype) -> torch.Tensor:
    from xpukit.kernels.nf4 import dequantize_nf4

    w = dequantize_nf4(weight, quant_state)
    return w if w.dtype == dtype else w.to(dtype)  # bitsandbytes' MatMul4Bit casts the same way


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * (a @ b)`` as one GEMM (``beta=0``: the empty input is ignored, NaNs included)."""
    import torch

    return torch.addmm(a.new_empty(a.shape[0], b.shape[1]), a, b, beta=0, alpha=scale)


@functools.cache
def _functions() -> Any:
    """Define the autograd functions (needs torch; built once)."""
    import torch

    class SharedInput(torch.autograd.Function):  # type: ignore[misc]
        """Projections of one input with their adapters (:func:`lora_shared_input`)."""

        @staticmethod
        def forward(
            ctx: Any, x: torch.Tensor, dtype: torch.dtype, specs: Any, *adapters: torch.Tensor
        ) -> Any:
            with torch.autocast(x.device.type, enabled=False):
                x2 = x.reshape(-1, x.shape[-1]).to(dtype)
                cast = [t.to(dtype) for t in adapters]
                outs, lora_in = [], []
                for i, (weight, quant_state, scale) in enumerate(specs):
                    a, b = cast[2 * i], cast[2 * i + 1]
                    y = x2 @ _dequant(weight, quant_state, dtype).t()
                    xa = x2 @ a.t()
                    y.addmm_(xa, b.t(), alpha=scale)
                    outs.append(y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype))
                    lora_in.append(xa)
            ctx.save_for_backward(x2, *cast, *lora_in)
            ctx.specs, ctx.dtype, ctx.x_shape, ctx.x_dtype = specs, dtype, x.shape, x.dtype
            ctx.adapter_dtypes = [t.dtype for t in adapters]
            return tuple(outs)

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
            n = len(ctx.specs)
            x2, *rest = ctx.saved_tensors
            cast, lora_in = rest[: 2 * n], rest[2 * n :]
            need_x = ctx.needs_input_grad[0]
            adapter_grads: list[torch.Tensor | None] = []
            dx = None
            with torch.autocast(x2.device.type, enabled=False):
                for i, (weight, quant_state, scale) in enumerate(ctx.specs):
                    a, b = cast[2 * i], cast[2 * i + 1]
                    grad = grads[i]
                    if grad is None:  # an output that was not used
                        adapter_grads += [None, None]
                        continue
                    dy = grad.reshape(-1, b.shape[0]).to(ctx.dtype)
                    dyb = dy @ b
                    adapter_grads.append(_scaled_mm(dyb.t(), x2, scale).to(ctx.adapter_dtypes[2 * i]))
                    adapter_grads.append(
                        _scaled_mm(dy.t(), lora_in[i], scale).to(ctx.adapter_dtypes[2 * i + 1])
                    )
                    if need_x:
                        w = _dequant(weight, quant_state, ctx.dtype)
                        dx = dy @ w if dx is None else dx.addmm_(dy, w)
                        dx.addmm_(dyb, a, alpha=scale)
            if dx is not None:
                dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
            return (dx, None, None, *adapter_grads)

    class SwiGLU(torch.autograd.Function):  # type: ignore[misc]
        """``down(silu(gate(x)) * up(x))`` with the three adapters (:func:`lora_swiglu_mlp`)."""

        @staticmethod
        def forward(
            ctx: Any, x: torch.Tensor, dtype: torch.dtype, specs: Any, liger: bool, *adapters: torch.Tensor
        ) -> Any:
            with torch.autocast(x.device.type, enabled=False):
                x2 = x.reshape(-1, x.shape[-1]).to(dtype)
                ag, bg, au, bu, ad, bd = (t.to(dtype) for t in adapters)
                (wg4, qg, sg), (wu4, qu, su), (wd4, qd, sd) = specs
                gate = x2 @ _dequant(wg4, qg, dtype).t()
                xag = x2 @ ag.t()
                gate.addmm_(xag, bg.t(), alpha=sg)
                up = x2 @ _dequant(wu4, qu, dtype).t()
                xau = x2 @ au.t()
                up.addmm_(xau, bu.t(), alpha=su)
                h = _silu_mul(gate, up, liger)
                y = h @ _dequant(wd4, qd, dtype).t()
                ha = h @ ad.t()
                y.addmm_(ha, bd.t(), alpha=sd)
            ctx.save_for_backward(x2, gate, up, xag, xau, ha, ag, bg, au, bu, ad, bd)
            ctx.specs, ctx.dtype, ctx.x_shape, ctx.x_dtype = specs, dtype, x.shape, x.dtype
            ctx.adapter_dtypes, ctx.liger = [t.dtype for t in adapters], liger
            return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> Any:
            x2, gate, up, xag, xau, ha, ag, bg, au, bu, ad, bd = ctx.saved_tensors
            (wg4, qg, sg), (wu4, qu, su), (wd4, qd, sd) = ctx.specs
            dtypes = ctx.adapter_dtypes
            with torch.autocast(x2.device.type, enabled=False):
                dy = grad.reshape(-1, bd.shape[0]).to(ctx.dtype)
                dyb = dy @ bd
                d_ad = _scaled_mm(dyb.t(), _silu_mul(gate, up, ctx.liger), sd)  # h, recomputed
                d_bd = _scaled_mm(dy.t(), ha, sd)
                dh = dy @ _dequant(wd4, qd, ctx.dtype)
                dh.addmm_(dyb, ad, alpha=sd)
                d_gate, d_up = _silu_mul_backward(gate, up, dh, ctx.liger)
                del dh
                grads: list[torch.Tensor] = []
                dx: torch.Tensor | None = None
                for d, xa, a, b, w4, qs, s in (
                    (d_gate, xag, ag, bg, wg4, qg, sg),
                    (d_up, xau, au, bu, wu4, qu, su),
                ):
                    dab = d @ b
                    grads += [_scaled_mm(dab.t(), x2, s), _scaled_mm(d.t(), xa, s)]
                    if ctx.needs_input_grad[0]:
                        w = _dequant(w4, qs, ctx.dtype)
                        dx = d @ w if dx is None else dx.addmm_(d, w)
                        dx.addmm_(dab, a, alpha=s)
            grads += [d_ad, d_bd]
            adapter_grads = [g.to(dt) for g, dt in zip(grads, dtypes, strict=True)]
            if dx is not None:
                dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
            return (dx, None, None, None, *adapter_grads)

    class _Functions:
        pass

    functions = _Functions()
    functions.SharedInput = SharedInput  # type: ignore[attr-defined]
    functions.SwiGLU = SwiGLU  # type: ignore[attr-defined]
    return functions
