"""What ``xpukit demo`` reports: :class:`DemoResult` (the ``--json`` schema and the summary table), and
:func:`demo_result`, which builds it from a finished run."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xpukit.demo.output import peak_memory
from xpukit.planning.budgets import format_bytes

if TYPE_CHECKING:
    from peft import PeftModel

    from xpukit.demo.training_run import TrainingRun
    from xpukit.planning.loadplan import LoadPlan

__all__ = ["DemoResult", "demo_result"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoResult:
    """What a demo run did, measured.

    Attributes:
        model: the model directory or Hub id; ``embedded`` says whether it was the built-in one.
        device / device_name: the torch device trained on and its name.
        dtype: compute dtype chosen by the plan.
        quantization: ``"4bit"`` or ``None``; ``quantization_note`` says why.
        trainable_params / total_params: LoRA parameters against all (4-bit weights counted as values).
        lora_layers: LoRA layers (one ``lora_B`` each).
        lora_layers_with_gradient: how many got a non-zero gradient at the first step, when every
            ``lora_B`` is still zero and gradient can only arrive through the base model (a smaller
            number means a broken backward, such as bitsandbytes' CPU repacking; module docstring).
        lora_layers_updated: how many training changed.
        steps, batch_size, learning_rate: the training run.
        train_seconds / steps_per_second: time in ``Trainer.train`` and its rate.
        losses: ``(step, loss)`` for every step.
        first_loss: the loss at step 1 (the model before it learned anything).
        last_loss: the mean loss over the last few logged steps (one step alone is noisy).
        peak_memory / memory_source: peak bytes, and what was measured (device allocator or process RSS).
        before / after: ``(prompt, continuation)`` pairs, greedy, before and after training.
        fallbacks: what the load could not do as planned, with the cause.
        plot / output_dir: files kept (``None`` when not asked).
        wall_seconds: the whole run, model build and load included.
    """

    model: str
    embedded: bool
    device: str
    device_name: str
    dtype: str
    quantization: str | None
    quantization_note: str
    trainable_params: int
    total_params: int
    lora_layers: int
    lora_layers_with_gradient: int
    lora_layers_updated: int
    steps: int
    batch_size: int
    learning_rate: float
    train_seconds: float
    steps_per_second: float
    losses: tuple[tuple[int, float], ...]
    first_loss: float
    last_loss: float
    peak_memory: int | None
    memory_source: str
    before: tuple[tuple[str, str], ...]
    after: tuple[tuple[str, str], ...]
    fallbacks: tuple[str, ...]
    plot: str | None
    output_dir: str | None
    wall_seconds: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (the schema of ``xpukit demo --json``)."""
        out = asdict(self)
        out["losses"] = [[step, loss] for step, loss in self.losses]
        out["before"] = [{"prompt": p, "text": t} for p, t in self.before]
        out["after"] = [{"prompt": p, "text": t} for p, t in self.after]
        out["fallbacks"] = list(self.fallbacks)
        return out

    def render(self) -> str:
        """The summary table printed at the end of the demo."""
        quant = self.quantization or "none"
        memory = format_bytes(self.peak_memory) if self.peak_memory is not None else "unknown"
        rows = [
            ("model", self.model + (" (embedded tiny Qwen3-style model)" if self.embedded else "")),
            ("device", f"{self.device} ({self.device_name})"),
            ("dtype", self.dtype),
            ("quantization", f"{quant}: {self.quantization_note}"),
            (
                "LoRA",
                f"{self.trainable_params:,} trainable of {self.total_params:,} parameters "
                f"({100 * self.trainable_params / max(self.total_params, 1):.2f} %)",
            ),
            (
                "LoRA check",
                f"gradients reached {self.lora_layers_with_gradient} of {self.lora_layers} layers at step 1; "
                f"training changed {self.lora_layers_updated}",
            ),
            ("memory", f"{memory} peak ({self.memory_source})"),
            (
                "training",
                f"{self.steps} steps in {self.train_seconds:.1f} s ({self.steps_per_second:.2f} steps/s), "
                f"batch {self.batch_size}, lr {self.learning_rate:g}",
            ),
            ("loss", f"{self.first_loss:.2f} at step 1 -> {self.last_loss:.2f} at the end"),
            ("time", f"{self.wall_seconds:.1f} s in all"),
        ]
        rows += [("fallback", f) for f in self.fallbacks]
        return "\n".join(f"  {name:<13}{value}" for name, value in rows)


def demo_result(
    peft_model: PeftModel,
    run: TrainingRun,
    loaded_plan: LoadPlan,
    *,
    source: str,
    embedded: bool,
    quant_note: str,
    steps: int,
    batch_size: int,
    lr: float,
    log_every: int,
    before: tuple[tuple[str, str], ...],
    after: tuple[tuple[str, str], ...],
    layers: tuple[int, int],
    plot_path: Path | None,
    keep: Path | None,
    started: float,
) -> DemoResult:
    """The :class:`DemoResult` of a finished run (``layers``: LoRA layers, and those updated)."""
    trainable, total = peft_model.get_nb_trainable_parameters()
    peak, memory_source = peak_memory(loaded_plan.device.backend)
    last = [loss for _, loss in run.losses[-max(1, min(log_every, len(run.losses))) :]]
    return DemoResult(
        model=source,
        embedded=embedded,
        device=loaded_plan.device.torch_device,
        device_name=loaded_plan.device.name,
        dtype=loaded_plan.dtype,
        quantization=loaded_plan.quantization,
        quantization_note=quant_note,
        trainable_params=int(trainable),
        total_params=int(total),
        lora_layers=layers[0],
        lora_layers_with_gradient=sum(run.first_gradients.values()),
        lora_layers_updated=layers[1],
        steps=steps,
        batch_size=batch_size,
        learning_rate=lr,
        train_seconds=run.seconds,
        steps_per_second=steps / run.seconds if run.seconds > 0 else math.inf,
        losses=run.losses,
        first_loss=run.losses[0][1],
        last_loss=sum(last) / len(last),
        peak_memory=peak,
        memory_source=memory_source,
        before=before,
        after=after,
        fallbacks=tuple(f"{e.what}: {e.planned} -> {e.actual} ({e.cause})" for e in loaded_plan.fallbacks),
        plot=str(plot_path) if plot_path is not None else None,
        output_dir=str(keep) if keep is not None else None,
        wall_seconds=time.perf_counter() - started,
    )
