"""The training plan for LoRA adapters as a value: the savers chosen, the estimate behind them, and how
it is said (pure; :mod:`xpukit.planning.training.fit` chooses it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xpukit.planning.budgets import format_bytes
from xpukit.planning.vocabulary import Decision

__all__ = ["TrainingPlan", "option_text"]


@dataclass(frozen=True, kw_only=True)
class TrainingPlan:
    """The memory savers chosen for training new LoRA adapters, and the estimate behind them.

    Attributes:
        batch_size / seq_len: the step planned for (``*_given``: whether the user said so).
        micro_batch: sequences per forward; ``gradient_accumulation_steps`` make up the batch.
        gradient_checkpointing: ``False``, ``True`` or ``"offload"``.
        liger: apply liger-kernel's fused kernels (its fused linear cross-entropy among them).
        loss: ``"plain"`` (``lm_head`` + transformers' loss), ``"liger"`` (liger's fused linear
            cross-entropy) or ``"chunked"`` (xpukit's, where liger cannot run or was turned off).
        budget: bytes the device may fill; ``fixed``: weights + LoRA state + reserve.
        estimates: the peak activation bytes of each option tried, in order.
        pass_tokens / split_by_tokens: the token budget per pass with packing (see the fields).
        decisions: ``gradient_checkpointing``, ``liger``, ``loss``, ``micro_batch``.
    """

    batch_size: int
    seq_len: int
    batch_given: bool
    seq_given: bool
    micro_batch: int
    gradient_accumulation_steps: int
    gradient_checkpointing: bool | str
    liger: bool
    budget: int
    budget_rule: str
    fixed: int
    fixed_rule: str
    estimate: dict[str, int]
    estimates: tuple[tuple[str, int], ...]
    fits: bool
    decisions: tuple[Decision, ...]
    loss: str = "plain"
    # With packing: the most real tokens one pass carries within the budget (a step with more is
    # split by tokens at run time); ``split_by_tokens``: the worst case does not fit in one pass, so
    # the whole batch is kept and only steps over ``pass_tokens`` are split.
    pass_tokens: int | None = None
    split_by_tokens: bool = False
    # The layers run as graphs on the chosen rung (only where they may: ``graphs`` of the fit).
    graphs: bool = False
    # The frozen input embedding lives in host memory (its bytes are not in ``fixed``).
    embedding_on_host: bool = False
    # With checkpointing inside the graphs: only the first this many layers are checkpointed, the
    # fewest whose step fits (``None``: every layer; docs/training-plan.md "Fewer checkpointed layers").
    checkpoint_layers: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        out = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "decisions"}
        out["estimates"] = [{"option": o, "peak": b} for o, b in self.estimates]
        return out

    @property
    def room(self) -> int:
        """Bytes left for the step's activations: the budget less the fixed part (0 when negative)."""
        return max(self.budget - self.fixed, 0)

    def explain_lines(self) -> list[str]:
        """The "Training memory" section of :meth:`LoadPlan.explain`."""
        said = {True: "given", False: "default"}
        lines = [
            "",
            f"Training memory (batch {self.batch_size} [{said[self.batch_given]}] × seq {self.seq_len} "
            f'[{said[self.seq_given]}]; docs/training-plan.md "The activation estimate")',
            f"  budget     {format_bytes(self.budget):>11}  {self.budget_rule}",
            f"  fixed      {format_bytes(self.fixed):>11}  {self.fixed_rule}",
            f"  for steps  {format_bytes(self.room):>11}  budget − fixed",
        ]
        for option, peak in self.estimates:
            lines.append(f"  {format_bytes(peak):>22}  activations with {option}")
        verdict = "fits" if self.fits else "does NOT fit even at micro-batch 1"
        lines.append(f"  chosen: {self._chosen()} ({verdict})")
        return lines

    def summary_line(self) -> str:
        """The training plan in one line, for the short :meth:`LoadPlan.explain`."""
        verdict = "fits" if self.fits else "does NOT fit even at micro-batch 1"
        return (
            f"Training: batch {self.batch_size} × seq {self.seq_len}: {self._chosen()} ({verdict}), "
            f"{format_bytes(self.estimate['peak'])} of activations in the {format_bytes(self.room)} left"
        )

    def warning(self, device: str) -> str | None:
        """The load's warning when even the leanest step is estimated not to fit, else ``None``."""
        if self.fits:
            return None
        return (
            f"training: a step of batch {self.batch_size} × {self.seq_len} tokens is estimated at "
            f"{format_bytes(self.estimate['peak'])} of activations with the leanest plan "
            f"({self._chosen()}), over the {format_bytes(self.room)} left on {device} beside the "
            f"weights, the LoRA state and the reserve ({format_bytes(self.fixed)} of a "
            f"{format_bytes(self.budget)} budget: "
            f"{self.budget_rule}), so it may run out of device memory (the estimate is within -3..+11 % "
            'of the peaks measured on an H200: docs/training-plan.md "The activation estimate"). Fix: a '
            "shorter seq_len=, a larger max_memory= or a device with more memory (batch_size= does not "
            "change it: the step already runs the smallest micro-batch)."
        )

    def _chosen(self) -> str:
        text = option_text(self.loss, self.gradient_checkpointing, self.micro_batch, self.batch_size)
        if self.checkpoint_layers is not None:
            text += f" ({self.checkpoint_layers} layers checkpointed)"
        if self.split_by_tokens and self.pass_tokens is not None:
            text += f", passes of up to {self.pass_tokens:,} tokens (split by tokens at run time)"
        if self.embedding_on_host:
            text += ", input embedding in host memory"
        return text


_LOSS_TEXT = {"liger": "liger's fused CE", "chunked": "chunked CE"}


def option_text(loss: str, gc: bool | str, micro: int, batch: int) -> str:
    """One set of savers in words, e.g. ``liger's fused CE + checkpointing``."""
    parts = [_LOSS_TEXT[loss]] if loss in _LOSS_TEXT else []
    if gc:
        parts.append("offloaded checkpointing" if gc == "offload" else "checkpointing")
    if micro < batch:
        parts.append(f"micro-batch {micro} × {batch // micro} accumulation")
    return " + ".join(parts) or "no savers"
