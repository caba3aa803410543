"""``TrainingArguments`` that do not fail on the first step, on XPU, CUDA, MPS and CPU.

:func:`xpukit.training.keywords.training_kwargs` decides the keywords from facts alone (testable
with recorded device profiles); :func:`training_args` finds the facts (from the model, its
``xpukit_plan``, or the machine) and builds the ``transformers.TrainingArguments``. Rules
(docs/known-issues.md "TrainingArguments: bf16 on CPU raises without use_cpu" and
docs/known-issues.md "TrainingArguments: ddp_backend in a single process", docs/platform-notes.md
§4.1–4.3):

* Precision from :func:`xpukit.machine.precision.training_precision`: bf16 where native, fp16 (with
  ``GradScaler``) only where the device has fp64, else fp32. A model loaded by
  :func:`xpukit.load_for_xpu` trains in the dtype its plan computes in (``model.xpukit_plan.dtype``):
  that is what :func:`xpukit.loading.lora.apply_lora` prepared the weights for (fp32 LoRA weights for an fp16
  ``GradScaler``), and what the user asked for with ``dtype=``.
* A single process trains on device 0 (``TrainingArguments`` sets ``xpu:0``/``cuda:0``): a model on
  another card is refused with the fix (``xpukit launch --devices N``, which makes that card device 0).
* A trainable model whose 4-bit weights bitsandbytes repacked for CPU inference (a ``generate()`` on
  an avx512_bf16 CPU, docs/known-issues.md "bitsandbytes: CPU repacking of 4-bit weights") gets its
  trainable layout back, with a warning: that layout
  has no backward and would give zero LoRA gradients.
* ``use_cpu=True`` on the CPU: ``TrainingArguments(bf16=True)`` raises there without it.
* ``ddp_backend`` only in a distributed run (``WORLD_SIZE`` > 1): xccl on XPU (torch ≥ 2.8), nccl
  on CUDA, gloo on CPU/MPS. Set in a single process it crashes ("Default process group has not been
  initialized").
* ``gradient_checkpointing_kwargs={"use_reentrant": False}`` whenever checkpointing is on.
* ``optim``: ``paged_adamw_8bit`` for a quantised model where bitsandbytes has paged optimizers for
  the device (CUDA; XPU from bitsandbytes 0.50), else ``adamw_torch``.
* ``logging_nan_inf_filter=False`` on CUDA/XPU unless fp16's GradScaler runs: ``Trainer``'s
  per-step nan/inf check of the loss makes the host wait for the device (docs/training.md "Why the
  loss filter is off").
* ``report_to="none"`` unless given.
* A model with parameters of which none requires a gradient (a trained adapter loaded for
  inference, a merged model) is refused with the fix (``load_for_xpu(..., lora=DIR,
  trainable=True)``) instead of ``Trainer.train()`` failing at its first step.
* The user's keywords always win, except a combination that would fail, which is refused with the
  fix instead of transformers' ValueError on the first step.

Constructing ``TrainingArguments`` initialises the XPU runtime (its ``__post_init__`` touches
``self.device``, docs/platform-notes.md §4.1): set device selection (``xpukit launch``) before calling
:func:`training_args`.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeAlias

from xpukit import _environ
from xpukit._compat import installed_version, is_installed
from xpukit._quiet import quiet_imports
from xpukit.errors import InvalidRequestError
from xpukit.loading.bnb_cpu import restore_trainable_4bit_layout
from xpukit.machine.facts import DeviceFacts, MachineFacts
from xpukit.training.keywords import TrainingContext, training_kwargs

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel, TrainingArguments

__all__ = ["training_args"]

# The model to train, where there is one (its attributes are read with getattr: any model will do).
_Model: TypeAlias = "PreTrainedModel | PeftModel | None"

logger = logging.getLogger(__name__)


# =============================================================================================
# Acting: find the facts, build the TrainingArguments
# =============================================================================================


def _import_deepspeed_quietly() -> None:
    """Import DeepSpeed now, inside this quieted call, when transformers' Trainer will import it anyway.

    With DeepSpeed installed, ``Trainer(...)`` imports it, and its import logs "Setting accelerator
    to CPU" (or the accelerator it picked) to stdout from DeepSpeed's own logger, in the user's
    training loop (docs/troubleshooting.md "Quiet imports"). Imported here, under
    :func:`~xpukit._quiet.quiet_imports`, that line is collected instead; the import is paid once
    either way (about 1 s on a 2-core CPU).
    """
    if not is_installed("deepspeed"):
        return
    from transformers.integrations import is_deepspeed_available

    if is_deepspeed_available():
        import deepspeed  # noqa: F401


def training_args(
    model: PreTrainedModel | PeftModel | str | os.PathLike[str] | None = None,
    *,
    facts: MachineFacts | DeviceFacts | None = None,
    strategy: str | None = None,
    config_class: type[TrainingArguments] | None = None,
    **kwargs: object,
) -> TrainingArguments:
    """``transformers.TrainingArguments`` for the model's device, with the user's keywords on top.

    The device comes from ``model.xpukit_plan.device`` when the model was loaded by
    :func:`xpukit.load_for_xpu`, else from where the model's parameters are, else from ``facts``
    (or :func:`xpukit.detect`). ``use_cpu=True`` among ``kwargs`` trains on the CPU. The mixed
    precision follows ``model.xpukit_plan.dtype`` when there is a plan.

    A trainable model whose 4-bit weights bitsandbytes repacked for CPU inference (a ``generate()``
    before training, on an avx512_bf16 CPU) is restored in place, with a logged warning, and the
    repacking is turned off on it (:func:`xpukit.loading.bnb_cpu.restore_trainable_4bit_layout`).

    Args:
        model: the model to train (a ``PreTrainedModel`` or ``PeftModel``), optional. A string or
            path here is the output directory, as ``TrainingArguments("out")`` takes it.
        facts: machine or device facts to use instead of detecting them.
        strategy: ``"auto"``, ``"ddp"``, ``"fsdp"`` (FSDP2) or ``"deepspeed"`` (ZeRO): adds that
            strategy's keywords (:mod:`xpukit.training.strategy`, docs/distributed.md); default none.
        config_class: a ``TrainingArguments`` subclass to build instead (TRL's ``SFTConfig``,
            ``DPOConfig``, ``GRPOConfig`` …): xpukit's decisions, explicit whatever its defaults, and
            the user's keywords, its own included (:mod:`xpukit.training.config_class`).
        **kwargs: any ``TrainingArguments`` keyword (``output_dir``, batch size, ...); they win.

    Returns:
        The ``TrainingArguments``. Building it initialises the XPU runtime (see the module docstring).

    Raises:
        InvalidRequestError: a keyword combination that cannot work on this device, a model with
            nothing to train (every parameter frozen), a model on a device other than index 0 in a
            single process, a ``config_class`` that is not a
            ``TrainingArguments`` subclass, or a keyword that class does not have.
        DeviceUnavailableError: repacked 4-bit weights that could not be restored.

    Example::

        args = training_args(model, output_dir="out", per_device_train_batch_size=4)
        Trainer(model=model, args=args, train_dataset=data).train()
    """
    # Other libraries imported here say nothing unless verbose (xpukit/_quiet.py).
    with quiet_imports():
        from xpukit.training.config_class import build_config, check_config_class

        if isinstance(model, (str, os.PathLike)):  # training_args("out"), as TrainingArguments("out")
            kwargs = _output_dir_given_first(model, kwargs)
            model = None
        cls = check_config_class(config_class)
        _import_deepspeed_quietly()
        _refuse_batch_size(kwargs)
        _refuse_nothing_to_train(model)
        _refuse_quantized_without_adapters(model)
        device = _training_device(model, facts, use_cpu=bool(kwargs.get("use_cpu")))
        context = _context(model, facts)
        keywords = training_kwargs(device, context=context, **kwargs)
        if strategy is not None:
            from xpukit.training.strategy import apply_strategy

            keywords, reasons = apply_strategy(strategy, model, device, keywords, kwargs, context.world_size)
            for reason in reasons:
                logger.info("training_args: %s", reason)
        if context.world_size > 1:
            _destroy_process_group_at_exit()
        _restore_repacked_4bit(model)
        return build_config(cls, keywords, kwargs)


def _output_dir_given_first(
    output_dir: str | os.PathLike[str], kwargs: dict[str, object]
) -> dict[str, object]:
    """``training_args("out")``: the string is the output directory, never dropped (as documented in
    docs/training.md, the ``training_args`` section)."""
    if "output_dir" in kwargs:
        raise InvalidRequestError(
            f"training_args({os.fspath(output_dir)!r}, output_dir={kwargs['output_dir']!r}): a string first "
            "is the output directory (as in TrainingArguments), and output_dir= names another. Fix: pass "
            "the model first, training_args(model, output_dir=...), or one output directory."
        )
    return {**kwargs, "output_dir": os.fspath(output_dir)}


@functools.cache  # once per process
def _destroy_process_group_at_exit() -> None:
    """Register, once per process, :func:`_destroy_process_group` to run at interpreter exit (gloo).

    ``Trainer`` never destroys the process group its arguments start, and a rank that exits with a
    gloo group alive can abort in its last instant (SIGABRT, "terminate called without an active
    exception") while gloo's threads are torn down with the interpreter: docs/distributed.md "The
    process group at exit". ``atexit`` runs while the interpreter is still whole.
    """
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    """Destroy the default gloo process group if it is still up (a no-op after the user's own call).

    Only gloo: its teardown is local to the process. NCCL's and XCCL's shut down communicators that
    other ranks may still be waiting in after this one failed, which is theirs to decide.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    if dist.get_backend() != "gloo":
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # exit must go on; say why the group stayed up
        logger.warning("training_args: destroying the process group at exit failed: %s", exc)
        return
    # What still holds the group (a DDP wrapper of a Trainer caught in a reference cycle) is freed now,
    # while the interpreter is whole, rather than at its finalization: the abort was seen again once
    # on a loaded 2-core CI machine with the group destroyed (docs/distributed.md "The process group
    # at exit").
    import gc

    gc.collect()


def _context(model: _Model, facts: MachineFacts | DeviceFacts | None) -> TrainingContext:
    plan_dtype = getattr(getattr(model, "xpukit_plan", None), "dtype", None)
    in_graphs = bool(getattr(getattr(model, "xpukit_layer_graphs", None), "checkpoint", False))
    return TrainingContext(
        world_size=_world_size(),
        torch_version=_torch_version(facts),
        quantized=_is_quantized(model),
        # Checkpointing inside the layer graphs is checkpointing too (the optimizer rule reads it);
        # training_kwargs keeps transformers' own off then.
        gradient_checkpointing=_has_gradient_checkpointing(model) or in_graphs,
        bitsandbytes_version=installed_version("bitsandbytes"),
        compute_dtype=plan_dtype if isinstance(plan_dtype, str) else None,
        training=getattr(getattr(model, "xpukit_plan", None), "training", None),
        checkpoint_in_graphs=in_graphs,
    )


def _refuse_nothing_to_train(model: _Model) -> None:
    """Refuse a model whose every parameter is frozen: ``Trainer.train()`` would fail at its first step
    with ``element 0 of tensors does not require grad``
    (docs/training.md "Training a saved adapter further")."""
    if model is None or not hasattr(model, "parameters"):
        return
    count = 0
    for param in model.parameters():
        if getattr(param, "requires_grad", True):
            return
        count += 1
    if count == 0:
        return
    plan = getattr(model, "xpukit_plan", None)
    lora = getattr(plan, "lora", None)
    path = getattr(lora, "adapter_path", None) or "path/to/adapter"
    loaded = (
        f": load_for_xpu(..., lora={path!r}) loads a trained adapter frozen, for inference" if lora else ""
    )
    if lora is not None and getattr(plan, "merge", None) is not None:
        loaded = f": merge=True merged {path!r} into a frozen plain model"
    raise InvalidRequestError(
        f"training_args: nothing in this {type(model).__name__} can train: all {count} parameter tensors are "
        f"frozen (requires_grad=False){loaded}. Trainer.train() would fail at its first step (element 0 of "
        f"tensors does not require grad). Fix: load_for_xpu(base, lora={path!r}, trainable=True) to train a "
        "saved adapter further, lora=True for new adapters, or unfreeze what should train "
        "(param.requires_grad_(True))."
    )


_BATCH_KEYWORDS = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")


def _refuse_batch_size(kwargs: Mapping[str, object]) -> None:
    """A batch size or accumulation that is not a positive int, refused before anything is built:
    ``Trainer`` would fail later, after making ``output_dir``."""
    for name in _BATCH_KEYWORDS:
        value = kwargs.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidRequestError(
                f"training_args: {name}={value!r} is not a positive int. Trainer would fail at its first "
                f"step, after making output_dir. Fix: {name}=1 or more (or leave it out: the plan's "
                "micro-batch and accumulation are used)."
            )


def _refuse_quantized_without_adapters(model: _Model) -> None:
    """A quantized model loaded to run (no adapters) cannot be fine-tuned: ``Trainer`` refuses purely
    quantized models at ``train()``, after making ``output_dir`` (docs/training.md "The one-call
    flow")."""
    if model is None or not getattr(model, "is_quantized", False):
        return
    if hasattr(model, "peft_config") or getattr(model, "_hf_peft_config_loaded", False):
        return
    method = getattr(model, "quantization_method", None)
    how = getattr(method, "value", method) or "quantized"
    raise InvalidRequestError(
        f"training_args: this {type(model).__name__} has {how} weights and no adapters: it was loaded to "
        "run, and Trainer cannot fine-tune purely quantized weights (it refuses at train(), after making "
        'output_dir). Fix: load_for_xpu(model, quantize="4bit", lora=True) for QLoRA (bitsandbytes 4-bit '
        "with LoRA adapters), or load without quantize= to train full weights."
    )


def _restore_repacked_4bit(model: _Model) -> None:
    """Give a trainable model's CPU-repacked 4-bit weights their trainable layout back (docs/known-issues.md
    "bitsandbytes: CPU repacking of 4-bit weights").

    Restoring rather than refusing: the user's model (often their own ``get_peft_model`` after a
    ``generate()``) trains correctly afterwards with no reload, by the same tested inverse
    :func:`xpukit.loading.lora.apply_lora` uses; the repacking is also turned off, so a ``Trainer``
    evaluation between steps cannot break the gradients again. A frozen (inference) model is left
    alone: it keeps bitsandbytes' faster repacked kernel.
    """
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None or model is None or not hasattr(model, "named_modules"):
        return  # no 4-bit layer exists without bitsandbytes imported
    if not any(p.requires_grad for p in model.parameters()):
        return
    repacked = [
        name
        for name, module in model.named_modules()
        if isinstance(module, bnb.nn.Linear4bit)
        and getattr(getattr(module.weight, "quant_state", None), "packing_format_for_cpu", False)
    ]
    notes = restore_trainable_4bit_layout(model)
    if repacked:
        logger.warning(
            "training_args: %d 4-bit layers (e.g. %s) had been repacked by bitsandbytes for CPU "
            "inference (a generate() or eval forward ran on the 4-bit model). That layout has no "
            "backward: LoRA layers before it (q/k/v, gate/up) would get exactly zero gradients. "
            "Restored with xpukit.loading.bnb_cpu.restore_trainable_4bit_layout and turned the repacking off "
            "on this model. To skip this, add LoRA with load_for_xpu(..., lora=...) or "
            "xpukit.loading.lora.apply_lora, which do it before training.",
            len(repacked),
            repacked[0],
        )
    for note in notes:
        logger.info("training_args: %s", note)


def _training_device(
    model: _Model, facts: MachineFacts | DeviceFacts | None, *, use_cpu: bool
) -> DeviceFacts:
    if isinstance(facts, DeviceFacts) and not use_cpu:
        return facts
    plan_device = getattr(getattr(model, "xpukit_plan", None), "device", None)
    if isinstance(plan_device, DeviceFacts) and not use_cpu:
        return plan_device
    machine = facts if isinstance(facts, MachineFacts) else None
    if use_cpu:
        if machine is None and isinstance(facts, DeviceFacts) and facts.backend == "cpu":
            return facts
        return (machine or _detect(devices=False)).cpu
    backend, index = _parameter_device(model)
    if backend == "cpu":
        return (machine or _detect(devices=False)).cpu
    machine = machine or _detect(devices=True)
    if backend is None:
        return machine.devices[0] if machine.devices else machine.cpu
    for device in machine.devices_of(backend):
        if device.index == (index or 0):
            return device
    found = ", ".join(d.torch_device for d in machine.devices) or "none"
    raise InvalidRequestError(
        f"training_args: the model is on {backend}:{index or 0}, but the machine facts list no such "
        f"device (found: {found}). Pass facts= for that machine, or move the model."
    )


def _detect(*, devices: bool) -> MachineFacts:
    from xpukit.machine.probe import detect

    return detect(devices=devices)


def _parameter_device(model: _Model) -> tuple[str | None, int | None]:
    if model is None or not hasattr(model, "parameters"):
        return None, None
    for param in model.parameters():
        if param.device.type != "meta":
            return str(param.device.type), param.device.index
    return None, None


def _is_quantized(model: _Model) -> bool:
    if model is None:
        return False
    return bool(
        getattr(model, "is_loaded_in_4bit", False)
        or getattr(model, "is_loaded_in_8bit", False)
        or getattr(model, "quantization_method", None) == "bitsandbytes"
    )


def _has_gradient_checkpointing(model: _Model) -> bool:
    if model is None or not hasattr(model, "modules"):
        return False
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _world_size() -> int:
    value = _environ.get("WORLD_SIZE")
    try:
        return int(value) if value else 1
    except ValueError:
        return 1


def _torch_version(facts: MachineFacts | DeviceFacts | None) -> str | None:
    if isinstance(facts, MachineFacts) and facts.torch_version:
        return facts.torch_version
    return installed_version("torch")
