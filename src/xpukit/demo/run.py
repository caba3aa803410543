"""``xpukit demo``: the main job, end to end, on an embedded tiny model (or a real one).

Plan → QLoRA load → generate → fine-tune → generate, with the numbers a user wants to see: device,
dtype, quantisation, trainable parameters, peak memory, steps/s and the loss falling. Offline by
default: the model is :func:`xpukit.demo.tiny.demo_model_dir` (built once, then cached) and the text is
the bundled corpus (:func:`xpukit.demo.tiny.corpus_lines`).

The order matters on CPUs with avx512_bf16: a ``generate()`` on a 4-bit model before training would
let bitsandbytes repack the weights into a layout without a backward, and most LoRA gradients would
silently be zero while the loss still falls. :func:`xpukit.load_for_xpu` turns that repacking off
when it attaches LoRA, so generating first is safe; the demo checks it anyway: it reports how many
LoRA layers got a gradient at the first step (when only a working base-model backward can give one)
and warns when some did not.

Example::

    from xpukit.demo.run import run_demo

    result = run_demo(steps=30)            # quiet; pass stream=sys.stdout for the narrative
    print(result.render())
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING

from xpukit._compat import installed_version, is_installed, require
from xpukit._partial import into_place, writing
from xpukit.demo.output import (
    Narrator,
    one_cpu_thread,
    plot_losses,
    quiet_known_noise,
)
from xpukit.demo.result import DemoResult, demo_result
from xpukit.demo.text import readable, token_bytes
from xpukit.demo.training_run import lora_layers_updated, train
from xpukit.errors import InvalidRequestError, MissingExtraError
from xpukit.loading.load_problems import missing_weights_problem

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase

    from xpukit.demo.training_run import TrainingRun
    from xpukit.planning.loadplan import LoadPlan

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
        seed: seeds the LoRA initialisation (the plan's ``seed`` decision says so) and the data order.
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
    keep = _check_output_dir(output_dir)
    require("peft", "xpukit demo (LoRA fine-tuning)")
    say = Narrator(stream)
    with contextlib.ExitStack() as cleanup:
        work = _workdir(cleanup)  # training's own files; the adapter goes to output_dir at the end
        cleanup.enter_context(quiet_known_noise(embedded=model is None))
        from xpukit.demo.tiny import DEMO_PROMPTS, corpus_lines

        source = _source(model, say)
        embedded = model is None
        lr = learning_rate if learning_rate is not None else (_LR_EMBEDDED if embedded else _LR_PRETRAINED)

        plan, quant_note = _plan(source, device=device, quantize=quantize, seed=seed)
        missing = missing_weights_problem(plan)
        if missing is not None:  # before the plan is printed: the demo cannot run on it
            raise InvalidRequestError(missing)
        say("", plan.explain(), "", f"Quantization: {plan.quantization or 'none'}; {quant_note}", "")
        if embedded and plan.device.backend == "cpu":
            cleanup.enter_context(one_cpu_thread())
        peft_model, tokenizer = _load(plan, source, say)
        loaded_plan = peft_model.xpukit_plan

        say("", f"Before training (greedy, {max_new_tokens} new tokens):")
        before = _generate(peft_model, tokenizer, DEMO_PROMPTS, max_new_tokens)
        say(*(f"  {p} | {t}" for p, t in before))

        say("", f"Fine-tuning the LoRA adapters on the bundled text ({len(corpus_lines())} lines):")
        run = train(
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

        lora_layers, updated = _check_gradients(peft_model, run)
        _keep(peft_model, tokenizer, run, say, work=keep, source=source, plot_path=plot_path)
        return demo_result(
            peft_model,
            run,
            loaded_plan,
            source=source,
            embedded=embedded,
            quant_note=quant_note,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            log_every=log_every,
            before=before,
            after=after,
            layers=(lora_layers, updated),
            plot_path=plot_path,
            keep=keep,
            started=started,
        )


def _check_output_dir(output_dir: str | os.PathLike[str] | None) -> Path | None:
    """``output_dir`` as a path, refused before anything runs when it is a file or a non-empty directory
    (the adapter must not mix with other files, as ``xpukit merge`` refuses such an OUT)."""
    if output_dir is None:
        return None
    target = Path(output_dir)
    if target.exists() and not target.is_dir():
        raise InvalidRequestError(
            f"--output-dir {str(target)!r} is a file, not a directory. Fix: pass a new directory."
        )
    if target.exists() and any(target.iterdir()):
        raise InvalidRequestError(
            f"--output-dir {str(target)!r} is not empty: the adapter would be written among its files. "
            "Fix: pass a new (or empty) directory, or remove that one first."
        )
    return target


def _workdir(cleanup: contextlib.ExitStack) -> Path:
    """A temporary directory for training's own files, removed at the end."""
    # A partial that is never published: removed at the end, on SIGTERM / Ctrl-C, or, after a kill,
    # by the next demo (xpukit._partial).
    return cleanup.enter_context(writing(Path(tempfile.gettempdir()) / "xpukit-demo"))


