"""``plan_load``: every loading choice decided from facts, with its reason, before any weight is read.

Deciding is a pure function of the request, the machine's facts and the model's facts. The only
reads are the model's config (never its weights), the machine (only when ``facts`` is not given:
:func:`xpukit.machine.probe.detect`), installed package versions, the local kernel cache, and — only when
a Hub-backed choice is on the table — one bounded reachability check (:mod:`xpukit.hub`).
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

from xpukit.errors import InvalidRequestError
from xpukit.machine.facts import MachineFacts
from xpukit.planning.arguments import (
    check_keywords,
    check_lora_targets,
    device_of_map,
    host_modules_reason,
    lora_request_for,
    seed_decision,
)
from xpukit.planning.device.attention import choose_attention
from xpukit.planning.device.choice import decide_dtype, machine_for, resolve_device
from xpukit.planning.device.decode import decide_decode
from xpukit.planning.device.distributed import place_rank, plan_distributed, shard_candidates
from xpukit.planning.device.layer_kernels import choose_kernels
from xpukit.planning.device.layout import plan_layout
from xpukit.planning.device.quantization import QuantRequest, head_skip_modules, recorded_request
from xpukit.planning.for_training import Attempt, layout_for_training
from xpukit.planning.loadplan import LoadPlan
from xpukit.planning.model.classes import choose_model_class
from xpukit.planning.model.facts import model_facts
from xpukit.planning.model.source import read_config
from xpukit.planning.request import check_request
from xpukit.planning.training.adapter_fit import check_saved_adapter
from xpukit.planning.training.allocation import allocation_cap
from xpukit.planning.training.fit import training_plan_for
from xpukit.planning.training.fused import decide_fused, fused_will_run
from xpukit.planning.training.graphs import decide_layer_graphs, graphs_possible
from xpukit.planning.training.lora_config import fit_lora_to_class
from xpukit.planning.training.merge import plan_merge, replace_plan
from xpukit.planning.training.packing import decide_packing, packing_wanted
from xpukit.planning.vocabulary import Decision

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
        model: a Hub id, a local model directory, or a ``PretrainedConfig``.
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
    kwargs = dict(from_pretrained_kwargs)
    # Everything that can be checked without reading anything is checked first.
    req = check_request(
        kwargs, device=device, dtype=dtype, attn=attn, kernels=kernels, device_map=device_map,
        max_memory=max_memory, quantize=quantize, lora=lora, headroom=headroom, model_class=model_class,
        seed=seed, strategy=strategy, fast_decode=fast_decode, batch_size=batch_size, seq_len=seq_len,
        merge=merge, force=force, trainable=trainable,
    )  # fmt: skip
    attn, quantize, kernels, quant = req.attn, req.quantize, req.kernels, req.quant
    dtype_req, given_headroom, memory_limits = req.dtype, req.headroom, req.max_memory
    device_text = req.device_text
    class_name, seed, strategy, fast_decode = req.class_name, req.seed, req.strategy, req.fast_decode
    batch_size, seq_len, merge_request = req.batch_size, req.seq_len, req.merge
    given_lora = req.lora
    config, source, name, consumed = read_config(model, kwargs)
    check_keywords(kwargs, config, consumed, ours=_XPUKIT_KEYWORDS)
    if quantize is None and lora is None and (recorded := recorded_request(config)) is not None:
        # A merged checkpoint written to load quantized (docs/planning.md "Quantization for inference").
        quant = recorded
    machine, facts_given = machine_for(facts)
    if isinstance(device_map, dict):
        device_text = device_of_map(device_map, device_text, machine)
    rank = place_rank(device_text, device_map, machine, strategy=strategy)  # a launched job's rank
    if rank is not None:
        device_text = rank.device_text
    origin = None
    if rank is not None:
        origin = f"{rank.device_text}: this rank's own device in the launched job"
    elif device is None and device_text is not None:
        origin = "device_map= given"
    main, candidates, device_decision = resolve_device(device_text, machine, origin=origin)
    if rank is not None and strategy in {"auto", "fsdp"}:
        candidates = shard_candidates(main, machine)  # sized against the ranks' devices together
    class_choice = choose_model_class(config, model_class if class_name else None)  # docs/planning.md
    mfacts = model_facts(
        config,
        name=name,
        trust_remote_code=bool(kwargs.get("trust_remote_code", False)),
        model_class=class_choice.cls or class_choice.name,
    )
    if mfacts.pre_quantized and quant.kind not in {None, "auto"}:
        raise InvalidRequestError(
            f"quantize={quantize!r}: {name} is already quantized ({mfacts.pre_quantized}); it cannot be "
            "quantized again. Fix: quantize=None."
        )

    warnings: list[str] = []
    # A trained adapter: its tensors against the base's modules, before any weight is read.
    adapter_check, record = check_saved_adapter(
        given_lora, config=config, model_class=class_choice.cls or class_choice.name, base=mfacts.name,
        force=force, merging=merge_request is not None, warnings=warnings,
        trust_remote_code=bool(kwargs.get("trust_remote_code", False)),
    )  # fmt: skip
    dtype_decision = decide_dtype(dtype_req, main, warnings)
    world = machine.launch.world_size if machine.launch is not None else 1  # processes of a launched job

    def attempt(quant_request: QuantRequest) -> Attempt:
        """A layout with the training plan made for it (new adapters), and its warnings."""
        said: list[str] = []
        lay = plan_layout(
            facts=mfacts,
            machine=machine,
            main=main,
            candidates=candidates,
            dtype_decision=dtype_decision,
            quant=quant_request,
            device_map=device_map,
            max_memory=memory_limits,
            offload=offload is not False,
            headroom=given_headroom,
            enforce_extras=not facts_given,
            warnings=said,
            serve=lora is None and strategy is None,  # docs/planning.md "Quantization for inference"
        )
        request = lora_request_for(lora, quantized=lay.quantization is not None, trainable=trainable)
        request = fit_lora_to_class(request, class_choice, mfacts)  # task, head, VLM targets
        check_lora_targets(request, mfacts, enforce=not facts_given, warnings=said)
        fused = fused_will_run(request, mfacts, quantization=lay.quantization, backend=main.backend)
        graphs = graphs_possible(
            request, fused=fused, backend=main.backend, world_size=world, torch_version=machine.torch_version
        )
        train, request = training_plan_for(
            request, config=config, max_positions=mfacts.max_positions, memory=lay.memory,
            device=main, dtype=str(lay.dtype.value), batch_size=batch_size, seq_len=seq_len, fused=fused,
            quantized=lay.quantization in {"4bit", "8bit"}, packed=packing_wanted(request, mfacts),
            allocation_cap=allocation_cap(main, machine.env), graphs=graphs,
        )  # fmt: skip
        return Attempt(layout=lay, lora=request, training=train, warnings=tuple(said))

    chosen = layout_for_training(  # new adapters: 4-bit by fit, no silent weight offload
        attempt(quant), replan=attempt, quantize_given=quantize is not None, offload=offload,
        device=main.torch_device,
    )  # fmt: skip
    layout, lora_request, training = chosen.layout, chosen.lora, chosen.training
    warnings += chosen.warnings
    if training is not None and (too_big := training.warning(main.torch_device)) is not None:
        warnings.append(too_big)
    dtype_name = str(layout.dtype.value)
    distributed = plan_distributed(
        rank=rank,
        strategy=strategy,
        layout=layout,
        model_facts=mfacts,
        main=main,
        machine=machine,
        user_device_map=device_map,
        user_quant_config=quant.user_config,
        lora=lora is not None,
    )
    host_modules = host_modules_reason(device_map, layout.max_memory, main)
    attention = choose_attention(attn, main, dtype_name, mfacts, host_modules=host_modules)
    kernel_choice = choose_kernels(
        kernels, main, mfacts, lora=lora_request is not None, host_modules=host_modules
    )
    for warning in (attention.warning, kernel_choice.warning):
        if warning:
            warnings.append(warning)
    decisions = [device_decision, layout.dtype, *layout.decisions, attention.decision, kernel_choice.decision]
    decisions = distributed.merged(decisions)
    decisions.insert(0, class_choice.decision)
    if lora_request is not None:
        checked = f"; adapter check: {adapter_check}" if adapter_check else ""
        decisions.append(
            Decision(
                name="lora",
                value=lora_request.describe(),
                reason=lora_request.reason + checked,
                source="user",
            )
        )
        if lora_request.trainable and record is not None:
            mismatch = record.training_mismatch(layout.quantization)
            warnings += [mismatch] if mismatch else []
    decisions += list(training.decisions) if training is not None else []
    fused = decide_fused(lora_request, mfacts, quantization=layout.quantization, backend=main.backend)
    decisions += [fused] if fused is not None else []
    whole = fused_will_run(lora_request, mfacts, quantization=layout.quantization, backend=main.backend)
    graphs = decide_layer_graphs(
        lora_request, fused=whole, training=training, backend=main.backend, world_size=world,
        torch_version=machine.torch_version,
    )  # fmt: skip
    decisions += [graphs] if graphs is not None else []
    packing = decide_packing(lora_request, mfacts, graphs=bool(graphs is not None and graphs.value))
    decisions += [packing] if packing is not None else []
    new_adapters = lora_request is not None and lora_request.kind == "new"
    if seed is not None or new_adapters:
        decisions.append(seed_decision(seed, new_adapters=new_adapters))
    decode, decode_decision = decide_decode(
        fast_decode,
        serving=lora is None and strategy is None,
        chosen_format=quant.user_config is None,
        device=main,
        dtype=dtype_name,
        memory=layout.memory,
        facts=mfacts,
        quantization=layout.quantization,
        device_map=distributed.device_map,
        quantization_config=layout.quantization_config,
    )
    decisions += [decode_decision] if decode_decision is not None else []
    merge_plan = None if merge_request is None else plan_merge(
        merge_request, lora_request=lora_request, memory=layout.memory, main=main, machine=machine,
        facts=mfacts, dtype=dtype_name, adapter_check=adapter_check or "", record=record,
        warnings=warnings,
    )  # fmt: skip
    for warning in warnings:
        logger.warning("%s", warning)
    plan = LoadPlan(
        model=source,
        model_facts=mfacts,
        machine=machine,
        device=main,
        dtype=dtype_name,
        quantization=layout.quantization,
        quantization_config=head_skip_modules(mfacts, distributed.quantization_config, quant.user_config),
        attn_implementation=attention.value,
        attention_kernel=attention.kernel.repo if attention.kernel else None,
        use_kernels=kernel_choice.use,
        device_map=distributed.device_map,
        max_memory=distributed.max_memory,
        memory=layout.memory,
        lora=lora_request,
        decisions=tuple(decisions),
        warnings=tuple(warnings),
        passthrough=kwargs,
        model_class=class_choice.name,
        user_quantization_config=quant.user_config,
        kernel_config=kernel_choice.config if kernel_choice.use else None,
        config=config,
        config_kwargs=consumed,
        config_given="config" in kwargs or (source is not None and not isinstance(model, (str, Path))),
        seed=seed,
        strategy=distributed.strategy,
        decode=decode,
        training=training,
    )
    # merge=: the plan as the merge carries it out (docs/planning.md "Merge (`merge=`)").
    return plan if merge_plan is None else replace_plan(plan, merge_plan)


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Machine and device
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


# plan_load's own keywords (load_for_xpu takes the same): the "did you mean" of check_keywords.
_XPUKIT_KEYWORDS = tuple(
    name for name, p in inspect.signature(plan_load).parameters.items() if p.kind is p.KEYWORD_ONLY
)
