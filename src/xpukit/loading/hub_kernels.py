"""Hub kernels at load time: fetched under a time bound before ``from_pretrained``, with a recorded
fallback when they cannot be had (SDPA for attention, no ``use_kernels`` for layers).

Fetching first, bounded, is what keeps a silent Hub endpoint from hanging the load (docs/known-issues.md
"huggingface_hub 2.4: Hub requests without a timeout"); transformers then reuses what was loaded.
"""

from __future__ import annotations

import copy
import logging
from typing import TypedDict

from xpukit.hub import fetch_timeout, run_bounded
from xpukit.planning.loadplan import LoadPlan
from xpukit.planning.vocabulary import Decision, LoadEvent

__all__ = [
    "PlanChanges",
    "fetch_attention_kernel",
    "fetch_layer_kernels",
    "preload_layer_kernels",
    "replace_decision",
]

logger = logging.getLogger(__name__)


class PlanChanges(TypedDict, total=False):
    """The plan's fields a fallback at load changes (``LoadPlan.with_events(events, **changes)``)."""

    attn_implementation: str
    attention_kernel: str | None
    use_kernels: bool
    decisions: tuple[Decision, ...]


def fetch_attention_kernel(
    plan: LoadPlan, kwargs: dict[str, object], events: list[LoadEvent], changes: PlanChanges
) -> None:
    """Load the Hub attention kernel under a time bound; transformers reuses what was loaded."""
    from transformers import modeling_flash_attention_utils as fa

    implementation = plan.attn_implementation
    allow_all = bool(plan.passthrough.get("allow_all_kernels", False))
    try:
        run_bounded(
            lambda: fa.lazy_import_flash_attention(implementation, allow_all_kernels=allow_all),
            fetch_timeout(),
            f"fetching {implementation}",
        )
    except Exception as exc:
        if (
            not isinstance(exc, TimeoutError)
            and getattr(fa, "_loaded_implementation", None) == implementation
        ):
            fa._loaded_implementation = None  # do not leave a half-loaded kernel cached for later loads
        fallback = "sdpa" if plan.model_facts.supports_sdpa else "eager"
        cause = f"{type(exc).__name__}: {exc}"
        logger.warning(
            "Attention kernel %s could not be had (%s); using %s instead", implementation, cause, fallback
        )
        kwargs["attn_implementation"] = fallback
        events.append(
            LoadEvent(
                kind="fallback",
                what="attn_implementation",
                planned=implementation,
                actual=fallback,
                cause=cause,
            )
        )
        changes["attn_implementation"] = fallback
        changes["attention_kernel"] = None
        changes["decisions"] = replace_decision(
            changes.get("decisions", plan.decisions), "attn_implementation", fallback, implementation, cause
        )


def fetch_layer_kernels(
    plan: LoadPlan, kwargs: dict[str, object], events: list[LoadEvent], changes: PlanChanges
) -> None:
    """Kernelize a throwaway meta-device copy under a time bound, so the layer kernels are loaded.

    The kernels library memoizes loaded layers; the real ``kernelize`` inside ``from_pretrained``
    then finds them without touching the Hub. A failure turns ``use_kernels`` off for this load.
    """
    try:
        run_bounded(lambda: preload_layer_kernels(plan), fetch_timeout(), "fetching layer kernels")
    except Exception as exc:
        cause = f"{type(exc).__name__}: {exc}"
        logger.warning("Hub layer kernels could not be had (%s); loading without use_kernels", cause)
        kwargs["use_kernels"] = False  # never left out: transformers >= 5.25 would kernelize anyway
        kwargs.pop("kernel_config", None)
        events.append(LoadEvent(kind="fallback", what="use_kernels", planned=True, actual=False, cause=cause))
        changes["use_kernels"] = False
        changes["decisions"] = replace_decision(
            changes.get("decisions", plan.decisions), "use_kernels", False, True, cause
        )


def preload_layer_kernels(plan: LoadPlan) -> None:
    """Run the kernels library's ``kernelize`` for the plan's device on a meta-device model."""
    import torch
    import transformers
    from kernels import Mode, kernelize, use_kernel_mapping
    from transformers.integrations.hub_kernels import register_kernel_mapping_transformers

    auto = getattr(transformers, plan.model_facts.auto_class)
    with torch.device("meta"):
        model = auto.from_config(
            copy.deepcopy(plan.config), dtype=getattr(torch, plan.dtype), attn_implementation="eager"
        )
    model.eval()
    register_kernel_mapping_transformers()
    device_type = "rocm" if plan.device.family == "amd" else plan.device.backend
    config = plan._kernel_config()
    if config is None:
        kernelize(model, device=device_type, mode=Mode.INFERENCE, use_fallback=True)
        return
    model.kernel_config = config
    config.sanitize_kernel_mapping(model)
    config.create_compatible_mapping(model)
    inherit = not config.use_local_kernel and config.inherit_mapping
    with use_kernel_mapping(config.kernel_mapping, inherit_mapping=inherit):
        kernelize(model, device=device_type, mode=Mode.INFERENCE, use_fallback=True)


def replace_decision(
    decisions: tuple[Decision, ...], name: str, actual: object, planned: object, cause: str
) -> tuple[Decision, ...]:
    return tuple(
        Decision(
            name=name,
            value=actual,
            reason=f"planned {planned}, but it could not be had at load: {cause}",
            rejected=((planned, cause),),
            source="fallback",
        )
        if d.name == name
        else d
        for d in decisions
    )
