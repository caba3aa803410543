"""liger-kernel's RoPE kernel inside the layer graphs, where it computes what the model's own does.

transformers' RoPE is ``q * cos + rotate_half(q) * sin`` and the same for ``k``: a slice, a
negation, a concatenation, two products and a sum each way, forward and backward, for every layer.
liger-kernel's ``liger_rotary_pos_emb`` does ``q`` and ``k`` in one Triton kernel each way. On an
H200 (fused 4-bit LoRA in the layer graphs, 4 × 512 tokens) it took Llama-3.1-8B's step from 146.4 to
134.2 ms of device time, measured with liger's function swapped in for a whole bench process
(docs/benchmarks.md "Other families").

transformers' attention calls the module-level ``apply_rotary_pos_emb`` of its modeling module, and
a module attribute is process-wide: set for good, every later model of the family in the process
would run it, a CPU model included (where Triton cannot run). So liger's function is put there only
while the layer graphs capture (:meth:`GraphRope.swapped`): the replays run its kernels, the eager
passes (the first training call, evaluation, ``generate``) keep transformers'. Both compute the same
function, so a replayed and an eager pass train the same thing.

Before the first capture uses it, liger's function is checked against each modeling module's own on
the position embeddings of that very call (cos and sin in float32, random ``q``/``k`` laid out as
the attention hands them over, forward and both gradients): they must agree within
:data:`TOLERANCE` of the largest value. A family whose RoPE is another function (GLM-4 interleaves
the rotated pairs) fails the check and keeps its own, with the difference in :attr:`GraphRope.note`
(docs/layer-graphs.md "RoPE in the layer graphs").
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, TypeAlias, TypeVar

from xpukit.loading.training.layer_calls import Call
from xpukit.planning.model.shape import model_shape

if TYPE_CHECKING:
    import torch

__all__ = ["ROPE_GLOBAL", "TOLERANCE", "GraphRope", "RopeFunction", "rope_difference"]

# ``apply_rotary_pos_emb(q, k, cos, sin, ...)`` -> the rotated ``(q, k)``: transformers' or liger's.
RopeFunction: TypeAlias = Callable[..., tuple["torch.Tensor", "torch.Tensor"]]
_T = TypeVar("_T")

ROPE_GLOBAL = "apply_rotary_pos_emb"
# Largest |liger - own| over the largest |own|, float32 (rounding differences are ~1e-7).
TOLERANCE = 1e-4
_Q_HEADS, _KV_HEADS = 3, 1  # enough to tell the layout; a small check


def _liger_rope() -> RopeFunction | None:
    try:
        from liger_kernel.transformers import liger_rotary_pos_emb
    except Exception:  # not installed, or a layout without it
        return None
    rope: RopeFunction = liger_rotary_pos_emb  # liger-kernel ships no type information
    return rope


def _head_dim(attn: object) -> int | None:
    """The attention's head size: its own attribute, else its config's (:func:`model_shape`)."""
    head_dim = getattr(attn, "head_dim", None)
    if head_dim:
        return int(head_dim)
    config = getattr(attn, "config", None)
    shape = model_shape(config) if config is not None else None
    return shape.head_dim if shape is not None else None


def rope_difference(
    own: RopeFunction, other: RopeFunction, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> float:
    """The largest difference between ``other`` and ``own`` RoPE (outputs, and gradients of ``q`` and
    ``k`` for one random upstream gradient) over the largest |value|, in float32. ``q``/``k`` come
    as transformers' attention hands them over: ``[batch, seq, heads, dim]`` transposed to
    ``[batch, heads, seq, dim]``, not leaves (liger's kernel writes such tensors in place)."""
    import torch

    cos, sin = cos.detach().float(), sin.detach().float()
    batch, seq = cos.shape[0], cos.shape[-2]
    generator = torch.Generator().manual_seed(0)

    def randn(heads: int) -> torch.Tensor:
        return torch.randn(batch, seq, heads, head_dim, generator=generator).to(cos.device)

    q0, k0 = randn(_Q_HEADS), randn(_KV_HEADS)
    dq, dk = randn(_Q_HEADS).transpose(1, 2), randn(_KV_HEADS).transpose(1, 2)
    results = []
    for fn in (own, other):
        q, k = q0.clone().requires_grad_(True), k0.clone().requires_grad_(True)
        q_out, k_out = fn((q * 1.0).transpose(1, 2), (k * 1.0).transpose(1, 2), cos, sin)
        grads = torch.autograd.grad((q_out, k_out), (q, k), (dq, dk))
        results.append([q_out.detach(), k_out.detach(), *grads])
    worst = 0.0
    for a, b in zip(*results, strict=True):
        scale = float(a.abs().max()) or 1.0
        worst = max(worst, float((a - b).abs().max()) / scale)
    return worst


class GraphRope:
    """Whether the layer graphs capture with liger-kernel's RoPE; decided once, at the first capture.

    Attributes:
        active: liger's RoPE is put in place while the graphs capture.
        note: what runs, and why (the check's measured difference, or why not).
    """

    def __init__(self, layers: Sequence[torch.nn.Module], *, wanted: bool) -> None:
        self.layers = list(layers)
        self.active = False
        self._decided = not wanted
        off = "transformers' RoPE (liger-kernel's turned off)"
        self.note = off if not wanted else "not decided (nothing captured)"
        self._modules: list[ModuleType] = []
        self._fn: RopeFunction | None = None

    def decide(self, calls: Sequence[Call]) -> None:
        """Check liger's RoPE against each modeling module's own on ``calls`` (the layers'
        ``(args, kwargs)`` of the call about to be captured); only the first call decides."""
        if self._decided:
            return
        self._decided = True
        fn = _liger_rope()
        if fn is None:
            self.note = "transformers' RoPE (liger-kernel's liger_rotary_pos_emb cannot be imported)"
            return
        # each modeling module: (the module, its own RoPE, one layer's (cos, sin), the head size)
        checks: dict[str, tuple[ModuleType, RopeFunction, tuple[torch.Tensor, torch.Tensor], int]] = {}
        for layer, (_, kwargs) in zip(self.layers, calls, strict=True):
            attn = getattr(layer, "self_attn", None)
            module = sys.modules.get(type(attn).__module__)
            own = getattr(module, ROPE_GLOBAL, None)
            embeddings = kwargs.get("position_embeddings")
            head_dim = _head_dim(attn)
            if module is None or own is None or not isinstance(embeddings, tuple) or head_dim is None:
                self.note = (
                    f"transformers' RoPE (cannot check {type(attn).__name__}'s: no {ROPE_GLOBAL} in its "
                    "module, position embeddings or head size)"
                )
                return
            checks.setdefault(module.__name__, (module, own, embeddings, head_dim))
        worst = 0.0
        for name, (_, own, (cos, sin), head_dim) in checks.items():
            try:
                difference = rope_difference(own, fn, cos, sin, head_dim)
            except Exception as exc:  # a shape liger's kernel does not take
                self.note = f"transformers' RoPE (liger's failed on {name}'s: {type(exc).__name__}: {exc})"
                return
            if not difference <= TOLERANCE:
                self.note = (
                    f"transformers' RoPE: liger-kernel's differs from {name}.{ROPE_GLOBAL} by "
                    f"{difference:.1e} (tolerance {TOLERANCE:.0e})"
                )
                return
            worst = max(worst, difference)
        self.active, self._fn = True, fn
        self._modules = [module for module, *_ in checks.values()]
        self.note = (
            f"liger-kernel's RoPE in the graphs' replays (agrees with {', '.join(checks)} within "
            f"{worst:.1e}); eager passes keep transformers'"
        )

    def run(self, capture: Callable[[], _T], *, keep: type[BaseException]) -> _T:
        """``capture()`` with liger's RoPE in place; if that raises (other than ``keep``), once more
        with transformers' (liger's kernel runs only here), and liger's stays off."""
        if not self.active:
            return capture()
        try:
            with self.swapped():
                return capture()
        except keep:
            raise
        except Exception as exc:
            self.active = False
            failure = f"{type(exc).__name__}: {exc}"
            self.note = f"transformers' RoPE (a capture failed with liger-kernel's: {failure})"
        return capture()

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Within: the checked modeling modules' ``apply_rotary_pos_emb`` is liger's."""
        if not self.active:
            yield
            return
        saved = [(module, vars(module).get(ROPE_GLOBAL)) for module in self._modules]
        for module, _ in saved:
            setattr(module, ROPE_GLOBAL, self._fn)
        try:
            yield
        finally:
            for module, own in saved:
                setattr(module, ROPE_GLOBAL, own)
