"""The stages of :func:`xpukit.planning.plan.plan_load`, in the order they run.

request → config → machine → model → placement → attention → adapters and training → decode → plan
(the last, gathering every decision into the plan, is :func:`xpukit.planning.plan.plan_stage`).
Each stage is a function of what the stages before it decided, and returns a small frozen value
(:mod:`xpukit.planning.stage_values`): a reader sees at a glance what is known when each decision is
taken. A new decision goes into the stage that first knows everything it needs (CONTRIBUTING.md).
Warnings are returned by each stage and joined in stage order, which is the order the plan lists them.
"""

from __future__ import annotations

import functools
from pathlib import Path

from xpukit.errors import InvalidRequestError
from xpukit.planning.arguments import (
    check_keywords,
    check_lora_targets,
    device_of_map,
    host_modules_reason,
    seed_decision,
)
from xpukit.planning.device.attention import choose_attention
from xpukit.planning.device.choice import decide_dtype, machine_for, resolve_device
from xpukit.planning.device.decode import decide_decode
from xpukit.planning.device.distributed import (
    place_rank,
    plan_distributed,
    shard_candidates,
)
from xpukit.planning.device.layer_kernels import choose_kernels
from xpukit.planning.device.layout import plan_layout
from xpukit.planning.device.quantization import QuantRequest, recorded_request
from xpukit.planning.device.saved_quant import check_saved_family, read_saved, saved_dtype
from xpukit.planning.for_training import Attempt, layout_for_training
from xpukit.planning.model.classes import choose_model_class
from xpukit.planning.model.facts import model_facts
from xpukit.planning.request import LoadRequest, ModelArg, keywords
from xpukit.planning.stage_values import Adapters, Attention, Config, Decode, Machine, Model, Placement
from xpukit.planning.training.adapter_base import AdapterBase, adapter_base
from xpukit.planning.training.adapter_fit import check_saved_adapter
from xpukit.planning.training.allocation import allocation_cap
from xpukit.planning.training.expandable_segments import decide_expandable_segments
from xpukit.planning.training.fit import training_plan_for
from xpukit.planning.training.fused import decide_fused, fused_will_run
from xpukit.planning.training.graphs import decide_layer_graphs, graphs_possible
from xpukit.planning.training.lora_config import fit_lora_to_class
from xpukit.planning.training.merge import MergePlan, plan_merge
from xpukit.planning.training.packed_attention import decide_packed_attention
from xpukit.planning.training.packing import decide_packing, packing_wanted
from xpukit.planning.vocabulary import Decision
from xpukit.sources.hub_access import HubFacts
from xpukit.sources.model_config import ConfigRead

__all__ = [
    "adapters_stage",
    "attention_stage",
    "config_stage",
    "decode_stage",
    "machine_stage",
    "merge_stage",
    "model_stage",
    "placement_stage",
]


def _trust_remote_code(req: LoadRequest) -> bool:
    return bool(req.from_pretrained_kwargs.get("trust_remote_code", False))


def config_stage(model: ModelArg, req: LoadRequest, read: ConfigRead) -> Config:
    """The config as read (:func:`~xpukit.planning.request.read_model_config`), the leftover keywords
    checked against it, and the quantization asked or recorded in it."""
    kwargs = req.from_pretrained_kwargs
    config, source, name, consumed = read
    check_keywords(kwargs, config, consumed, ours=keywords())
    quant = req.quant
    if req.quantize is None and req.lora is None and (recorded := recorded_request(config)) is not None:
        # A merged checkpoint written to load quantized (docs/planning.md "Quantization for inference").
        quant = recorded
    given = "config" in kwargs or (source is not None and not isinstance(model, (str, Path)))
    return Config(
        config=config,
        source=source,
        name=name,
        consumed=consumed,
        quant=quant,
        given=given,
        saved=read_saved(config),
    )


def machine_stage(req: LoadRequest, hub: HubFacts) -> Machine:
    """The machine (a profile or this one), a launched job's rank, and the main device; ``hub``
    (its answers gathered lazily) is kept with them."""
    strategy, device_text = req.strategy, req.device_text
    machine, facts_given = machine_for(req.facts)
    if isinstance(req.device_map, dict):
        device_text = device_of_map(req.device_map, device_text, machine)
    rank = place_rank(device_text, req.device_map, machine, strategy=strategy)  # a launched job's rank
    if rank is not None:
        device_text = rank.device_text
    origin = None
    if rank is not None:
        origin = f"{rank.device_text}: this rank's own device in the launched job"
    elif req.device is None and device_text is not None:
        origin = "device_map= given"
    main, candidates, device_decision = resolve_device(device_text, machine, origin=origin)
    if rank is not None and strategy in {"auto", "fsdp"}:
        candidates = shard_candidates(main, machine)  # sized against the ranks' devices together
    return Machine(
        machine=machine,
        facts_given=facts_given,
        rank=rank,
        main=main,
        candidates=candidates,
        device_decision=device_decision,
        world=machine.launch.world_size if machine.launch is not None else 1,
        hub=hub,
    )