def _source(model: str | os.PathLike[str] | None, say: Narrator) -> str:
    """The model to load: the one given, else the embedded tiny model (built once, cached)."""
    if model is not None:
        return os.fspath(model)
    from xpukit.demo.tiny import demo_model_dir

    build_started = time.perf_counter()
    source = str(demo_model_dir())
    took = time.perf_counter() - build_started
    how = f"built in {took:.1f} s" if took > 1 else "from the cache"
    say(f"Embedded tiny model: {source} ({how})")
    return source


def _load(plan: LoadPlan, source: str, say: Narrator) -> tuple[PeftModel, PreTrainedTokenizerBase]:
    """The model loaded as planned (what ran said), and its tokenizer with a pad token."""
    import transformers

    from xpukit.loading.load import load_for_xpu

    say("Loading ...")  # the plan's seed: set_seed(seed) right before the LoRA adapters are made
    peft_model = load_for_xpu(plan)
    for event in peft_model.xpukit_plan.events:
        say(f"  {event.what}: {event.actual}" + (f" ({event.cause})" if event.cause else ""))
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # the collator pads batches
    return peft_model, tokenizer


def _check_gradients(peft_model: PeftModel, run: TrainingRun) -> tuple[int, int]:
    """The LoRA layers, and how many training updated; a warning when some got no gradient."""
    lora_layers, updated = lora_layers_updated(peft_model)
    no_gradient = sorted(name for name, ok in run.first_gradients.items() if not ok)
    if no_gradient:
        logger.warning(
            "%d of %d LoRA layers got no gradient at the first step, so the backward through the "
            "base model is broken and training cannot reach them: %s",
            len(no_gradient),
            lora_layers,
            ", ".join(no_gradient[:6]) + (" ..." if len(no_gradient) > 6 else ""),
        )
    return lora_layers, updated


