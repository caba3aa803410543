"""``xpukit demo``: the main job, end to end, on an embedded tiny model (or a real one).

Plan → QLoRA load → generate → fine-tune → generate, with the numbers a user wants to see: device,
dtype, quantisation, trainable parameters, peak memory, steps/s and the loss falling. Offline by
default: the model is :func:`xpukit.tiny.demo_model_dir` (built once, then cached) and the text is
the bundled corpus (:func:`xpukit.tiny.corpus_lines`).

The order matters on CPUs with avx512_bf16: a ``generate()`` on a 4-bit model before training would
let bitsandbytes repack the weights into a layout without a backward, and most LoRA gradients would
silently be zero while the loss still falls. :func:`xpukit.load_for_xpu` turns that repacking off
when it attaches LoRA, so generating first is safe; the demo checks it anyway: it reports how many
LoRA layers got a gradient at the first step (when only a working base-model backward can give one)
and warns when some did not.

Example::

    from xpukit.demo import run_demo

    result = run_demo(steps=30)            # quiet; pass stream=sys.stdout for the narrative
    print(result.render())
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from xpukit._compat import installed_version, is_installed, require
from xpukit.errors import InvalidRequestError, MissingExtraError
from xpukit.placement import format_bytes

__all__ = ["DEFAULT_BATCH_SIZE", "DEFAULT_STEPS", "DemoResult", "plot_losses", "run_demo"]

logger = logging.getLogger(__name__)

# 60 steps of batch 8 take the embedded model's loss from ~9.4 to ~1 (about 12 s on two CPU cores,
# in a run of about 35 s with imports): enough for the generated text to become corpus sentences.
DEFAULT_STEPS = 60
DEFAULT_BATCH_SIZE = 8
# LoRA learning rates. The tiny random model needs a high one (measured: 1e-2 falls steadily, 3e-2
# collapses); a pretrained model wants the usual QLoRA rate.
_LR_EMBEDDED = 1e-2
_LR_PRETRAINED = 2e-4
_MAX_TOKENS = 64  # per training line; the corpus lines are about 17 tokens
_PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


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


def run_demo(
    *,
    model: str | os.PathLike[str] | None = None,
    steps: int = DEFAULT_STEPS,
    device: str | None = None,
    quantize: bool = True,
    learning_rate: float | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_new_tokens: int = 12,
    log_every: int = 5,
    output_dir: str | os.PathLike[str] | None = None,
    plot: str | os.PathLike[str] | None = None,
    seed: int = 0,
    stream: IO[str] | None = None,
) -> DemoResult:
    """Plan, load (4-bit + LoRA), generate, fine-tune on the bundled text, generate again.

    Args:
        model: a model directory or Hub id; default: the embedded tiny model (built offline, cached).
        steps: training steps.
        device: ``"xpu"``, ``"cuda"``, ``"cpu"``…; default: what :func:`xpukit.load_for_xpu` picks.
        quantize: load in 4-bit when bitsandbytes is installed and supports the device.
        learning_rate: default 1e-2 for the embedded model, 2e-4 for a pretrained one.
        batch_size: sequences per step.
        max_new_tokens: tokens generated per prompt, greedy.
        log_every: print the loss every this many steps.
        output_dir: keep the trained adapter and tokenizer here; default: a temporary directory,
            removed at the end.
        plot: save the loss curve to this image file (needs the ``plot`` extra).
        seed: seeds the LoRA initialisation and the data order.
        stream: where the narrative and progress bar go; ``None`` runs quietly.

    Returns:
        The :class:`DemoResult`.

    Raises:
        InvalidRequestError: a bad argument (checked before anything is loaded).
        MissingExtraError: peft is missing (extra ``lora``), or matplotlib for ``plot`` (extra ``plot``).
        XpukitError: whatever :func:`xpukit.load_for_xpu` refuses for this model or device.
    """
    started = time.perf_counter()
    plot_path = _check_request(steps, batch_size, learning_rate, max_new_tokens, log_every, plot)
    require("peft", "xpukit demo (LoRA fine-tuning)")
    say = _Narrator(stream)
    keep = output_dir is not None
    with contextlib.ExitStack() as cleanup:
        if output_dir is None:
            work = Path(tempfile.mkdtemp(prefix="xpukit-demo-"))
            cleanup.callback(shutil.rmtree, work, ignore_errors=True)
        else:
            work = Path(output_dir)
        cleanup.enter_context(_quiet_known_noise(embedded=model is None))
        from xpukit.tiny import DEMO_PROMPTS, corpus_lines, demo_model_dir

        embedded = model is None
        if model is None:
            build_started = time.perf_counter()
            source = str(demo_model_dir())
            took = time.perf_counter() - build_started
            how = f"built in {took:.1f} s" if took > 1 else "from the cache"
            say(f"Embedded tiny model: {source} ({how})")
        else:
            source = os.fspath(model)
        lr = learning_rate if learning_rate is not None else (_LR_EMBEDDED if embedded else _LR_PRETRAINED)

        plan, quant_note = _plan(source, device=device, quantize=quantize)
        say("", plan.explain(), "", f"Quantization: {plan.quantization or 'none'}; {quant_note}", "")
        if embedded and plan.device.backend == "cpu":
            cleanup.enter_context(_one_cpu_thread())

        import transformers

        from xpukit.load import load_for_xpu

        transformers.set_seed(seed)  # the LoRA initialisation draws from the global RNG
        say("Loading ...")
        peft_model = load_for_xpu(plan)
        loaded_plan = peft_model.xpukit_plan
        fallbacks = tuple(f"{e.what}: {e.planned} -> {e.actual} ({e.cause})" for e in loaded_plan.fallbacks)
        for event in loaded_plan.events:
            say(f"  {event.what}: {event.actual}" + (f" ({event.cause})" if event.cause else ""))
        tokenizer = transformers.AutoTokenizer.from_pretrained(source)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token  # the collator pads batches

        say("", f"Before training (greedy, {max_new_tokens} new tokens):")
        before = _generate(peft_model, tokenizer, DEMO_PROMPTS, max_new_tokens)
        say(*(f"  {p} | {t}" for p, t in before))

        say("", f"Fine-tuning the LoRA adapters on the bundled text ({len(corpus_lines())} lines):")
        run = _train(
            peft_model,
            tokenizer,
            corpus_lines(),
            steps=steps,
            batch_size=batch_size,
            learning_rate=lr,
            max_tokens=_MAX_TOKENS,
            log_every=log_every,
            seed=seed,
            output_dir=work,
            stream=say.stream,
        )

        say("", "After training:")
        after = _generate(peft_model, tokenizer, DEMO_PROMPTS, max_new_tokens)
        say(*(f"  {p} | {t}" for p, t in after))

        lora_layers, updated = _lora_layers_updated(peft_model)
        no_gradient = sorted(name for name, ok in run.first_gradients.items() if not ok)
        if no_gradient:
            logger.warning(
                "%d of %d LoRA layers got no gradient at the first step, so the backward through the "
                "base model is broken and training cannot reach them: %s",
                len(no_gradient),
                lora_layers,
                ", ".join(no_gradient[:6]) + (" ..." if len(no_gradient) > 6 else ""),
            )
        if keep:
            peft_model.save_pretrained(work)
            tokenizer.save_pretrained(work)
            say("", f"Adapter saved in {work} (load it with load_for_xpu({source!r}, lora={str(work)!r})).")
        if plot_path is not None:
            what = f"{loaded_plan.quantization} + LoRA" if loaded_plan.quantization else "LoRA"
            plot_losses(
                run.losses, plot_path, title=f"xpukit demo: {what} on {loaded_plan.device.torch_device}"
            )
            say(f"Loss curve saved to {plot_path}")

        trainable, total = peft_model.get_nb_trainable_parameters()
        peak, memory_source = _peak_memory(loaded_plan.device.backend)
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
            lora_layers=lora_layers,
            lora_layers_with_gradient=sum(run.first_gradients.values()),
            lora_layers_updated=updated,
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
            fallbacks=fallbacks,
            plot=str(plot_path) if plot_path is not None else None,
            output_dir=str(work) if keep else None,
            wall_seconds=time.perf_counter() - started,
        )


# --- steps ---------------------------------------------------------------------------------------


def _check_request(
    steps: int,
    batch_size: int,
    learning_rate: float | None,
    max_new_tokens: int,
    log_every: int,
    plot: str | os.PathLike[str] | None,
) -> Path | None:
    """Refuse bad arguments before anything is imported or loaded."""
    for name, value in (
        ("steps", steps),
        ("batch_size", batch_size),
        ("max_new_tokens", max_new_tokens),
        ("log_every", log_every),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequestError(f"xpukit demo: {name}={value!r} must be a whole number of at least 1.")
    if learning_rate is not None and not (isinstance(learning_rate, int | float) and 0 < learning_rate < 1):
        raise InvalidRequestError(
            f"xpukit demo: learning_rate={learning_rate!r} must be a number between 0 and 1 "
            "(LoRA on the embedded model: 1e-2; on a pretrained model: 1e-4 to 3e-4)."
        )
    if plot is None:
        return None
    require("matplotlib", "xpukit demo --plot")
    path = Path(plot).expanduser()
    if path.suffix.lower() not in _PLOT_SUFFIXES:
        raise InvalidRequestError(
            f"xpukit demo --plot {os.fspath(plot)!r}: unknown image type {path.suffix or '(none)'!r}; "
            f"use one of {', '.join(_PLOT_SUFFIXES)} (e.g. --plot loss.png)."
        )
    if not path.parent.is_dir():
        raise InvalidRequestError(
            f"xpukit demo --plot {os.fspath(plot)!r}: the directory {str(path.parent)!r} does not exist."
        )
    return path


def _plan(source: str, *, device: str | None, quantize: bool) -> tuple[Any, str]:
    """The load plan, 4-bit where bitsandbytes can do it here, and a note saying why (or why not)."""
    from xpukit.plan import plan_load

    if not quantize:
        return plan_load(source, device=device, lora=True), "not asked (--no-quantize): LoRA on full weights"
    if not is_installed("bitsandbytes"):
        note = 'bitsandbytes is not installed (pip install "xpukit[quant]" for 4-bit): LoRA on full weights'
        return plan_load(source, device=device, lora=True), note
    try:
        plan = plan_load(source, device=device, quantize="4bit", lora=True)
    except (MissingExtraError, InvalidRequestError) as exc:
        # bitsandbytes too old, or no backend for this device (MPS). Plan again without 4-bit: an
        # error that has nothing to do with quantisation is raised again by this second plan.
        plan = plan_load(source, device=device, lora=True)
        return plan, f"4-bit not possible here ({exc}): LoRA on full weights"
    version = installed_version("bitsandbytes")
    return plan, f"bitsandbytes {version} nf4 with double quantisation, compute in {plan.dtype}"


def _generate(
    model: Any, tokenizer: Any, prompts: tuple[str, ...], max_new_tokens: int
) -> tuple[tuple[str, str], ...]:
    """Greedy continuations, one prompt at a time (no padding to get wrong)."""
    import torch
    from transformers import GenerationConfig

    # A fresh config: the model's own may ask for sampling, which greedy decoding would warn about.
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model.eval()  # dropout off; gradient checkpointing only acts in training mode
    out = []
    for prompt in prompts:
        encoded = tokenizer(prompt, return_tensors="pt").to(model.device)
        with torch.inference_mode():
            tokens = model.generate(**encoded, generation_config=config)
        new = tokens[0, encoded["input_ids"].shape[1] :]
        text = tokenizer.decode(new, skip_special_tokens=True).strip()
        # An untrained model emits stray bytes; a control character (a BEL) must not reach the terminal.
        out.append((prompt, "".join(c if c.isprintable() else "\ufffd" for c in text)))
    return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class _TrainingRun:
    losses: tuple[tuple[int, float], ...]
    seconds: float
    # lora_B parameter name -> whether its gradient at the first step was non-zero
    first_gradients: dict[str, bool]


def _train(
    model: Any,
    tokenizer: Any,
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
) -> _TrainingRun:
    """``training_args`` + ``Trainer`` on the lines; records every step's loss, prints every few."""
    from transformers import DataCollatorForLanguageModeling, Trainer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from xpukit.train import training_args

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
        disable_tqdm=stream is None,
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
    trainer.add_callback(_loss_callback(losses, first_gradients, steps, log_every, stream))
    model.train()
    started = time.perf_counter()
    trainer.train()
    return _TrainingRun(
        losses=tuple(losses), seconds=time.perf_counter() - started, first_gradients=first_gradients
    )