def model_stage(req: LoadRequest, cfg: Config) -> Model:
    """The class to load with, the model's facts, and a trained adapter checked against its modules."""
    class_choice = choose_model_class(cfg.config, req.model_class if req.class_name else None)
    facts = model_facts(
        cfg.config,
        name=cfg.name,
        trust_remote_code=_trust_remote_code(req),
        model_class=class_choice.cls or class_choice.name,
    )
    if facts.pre_quantized and cfg.quant.kind not in {None, "auto"}:
        raise InvalidRequestError(
            f"quantize={req.quantize!r}: {cfg.name} is already quantized ({facts.pre_quantized}); it "
            "cannot be quantized again. Fix: quantize=None."
        )
    # A trained adapter: its tensors against the base's modules, before any weight is read.
    saved = check_saved_adapter(
        req.lora_request,
        config=cfg.config,
        model_class=class_choice.cls or class_choice.name,
        base=facts.name,
        force=req.force,
        merging=req.merge is not None,
        trust_remote_code=_trust_remote_code(req),
    )
    return Model(
        class_choice=class_choice,
        facts=facts,
        adapter_check=saved.check,
        record=saved.record,
        warnings=saved.warnings,
    )


def _attempt(
    req: LoadRequest, cfg: Config, mach: Machine, model: Model, dtype_decision: Decision, quant: QuantRequest
) -> Attempt:
    """A layout with the training plan made for it (new adapters), and its warnings."""
    main, facts = mach.main, model.facts
    lay = plan_layout(
        facts=facts,
        machine=mach.machine,
        main=main,
        candidates=mach.candidates,
        dtype_decision=dtype_decision,
        quant=quant,
        device_map=req.device_map,
        max_memory=req.max_memory,
        offload=req.offload is not False,
        headroom=req.headroom,
        enforce_extras=not mach.facts_given,
        serve=req.lora is None and req.strategy is None,  # docs/planning.md "Quantization for inference"
        saved=cfg.saved,
    )
    # lora= as resolved with the request, its checkpointing default fitted to this layout
    request = req.lora_request.for_base(quantized=lay.quantization is not None) if req.lora_request else None
    request = fit_lora_to_class(request, model.class_choice, facts)  # task, head, VLM targets
    unchecked = check_lora_targets(request, facts, enforce=not mach.facts_given, hub=mach.hub)
    fused = fused_will_run(request, facts, quantization=lay.quantization, backend=main.backend)
    graphs = graphs_possible(
        request,
        fused=fused,
        backend=main.backend,
        world_size=mach.world,
        torch_version=mach.machine.torch_version,
    )
    train, request = training_plan_for(
        request,
        config=cfg.config,
        max_positions=facts.max_positions,
        memory=lay.memory,
        device=main,
        dtype=str(lay.dtype.value),
        batch_size=req.batch_size,
        seq_len=req.seq_len,
        fused=fused,
        quantized=lay.quantization in {"4bit", "8bit"},
        packed=packing_wanted(request, facts),
        allocation_cap=allocation_cap(main, mach.machine.env),
        graphs=graphs,
        single_process=mach.world == 1,
    )
    return Attempt(layout=lay, lora=request, training=train, warnings=(*lay.warnings, *unchecked))


def _adapter_base(req: LoadRequest, cfg: Config, model: Model) -> AdapterBase:
    """A trained adapter's base as it trained (its record); a merge takes only the recorded dtype."""
    record = model.record
    if req.merge is not None:  # a merge: the dtype it trained in; plan_merge decides the weights
        trained = (record.dtype, record.path) if record is not None else None
        return AdapterBase(quant=cfg.quant, trained=trained, followed=False, warnings=())
    return adapter_base(
        record,
        cfg.quant,
        quantize=req.quantize,
        dtype=req.dtype,
        trainable=req.trainable,
        pre_quantized=model.facts.pre_quantized,
    )


def placement_stage(req: LoadRequest, cfg: Config, mach: Machine, model: Model) -> Placement:
    """The dtype, the layout (with the training plan for new adapters), and a launched job's share."""
    if cfg.saved is not None:  # written for one device family (docs/export.md "To another machine")
        check_saved_family(cfg.saved, mach.main, cfg.name)
    base = _adapter_base(req, cfg, model)
    dtype_decision, dtype_warnings = decide_dtype(req.dtype, mach.main, trained=base.trained)
    if cfg.saved is not None and base.trained is None:
        dtype_decision = saved_dtype(cfg.saved, req.dtype, cfg.name) or dtype_decision
    attempt = functools.partial(_attempt, req, cfg, mach, model, dtype_decision)
    chosen = layout_for_training(  # new adapters: 4-bit by fit, no silent weight offload
        attempt(base.quant),
        replan=attempt,
        quantize_given=req.quantize is not None or base.followed,
        offload=req.offload,
        device=mach.main.torch_device,
    )
    training = chosen.training
    too_big = training.warning(mach.main.torch_device) if training is not None else None
    distributed = plan_distributed(
        rank=mach.rank,
        strategy=req.strategy,
        layout=chosen.layout,
        model_facts=model.facts,
        main=mach.main,
        machine=mach.machine,
        user_device_map=req.device_map,
        user_quant_config=cfg.quant.user_config,
        lora=req.lora is not None,
    )
    return Placement(
        layout=chosen.layout,
        lora=chosen.lora,
        training=training,
        distributed=distributed,
        warnings=(*base.warnings, *dtype_warnings, *chosen.warnings, *([] if too_big is None else [too_big])),
    )


