"""``load_for_xpu``: carry out a :class:`~xpukit.planning.loadplan.LoadPlan` and record what really ran.

Acting, in order:

1. The plan's device must exist in this torch build (transformers would raise a bare
   ``AssertionError: Torch not compiled with XPU enabled``).
2. While the Hub is offline or found unreachable, huggingface_hub runs in offline mode for the whole
   load (:func:`xpukit.hub.offline_guard`), so nothing can wait on a silent endpoint.
3. Hub kernels the plan needs (flash-attn2 for attention, layer kernels for ``use_kernels``) are
   fetched first, each under ``XPUKIT_HUB_FETCH_TIMEOUT``; transformers then finds them already
   loaded. One that cannot be had is replaced (SDPA, kernels off), logged once, and recorded with
   its cause.
4. ``from_pretrained`` with the plan's kwargs; then LoRA, when planned — still inside the offline
   guard, because importing peft imports bitsandbytes.
5. The plan as carried out is attached as ``model.xpukit_plan``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, TypedDict

from xpukit import _quiet
from xpukit._compat import require
from xpukit._quiet import quiet_imports
from xpukit.errors import DeviceUnavailableError, InvalidRequestError, XpukitError
from xpukit.hub import hub_offline, hub_status, offline_guard
from xpukit.loading.hub_kernels import (
    PlanChanges,
    fetch_attention_kernel,
    fetch_layer_kernels,
)
from xpukit.loading.load_problems import missing_weights_problem, weights_problem
from xpukit.planning.device.choice import INSTALL_FIX
from xpukit.planning.device.quantization import require_bnb
from xpukit.planning.loadplan import LoadPlan
from xpukit.planning.model.classes import unexpected_weights_problem
from xpukit.planning.plan import plan_request
from xpukit.planning.request import LoadRequest, ModelArg, takes_request
from xpukit.planning.vocabulary import LoadEvent

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

__all__ = ["carry_out", "load_for_xpu"]

logger = logging.getLogger(__name__)


class _LoadingInfo(TypedDict, total=False):
    """What ``from_pretrained(..., output_loading_info=True)`` reports and the load reads of it."""

    missing_keys: Collection[str]
    unexpected_keys: Collection[str]


# ``**keywords``: LoadRequest's, which checks them; takes_request gives load_for_xpu their types.
@takes_request(LoadRequest)
def load_for_xpu(model: ModelArg | LoadPlan, **keywords: Any) -> PreTrainedModel | PeftModel:
    """Load a model for inference the way :func:`xpukit.plan_load` plans it, and say what ran.

    Takes the same arguments as :func:`xpukit.plan_load`, the keywords of
    :class:`~xpukit.planning.request.LoadRequest` (or a ``LoadPlan`` as ``model``). Any other
    keyword goes to ``from_pretrained`` unchanged. ``seed=N`` seeds the new LoRA adapters'
    initialisation (``transformers.set_seed(N)`` right before they are created; from_pretrained is
    not affected), so ``load_for_xpu(..., seed=N)`` with ``training_args(..., seed=N)`` repeats a run
    exactly (docs/training.md "Reproducible runs"). ``strategy=`` (``auto``/``ddp``/``fsdp``/``deepspeed``)
    plans the load for that distributed strategy: ``fsdp`` loads without a device_map for sharding
    (docs/distributed.md "What xpukit decides"); a rank of a launched job loads on its own device.
    ``fast_decode=True`` sets a static KV cache and compiled decoding on ``model.generation_config``
    as the plan's ``fast_decode`` decision says (the default ``"auto"`` does so for torchao weights
    loaded to run on CUDA/XPU); ``warmup=True`` then runs one short generation at load and records
    its time (the compile) as a ``warmup`` event, else the first ``generate()`` compiles, with a
    progress line (docs/decode.md). With new LoRA
    adapters, ``batch_size=`` and ``seq_len=`` size the training step the memory savers are chosen
    for (checkpointing, offload, liger, micro-batch; docs/training-plan.md "Training plan by fit").
    ``merge=True`` with ``lora=`` an adapter directory returns a plain transformers model with the
    adapter merged into full-precision base weights, as the plan's ``merge`` decision says
    (docs/merging.md "Merging an adapter"). ``trainable=True`` with ``lora=`` an adapter directory
    loads it to train further (docs/training.md "Training a saved adapter further"). A model loaded
    with adapters to train writes, on ``save_pretrained`` (``Trainer``'s saves too), how its base is
    held beside the adapter, which ``merge=True`` follows (:mod:`xpukit.loading.adapter_record`).

    Returns:
        The loaded ``PreTrainedModel`` (a ``PeftModel`` when ``lora`` was given, unless merged), with
        the plan as carried out — fallbacks and their causes included — in ``model.xpukit_plan``.

    Raises:
        The errors of :func:`xpukit.plan_load`, all before any weight is read.

    Example:
        >>> model = load_for_xpu("Qwen/Qwen3-0.6B")  # doctest: +SKIP
        >>> print(model.xpukit_plan.explain())  # doctest: +SKIP

        Offline, on the CPU, with a tiny local model:

        >>> import tempfile
        >>> from xpukit.demo.tiny import build_tiny_model
        >>> tiny = load_for_xpu(build_tiny_model("qwen3", tempfile.mkdtemp()), device="cpu", lora=True)
        >>> tiny.xpukit_plan.device.torch_device, type(tiny).__name__
        ('cpu', 'PeftModelForCausalLM')
    """
    # Other libraries imported while loading say nothing unless verbose (xpukit/_quiet.py).
    with quiet_imports():
        req = LoadRequest(**keywords)
        plan = model if isinstance(model, LoadPlan) else plan_request(model, req)
        return carry_out(plan, model_class=req.model_class, warmup=req.warmup)


def carry_out(
    plan: LoadPlan, *, model_class: type[PreTrainedModel] | str | None = None, warmup: bool = False
) -> PreTrainedModel | PeftModel:
    """Load the model a plan describes; see the module docstring for the steps.

    The steps follow the plan's stages: the request checked before anything is read, the class and
    keywords from the config, the Hub kernels the attention and kernels decisions need, the weights
    placed, the adapters applied (or merged), decoding set up, and the events recorded on the plan.
    A step that fails after the weights are read returns its error, so that the model is dropped
    here before raising (a traceback must not keep the weights alive).
    """
    _check_before_reading(plan, warmup)
    cls = _model_class(plan, model_class)
    kwargs = _from_pretrained_kwargs(plan)
    events: list[LoadEvent] = []
    changes: PlanChanges = {}
    # Everything that may import bitsandbytes (from_pretrained with 4-bit, peft for LoRA) runs inside
    # the guard: on avx512_bf16 CPUs `import bitsandbytes` makes a Hub call with no timeout.
    with offline_guard(_needs_offline_guard(plan)), _quiet.quiet_load():
        kwargs = _fetch_kernels(plan, kwargs, events, changes)
        model, info = _read_weights(plan, cls, kwargs, events)
        unused = _check_weights(plan, cls, model, info, events)
        if unused is not None:
            del model  # dropped before raising, so the traceback does not keep the weights alive
            raise InvalidRequestError(unused)
        if plan.lora is not None:
            model, error = _adapters(model, plan, events)
            if error is not None:
                del model  # the error (and its traceback's frames) must not keep the weights alive
                _drop_frames(error)
                raise error
    events += _import_notes(plan)
    if plan.lora is not None:  # the training's allocator, once nothing can refuse the load any more
        from xpukit.loading.training.expandable_segments import apply_expandable_segments

        events += apply_expandable_segments(plan)
    if plan.decode is not None:
        from xpukit.loading.decode.fast_decode import apply_fast_decode, warm_up

        events += apply_fast_decode(model, plan)
        if warmup:
            events += warm_up(model, plan)
    model.xpukit_plan = plan.with_events(tuple(events), **changes)
    return model


def _import_notes(plan: LoadPlan) -> list[LoadEvent]:
    """What an optional kernel another library could not load costs this load, in xpukit's words:
    a ``note`` event on every load it matters to, logged once per process (xpukit/_quiet.py)."""
    events = []
    for note in _quiet.notes_for(_quiet.collected(), plan):
        events.append(LoadEvent(kind="note", what="kernels", actual=note))
        if _quiet.say_once(note):
            logger.warning("%s", note)
    return events


def _check_before_reading(plan: LoadPlan, warmup: bool) -> None:
    """The request: what can be refused before any weight is read (warm-up, bare config, runtime, extras)."""
    if warmup is not False and (warmup is not True or plan.decode is None):
        raise InvalidRequestError(
            f"warmup={warmup!r}: the warm-up compiles the decoding that fast_decode=True sets up. "
            "Fix: load_for_xpu(..., fast_decode=True, warmup=True), or leave warmup out."
        )
    if plan.model is None:
        raise InvalidRequestError(
            f"The plan is for a bare config ({plan.model_facts.name}) with no weights to load. Fix: pass the "
            "model's directory or Hub id to load_for_xpu()."
        )
    missing = missing_weights_problem(plan)
    if missing is not None:
        raise InvalidRequestError(missing)
    check_runtime(plan)
    if plan.quantization in {"4bit", "8bit"}:
        require_bnb(plan.quantization)  # MissingExtraError naming the fix, before any weight is read
    elif plan.quantization == "torchao":
        require("torchao", f"quantization {plan.decision('quantization').value}")


def _model_class(plan: LoadPlan, model_class: type[PreTrainedModel] | str | None) -> type[PreTrainedModel]:
    """The transformers class to load with: the one given, else the plan's."""
    import transformers

    if model_class is not None and not isinstance(model_class, str):
        return model_class
    named: type[PreTrainedModel] = getattr(transformers, model_class or plan.model_class)
    return named


def _from_pretrained_kwargs(plan: LoadPlan) -> dict[str, object]:
    """The config: ``from_pretrained``'s keywords, with the config already read for the plan."""
    kwargs = plan.from_pretrained_kwargs()
    if plan.config is not None:
        # The config already read for the plan: from_pretrained skips re-reading it. Keywords the
        # config consumed (overrides such as rope_scaling=) are already applied to it.
        kwargs = {k: v for k, v in kwargs.items() if k not in plan.config_kwargs}
        kwargs["config"] = copy.deepcopy(plan.config)
    return kwargs


def _fetch_kernels(
    plan: LoadPlan, kwargs: dict[str, object], events: list[LoadEvent], changes: PlanChanges
) -> dict[str, object]:
    """Attention and kernels: the Hub kernels the plan chose, fetched under a time bound (a fallback
    recorded when one cannot be had); ``merge=``'s keywords for the base it merges into."""
    if plan.attention_kernel is not None:
        fetch_attention_kernel(plan, kwargs, events, changes)
    if plan.use_kernels:
        fetch_layer_kernels(plan, kwargs, events, changes)
    if plan.merge is not None:
        from xpukit.loading.merge import merge_kwargs

        kwargs = merge_kwargs(plan, kwargs)  # merge="dequantized": the 4-bit base training saw
    return kwargs


def _read_weights(
    plan: LoadPlan, cls: type[PreTrainedModel], kwargs: dict[str, object], events: list[LoadEvent]
) -> tuple[PreTrainedModel, _LoadingInfo]:
    """Placement: ``from_pretrained`` with the plan's keywords, and its loading report."""
    problem = None
    kwargs.pop("output_loading_info", None)  # always asked: the load report decides below
    from xpukit.loading.torchao_read import scoped_torchao_read
    from xpukit.loading.training.host_embedding import weights_apart

    apart = plan.training is not None and plan.training.embedding_on_host
    torchao = plan.model_facts.pre_quantized == "torchao"  # docs/export.md "To another machine"
    try:
        with weights_apart(apart), scoped_torchao_read(torchao) as scoped:
            model, info = cls.from_pretrained(plan.model, output_loading_info=True, **kwargs)
        if scoped:
            note = (
                "torchao's weights read without a walk of the whole checkpoint per weight: each "
                "rebuilt from its own metadata, the quantizer shared by the copies, one metadata check"
            )
            events.append(LoadEvent(kind="applied", what="torchao read", actual=note))
    except Exception as exc:
        problem = weights_problem(plan, exc)
        if problem is None:
            raise
    if problem is not None:  # raised outside `except`, so no traceback keeps the half-built model
        raise InvalidRequestError(problem)
    return model, info


def _check_weights(
    plan: LoadPlan,
    cls: type[PreTrainedModel],
    model: PreTrainedModel,
    info: _LoadingInfo,
    events: list[LoadEvent],
) -> str | None:
    """Never a model with checkpoint weights left out (docs/planning.md "Model class (`model_class=`)"):
    the problem, else ``None`` with the loading report's notes and the placement recorded."""
    config = plan.config if plan.config is not None else model.config
    unexpected = info.get("unexpected_keys")
    user_class = any(d.name == "model_class" and d.source == "user" for d in plan.decisions)
    unused, head_note = unexpected_weights_problem(
        str(plan.model),
        cls.__name__,
        unexpected,
        config,
        base_prefix=str(getattr(model, "base_model_prefix", "") or ""),
        user_class=user_class,
    )
    if unused is not None:
        return unused
    if head_note is not None:
        logger.warning("%s", head_note)
        events.append(LoadEvent(kind="note", what="weights", actual=head_note))
    missing = info.get("missing_keys")
    if missing:
        new = ", ".join(sorted(missing))
        events.append(LoadEvent(kind="note", what="weights", actual=f"newly initialised: {new}"))
    events.append(LoadEvent(kind="applied", what="placement", planned=plan.device_map, actual=_where(model)))
    if plan.quantization == "torchao":  # how many layers the format really took
        from xpukit.loading.quantized_layers import quantized_layers_event

        events.append(quantized_layers_event(model, str(plan.decision("quantization").value)))
    return None


def _adapters(
    model: PreTrainedModel, plan: LoadPlan, events: list[LoadEvent]
) -> tuple[PreTrainedModel | PeftModel, XpukitError | None]:
    """Adapters and training: the LoRA adapters applied (or merged), and the error that refused them."""
    from xpukit.loading.lora import apply_lora, lora_problem

    assert plan.lora is not None
    # plan_load checked the request against the model's facts; this safety net catches a model that
    # differs from them (the caller drops the model before raising).
    problem = lora_problem(model, plan.lora)
    if problem is not None:
        return model, InvalidRequestError(problem)
    if plan.seed is not None and plan.lora.kind == "new":
        from transformers import set_seed

        set_seed(plan.seed)  # only the adapters' init draws random numbers after this
        events.append(LoadEvent(kind="applied", what="seed", actual=f"set_seed({plan.seed})"))
    try:
        if plan.merge is not None:
            from xpukit.loading.merge import merge_adapter

            model, notes = merge_adapter(model, plan)
        else:
            fused = next((d for d in plan.decisions if d.name == "fused_lora"), None)
            graphs = next((d for d in plan.decisions if d.name == "layer_graphs"), None)
            packing = next((d for d in plan.decisions if d.name == "packing"), None)
            packed = next((d for d in plan.decisions if d.name == "packed_attention"), None)
            model, notes = apply_lora(
                model,
                plan.lora,
                compute_dtype=plan.dtype,
                quantized=plan.quantization is not None,
                device=plan.device,
                fused=bool(fused is not None and fused.value),
                fused_insist=fused is not None and fused.source == "user" and bool(fused.value),
                graphs=bool(graphs is not None and graphs.value),
                packing=int(packing.value) if packing is not None and packing.value else None,
                pass_tokens=plan.training.pass_tokens if plan.training is not None else None,
                host_embedding=plan.training is not None and plan.training.embedding_on_host,
                varlen=packed is not None and packed.value == "varlen",
            )
    except XpukitError as exc:
        return model, exc
    if plan.merge is None and plan.lora.trains:
        from xpukit.loading.adapter_record import record_on_save

        notes.append(record_on_save(model, dtype=plan.dtype, base_model=str(plan.model)))
    events += [LoadEvent(kind="applied", what="lora", actual=note) for note in notes]
    return model, None


def check_runtime(plan: LoadPlan) -> None:
    """Refuse a plan whose device this torch build or machine cannot use (before any weight is read)."""
    backend = plan.device.backend
    if backend == "cpu":
        return
    import torch

    compiled = {
        "xpu": bool(getattr(torch, "xpu", None) and torch.xpu._is_compiled()),
        "cuda": bool(torch.version.cuda or getattr(torch.version, "hip", None)),
        "mps": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_built()),
    }[backend]
    if not compiled:
        raise DeviceUnavailableError(
            f"The plan loads on {plan.device.torch_device}, but this torch build "
            f"({torch.__version__}) has no "
            f"{backend.upper()} support. Fix: {INSTALL_FIX[backend]}"
        )
    module = getattr(torch, backend)
    count = module.device_count() if backend != "mps" else int(torch.backends.mps.is_available())
    if plan.device.index >= count:
        raise DeviceUnavailableError(
            f"The plan loads on {plan.device.torch_device} ({plan.machine.source}), but this machine has "
            f"{count} {backend} device(s). Plan on this machine (no facts=) or fix the device selection."
        )


def _drop_frames(exc: BaseException | None) -> None:
    """Clear the locals of every frame an error chain holds (a raising callee's ``model`` argument)."""
    import traceback

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def _needs_offline_guard(plan: LoadPlan) -> bool:
    # Offline (or env set after huggingface_hub was imported): make the library honour it. Otherwise
    # ask the Hub only when something in this load could use it.
    if hub_offline():
        return True
    from xpukit.sources.model_config import local_model_dir

    uses_hub = (
        plan.attention_kernel is not None
        or plan.use_kernels
        or plan.quantization is not None  # import bitsandbytes fetches a kernel on avx512_bf16 CPUs
        or plan.lora is not None
        or local_model_dir(plan.model or "") is None
    )
    if not uses_hub:
        return False
    status = hub_status()
    if not status.usable:
        logger.info("The Hub cannot be used (%s): loading in offline mode", status.reason)
    return not status.usable


def _where(model: PreTrainedModel) -> dict[str, str] | str:
    #  hf_device_map exists only when a model is split over several devices (docs/known-issues.md
    # "transformers: hf_device_map only for multi-device maps").
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        return {k: str(v) for k, v in device_map.items()}
    return str(getattr(model, "device", "unknown"))
