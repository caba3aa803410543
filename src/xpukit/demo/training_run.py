"""The demo's fine-tuning run: ``training_args`` + ``Trainer``, every step's loss recorded.

At the first step it also records which LoRA layers got a gradient (module docstring of
:mod:`xpukit.demo.run`: a zero there means the backward through the 4-bit base model is broken).

Progress is shown one way only: in a terminal, one tqdm bar with the running loss in it; anywhere
else (a pipe, a log file, a notebook cell), a plain ``step N/M  loss X`` line every few steps, which
a bar would fill with carriage returns. Trainer's own bar and log printer are removed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import (
        PreTrainedTokenizerBase,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )

__all__ = ["TrainingRun", "lora_layers_updated", "loss_callback", "train"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingRun:
    losses: tuple[tuple[int, float], ...]
    seconds: float
    # lora_B parameter name -> whether its gradient at the first step was non-zero
    first_gradients: dict[str, bool]


class _Bar(Protocol):
    """What the callback uses of a tqdm bar."""

    n: float

    def update(self, n: float) -> object: ...

    def set_postfix_str(self, s: str) -> None: ...

    def close(self) -> None: ...


def train(
    model: PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    lines: list[str],
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    max_tokens: int,
    log_every: int,
    seed: int,
    output_dir: Path,
    stream: IO[str] | None,
) -> TrainingRun:
    """``training_args`` + ``Trainer`` on the lines; records every step's loss, prints every few."""
    from transformers import DataCollatorForLanguageModeling, Trainer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from xpukit.training.arguments import training_args

    data = [tokenizer(line, truncation=True, max_length=max_tokens) for line in lines]
    args = training_args(
        model,
        output_dir=str(output_dir),
        per_device_train_batch_size=batch_size,
        max_steps=steps,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",  # a few dozen steps: no time to warm up or decay
        logging_steps=1,  # every loss is recorded; the callback prints every `log_every`
        save_strategy="no",
        seed=seed,
        data_seed=seed,
        disable_tqdm=True,  # the demo shows its own progress (module docstring)
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    # Trainer prints each log as a raw dict; the demo prints one readable line every few steps.
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    losses: list[tuple[int, float]] = []
    first_gradients: dict[str, bool] = {}
    trainer.add_callback(loss_callback(losses, first_gradients, steps, log_every, stream))
    model.train()
    started = time.perf_counter()
    trainer.train()
    return TrainingRun(
        losses=tuple(losses), seconds=time.perf_counter() - started, first_gradients=first_gradients
    )


def loss_callback(
    losses: list[tuple[int, float]],
    first_gradients: dict[str, bool],
    steps: int,
    log_every: int,
    stream: IO[str] | None,
) -> TrainerCallback:
    """A callback that records each step's loss into ``losses`` and, at the first step, which
    ``lora_B`` weights got a non-zero gradient into ``first_gradients``; it shows progress on
    ``stream`` as one bar (a terminal) or as lines (anything else), never both.

    Every ``lora_B`` starts at zero, so at the first step a layer's gradient can only come through
    the frozen base weights above it: a zero there means the backward through the base model is
    broken (module docstring), which later steps hide as the LoRA paths start to carry gradient.
    """
    from transformers import TrainerCallback

    as_bar = stream is not None and _is_terminal(stream)

    class LossProgress(TrainerCallback):  # type: ignore[misc]
        bar: _Bar | None = None

        def on_pre_optimizer_step(
            self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
        ) -> None:
            if first_gradients:
                return
            model = cast("torch.nn.Module", kwargs["model"])  # Trainer passes its model
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    grad = param.grad
                    first_gradients[name] = grad is not None and bool(grad.detach().abs().max().item() > 0)

        def on_train_begin(
            self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
        ) -> None:
            if as_bar and state.is_world_process_zero:
                from tqdm.auto import tqdm  # type: ignore[import-untyped]

                self.bar = tqdm(total=state.max_steps, file=stream, desc="  training", dynamic_ncols=True)

        def on_step_end(
            self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
        ) -> None:
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)

        def on_log(
            self,
            args: TrainingArguments,
            state: TrainerState,
            control: TrainerControl,
            logs: dict[str, float] | None = None,
            **kwargs: object,
        ) -> None:
            if not logs or "loss" not in logs:
                return  # the end-of-training summary dict
            losses.append((int(state.global_step), float(logs["loss"])))
            step = state.global_step
            recent = [loss for s, loss in losses if s > step - log_every]
            mean = sum(recent) / len(recent)
            if self.bar is not None:
                self.bar.set_postfix_str(f"loss {mean:.3f}")
            elif stream is not None and (step % log_every == 0 or step == steps or step == 1):
                print(f"  step {step:>{len(str(steps))}}/{steps}  loss {mean:.3f}", file=stream, flush=True)

        def on_train_end(
            self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
        ) -> None:
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    return LossProgress()


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def lora_layers_updated(model: torch.nn.Module) -> tuple[int, int]:
    """LoRA layers, and how many of them moved: peft starts every ``lora_B`` at zero."""
    total = updated = 0
    for name, param in model.named_parameters():
        if "lora_B" in name:
            total += 1
            updated += int(bool(param.detach().abs().max().item() > 0))
    return total, updated