def attention_stage(req: LoadRequest, mach: Machine, model: Model, place: Placement) -> Attention:
    """The attention implementation and the Hub layer kernels, knowing where every module runs."""
    host_modules = host_modules_reason(req.device_map, place.layout.max_memory, mach.main)
    attention = choose_attention(
        req.attn, mach.main, place.dtype, model.facts, hub=mach.hub, host_modules=host_modules
    )
    kernels = choose_kernels(
        req.kernels,
        mach.main,
        model.facts,
        hub=mach.hub,
        lora=place.lora is not None,
        host_modules=host_modules,
    )
    warnings = tuple(w for w in (attention.warning, kernels.warning) if w)
    return Attention(attention=attention, kernels=kernels, warnings=warnings)


def adapters_stage(
    req: LoadRequest, mach: Machine, model: Model, place: Placement, attn: Attention
) -> Adapters:
    """The LoRA decision, the training plan's, the fused path, the layer graphs, packing and its
    attention (``attn``: the attention stage's choice), the seed."""
    lora, training, facts, main = place.lora, place.training, model.facts, mach.main
    quantization = place.layout.quantization
    decisions: list[Decision] = []
    mismatch = None
    if lora is not None:
        checked = f"; adapter check: {model.adapter_check}" if model.adapter_check else ""
        decisions.append(
            Decision(name="lora", value=lora.describe(), reason=lora.reason + checked, source="user")
        )
        if lora.trainable and model.record is not None:
            mismatch = model.record.training_mismatch(quantization)
    decisions += list(training.decisions) if training is not None else []
    fused = decide_fused(lora, facts, quantization=quantization, backend=main.backend)
    decisions += [fused] if fused is not None else []
    whole = fused_will_run(lora, facts, quantization=quantization, backend=main.backend)
    graphs = decide_layer_graphs(
        lora,
        fused=whole,
        training=training,
        backend=main.backend,
        world_size=mach.world,
        torch_version=mach.machine.torch_version,
    )
    decisions += [graphs] if graphs is not None else []
    segments = decide_expandable_segments(
        graphs=bool(graphs is not None and graphs.value),
        backend=main.backend,
        torch_version=mach.machine.torch_version,
        env=mach.machine.env,
    )
    decisions += [segments] if segments is not None else []
    checkpointing = training.gradient_checkpointing if training is not None else False
    packing = decide_packing(
        lora, facts, graphs=bool(graphs is not None and graphs.value), checkpointing=checkpointing
    )
    decisions += [packing] if packing is not None else []
    packed = decide_packed_attention(
        packing,
        attn.attention.decision,
        device=main,
        dtype=place.dtype,
        torch_version=mach.machine.torch_version,
    )
    decisions += [packed] if packed is not None else []
    new_adapters = lora is not None and lora.kind == "new"
    if req.seed is not None or new_adapters:
        decisions.append(seed_decision(req.seed, new_adapters=new_adapters))
    return Adapters(decisions=tuple(decisions), warnings=(mismatch,) if mismatch else ())


def decode_stage(req: LoadRequest, cfg: Config, mach: Machine, model: Model, place: Placement) -> Decode:
    """``fast_decode``: the static cache and compiled decoding, sized from the headroom; ``"auto"``
    takes it for torchao weights xpukit chose, loaded to run on CUDA/XPU (docs/decode.md "Fast by
    default")."""
    decode, decision = decide_decode(
        req.fast_decode,
        serving=req.lora is None and req.strategy is None,
        chosen_format=cfg.quant.user_config is None,
        device=mach.main,
        dtype=place.dtype,
        memory=place.layout.memory,
        facts=model.facts,
        quantization=place.layout.quantization,
        device_map=place.distributed.device_map,
        quantization_config=place.layout.quantization_config,
    )
    return Decode(plan=decode, decision=decision)


def merge_stage(req: LoadRequest, mach: Machine, model: Model, place: Placement) -> MergePlan | None:
    """``merge=``: which weights the adapter is merged into, and where (its warning is the plan's
    ``warning``, which joins the plan's warnings last)."""
    if req.merge is None:
        return None
    assert place.lora is not None  # merge= takes lora= a trained adapter (parse_merge)
    return plan_merge(
        req.merge,
        lora_request=place.lora,
        memory=place.layout.memory,
        main=mach.main,
        machine=mach.machine,
        facts=model.facts,
        dtype=place.dtype,
        adapter_check=model.adapter_check or "",
        record=model.record,
    )