def _keep(
    peft_model: PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    run: TrainingRun,
    say: Narrator,
    *,
    work: Path | None,
    source: str,
    plot_path: Path | None,
) -> None:
    """Save the adapter and tokenizer (``output_dir=``) and the loss curve (``plot=``)."""
    loaded_plan = peft_model.xpukit_plan
    if work is not None:
        with writing(work) as partial:  # written whole, or not at all (an error, Ctrl-C)
            peft_model.save_pretrained(partial)
            tokenizer.save_pretrained(partial)
            into_place(partial, work)  # an empty work folder: checked before the run
        say("", f"Adapter saved in {work} (load it with load_for_xpu({source!r}, lora={str(work)!r})).")
    if plot_path is not None:
        what = f"{loaded_plan.quantization} + LoRA" if loaded_plan.quantization else "LoRA"
        plot_losses(run.losses, plot_path, title=f"xpukit demo: {what} on {loaded_plan.device.torch_device}")
        say(f"Loss curve saved to {plot_path}")


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
    # No "xpukit demo:" in front: the command line puts it there ("xpukit demo: error: ...").
    for name, value in (
        ("steps", steps),
        ("batch_size", batch_size),
        ("max_new_tokens", max_new_tokens),
        ("log_every", log_every),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequestError(f"{name}={value!r} must be a whole number of at least 1.")
    if learning_rate is not None and not (isinstance(learning_rate, int | float) and 0 < learning_rate < 1):
        raise InvalidRequestError(
            f"learning_rate={learning_rate!r} (--lr) must be a number between 0 and 1 "
            "(LoRA on the embedded model: 1e-2; on a pretrained model: 1e-4 to 3e-4)."
        )
    if plot is None:
        return None
    require("matplotlib", "xpukit demo --plot")
    path = Path(plot).expanduser()
    if path.suffix.lower() not in _PLOT_SUFFIXES:
        raise InvalidRequestError(
            f"plot={os.fspath(plot)!r}: unknown image type {path.suffix or '(none)'!r}; "
            f"use one of {', '.join(_PLOT_SUFFIXES)} (e.g. --plot loss.png)."
        )
    if not path.parent.is_dir():
        raise InvalidRequestError(
            f"plot={os.fspath(plot)!r}: the directory {str(path.parent)!r} does not exist."
        )
    return path


def _plan(source: str, *, device: str | None, quantize: bool, seed: int = 0) -> tuple[LoadPlan, str]:
    """The load plan, 4-bit where bitsandbytes can do it here, and a note saying why (or why not).

    The seed is the plan's, so the plan says what runs: the LoRA initialisation seeded with it.
    """
    from xpukit.planning.plan import plan_load

    if not quantize:
        plan = plan_load(source, device=device, lora=True, seed=seed)
        return plan, "not asked (--no-quantize): LoRA on full weights"
    if not is_installed("bitsandbytes"):
        note = 'bitsandbytes is not installed (pip install "xpukit[quant]" for 4-bit): LoRA on full weights'
        return plan_load(source, device=device, lora=True, seed=seed), note
    try:
        plan = plan_load(source, device=device, quantize="4bit", lora=True, seed=seed)
    except (MissingExtraError, InvalidRequestError) as exc:
        # bitsandbytes too old, or no backend for this device (MPS). Plan again without 4-bit: an
        # error that has nothing to do with quantisation is raised again by this second plan.
        plan = plan_load(source, device=device, lora=True, seed=seed)
        return plan, f"4-bit not possible here ({exc}): LoRA on full weights"
    version = installed_version("bitsandbytes")
    return plan, f"bitsandbytes {version} nf4 with double quantisation, compute in {plan.dtype}"


def _generate(
    model: PeftModel, tokenizer: PreTrainedTokenizerBase, prompts: tuple[str, ...], max_new_tokens: int
) -> tuple[tuple[str, str], ...]:
    """Greedy continuations, one prompt at a time (no padding to get wrong)."""
    import torch
    from transformers import GenerationConfig

    # The embedding matrix may be larger than the vocabulary (the tiny model's 1024 rows hold a
    # 922-token tokenizer): ids past the vocabulary stand for no text, so they are never generated.
    rows = model.get_output_embeddings().weight.shape[0]
    # A fresh config: the model's own may ask for sampling, which greedy decoding would warn about.
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        suppress_tokens=list(range(len(tokenizer), rows)) or None,
    )
    model.eval()  # dropout off; gradient checkpointing only acts in training mode
    out = []
    for prompt in prompts:
        encoded = tokenizer(prompt, return_tensors="pt").to(model.device)
        with torch.inference_mode():
            tokens = model.generate(**encoded, generation_config=config)
        new = tokens[0, encoded["input_ids"].shape[1] :]
        # An untrained model emits stray bytes (half a character, a BEL): shown as escapes that read
        # back into the exact bytes (xpukit.demo.text), never as U+FFFD or raw control characters.
        out.append((prompt, readable(token_bytes(tokenizer, new.tolist())).strip(" ")))
    return tuple(out)


# --- output --------------------------------------------------------------------------------------
