"""The ``TrainingArguments`` pieces of a distributed strategy: DDP, FSDP2, DeepSpeed ZeRO.

:func:`strategy_kwargs` is pure (facts in, keywords out) and is what
``training_args(..., strategy=...)`` adds to its keywords. Rules and their sources:
docs/distributed.md "What xpukit decides".

* ``ddp``: ``ddp_find_unused_parameters=False`` for a LoRA model (every adapter is used in every
  forward, so the extra autograd traversal DDP does for unused parameters is wasted); gradient
  checkpointing non-reentrant (set by ``training_kwargs``: reentrant checkpointing under DDP marks
  parameters ready twice).
* ``fsdp``: ``fsdp=True`` with transformers' FSDP2 ``fsdp_config`` (``version: 2``, transformer-based
  auto-wrap of the model's ``_no_split_modules``, ``reshard_after_forward``), activation
  checkpointing through FSDP instead of the model's gradient checkpointing (which costs FSDP an extra
  all-gather), ``cpu_ram_efficient_loading`` when the plan loaded without a device_map for FSDP.
  Refused on the CPU: accelerate applies FSDP only on accelerators, and Trainer would silently train
  with DDP.
* ``deepspeed``: a ZeRO-2 (the model fits one device) or ZeRO-3 config dict, bf16/fp16 per the
  precision rule, batch sizes left ``"auto"`` for transformers to fill; ``MissingExtraError`` without
  the ``deepspeed`` extra.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from xpukit import _environ
from xpukit._compat import is_installed, require
from xpukit.errors import InvalidRequestError
from xpukit.machine.facts import DeviceFacts
from xpukit.machine.precision import TrainingPrecision
from xpukit.planning.device.distributed import parse_strategy

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

__all__ = ["StrategyFacts", "apply_strategy", "deepspeed_config", "strategy_facts", "strategy_kwargs"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StrategyFacts:
    """What the strategy keywords are decided from.

    Attributes:
        lora: the model trains LoRA adapters (a PEFT model).
        wrap_classes: the model's ``_no_split_modules`` (its decoder layer classes), for auto-wrap.
        planned: the strategy ``model.xpukit_plan`` was loaded for (``fsdp``, ``ddp``…), if any.
        loaded_for_sharding: the plan loaded without a device_map for FSDP.
        fits_one_device: the plan found the model with its training memory fits one device
            (``None``: unknown).
        world_size: processes in the job.
        deepspeed_env_missing: the launch variables DeepSpeed needs that this process lacks, when
            DeepSpeed would look for them through MPI and mpi4py is not installed (``()``: none missing,
            or DeepSpeed can find its ranks).
        notes: anything else read from the model, in words.
    """

    lora: bool = False
    wrap_classes: tuple[str, ...] = ()
    planned: str | None = None
    loaded_for_sharding: bool = False
    fits_one_device: bool | None = None
    world_size: int = 1
    deepspeed_env_missing: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())


def strategy_kwargs(
    strategy: str | None,
    device: DeviceFacts,
    precision: TrainingPrecision,
    facts: StrategyFacts,
    user: Mapping[str, object],
) -> tuple[dict[str, object], list[str]]:
    """The keywords a strategy adds, and why; the user's keywords are not in them (they win later).

    Args:
        strategy: ``"auto"``, ``"ddp"``, ``"fsdp"``, ``"deepspeed"`` or ``None`` (nothing added).
        device: this rank's training device.
        precision: the mixed precision ``training_kwargs`` chose (bf16/fp16/fp32).
        facts: the model and plan facts.
        user: the user's ``TrainingArguments`` keywords (read, never changed).

    Returns:
        ``(keywords, reasons)``.

    Raises:
        InvalidRequestError: ``fsdp`` on the CPU or MPS; a user's ``fsdp``/``deepspeed`` keyword that
            contradicts the strategy.
        MissingExtraError: ``deepspeed`` without the ``deepspeed`` extra.
    """
    chosen = parse_strategy(strategy)
    if chosen is None:
        return {}, []
    if chosen == "auto":
        if facts.planned in {"ddp", "fsdp", "deepspeed"}:
            chosen, why = facts.planned, f"strategy auto: {facts.planned}, as the load was planned for"
        elif facts.fits_one_device is False and device.backend not in {"cpu", "mps"}:
            chosen, why = "fsdp", "strategy auto: fsdp, the model does not fit one device"
        else:
            chosen, why = "ddp", "strategy auto: ddp (no plan says the model does not fit one device)"
        out, reasons = strategy_kwargs(chosen, device, precision, facts, user)
        return out, [why, *reasons]
    if chosen != "fsdp" and user.get("fsdp"):
        raise InvalidRequestError(
            f"training_args(strategy={chosen!r}, fsdp={user['fsdp']!r}): the strategy and the fsdp keyword "
            "disagree. Fix: strategy='fsdp', or drop fsdp."
        )
    if chosen == "ddp":
        return _ddp(facts)
    if chosen == "fsdp":
        return _fsdp(device, facts, user)
    return _deepspeed(device, precision, facts, user)


def _ddp(facts: StrategyFacts) -> tuple[dict[str, object], list[str]]:
    if not facts.lora:
        return {}, ["strategy ddp: transformers' DDP defaults (find_unused_parameters as it decides)"]
    return {"ddp_find_unused_parameters": False}, [
        "strategy ddp: ddp_find_unused_parameters=False (every LoRA adapter is used in every forward)"
    ]


def _fsdp(
    device: DeviceFacts, facts: StrategyFacts, user: Mapping[str, object]
) -> tuple[dict[str, object], list[str]]:
    if device.backend in {"cpu", "mps"}:
        raise InvalidRequestError(
            f"training_args(strategy='fsdp') on {device.torch_device}: accelerate applies FSDP only on "
            "accelerators (its FSDP switch sits in the multi-GPU/XPU branch), so Trainer would silently "
            "train with DDP (docs/distributed.md \"FSDP2 on the CPU\"). Fix: strategy='ddp' on the CPU; "
            "torch's own fully_shard runs on the CPU (examples/fsdp_qlora.py)."
        )
    if user.get("deepspeed"):
        raise InvalidRequestError(
            "training_args(strategy='fsdp', deepspeed=...): FSDP and DeepSpeed cannot both shard the "
            "model. Fix: drop one."
        )
    checkpointing = bool(user.get("gradient_checkpointing"))
    config: dict[str, object] = {
        "version": 2,
        "reshard_after_forward": True,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "activation_checkpointing": checkpointing,
        "cpu_ram_efficient_loading": facts.loaded_for_sharding,
        "state_dict_type": "FULL_STATE_DICT",
    }
    reasons = ["strategy fsdp: FSDP2 (fsdp_config version 2), full shard (reshard_after_forward)"]
    if facts.wrap_classes:
        config["transformer_layer_cls_to_wrap"] = list(facts.wrap_classes)
        reasons.append(f"auto-wrap by the model's _no_split_modules: {', '.join(facts.wrap_classes)}")
    if checkpointing:
        reasons.append(
            "activation checkpointing through FSDP (fsdp_config), model gradient checkpointing off: it "
            "would cost FSDP a redundant all-gather in the backward"
        )
    if facts.loaded_for_sharding:
        reasons.append("cpu_ram_efficient_loading: the plan loaded without a device_map, for sharding")
    given = user.get("fsdp_config")
    if isinstance(given, dict):
        config.update(given)  # the user's fsdp_config keys win, one by one
    out: dict[str, object] = {"fsdp": user.get("fsdp") or True, "fsdp_config": config}
    if checkpointing:
        out["gradient_checkpointing"] = False
    return out, reasons


def _deepspeed(
    device: DeviceFacts, precision: TrainingPrecision, facts: StrategyFacts, user: Mapping[str, object]
) -> tuple[dict[str, object], list[str]]:
    require("deepspeed", "training_args(strategy='deepspeed')")
    if facts.deepspeed_env_missing:
        raise InvalidRequestError(
            f"training_args(strategy='deepspeed') in a process that was not launched ({device.torch_device}, "
            f"no {', '.join(facts.deepspeed_env_missing)}): DeepSpeed then looks for its ranks through MPI, "
            "and mpi4py is not installed, so Trainer.train() would fail in deepspeed.initialize "
            "(docs/distributed.md \"DeepSpeed\"). Fix: leave strategy= out (or strategy='ddp') for one "
            "process, or start the script with a launcher that sets them: `xpukit launch --nproc N -- "
            "train.py` (torchrun), `deepspeed train.py` or `accelerate launch train.py`."
        )
    if user.get("deepspeed") is not None:
        return {}, ["strategy deepspeed: the given deepspeed config is used as it is"]
    stage = 2 if facts.fits_one_device is not False else 3
    config = deepspeed_config(stage, precision)
    why = "the model fits one device" if stage == 2 else "the model does not fit one device"
    return {"deepspeed": config}, [f"strategy deepspeed: ZeRO-{stage} ({why}), {precision.name}"]


def deepspeed_config(stage: int, precision: TrainingPrecision) -> dict[str, object]:
    """A DeepSpeed ZeRO-2 or ZeRO-3 config dict for ``TrainingArguments(deepspeed=...)``.

    Sizes left ``"auto"`` are filled by transformers from the ``TrainingArguments``
    (``HfTrainerDeepSpeedConfig``); bf16/fp16 follow the precision rule (docs/platform-notes.md §3.4).

    Args:
        stage: 2 (shard optimizer states and gradients) or 3 (also the weights).
        precision: the training precision.

    Returns:
        The config dict.

    Raises:
        InvalidRequestError: a stage other than 2 or 3.
    """
    if stage not in (2, 3):
        raise InvalidRequestError(
            f"deepspeed_config(stage={stage!r}): xpukit writes ZeRO-2 or ZeRO-3 configs."
        )
    zero: dict[str, object] = {
        "stage": stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
    }
    if stage == 3:
        zero |= {
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": True,
        }
    else:
        zero |= {"allgather_partitions": True, "reduce_scatter": True}
    return {
        "zero_optimization": zero,
        "bf16": {"enabled": precision.bf16},
        "fp16": {"enabled": precision.fp16, "loss_scale": 0, "initial_scale_power": 16},
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }


# ---------------------------------------------------------------------------------------------
# Acting: read the facts from the model and its plan
# ---------------------------------------------------------------------------------------------


def strategy_facts(model: PreTrainedModel | PeftModel | None, world_size: int) -> StrategyFacts:
    """What :func:`strategy_kwargs` needs, read from the model and ``model.xpukit_plan``."""
    plan = getattr(model, "xpukit_plan", None)
    base = model.get_base_model() if model is not None and hasattr(model, "get_base_model") else model
    wrap = tuple(getattr(base, "_no_split_modules", None) or ())
    fits: bool | None = None
    decision = next((d for d in getattr(plan, "decisions", ()) if d.name == "strategy"), None)
    if decision is not None:
        fits = decision.value == "ddp"
    return StrategyFacts(
        lora=hasattr(model, "peft_config"),
        wrap_classes=wrap,
        planned=getattr(plan, "strategy", None),
        loaded_for_sharding=plan is not None
        and getattr(plan, "strategy", None) == "fsdp"
        and plan.device_map is None,
        fits_one_device=fits,
        world_size=world_size,
        deepspeed_env_missing=deepspeed_env_missing(),
    )


# DeepSpeed's init_distributed: without all of these it discovers the ranks through MPI (mpi4py),
# except on Azure ML and SageMaker, which it reads itself (deepspeed/comm/comm.py, 0.19).
DEEPSPEED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def deepspeed_env_missing() -> tuple[str, ...]:
    """The DeepSpeed launch variables this process lacks where DeepSpeed could not find its ranks
    otherwise (no mpi4py, not Azure ML or SageMaker); ``()`` when it can."""
    if is_installed("mpi4py") or _environ.get("AZUREML_EXPERIMENT_ID") or _environ.get("SM_TRAINING_ENV"):
        return ()
    return tuple(name for name in DEEPSPEED_ENV if _environ.get(name) is None)


def apply_strategy(
    strategy: str | None,
    model: PreTrainedModel | PeftModel | None,
    device: DeviceFacts,
    keywords: dict[str, object],
    user: Mapping[str, object],
    world_size: int,
) -> tuple[dict[str, object], list[str]]:
    """``keywords`` (xpukit's choices with the user's on top) with the strategy's keywords added.

    The strategy's keywords never replace one the user gave, except ``gradient_checkpointing``,
    which FSDP turns into activation checkpointing, and ``fsdp_config``, merged key by key.
    """
    precision = TrainingPrecision(bf16=bool(keywords.get("bf16")), fp16=bool(keywords.get("fp16")), reason="")
    extra, reasons = strategy_kwargs(strategy, device, precision, strategy_facts(model, world_size), user)
    out = dict(keywords)
    for key, value in extra.items():
        if key not in user or key in {"fsdp", "fsdp_config", "gradient_checkpointing"}:
            out[key] = value
    if out.get("fsdp") and not out.get("gradient_checkpointing"):
        out.pop("gradient_checkpointing_kwargs", None)
    return out, reasons
