"""``TrainingArguments`` that do not fail on the first step, on XPU, CUDA, MPS and CPU.

:func:`training_kwargs` decides the keywords from facts alone (testable with recorded device
profiles); :func:`training_args` finds the facts (from the model, its ``xpukit_plan``, or the machine)
and builds the ``transformers.TrainingArguments``. Rules (docs/known-issues.md "TrainingArguments: bf16 on
CPU raises without use_cpu" and docs/known-issues.md "TrainingArguments: ddp_backend in a single process",
docs/platform-notes.md §4.1–4.3):

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
* ``report_to="none"`` unless given.
* The user's keywords always win, except a combination that would fail, which is refused with the
  fix instead of transformers' ValueError on the first step.

Constructing ``TrainingArguments`` initialises the XPU runtime (its ``__post_init__`` touches
``self.device``, docs/platform-notes.md §4.1): set device selection (``xpukit launch``) before calling
:func:`training_args`.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from xpukit import _environ
from xpukit._compat import installed_version, version_at_least
from xpukit.errors import InvalidRequestError
from xpukit.loading.bnb_cpu import restore_trainable_4bit_layout
from xpukit.machine.facts import DeviceFacts, MachineFacts
from xpukit.machine.precision import (
    TrainingPrecision,
    normalize_dtype,
    training_precision,
    training_precision_for_dtype,
)
from xpukit.planning.training_plan import step_keywords

if TYPE_CHECKING:
    from transformers import TrainingArguments

__all__ = ["TrainingContext", "training_args", "training_kwargs"]

logger = logging.getLogger(__name__)

#  bitsandbytes releases with paged 8-bit optimizers per device (docs/platform-notes.md §5.1). Never on
# CPU/MPS.
_PAGED_OPTIM_MIN_BNB = {"cuda": "0.48", "xpu": "0.50"}


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingContext:
    """Facts about the run beside the device.

    Attributes:
        world_size: processes in the run (``WORLD_SIZE``; 1 when not launched).
        torch_version: the installed torch version (xccl needs ≥ 2.8).
        quantized: the model's weights are 4/8-bit (bitsandbytes).
        gradient_checkpointing: the model already has gradient checkpointing on.
        bitsandbytes_version: the installed bitsandbytes version, if any.
        compute_dtype: the dtype the model was loaded to compute in (``model.xpukit_plan.dtype``);
            when set, the mixed precision follows it instead of the device's best.
        training: the load plan's training plan (``model.xpukit_plan.training``): its micro-batch
            and accumulation become the defaults (docs/training.md "Training plan by fit").
    """

    world_size: int = 1
    torch_version: str | None = None
    quantized: bool = False
    gradient_checkpointing: bool = False
    bitsandbytes_version: str | None = None
    compute_dtype: str | None = None
    training: Any = None


def training_kwargs(
    device: DeviceFacts, /, *, context: TrainingContext | None = None, **user: Any
) -> dict[str, Any]:
    """The ``TrainingArguments`` keywords for a device: xpukit's choices, then the user's on top.

    Args:
        device: the device training runs on (for ``use_cpu=True`` pass the CPU's facts).
        context: the run's other facts (world size, torch version, quantisation, ...).
        **user: ``TrainingArguments`` keywords; they win over xpukit's choices.

    Returns:
        Keywords for ``transformers.TrainingArguments``.

    Raises:
        InvalidRequestError: a user combination that would fail on this device (bf16 together with
            fp16, bf16 with ``use_cpu=False`` on a CPU, fp16 with GradScaler on a device without fp64),
            or a device other than index 0 in a single process.

    Example::

        >>> from xpukit.machine.profiles import device_profile
        >>> training_kwargs(device_profile("t4"), output_dir="out")["fp16"]
        True
    """
    ctx = context or TrainingContext()
    if not user.get("use_cpu"):
        _refuse_other_card(device, ctx.world_size)
    out, reasons = _decide(device, ctx)
    planned, why = step_keywords(ctx.training)
    out.update(planned)
    reasons += why
    _refuse_impossible(device, user, _precision(device, ctx.compute_dtype).name)
    # One mixed precision named by the user replaces xpukit's, rather than joining it.
    for mine, other in (("bf16", "fp16"), ("fp16", "bf16")):
        if user.get(mine) and other not in user:
            out[other] = False
    if device.backend == "cpu" and user.get("use_cpu") is False and "bf16" not in user and out["bf16"]:
        out["bf16"] = False  # transformers raises on bf16 without use_cpu; the user kept use_cpu off
        reasons.append("bf16 off: use_cpu=False was given and transformers refuses bf16 then")
    out.update(user)
    if out.get("gradient_checkpointing") and "gradient_checkpointing_kwargs" not in user:
        out["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    for reason in reasons:
        logger.info("training_args: %s", reason)
    return out


def _refuse_other_card(device: DeviceFacts, world_size: int) -> None:
    """A single process trains on device 0 whatever card the model is on (docs/platform-notes.md §4.1)."""
    if world_size > 1 or device.backend not in ("xpu", "cuda") or device.index == 0:
        return
    raise InvalidRequestError(
        f"training_args: the model is on {device.torch_device}, but a single (non-distributed) process "
        f"trains on {device.backend}:0: TrainingArguments always sets {device.backend}:0 as its device, "
        f"so the batches would go to another card than the model. Fix: run the script on that card "
        f"alone, `xpukit launch --devices {device.index} -- python train.py`; inside it the card is "
        f"then {device.backend}:0, so load the model there (load_for_xpu picks it)."
    )


def _precision(device: DeviceFacts, compute_dtype: str | None) -> TrainingPrecision:
    """The device's best precision, or the one the model's load dtype implies."""
    dtype = normalize_dtype(compute_dtype) if compute_dtype is not None else None
    if dtype is None:
        return training_precision(device)
    return training_precision_for_dtype(device, dtype)


def _decide(device: DeviceFacts, ctx: TrainingContext) -> tuple[dict[str, Any], list[str]]:
    precision = _precision(device, ctx.compute_dtype)
    out: dict[str, Any] = {"bf16": precision.bf16, "fp16": precision.fp16, "report_to": "none"}
    reasons = [f"{precision.name}: {precision.reason}"]
    if device.backend == "cpu":
        out["use_cpu"] = True
        reasons.append("use_cpu=True: training on the CPU (bf16 would raise without it)")
    if ctx.world_size > 1:
        backend, why = _ddp_backend(device, ctx.torch_version)
        if backend:
            out["ddp_backend"] = backend
        reasons.append(why)
    if ctx.gradient_checkpointing:
        out["gradient_checkpointing"] = True
        reasons.append("gradient checkpointing: the model has it on (non-reentrant)")
    optim, why = _optimizer(device, ctx)
    out["optim"] = optim
    reasons.append(why)
    return out, reasons


def _ddp_backend(device: DeviceFacts, torch_version: str | None) -> tuple[str | None, str]:
    from xpukit.planning.distributed import process_group_backend

    return process_group_backend(device, torch_version)


def _optimizer(device: DeviceFacts, ctx: TrainingContext) -> tuple[str, str]:
    if not ctx.quantized:
        return "adamw_torch", "optim=adamw_torch (the model is not quantised)"
    minimum = _PAGED_OPTIM_MIN_BNB.get(device.backend)
    if minimum and version_at_least(ctx.bitsandbytes_version, minimum):
        return "paged_adamw_8bit", (
            f"optim=paged_adamw_8bit: quantised model, bitsandbytes {ctx.bitsandbytes_version} has paged "
            f"optimizers on {device.backend}"
        )
    why = (
        f"bitsandbytes >= {minimum} needed for paged optimizers on {device.backend}"
        if minimum
        else f"bitsandbytes has no paged optimizers on {device.backend}"
    )
    return "adamw_torch", f"optim=adamw_torch: {why}"


def _refuse_impossible(device: DeviceFacts, user: dict[str, Any], pick: str) -> None:
    if user.get("bf16") and user.get("fp16"):
        raise InvalidRequestError(
            "training_args(bf16=True, fp16=True): at most one mixed precision can be on. "
            f"Fix: drop one; on {device.name} xpukit would pick {pick}."
        )
    if user.get("bf16") and device.backend == "cpu" and user.get("use_cpu") is False:
        raise InvalidRequestError(
            "training_args(bf16=True, use_cpu=False) on a machine whose training device is the CPU: "
            "transformers refuses bf16 there without use_cpu. Fix: drop use_cpu=False."
        )
    if user.get("fp16") and device.backend == "xpu" and not device.fp64:
        raise InvalidRequestError(
            f"training_args(fp16=True) on {device.name}: fp16 training needs GradScaler, which needs "
            'fp64, and this GPU has none ("Required aspect fp64 is not supported" on the first '
            f"step). Fix: drop fp16=True (xpukit picks {pick}), or use bf16=True."
        )
    if user.get("bf16") and not device.native_bf16 and device.backend != "cpu":
        logger.warning(
            "training_args(bf16=True): %s has no native bf16, so it is emulated (slow).", device.name
        )


# =============================================================================================
# Acting: find the facts, build the TrainingArguments
# =============================================================================================


def training_args(
    model: Any = None,
    *,
    facts: MachineFacts | DeviceFacts | None = None,
    strategy: Any = None,
    config_class: Any = None,
    **kwargs: Any,
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
        model: the model to train (a ``PreTrainedModel`` or ``PeftModel``), optional.
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
        InvalidRequestError: a keyword combination that cannot work on this device, a model on a
            device other than index 0 in a single process, a ``config_class`` that is not a
            ``TrainingArguments`` subclass, or a keyword that class does not have.
        DeviceUnavailableError: repacked 4-bit weights that could not be restored.

    Example::

        args = training_args(model, output_dir="out", per_device_train_batch_size=4)
        Trainer(model=model, args=args, train_dataset=data).train()
    """
    from xpukit.training.config_class import build_config, check_config_class

    cls = check_config_class(config_class)
    device = _training_device(model, facts, use_cpu=bool(kwargs.get("use_cpu")))
    context = _context(model, facts)
    keywords = training_kwargs(device, context=context, **kwargs)
    if strategy is not None:
        from xpukit.training.strategy import apply_strategy

        keywords, reasons = apply_strategy(strategy, model, device, keywords, kwargs, context.world_size)
        for reason in reasons:
            logger.info("training_args: %s", reason)
    _restore_repacked_4bit(model)
    return build_config(cls, keywords, kwargs)


def _context(model: Any, facts: MachineFacts | DeviceFacts | None) -> TrainingContext:
    plan_dtype = getattr(getattr(model, "xpukit_plan", None), "dtype", None)
    return TrainingContext(
        world_size=_world_size(),
        torch_version=_torch_version(facts),
        quantized=_is_quantized(model),
        gradient_checkpointing=_has_gradient_checkpointing(model),
        bitsandbytes_version=installed_version("bitsandbytes"),
        compute_dtype=plan_dtype if isinstance(plan_dtype, str) else None,
        training=getattr(getattr(model, "xpukit_plan", None), "training", None),
    )


def _restore_repacked_4bit(model: Any) -> None:
    """Give a trainable model's CPU-repacked 4-bit weights their trainable layout back (docs/known-issues.md
    "bitsandbytes: CPU repacking of 4-bit weights").

    Restoring rather than refusing: the user's model (often their own ``get_peft_model`` after a
    ``generate()``) trains correctly afterwards with no reload, by the same tested inverse
    :func:`xpukit.loading.lora.apply_lora` uses; the repacking is also turned off, so a ``Trainer``
    evaluation between steps cannot break the gradients again. A frozen (inference) model is left
    alone: it keeps bitsandbytes' faster repacked kernel.
    """
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None or not hasattr(model, "named_modules"):
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


def _training_device(model: Any, facts: MachineFacts | DeviceFacts | None, *, use_cpu: bool) -> DeviceFacts:
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


def _parameter_device(model: Any) -> tuple[str | None, int | None]:
    if model is None or not hasattr(model, "parameters"):
        return None, None
    for param in model.parameters():
        if param.device.type != "meta":
            return str(param.device.type), param.device.index
    return None, None


def _is_quantized(model: Any) -> bool:
    if model is None:
        return False
    return bool(
        getattr(model, "is_loaded_in_4bit", False)
        or getattr(model, "is_loaded_in_8bit", False)
        or getattr(model, "quantization_method", None) == "bitsandbytes"
    )


def _has_gradient_checkpointing(model: Any) -> bool:
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
