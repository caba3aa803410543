"""The ``TrainingArguments`` keywords for a device, decided from facts alone (pure).

:func:`training_kwargs` is the deciding half of :func:`xpukit.training_args`; the rules are in
:mod:`xpukit.training.arguments` (its module docstring) and docs/training.md. It takes recorded
device facts, so every rule is tested without the device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from xpukit._compat import version_at_least
from xpukit.errors import InvalidRequestError
from xpukit.machine.facts import DeviceFacts
from xpukit.machine.precision import (
    TrainingPrecision,
    normalize_dtype,
    slow_precision,
    training_precision,
    training_precision_for_dtype,
)
from xpukit.planning.training.fit import step_keywords

if TYPE_CHECKING:
    from xpukit.planning.training.training_plan import TrainingPlan

__all__ = ["TrainingContext", "training_kwargs"]

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
        gradient_checkpointing: the model already has gradient checkpointing on (transformers', or
            inside its layer graphs).
        bitsandbytes_version: the installed bitsandbytes version, if any.
        compute_dtype: the dtype the model was loaded to compute in (``model.xpukit_plan.dtype``);
            when set, the mixed precision follows it instead of the device's best.
        training: the load plan's training plan (``model.xpukit_plan.training``): its micro-batch
            and accumulation become the defaults (docs/training-plan.md "Training plan by fit").
        checkpoint_in_graphs: the model's layer graphs checkpoint each layer themselves
            (``model.xpukit_layer_graphs.checkpoint``): transformers' checkpointing stays off.
    """

    world_size: int = 1
    torch_version: str | None = None
    quantized: bool = False
    gradient_checkpointing: bool = False
    bitsandbytes_version: str | None = None
    compute_dtype: str | None = None
    training: TrainingPlan | None = None
    checkpoint_in_graphs: bool = False


def training_kwargs(
    device: DeviceFacts, /, *, context: TrainingContext | None = None, **user: object
) -> dict[str, object]:
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
    if ctx.checkpoint_in_graphs:
        out["gradient_checkpointing"] = False
        reasons.append(
            "gradient_checkpointing=False: xpukit checkpoints each layer inside the layer graphs; "
            "transformers' own checkpointing would wrap them and keep the graphs from replaying"
        )
    _refuse_impossible(device, user, _precision(device, ctx.compute_dtype).name)
    # One mixed precision named by the user replaces xpukit's, rather than joining it.
    for mine, other in (("bf16", "fp16"), ("fp16", "bf16")):
        if user.get(mine) and other not in user:
            out[other] = False
    if device.backend == "cpu" and user.get("use_cpu") is False and "bf16" not in user and out["bf16"]:
        out["bf16"] = False  # transformers raises on bf16 without use_cpu; the user kept use_cpu off
        reasons.append("bf16 off: use_cpu=False was given and transformers refuses bf16 then")
    out.update(user)
    if "logging_nan_inf_filter" not in user:
        keep, note = _loss_filter(device, bool(out.get("fp16")))
        if keep is not None:
            out["logging_nan_inf_filter"] = keep
        if note:
            reasons.append(note)
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


def _decide(device: DeviceFacts, ctx: TrainingContext) -> tuple[dict[str, object], list[str]]:
    precision = _precision(device, ctx.compute_dtype)
    out: dict[str, object] = {"bf16": precision.bf16, "fp16": precision.fp16, "report_to": "none"}
    reasons = [f"{precision.name}: {precision.reason}"]
    if device.backend == "cpu":
        out["use_cpu"] = True
        reasons.append("use_cpu=True: training on the CPU (bf16 would raise without it)")
    if ctx.world_size > 1:
        backend, why = _ddp_backend(device, ctx.torch_version)
        if backend:
            out["ddp_backend"] = backend
        reasons.append(why)
    if ctx.gradient_checkpointing and not ctx.checkpoint_in_graphs:
        out["gradient_checkpointing"] = True
        reasons.append("gradient checkpointing: the model has it on (non-reentrant)")
    optim, why = _optimizer(device, ctx)
    out["optim"] = optim
    reasons.append(why)
    return out, reasons


def _ddp_backend(device: DeviceFacts, torch_version: str | None) -> tuple[str | None, str]:
    from xpukit.planning.device.distributed import process_group_backend

    return process_group_backend(device, torch_version)


def _optimizer(device: DeviceFacts, ctx: TrainingContext) -> tuple[str, str]:
    if not ctx.quantized:
        return "adamw_torch", "optim=adamw_torch (the model is not quantised)"
    counted = ctx.training is not None and bool(getattr(ctx.training, "fits", False))
    if device.backend in ("cuda", "xpu") and (not ctx.gradient_checkpointing or counted):
        room = "no checkpointing" if not ctx.gradient_checkpointing else "its fit counts AdamW's fp32 states"
        return "adamw_torch_fused", (
            "optim=adamw_torch_fused: the LoRA weights' update in one fused kernel; the plan has room "
            f"({room}), so the paged 8-bit states' few hundred MB are not worth their per-tensor "
            "launches (H200 real run, Qwen3-8B shape: 226 → 187 ms a step; "
            'docs/training-plan.md "The optimizer")'
        )
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


def _loss_filter(device: DeviceFacts, fp16: bool) -> tuple[bool | None, str]:
    """``logging_nan_inf_filter``: off on a GPU unless fp16's GradScaler already waits each step.

    transformers' ``Trainer`` checks each step's loss for nan/inf in a Python ``if``, which waits for the
    step's backward; the host's next launches then start on an idle device (docs/training.md
    "Why the loss filter is off")."""
    if device.backend not in ("cuda", "xpu"):
        return None, ""  # the CPU runs synchronously: the check waits for nothing
    if fp16:
        return None, (
            "logging_nan_inf_filter left on: fp16's GradScaler reads its inf check each step, so the "
            "filter's wait costs nothing more"
        )
    return False, (
        "logging_nan_inf_filter=False: Trainer's nan/inf check of each step's loss makes the host wait "
        "for the device every step (H200 real run, Qwen3-8B shape with room: device busy 60 % -> 81 %, "
        "170 -> 142 ms a step); a nan/inf loss now shows in the logged loss instead of being replaced "
        'by the average (docs/training.md "Why the loss filter is off")'
    )


def _refuse_impossible(device: DeviceFacts, user: dict[str, object], pick: str) -> None:
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
    for flag, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
        slow = slow_precision(device, dtype) if user.get(flag) else None  # as load_for_xpu(dtype=) warns
        if slow is not None:
            logger.warning("training_args(%s=True): %s", flag, slow)
