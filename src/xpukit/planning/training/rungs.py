"""The rungs of the training plan's ladder and how one is chosen by fit (pure; docs/training-plan.md
"Training plan by fit", "A token budget per pass").

A rung is a set of memory savers (a fused cross-entropy, gradient checkpointing, plain or offloaded)
with the decoder layers as graphs or eagerly. :class:`Rungs` estimates a pass of any number of tokens
on each (:func:`xpukit.planning.training.activation_memory.activation_bytes`, the graphs' own buffers
included) and the most tokens a pass may carry within a budget; :func:`choose` takes the fastest rung
whose worst step fits, else keeps the whole batch by tokens, else splits it by sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from xpukit.planning.training.activation_memory import activation_bytes, graph_bucket, graph_buffer_bytes
from xpukit.planning.training.training_plan import option_text

if TYPE_CHECKING:
    from xpukit.planning.model.shape import ModelShape
    from xpukit.planning.training.lora_request import LoraRequest

__all__ = ["Choice", "Rung", "Rungs", "choose", "ladder_of", "micro_batches"]

# One rung of the ladder: (fused cross-entropy, gradient checkpointing, the layers as graphs).
Rung = tuple[bool, bool | str, bool]
# A step with only some layers checkpointed is sized to fill the room: its estimate, which ran up to
# 3 % under the measured peaks (docs/training-plan.md "The activation estimate"), must fit with 5 % spare.
PARTLY_SPARE = 1.05


@dataclass(frozen=True)
class Rungs:
    """What sizing a pass needs, fixed before any rung is tried: the shape, the request, the device's
    backend and the paths that will run (:func:`plan_training`'s arguments)."""

    shape: ModelShape
    request: LoraRequest
    compute_bytes: int
    backend: str
    fused: bool
    packed: bool
    graphs: bool
    dequant: int
    liger_ok: bool

    def kind(self, fused_ce: bool) -> str:
        """Which cross-entropy: plain, else liger's where it may run, else xpukit's chunked one."""
        if not fused_ce:
            return "plain"
        return "liger" if self.liger_ok and self.request.liger is not False else "chunked"

    def estimate(self, rung: Rung, tokens: int, checkpointed: int | None = None) -> dict[str, int]:
        """The activation estimate of a pass of ``tokens`` tokens on this rung (docs/training-plan.md "The
        activation estimate"), the graphs' own buffers included where the layers run as graphs.
        ``checkpointed``: on a checkpointed rung, only that many layers are (:meth:`fewest_checkpointed`)."""
        fused_ce, gc, graphs = rung
        # The fused path's and liger's smaller saved tensors are counted on the rung without
        # checkpointing, where they were measured (H200); the checkpointed rungs keep the unfused terms,
        # which the 8 GB budget runs fit.
        request, a, measured = self.request, self.compute_bytes, not gc
        out = activation_bytes(
            self.shape,
            tokens,
            compute_bytes=a,
            lora_r=int(request.config.get("r", 16)),
            targets=request.config.get("target_modules"),
            dropout=float(request.config.get("lora_dropout", 0) or 0) > 0,
            mask_bytes=1 if self.backend in ("cuda", "xpu") else a,
            checkpointing=gc,
            fused_loss=fused_ce,
            fused_lora=self.fused and measured,
            dequant_bytes=self.dequant,
            chunked_loss=self.kind(fused_ce) == "chunked",
            kernel_norms=measured and self.kind(fused_ce) == "liger",
        )
        if gc is True and checkpointed is not None and checkpointed < self.shape.layers:
            out = self._partly(rung, tokens, out, checkpointed)
        if graphs:  # the graphs' own buffers: one shape, or a packed row's buckets
            held = graph_buffer_bytes(
                self.shape, tokens, compute_bytes=a, packed=self.packed, bucket=graph_bucket(gc)
            )
            if gc:  # the recomputation lives in the graphs' pool, which the eager loss cannot reuse
                held += min(out["loss"], out["recompute"])
            out = {**out, "graph_buffers": held, "peak": out["peak"] + held}
        return out

    def _partly(self, rung: Rung, tokens: int, checkpointed: dict[str, int], layers: int) -> dict[str, int]:
        """``checkpointed`` (the estimate with every layer checkpointed) with only ``layers`` of them
        checkpointed: each of the others keeps its saved tensors as on the rung without checkpointing;
        the recomputation is counted while one layer is."""
        plain = self.estimate((rung[0], False, False), tokens)
        kept = checkpointed["layers"] // self.shape.layers  # one checkpointed layer's input
        held = layers * kept + (self.shape.layers - layers) * plain["per_layer"]
        rest = (
            checkpointed["peak"] - checkpointed["layers"]
        )  # the final norm, and the loss or a recomputation
        if not layers:
            rest = plain["peak"] - plain["layers"]
        return {**checkpointed, "layers": held, "peak": held + rest, "checkpointed_layers": layers}

    def peak(self, rung: Rung, tokens: int, checkpointed: int | None = None) -> int:
        return self.estimate(rung, tokens, checkpointed)["peak"]

    def fewest_checkpointed(self, rung: Rung, tokens: int, room: int) -> int | None:
        """On a checkpointed rung with the layers as graphs (xpukit checkpoints them, layer by layer):
        the fewest layers to checkpoint for a pass of ``tokens`` to fit ``room``; ``None`` where every
        layer has to be (or the rung is not one of those)."""
        if rung[1] is not True or not rung[2]:
            return None
        layers, room = self.shape.layers, int(room / PARTLY_SPARE)
        low, high = 0, layers  # the peak falls as more layers are checkpointed
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if self.peak(rung, tokens, mid) <= room else (mid + 1, high)
        return low if low < layers and self.peak(rung, tokens, low) <= room else None

    def text(self, rung: Rung, micro: int, batch: int) -> str:
        """The rung in words; where the layers may run as graphs, whether they do on it."""
        text = option_text(self.kind(rung[0]), rung[1], micro, batch)
        return text + (", graphs" if rung[2] else ", eager") if self.graphs else text

    def pass_tokens(self, rung: Rung, room: int, checkpointed: int | None = None) -> int:
        """The most tokens one pass may carry on this rung within ``room`` (0: not even one)."""
        low, high = 0, 1 << 22  # 4 M tokens: beyond any pass a device holds
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.peak(rung, mid, checkpointed) <= room else (low, mid - 1)
        return low


@dataclass(frozen=True)
class Choice:
    """The rung chosen, its micro-batch and the tokens a pass may carry, and the options tried."""

    rung: Rung
    micro: int
    pass_tokens: int
    by_tokens: bool  # the whole batch in one pass, split by tokens at run time where needed
    tried: tuple[tuple[str, int], ...]
    checkpoint_layers: int | None = None  # a checkpointed rung with only that many layers checkpointed


def choose(rungs: Rungs, ladder: list[Rung], batch: int, seq: int, room: int) -> Choice:
    """The fastest rung whose worst step (``batch × seq`` tokens) fits; else, with packing, the rung
    that carries the most tokens a pass, with the whole batch in passes of the tokens that fit (split
    by tokens at run time, only for steps that carry more); else the leanest rung at the largest
    micro-batch that fits."""
    tried: list[tuple[str, int]] = []
    worst = batch * seq
    for rung in ladder:
        p = rungs.peak(rung, worst)
        tried.append((rungs.text(rung, batch, batch), p))
        if p <= room:
            return _fewer_checkpointed(rungs, ladder, rung, batch, worst, room, tried) or Choice(
                rung, batch, max(rungs.pass_tokens(rung, room), worst), False, tuple(tried)
            )
    if rungs.packed and batch > 1:
        # The rung that carries the most tokens a pass, so that the fewest steps are split: a split
        # step runs eagerly, and what it leaves cached in the device's default pool stays beside the
        # graphs' pool (H200, 8 GB: 9.07 GB reserved with the graphs' leanest rung, docs/benchmarks.md).
        rung = max(ladder, key=lambda r: (rungs.pass_tokens(r, room), r[2]))
        tokens = rungs.pass_tokens(rung, room)
        if tokens >= seq:  # one longest example fits a pass
            tried.append(
                (
                    rungs.text(rung, batch, batch) + f", passes of up to {tokens:,} tokens",
                    rungs.peak(rung, tokens),
                )
            )
            return Choice(rung, batch, tokens, True, tuple(tried))
    rung = min(ladder, key=lambda r: rungs.peak(r, worst))
    micro = next((m for m in micro_batches(batch) if rungs.peak(rung, m * seq) <= room), 1)
    tried.append((rungs.text(rung, micro, batch), rungs.peak(rung, micro * seq)))
    return Choice(rung, micro, micro * seq, False, tuple(tried))


def _fewer_checkpointed(
    rungs: Rungs,
    ladder: list[Rung],
    rung: Rung,
    batch: int,
    worst: int,
    room: int,
    tried: list[tuple[str, int]],
) -> Choice | None:
    """The checkpointed rung ``rung`` (the fastest that fits) with only the layers checkpointed that the
    budget needs, where the same rung without checkpointing was tried and did not fit: the rest of
    the budget goes to speed (docs/training-plan.md "Fewer checkpointed layers"). ``None``: all of them."""
    if (rung[0], False, rung[2]) not in ladder:  # the user asked for checkpointing: every layer
        return None
    layers = rungs.fewest_checkpointed(rung, worst, room)
    if layers is None:
        return None
    n = rungs.shape.layers
    text = rungs.text(rung, batch, batch) + f", {layers} of {n} layers checkpointed"
    tried[-1] = (text, rungs.peak(rung, worst, layers))  # the rung as it runs
    tokens = max(rungs.pass_tokens(rung, int(room / PARTLY_SPARE), layers), worst)
    return Choice(rung, batch, tokens, False, tuple(tried), checkpoint_layers=layers)


def micro_batches(batch: int) -> list[int]:
    """The micro-batches a step of ``batch`` sequences can be split into, largest first: the divisors
    of ``batch``, so that micro-batch × accumulation steps is the batch asked for (batch 6: 6, 3, 2, 1;
    a micro-batch of 4 would make it 4 or 8)."""
    return [m for m in range(batch, 0, -1) if batch % m == 0]


def ladder_of(
    gc: bool | str | None, liger: bool | None, *, offload: bool, graphs: tuple[bool, ...]
) -> list[Rung]:
    """The rungs in the order tried (fastest first), as (fused cross-entropy, checkpointing, graphs):
    every set of savers with the layers as graphs, then every set eagerly (a step bound by the host
    runs slower eagerly without savers than captured with checkpointing: H200, docs/benchmarks.md). A
    user's choice pins its saver (``lora={"liger": True}``: the fused loss, liger's where it runs)."""
    gcs: list[bool | str] = [gc] if gc is not None else [False, True] + (["offload"] if offload else [])
    losses = [True] if liger else [False, True]
    return [(ce, g, on) for on in graphs for g in gcs for ce in losses]
