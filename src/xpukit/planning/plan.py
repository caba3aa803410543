"""``plan_load``: every loading choice decided from facts, with its reason, before any weight is read.

Deciding is a pure function of the request, the machine's facts and the model's facts. The only
reads are the model's config (never its weights), the machine (only when ``facts`` is not given:
:func:`xpukit.machine.probe.detect`), installed package versions, the local kernel cache, and — only when
a Hub-backed choice is on the table — one bounded reachability check (:mod:`xpukit.hub`).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from xpukit._quiet import quiet_imports
from xpukit.machine.facts import MachineFacts
from xpukit.planning.loadplan import LoadPlan
from xpukit.planning.request import check_request
from xpukit.planning.stages import (
    Asked,
    adapters_stage,
    attention_stage,
    config_stage,
    decode_stage,
    machine_stage,
    merge_stage,
    model_stage,
    placement_stage,
    plan_stage,
)
from xpukit.planning.training.merge import replace_plan

__all__ = ["plan_load"]

logger = logging.getLogger(__name__)


def plan_load(
    model: Any,
    *,
    device: Any = None,
    dtype: Any = "auto",
    attn: Any = "auto",
    kernels: Any = "auto",
    device_map: Any = "auto",
    max_memory: dict[Any, Any] | None = None,
    quantize: Any = None,
    lora: Any = None,
    offload: bool | None = None,
    headroom: Any = None,
    facts: MachineFacts | str | None = None,
    model_class: Any = None,
    seed: Any = None,
    strategy: Any = None,
    fast_decode: bool | str = "auto",
    batch_size: int | None = None,
    seq_len: int | None = None,
    merge: Any = False,
    force: bool = False,
    trainable: bool = False,
    **from_pretrained_kwargs: Any,
) -> LoadPlan:
    """Plan how to load ``model`` for inference: device, dtype, placement, attention, kernels, 4-bit, LoRA.

    Reads the config only (offline rules honoured), never the weights. With ``facts`` given no
    device runtime is initialised.

    Args:
        model: a Hub id, a local model directory, a ``PretrainedConfig``, or the name of a built-in
            shape (``qwen3-8b``…, ``xpukit.planning.model.reference_models``: a real model's config,
            no download; there are no weights to load with it).
        device: ``"xpu"``, ``"xpu:1"``, ``"cuda"``, ``"mps"``, ``"cpu"`` or a ``torch.device``; default:
            the first available of xpu, cuda, mps, cpu.
        dtype: ``"auto"`` (per device family) or ``bfloat16`` / ``float16`` / ``float32``.
        attn: ``"auto"``, ``sdpa``, ``eager``, ``flex_attention``, ``flash_attention_2/3/4`` or a Hub
            kernel ``org/repo``.
        kernels: ``"auto"``, ``True``, ``False``, or a ``KernelConfig`` (or its mapping dict).
        device_map: ``"auto"`` (xpukit decides), an accelerate strategy, a device, or a dict.
        max_memory: per-device weight budgets (``{0: "10GiB", "cpu": "30GiB"}``).
        quantize: ``None``, ``"4bit"``, ``"8bit"``, ``"auto"``, ``"nf4"``, a ``BitsAndBytesConfig``, or
            another transformers quantization config (``QuantoConfig``, ``TorchAoConfig``…), passed
            through. Without ``lora=``, ``4bit``/``8bit`` (and ``auto``'s 4-bit) take the device's
            fastest weight-only format (torchao where it runs); with adapters, and for ``nf4``,
            bitsandbytes (docs/planning.md "Quantization for inference").
        lora: ``None``, ``True``, a ``LoraConfig``, a dict of its arguments, or an adapter path; new
            adapters are checked against the model's modules here (this imports peft).
        offload: allow CPU offload when the model fits nowhere else (else :class:`PlanError`);
            default ``None``: allowed (with a warning) for inference, refused for training new
            LoRA adapters (``True`` allows it there too; docs/planning.md "Training layout").
        headroom: memory kept free beside the weights (bytes or ``"2GiB"``); default: the rule in
            docs/planning.md.
        facts: the machine to plan for: :class:`MachineFacts`, or a profile such as
            ``"max-1550"`` (one card: two FLAT stacks); default: this machine (:func:`xpukit.detect`).
        model_class: the transformers class to load with (default: the Auto class for the config).
        seed: an int: ``transformers.set_seed(seed)`` right before new LoRA adapters are created, so
            their random initialisation repeats (docs/training.md "Reproducible runs"); default:
            unseeded, which the plan's ``seed`` decision says.
        strategy: the distributed training strategy the load is for: ``"auto"``, ``"ddp"``,
            ``"fsdp"`` (no device_map, 4-bit stored in the compute dtype, for sharding) or
            ``"deepspeed"``; default ``None`` (a rank of a launched job still loads on its own device,
            docs/distributed.md "What xpukit decides").
        fast_decode: ``True``: a static KV cache sized from the headroom and compiled decoding
            through the model's ``generation_config`` (CUDA, XPU; on the CPU and MPS nothing changes
            and the decision says why), as the plan's ``fast_decode`` decision says (docs/decode.md);
            ``"auto"`` (default): taken for torchao weights loaded to run on CUDA/XPU, otherwise off;
            ``"unfused"``: ``True`` without fused q/k/v and gate/up products; ``False``: off.
        batch_size: with new LoRA adapters, the sequences per optimizer step to plan training for
            (default 8); the memory savers are chosen by fit (docs/training.md "Training plan by fit").
        seq_len: with new LoRA adapters, the tokens per sequence (default 2048, capped at the
            model's context).
        merge: with ``lora=`` an adapter directory: ``True`` (or ``"dequantized"``) merges it into the
            base as 4-bit training saw it, ``"original"`` into the checkpoint's own weights; never into
            4-bit weights (``quantize=`` is refused). Placed by fit: the device, else the CPU. The
            plan's ``merge`` decision says which and why (docs/training.md "Merging an adapter").
        force: with ``lora=`` an adapter directory, load or merge it even when its tensors do not
            all fit the base (a warning instead of :class:`InvalidRequestError`); every trained
            adapter is checked against the base's modules before any weight is read.
        trainable: with ``lora=`` an adapter directory, load it to train further: its weights
            trainable, the training plan made for it as for new adapters (docs/training.md
            "Training a saved adapter further"); default: loaded for inference.
        **from_pretrained_kwargs: passed to ``from_pretrained`` unchanged.

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
        kwargs = dict(from_pretrained_kwargs)
        # Everything that can be checked without reading anything is checked first.
        req = check_request(
            kwargs, device=device, dtype=dtype, attn=attn, kernels=kernels, device_map=device_map,
            max_memory=max_memory, quantize=quantize, lora=lora, headroom=headroom, model_class=model_class,
            seed=seed, strategy=strategy, fast_decode=fast_decode, batch_size=batch_size, seq_len=seq_len,
            merge=merge, force=force, trainable=trainable,
        )  # fmt: skip
        asked = Asked(
            model=model, req=req, kwargs=kwargs, device=device, device_map=device_map, facts=facts, lora=lora,
            quantize=quantize, offload=offload, force=force, trainable=trainable, model_class=model_class,
        )  # fmt: skip
        cfg = config_stage(asked, ours=_XPUKIT_KEYWORDS)
        mach = machine_stage(asked)
        described = model_stage(asked, cfg)
        place = placement_stage(asked, cfg, mach, described)
        attention = attention_stage(asked, mach, described, place)
        adapters = adapters_stage(asked, mach, described, place)
        decode = decode_stage(asked, cfg, mach, described, place)
        warnings = [*described.warnings, *place.warnings, *attention.warnings, *adapters.warnings]
        merge_plan = merge_stage(asked, mach, described, place, warnings)
        for warning in warnings:
            logger.warning("%s", warning)
        plan = plan_stage(asked, cfg, mach, described, place, attention, adapters, decode, tuple(warnings))
        # merge=: the plan as the merge carries it out (docs/planning.md "Merge (`merge=`)").
        return plan if merge_plan is None else replace_plan(plan, merge_plan)


# plan_load's own keywords (load_for_xpu takes the same): the "did you mean" of check_keywords.
_XPUKIT_KEYWORDS = tuple(
    name for name, p in inspect.signature(plan_load).parameters.items() if p.kind is p.KEYWORD_ONLY
)
