"""The layout for new LoRA adapters: 4-bit by fit, and no weights offloaded behind the user's back (pure).

A layout that is fine for inference can be a plan that crawls for training: bf16 weights partly
offloaded to CPU memory are copied over the bus at every step of every micro-batch, and a step that
fits only as offloaded checkpointing at micro-batch 1 is the slowest rung of the ladder. So, for new
adapters, and for a saved adapter loaded with ``trainable=True`` (docs/planning.md "Training layout"):

* With no ``quantize=`` given, when the full-precision weights do not fit the device together with
  the training memory (they are offloaded, or the training plan does not fit even at its leanest),
  the plan takes 4-bit if 4-bit puts the weights on the device and its training plan fits; the
  ``quantization`` decision says so, with both sizes. ``quantize=False`` keeps full precision on
  purpose, and ``quantize="auto"`` keeps its own rule (by the weights alone).
* A training plan that still offloads weights to CPU memory is refused with the numbers and the
  fixes, unless ``offload=True`` was given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from xpukit.errors import PlanError, XpukitError
from xpukit.planning.budgets import format_bytes
from xpukit.planning.device.quantization import QuantRequest
from xpukit.planning.vocabulary import Decision

if TYPE_CHECKING:
    from xpukit.planning.device.layout import Layout
    from xpukit.planning.training.lora_request import LoraRequest
    from xpukit.planning.training.training_plan import TrainingPlan

__all__ = ["Attempt", "layout_for_training"]


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One layout with the training plan made for it, and the warnings planning it gave."""

    layout: Layout
    lora: LoraRequest | None
    training: TrainingPlan | None
    warnings: tuple[str, ...] = ()

    @property
    def offloads(self) -> bool:
        """Weights go to CPU memory (or disk)."""
        return self.layout.memory.placement == "offload"

    @property
    def crawls(self) -> bool:
        """Weights offloaded, or a step that does not fit even at its leanest."""
        return self.offloads or (self.training is not None and not self.training.fits)


def layout_for_training(
    first: Attempt,
    *,
    replan: Callable[[QuantRequest], Attempt],
    quantize_given: bool,
    offload: bool | None,
    device: str,
) -> Attempt:
    """The attempt to plan with (``first``, or the 4-bit one), or :class:`PlanError`.

    Args:
        first: the layout as asked, with its training plan.
        replan: plans the layout and training again with another quantization request.
        quantize_given: ``quantize=`` was passed (anything but the default ``None``).
        offload: ``offload=`` as given (``None``: not given).
        device: the training device, for messages.
    """
    if first.lora is None or not first.lora.trains or not first.crawls:
        return first
    chosen, rejected_why = first, ""
    if not quantize_given and first.layout.quantization is None:
        try:
            four = replan(QuantRequest(kind="4bit"))
        except XpukitError as exc:  # bitsandbytes cannot run here, or is missing
            four, rejected_why = None, str(exc).split(" Fix")[0]
        if four is not None and not four.crawls:
            chosen = replace(four, layout=_say_4bit(first, four, device))
        elif four is not None:
            rejected_why = f"4-bit would still not fit: {_why(four)}"
    if chosen.offloads and offload is not True:
        raise PlanError(_refusal(first, chosen, rejected_why, device, quantize_given))
    return chosen


def _why(attempt: Attempt) -> str:
    if attempt.offloads:
        return attempt.layout.memory.verdict
    training = attempt.training
    assert training is not None
    return (
        f"{format_bytes(training.estimate['peak'])} of activations at micro-batch {training.micro_batch} "
        f"exceed the {format_bytes(training.room)} left beside weights and LoRA state"
    )


def _say_4bit(first: Attempt, four: Attempt, device: str) -> Layout:
    """The 4-bit layout with its ``quantization`` decision made the plan's, with its cause."""
    full = first.layout.memory
    reason = (
        f"new LoRA adapters and no quantize= given: {format_bytes(full.weights)} of {full.weights_key} "
        f"weights and the training memory do not fit {device} ({_why(first)}); 4-bit "
        f"{format_bytes(four.layout.memory.weights)} does, with the step on the device. "
        "quantize=False keeps full precision"
    )
    decisions = [
        Decision(
            name="quantization",
            value=d.value,
            reason=reason,
            rejected=((None, f"full precision: {_why(first)}"),),
            source="auto",
        )
        if d.name == "quantization"
        else d
        for d in four.layout.decisions
    ]
    return replace(four.layout, decisions=decisions)


def _refusal(first: Attempt, chosen: Attempt, rejected_why: str, device: str, quantize_given: bool) -> str:
    m = chosen.layout.memory
    fixes = []
    if chosen.layout.quantization is None:
        fixes.append('quantize="4bit"' + (f" ({rejected_why})" if rejected_why else ""))
    fixes += [
        "a smaller model, or a device with more memory (max_memory= if the budget was set lower)",
        "offload=True to train with weights in CPU memory anyway (every step copies them over the bus)",
    ]
    asked = " with quantize= as given" if quantize_given else ""
    return (
        f"training new LoRA adapters{asked} on {device} would offload weights to CPU memory: {m.verdict}; "
        f"every training step would copy them to the device. Fix: {'; or '.join(fixes)}."
    )