def _loss_callback(
    losses: list[tuple[int, float]],
    first_gradients: dict[str, bool],
    steps: int,
    log_every: int,
    stream: IO[str] | None,
) -> Any:
    """A progress bar (when there is a stream) that records each step's loss into ``losses`` and,
    at the first step, which ``lora_B`` weights got a non-zero gradient into ``first_gradients``.

    Every ``lora_B`` starts at zero, so at the first step a layer's gradient can only come through
    the frozen base weights above it: a zero there means the backward through the base model is
    broken (module docstring), which later steps hide as the LoRA paths start to carry gradient.
    """
    from transformers.trainer_callback import ProgressCallback

    class LossProgress(ProgressCallback):  # type: ignore[misc]
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if first_gradients:
                return
            for name, param in kwargs["model"].named_parameters():
                if "lora_B" in name:
                    grad = param.grad
                    first_gradients[name] = grad is not None and bool(grad.detach().abs().max().item() > 0)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if stream is not None:
                super().on_train_begin(args, state, control, **kwargs)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.training_bar is not None:
                super().on_step_end(args, state, control, **kwargs)

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if not logs or "loss" not in logs:
                return  # the end-of-training summary dict
            losses.append((int(state.global_step), float(logs["loss"])))
            step = state.global_step
            if self.training_bar is not None and (step % log_every == 0 or step == steps or step == 1):
                recent = [loss for s, loss in losses if s > step - log_every]
                self.training_bar.write(
                    f"  step {step:>{len(str(steps))}}/{steps}  loss {sum(recent) / len(recent):.3f}",
                    file=stream,
                )

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.training_bar is not None:
                super().on_train_end(args, state, control, **kwargs)

    return LossProgress()


