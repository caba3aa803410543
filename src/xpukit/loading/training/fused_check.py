"""The load-time proof of the fused LoRA path: each distinct decoder-block type against peft's block.

docs/fused-lora.md "The load-time check". For the first block of each distinct type (the block's,
attention's and MLP's classes and the per-layer attention settings: sliding window, RoPE on or off,
layer type), :func:`check_blocks`:

1. runs the model on a small random batch of token ids (:data:`BATCH` × :data:`TOKENS`), without
   gradients, up to that block, and keeps the block's real inputs (hidden states, position
   embeddings, mask);
2. gives the block's LoRA ``B`` matrices random values for the check (peft starts them at zero, which
   would hide the adapter term and every ``A`` gradient), restored afterwards;
3. runs the block in eval mode (no dropout) once on peft's path and once on the fused path, with a
   backward of one random projection of the output, and compares the output, the input's gradient
   and every LoRA gradient of the block as relative L2 errors ``‖fused − peft‖ / ‖peft‖``
   against :data:`TOLERANCES` for the block's compute dtype;
4. in bf16 and fp16, where those tolerances are rounding noise, a block beyond them gets a second
   chance against the exact answer: peft's block runs once more in float32 on the same weights (the
   4-bit ones dequantised to float32), and the block agrees when the fused path is no further from
   that than :data:`REFERENCE_RATIO` times peft's own bf16 path, output and gradients alike.

It draws its random numbers from its own generator, so the caller's RNG (data order, dropout) is
untouched, and changes nothing it does not restore.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, cast

from xpukit.loading.training.fused_blocks import peft_path

if TYPE_CHECKING:
    import torch

__all__ = ["BATCH", "TOKENS", "TOLERANCES", "BlockCheck", "block_key", "check_blocks", "describe"]

BATCH, TOKENS = 1, 16
# Relative L2 error allowed, (output and input gradient, each LoRA gradient), by compute dtype.
# float32: the targets of docs/training.md; bf16/fp16: the rounding of the compute dtype, which the
# two paths round differently (docs/fused-lora.md "The load-time check" has the measurements).
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-4, 1e-3),
    "bfloat16": (3e-2, 6e-2),
    "float16": (5e-3, 1e-2),
}
# bf16/fp16 beyond TOLERANCES: agree when ‖fused − exact‖ ≤ RATIO × ‖peft − exact‖ + FLOOR (relative).
REFERENCE_RATIO, REFERENCE_FLOOR = 2.0, 1e-3
_ATTENTION_SETTINGS = ("is_sliding", "sliding_window", "use_rope", "layer_type", "attention_type")

# A block's call as the model made it: (positional arguments, keyword arguments).
_BlockCall: TypeAlias = tuple[tuple[object, ...], dict[str, object]]
# One path's run of a block: its output, and the gradients of its input and of each trained parameter.
_Run: TypeAlias = tuple["torch.Tensor", list["torch.Tensor | None"]]


@dataclass(frozen=True, slots=True)
class BlockCheck:
    """One block type's check: where, how many blocks share it, the errors and the verdict."""

    kind: str
    first: str
    blocks: int
    dtype: str
    output_error: float
    gradient_error: float
    worst: str  # the gradient with the largest error
    tolerance: tuple[float, float]
    seconds: float
    error: str | None = None  # the check could not run
    # Against peft's block in float32 (bf16/fp16 only): fused output, fused worst gradient, peft
    # output, peft worst gradient, each as a relative error.
    reference: tuple[float, float, float, float] | None = None

    @property
    def within_tolerance(self) -> bool:
        return _within(self.tolerance, self.output_error, self.gradient_error)

    @property
    def as_exact_as_peft(self) -> bool:
        if self.reference is None:
            return False
        fused_out, fused_grad, peft_out, peft_grad = self.reference
        return (
            fused_out <= REFERENCE_RATIO * peft_out + REFERENCE_FLOOR
            and fused_grad <= REFERENCE_RATIO * peft_grad + REFERENCE_FLOOR
        )

    @property
    def agrees(self) -> bool:
        return self.error is None and (self.within_tolerance or self.as_exact_as_peft)

    def text(self) -> str:
        if self.error is not None:
            return f"{self.kind} ({self.blocks} blocks): the check could not run ({self.error})"
        verdict = "agrees with" if self.agrees else "DIFFERS from"
        exact = ""
        if self.reference is not None:
            fo, fg, po, pg = self.reference
            exact = (
                f"; against float32: fused {fo:.1e} / {fg:.1e}, peft {po:.1e} / {pg:.1e} "
                f"(allowed: fused ≤ {REFERENCE_RATIO:g} × peft + {REFERENCE_FLOOR:.0e})"
            )
        return (
            f"{self.kind} ({self.blocks} blocks, first {self.first}) {verdict} peft's block in {self.dtype}: "
            f"output {self.output_error:.1e}, worst gradient {self.gradient_error:.1e} ({self.worst}); "
            f"tolerance {self.tolerance[0]:.0e} / {self.tolerance[1]:.0e}{exact}; "
            f"{1e3 * self.seconds:.0f} ms"
        )


