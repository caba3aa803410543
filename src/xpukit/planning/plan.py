"""``plan_load``: every loading choice decided from facts, with its reason, before any weight is read.

:func:`plan_request` runs the stages of :mod:`xpukit.planning.stages` in order; :func:`plan_stage`
gathers what they decided into the frozen :class:`LoadPlan`, every decision in the plan's order.

Deciding is a pure function of the request, the machine's facts and the model's facts. The only
reads are the model's config (never its weights), the machine (only when ``facts`` is not given:
:func:`xpukit.machine.probe.detect`), installed package versions, and, through the
:class:`~xpukit.sources.hub_access.HubFacts` the deciders are given, the local kernel cache and —
only when a Hub-backed choice is on the table — one bounded reachability check (:mod:`xpukit.hub`).
"""

from __future__ import annotations

import logging
from typing import Any

from xpukit._quiet import quiet_imports
from xpukit.planning.device.quantization import head_skip_modules
from xpukit.planning.loadplan import LoadPlan
from xpukit.planning.request import LoadRequest, ModelArg, read_model_config, takes_request
from xpukit.planning.stage_values import Adapters, Attention, Config, Decode, Machine, Model, Placement
from xpukit.planning.stages import (
    adapters_stage,
    attention_stage,
    config_stage,
    decode_stage,
    machine_stage,
    merge_stage,
    model_stage,
    placement_stage,
)
from xpukit.sources.hub_access import HubAccess, HubFacts

__all__ = ["plan_load", "plan_request", "plan_stage"]

logger = logging.getLogger(__name__)


# Its keywords' types are LoadRequest's: takes_request gives them to type checkers, and ``Any`` here is
# only what is handed on to LoadRequest, which checks each.
@takes_request(LoadRequest)
def plan_load(model: ModelArg, **keywords: Any) -> LoadPlan:
    """Plan how to load ``model`` for inference: device, dtype, placement, attention, kernels, 4-bit, LoRA.

    Reads the config only (offline rules honoured), never the weights. With ``facts`` given no
    device runtime is initialised.

    Args:
        model: a Hub id, a local model directory, a ``PretrainedConfig``, or the name of a built-in
            shape (``qwen3-8b``…, ``xpukit.planning.model.reference_models``: a real model's config,
            no download; there are no weights to load with it).
        **keywords: the request: :class:`~xpukit.planning.request.LoadRequest`'s keywords, each
            described there (its signature is this function's); any other keyword is passed to
            ``from_pretrained`` unchanged.

    Returns:
        A frozen :class:`LoadPlan`.

    Raises:
        InvalidRequestError: a bad or conflicting argument, path or model id.
        DeviceUnavailableError: the device cannot be used with this torch build or machine.
        MissingExtraError: a requested extra (bitsandbytes, peft) is missing on this machine.
        PlanError: the model fits nowhere (the message shows the numbers).

    Example:
        >>> from xpukit import plan_load
        >>> from xpukit.planning.model.reference_models import reference_config
        >>> plan = plan_load(reference_config("qwen3-8b"), facts="arc-b580", quantize="4bit")
        >>> plan.device_map, plan.dtype
        ('xpu:0', 'bfloat16')
    """
    # Other libraries imported while planning say nothing unless verbose (xpukit/_quiet.py).
    with quiet_imports():
        # Everything that can be checked without reading anything is checked first.
        return plan_request(model, LoadRequest(**keywords))


def plan_request(model: ModelArg, req: LoadRequest, *, hub: HubFacts | None = None) -> LoadPlan:
    """``plan_load`` for a request already built: the stages, in order (planning/stages.py).

    ``hub``: the Hub's facts (default: :class:`HubAccess`, this process's, each asked when needed).
    """
    with quiet_imports():
        cfg = config_stage(model, req, read_model_config(model, req))  # the config read first
        mach = machine_stage(req, HubAccess() if hub is None else hub)
        described = model_stage(req, cfg)
        place = placement_stage(req, cfg, mach, described)
        attention = attention_stage(req, mach, described, place)
        adapters = adapters_stage(req, mach, described, place, attention)
        decode = decode_stage(req, cfg, mach, described, place)
        merge_plan = merge_stage(req, mach, described, place)
        merged = (merge_plan.warning,) if merge_plan is not None and merge_plan.warning is not None else ()
        warnings = (*described.warnings, *place.warnings, *attention.warnings, *adapters.warnings, *merged)
        for warning in warnings:
            logger.warning("%s", warning)
        plan = plan_stage(req, cfg, mach, described, place, attention, adapters, decode, warnings)
        # merge=: the plan as the merge carries it out (docs/merging.md "Merge (`merge=`)").
        return plan if merge_plan is None else plan.with_merge(merge_plan)


def plan_stage(
    req: LoadRequest,
    cfg: Config,
    mach: Machine,
    model: Model,
    place: Placement,
    attn: Attention,
    adapters: Adapters,
    decode: Decode,
    warnings: tuple[str, ...],
) -> LoadPlan:
    """Every decision in the plan's order, and the frozen :class:`LoadPlan`."""
    layout, distributed = place.layout, place.distributed
    decisions = [mach.device_decision, layout.dtype, *layout.decisions, attn.attention.decision]
    decisions = distributed.merged([*decisions, attn.kernels.decision])
    decisions.insert(0, model.class_choice.decision)
    decisions += adapters.decisions
    decisions += [decode.decision] if decode.decision is not None else []
    user_config = cfg.quant.user_config
    return LoadPlan(
        model=cfg.source,
        model_facts=model.facts,
        machine=mach.machine,
        device=mach.main,
        dtype=place.dtype,
        quantization=layout.quantization,
        quantization_config=head_skip_modules(model.facts, distributed.quantization_config, user_config),
        attn_implementation=attn.attention.value,
        attention_kernel=attn.attention.kernel.repo if attn.attention.kernel else None,
        use_kernels=attn.kernels.use,
        device_map=distributed.device_map,
        max_memory=distributed.max_memory,
        memory=layout.memory,
        lora=place.lora,
        decisions=tuple(decisions),
        warnings=warnings,
        passthrough=req.from_pretrained_kwargs,
        model_class=model.class_choice.name,
        user_quantization_config=user_config,
        config_kwargs=cfg.consumed,
        config_given=cfg.given,
        kernel_config=attn.kernels.config if attn.kernels.use else None,
        config=cfg.config,
        seed=req.seed,
        strategy=distributed.strategy,
        decode=decode.plan,
        training=place.training,
    )