def _lora_layers_updated(model: Any) -> tuple[int, int]:
    """LoRA layers, and how many of them moved: peft starts every ``lora_B`` at zero."""
    total = updated = 0
    for name, param in model.named_parameters():
        if "lora_B" in name:
            total += 1
            updated += int(bool(param.detach().abs().max().item() > 0))
    return total, updated


def _peak_memory(backend: str) -> tuple[int | None, str]:
    """Peak device memory from the allocator on CUDA/XPU; else the process's peak resident memory."""
    if backend in ("cuda", "xpu"):
        import torch

        return int(getattr(torch, backend).max_memory_allocated()), f"torch.{backend}.max_memory_allocated"
    try:
        import resource
    except ImportError:  # Windows
        return None, "not measured on this platform"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return (peak if sys.platform == "darwin" else peak * 1024), "peak resident memory of the process"


def plot_losses(losses: tuple[tuple[int, float], ...], path: str | os.PathLike[str], *, title: str) -> Path:
    """Save a loss curve (every step, and a running mean) as an image.

    Args:
        losses: ``(step, loss)`` pairs.
        path: the image file; the type follows the suffix (``.png``, ``.svg``, ``.pdf``…).
        title: the plot's title.

    Returns:
        The path written.

    Raises:
        MissingExtraError: matplotlib is not installed (extra ``plot``).
    """
    require("matplotlib", "plot_losses")
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    steps = [s for s, _ in losses]
    values = [v for _, v in losses]
    window = max(1, len(values) // 12)
    mean = []
    for i in range(len(values)):
        recent = values[max(0, i - window + 1) : i + 1]
        mean.append(sum(recent) / len(recent))
    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(steps, values, color="#9bb7d4", linewidth=1, label="loss per step")
    ax.plot(steps, mean, color="#1f4e79", linewidth=2, label=f"mean of {window} steps")
    ax.set(xlabel="step", ylabel="training loss", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(path)
    fig.savefig(out, dpi=120)
    return out


@contextlib.contextmanager
def _one_cpu_thread() -> Iterator[None]:
    """Run torch on one CPU thread, then restore the thread count.

    The embedded model is too small to gain from more (measured on two cores: 60 steps in 10.8 s
    with two threads, 11.3 s with one). With two, a CPU shared with any other busy process makes
    OpenMP threads wait on each other: the same 60 steps took 60-115 s.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --- output --------------------------------------------------------------------------------------


class _Narrator:
    """Prints lines to the stream, or nothing when there is none."""

    def __init__(self, stream: IO[str] | None) -> None:
        self.stream = stream

    def __call__(self, *lines: str) -> None:
        if self.stream is not None:
            for line in lines:
                print(line, file=self.stream, flush=True)


class _DropMessages(logging.Filter):
    def __init__(self, needles: tuple[str, ...]) -> None:
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(needle in message for needle in self.needles)


# Messages that are no news to a demo user, by logger. bitsandbytes (on avx512_bf16 CPUs) tries to
# fetch an optional CPU kernel from the Hub at import, and says so when it cannot, then uses its
# bundled code, which is what it would use anyway offline.
_KNOWN_NOISE: dict[str, tuple[str, ...]] = {
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward",),
    "kernels.hf_hub": ("kernels-community/quantization-bitsandbytes",),
}


@contextlib.contextmanager
def _quiet_known_noise(*, embedded: bool) -> Iterator[None]:
    """Drop the known harmless messages above, for the demo only; every other warning still shows.

    For the embedded model also hide transformers' weight-loading progress bar (a fraction of a
    second for a tiny model); a real model keeps it.
    """
    filters = [(logging.getLogger(name), _DropMessages(needles)) for name, needles in _KNOWN_NOISE.items()]
    for log, flt in filters:
        log.addFilter(flt)
    restore: Callable[[], None] | None = None
    if embedded:
        from transformers.utils import logging as hf_logging

        if hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
            restore = hf_logging.enable_progress_bar
    try:
        yield
    finally:
        for log, flt in filters:
            log.removeFilter(flt)
        if restore is not None:
            restore()