def block_key(block: torch.nn.Module) -> str:
    """What makes two blocks the same type for the check, in words."""
    attn, mlp = block.self_attn, block.mlp
    settings = [f"{a}={getattr(o, a)}" for o in (block, attn) for a in _ATTENTION_SETTINGS if hasattr(o, a)]
    names = f"{type(block).__name__}({type(attn).__name__}, {type(mlp).__name__})"
    return names + (f" [{', '.join(dict.fromkeys(settings))}]" if settings else "")


class _Captured(Exception):
    pass


def check_blocks(
    model: torch.nn.Module, groups: dict[str, list[tuple[str, torch.nn.Module]]], dtype: torch.dtype | None
) -> list[BlockCheck]:
    """Check the first block of each group (``{key: [(name, block), ...]}``) of ``model`` (the
    transformers model under peft, patched); ``dtype``: the compute dtype (``None``: bitsandbytes
    computes in the input's)."""
    import torch

    started = time.perf_counter()
    firsts = {key: members[0] for key, members in groups.items()}
    try:
        inputs = _capture(model, {id(b): key for key, (_, b) in firsts.items()})
    except Exception as exc:  # a model this forward does not fit: nothing is proven
        reason = f"{type(exc).__name__}: {str(exc)[:200]}"
        return [_failed(key, members, dtype, reason) for key, members in groups.items()]
    capture_s = (time.perf_counter() - started) / max(len(firsts), 1)
    checks = []
    generator = torch.Generator().manual_seed(0)
    for key, (name, block) in firsts.items():
        t0 = time.perf_counter()
        try:
            out_err, grad_err, worst, reference = _compare(block, *inputs[key], generator, dtype)
        except Exception as exc:
            checks.append(_failed(key, groups[key], dtype, f"{type(exc).__name__}: {str(exc)[:200]}"))
            continue
        seconds = capture_s + time.perf_counter() - t0
        checks.append(
            BlockCheck(
                kind=key,
                first=name,
                blocks=len(groups[key]),
                dtype=_dtype_name(dtype),
                output_error=out_err,
                gradient_error=grad_err,
                worst=worst,
                tolerance=_tolerance(dtype),
                seconds=seconds,
                reference=reference,
            )
        )
    return checks


def _failed(
    key: str, members: list[tuple[str, torch.nn.Module]], dtype: torch.dtype | None, reason: str
) -> BlockCheck:
    nan = float("nan")
    tol = _tolerance(dtype)
    return BlockCheck(key, members[0][0], len(members), _dtype_name(dtype), nan, nan, "", tol, 0.0, reason)


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


def _tolerance(dtype: torch.dtype | None) -> tuple[float, float]:
    """:data:`TOLERANCES` for the compute dtype (bf16's for one it does not list)."""
    return TOLERANCES.get(_dtype_name(dtype), TOLERANCES["bfloat16"])


def _within(tolerance: tuple[float, float], output_error: float, gradient_error: float) -> bool:
    return output_error <= tolerance[0] and gradient_error <= tolerance[1]


def _capture(model: torch.nn.Module, wanted: dict[int, str]) -> dict[str, _BlockCall]:
    """Run ``model`` on random ids until every wanted block has been reached; their inputs."""
    import torch

    embeddings = model.get_input_embeddings()
    device = embeddings.weight.device
    ids = torch.randint(
        0, embeddings.num_embeddings, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0)
    ).to(device)
    inputs: dict[str, _BlockCall] = {}
    blocks = {id(m): m for m in model.modules() if id(m) in wanted}

    def hook(module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        key = wanted[id(module)]
        if key not in inputs:
            inputs[key] = (args, dict(kwargs))
        if len(inputs) == len(wanted):
            raise _Captured

    handles = [b.register_forward_pre_hook(hook, with_kwargs=True) for b in blocks.values()]
    # In train mode: bitsandbytes repacks a 4-bit weight for its CPU inference kernel on an eval-mode
    # forward without gradients (docs/training.md
    # "The CPU repacking trap (bitsandbytes ≥ 0.48 on avx512_bf16 CPUs)").
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    except _Captured:
        pass
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in modes:
            module.training = mode
    missing = set(wanted.values()) - set(inputs)
    if missing:
        raise RuntimeError(f"the forward did not reach {sorted(missing)}")
    return inputs


def _compare(
    block: torch.nn.Module,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    generator: torch.Generator,
    dtype: torch.dtype | None,
) -> tuple[float, float, str, tuple[float, float, float, float] | None]:
    """(output/input-gradient error, worst LoRA-gradient error, its name, the float32 reference's
    errors or ``None``) of fused against peft; ``dtype``: the compute dtype (the 4-bit layers' and
    the fused path's; the hidden states may be float32 under autocast)."""
    import torch

    # the block's hidden states: its first argument (a tensor), positional or by name
    if args:
        hidden, rest = cast("torch.Tensor", args[0]), args[1:]
    else:
        hidden, rest = cast("torch.Tensor", kwargs.pop("hidden_states")), ()
    params = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
    saved = {n: p.detach().clone() for n, p in params if "lora_B" in n}
    was_training = block.training
    seed: list[torch.Tensor] = []

    def run(fused: bool, exact: bool = False) -> _Run:
        x = hidden.detach().clone().requires_grad_()
        call_args, call_kwargs = (
            (tuple(_float32(v) for v in rest), {k: _float32(v) for k, v in kwargs.items()})
            if exact
            else (rest, kwargs)
        )
        with _maybe_peft(block, not fused), _exact(block, exact):
            out = block(x.float() if exact else x, *call_args, **call_kwargs)
            out = out[0] if isinstance(out, tuple) else out
            if not seed:
                seed.append(torch.randn(out.shape, generator=generator).to(out.device, torch.float32))
            loss = (out.float() * seed[0]).sum()
            grads = torch.autograd.grad(loss, [x] + [p for _, p in params], allow_unused=True)
        return out.detach().float(), [g if g is None else g.float() for g in grads]

    try:
        with torch.no_grad():
            for n, p in params:
                if n in saved:
                    rank = p.shape[-1] if p.dim() > 1 else 1
                    noise = torch.randn(p.shape, generator=generator) * (0.02 / rank**0.5)
                    p.copy_(noise.to(p.dtype))
        block.eval()
        peft_run, fused_run = run(False), run(True)
        out_err, worst, worst_name = _errors(fused_run, peft_run, params)
        reference = None
        if _dtype_name(dtype) != "float32" and not _within(_tolerance(dtype), out_err, worst):
            exact_run = run(False, exact=True)
            fused_vs = _errors(fused_run, exact_run, params)
            peft_vs = _errors(peft_run, exact_run, params)
            reference = (fused_vs[0], fused_vs[1], peft_vs[0], peft_vs[1])
    finally:
        block.train(was_training)
        with torch.no_grad():
            for n, p in params:
                if n in saved:
                    p.copy_(saved[n])
    return out_err, worst, worst_name, reference


def _errors(got: _Run, ref: _Run, params: list[tuple[str, torch.nn.Parameter]]) -> tuple[float, float, str]:
    """(output/input-gradient error, worst parameter-gradient error, its name) of ``got``."""
    (out, grads), (ref_out, ref_grads) = got, ref
    out_err = max(_rel(out, ref_out), _rel(grads[0], ref_grads[0]))
    worst, worst_name = 0.0, ""
    for (name, _), g, r in zip(params, grads[1:], ref_grads[1:], strict=True):
        err = _rel(g, r)
        if err > worst or not worst_name:
            worst, worst_name = err, name
    return out_err, worst, worst_name


def _float32(value: object) -> object:
    """``value`` with every floating tensor in it (tuples, lists, dicts) as float32."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_float32(v) for v in value)
    if isinstance(value, dict):
        return {k: _float32(v) for k, v in value.items()}
    return value


def _exact(block: torch.nn.Module, on: bool) -> contextlib.AbstractContextManager[None]:
    """For the float32 reference: autocast off, and bitsandbytes' 4-bit layers computing in float32
    (``compute_dtype``; their dequantised weights are then exact in float32), restored after."""
    import torch

    if not on:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def switched() -> Iterator[None]:
        layers = [(m, m.compute_dtype) for m in block.modules() if hasattr(m, "compute_dtype")]
        for m, _ in layers:
            m.compute_dtype = torch.float32
        try:
            with torch.autocast(_block_device(block), enabled=False):
                yield
        finally:
            for m, dtype in layers:
                m.compute_dtype = dtype

    return switched()


def _block_device(block: torch.nn.Module) -> str:
    return str(next(block.parameters()).device.type)


def _maybe_peft(block: torch.nn.Module, on: bool) -> contextlib.AbstractContextManager[None]:
    return peft_path(block) if on else contextlib.nullcontext()


def _rel(got: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    if got is None or ref is None:
        return 0.0 if got is None and ref is None else float("inf")
    denom = float(ref.norm())
    diff = float((got - ref).norm())
    return diff / denom if denom > 0 else (0.0 if diff == 0 else float("inf"))


def describe(checks: Iterable[BlockCheck]) -> str:
    return "; ".join(c.text() for c in checks)
