"""The training plan for new LoRA adapters: which memory savers to use, decided by fit (pure).

From the model's shape (read from its config), the batch and sequence length and the LoRA settings,
:func:`activation_bytes` estimates the activation memory of one training step under each set of
savers. :func:`plan_training` takes the fastest set that fits the device's memory beside the weights
and the adapters' training state, trying them in the order of docs/training-plan.md "Training plan by
fit": none → liger-kernel's fused linear cross-entropy → gradient checkpointing → checkpointing with
the saved activations offloaded to host memory → a smaller micro-batch with gradient accumulation.
The formula and its derivation are in docs/training-plan.md "The activation estimate"; the measured
peaks it was checked against are in tests/planning/training/test_training_plan.py.

An explicit choice wins: ``lora={"gradient_checkpointing": True | False | "offload"}`` and
``lora={"liger": True | False}`` are taken as given, and only the rest is decided around them.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from xpukit._compat import installed_version, is_installed
from xpukit.errors import InvalidRequestError
from xpukit.planning.budgets import HEADROOM_FIXED, format_bytes
from xpukit.planning.model.families import family
from xpukit.planning.model.shape import ModelShape, model_shape
from xpukit.planning.training.activation_memory import (
    activation_bytes,
    dequant_transient,
    lora_parameters,
)
from xpukit.planning.training.allocation import cap_text, logits_bytes
from xpukit.planning.training.fit_reasons import (
    FUSED_LOSS,
    PACKED_LOSS,
    gc_decision,
    liger_decision,
    loss_decision,
    partly,
)
from xpukit.planning.training.host_embedding import embedding_decision, host_embedding_bytes
from xpukit.planning.training.lora_request import rank_problem
from xpukit.planning.training.rungs import Choice, Rung, Rungs, choose, ladder_of, micro_batches
from xpukit.planning.training.training_plan import TrainingPlan
from xpukit.planning.vocabulary import Decision

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from xpukit.machine.facts import DeviceFacts
    from xpukit.planning.training.lora_request import LoraRequest
    from xpukit.planning.vocabulary import MemoryEstimate

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_SEQ_LEN",
    "LORA_STATE_BYTES",
    "ModelShape",
    "activation_bytes",
    "check_step_size",
    "liger_availability",
    "micro_batches",
    "model_shape",
    "plan_training",
    "step_keywords",
    "training_plan_for",
]

# transformers' TrainingArguments default per_device_train_batch_size, and a context that covers most
# instruction data; both are stated in the plan when not given.
DEFAULT_BATCH_SIZE = 8
DEFAULT_SEQ_LEN = 2048
# Per trainable (LoRA) parameter: fp32 weight + fp32 gradient + AdamW's two fp32 moments.
LORA_STATE_BYTES = 16
# The order savers are tried in (fastest first); each set includes the ones before it.
GC_OPTIONS: tuple[bool | str, ...] = (False, True, "offload")

# Device types on which Triton, and so liger-kernel, runs (xpukit.loading.training.liger.TRITON_BACKENDS).
_TRITON_BACKENDS = ("cuda", "xpu")


def _micro_batch_decision(choice: Choice, batch: int, seq: int, fit_text: str) -> Decision:
    micro = choice.micro
    if choice.by_tokens:
        return Decision(
            name="micro_batch",
            value=micro,
            reason=f"the whole batch of {batch} in one pass of its real tokens (packing knows them per "
            f"batch at run time) up to {choice.pass_tokens:,} tokens: {fit_text}; a step that carries "
            'more is split by tokens into passes of at most that many (docs/training-plan.md "A token '
            'budget per pass"), where the worst case of every example at its longest would split every step',
            rejected=((f"{batch} × {seq} tokens in one pass", "the worst case does not fit"),),
        )
    return Decision(
        name="micro_batch",
        value=micro,
        reason=(
            f"{micro} sequences per step × {batch // micro} gradient accumulation steps = batch "
            f"{batch}: {fit_text}; training_args passes it on"
            if micro < batch
            else f"the whole batch of {batch} in one step: {fit_text}"
        ),
        rejected=tuple((m, "does not fit") for m in (batch,) if micro < batch),
    )


def plan_training(
    shape: ModelShape,
    request: LoraRequest,
    *,
    compute_dtype: str,
    backend: str,
    weights: int,
    budget: int,
    budget_rule: str,
    batch_size: int | None,
    seq_len: int | None,
    max_positions: int | None,
    liger_available: tuple[bool, str],
    fused: bool = False,
    quantized: bool = False,
    packed: bool = False,
    allocation_cap: int | None = None,
    graphs: bool = False,
    host_embedding: int = 0,
) -> TrainingPlan:
    """Choose the fastest set of memory savers whose estimated peak fits (module docstring).

    Args:
        shape: from :func:`model_shape`.
        request: the new-adapter LoRA request (its ``gradient_checkpointing``/``liger`` are the user's
            choices when ``gradient_checkpointing_given``/``liger`` are set).
        compute_dtype: the plan's dtype.
        backend: the training device's backend (``cuda``, ``xpu``, ``cpu``, ``mps``).
        weights: bytes of the loaded weights.
        budget: bytes the device may fill (``max_memory`` for it, else its usable memory).
        budget_rule: how ``budget`` was found.
        batch_size / seq_len: the step to plan for (``None``: the defaults above).
        max_positions: the model's context length (caps the default ``seq_len``).
        liger_available: whether liger-kernel can run here, and why (not).
        fused: the fused 4-bit LoRA path will run (it saves less per layer, and takes liger's loss,
            with its RMSNorm, first where liger can run unless ``lora={"liger": False}``).
        quantized: 4-bit weights, dequantised in backward (a transient the checkpointed rungs count).
        packed: padded batches run as one row of their real tokens: a pass's tokens are known per
            batch at run time, so a batch whose worst case does not fit keeps its examples together
            in passes of the tokens that fit (the token budget) instead of a smaller micro-batch.
        graphs: the layers may run as graphs: their buffers are counted on every rung.
        host_embedding: bytes of a frozen, untied input embedding that may live in host memory
            (0: it may not); it moves there only where that lets a faster step fit
            (:func:`xpukit.planning.training.host_embedding.embedding_decision`).

    Returns:
        The :class:`TrainingPlan` with its four decisions.
    """
    batch = batch_size or DEFAULT_BATCH_SIZE
    seq = seq_len or min(DEFAULT_SEQ_LEN, max_positions or DEFAULT_SEQ_LEN)
    a = 4 if compute_dtype == "float32" else 2
    lora_params = lora_parameters(shape, request)
    fixed = weights + LORA_STATE_BYTES * lora_params + TRAINING_RESERVE
    room = budget - fixed
    user_gc, user_liger = request.gradient_checkpointing_given, request.liger
    liger_ok, liger_why = liger_available
    transient = dequant_transient(shape, compute_bytes=a, fused_lora=fused) if quantized else 0
    rungs = Rungs(shape, request, a, backend, fused, packed, graphs, transient, liger_ok)
    fused_first = (packed or fused) and liger_ok and user_liger is not False  # PACKED_LOSS, FUSED_LOSS
    ladder = _ladder(request, backend, graphs, fused_first)

    capped = functools.partial(_capped, allocation_cap, seq, shape.vocab)
    if capped(batch):  # only the fused losses (the ladder always holds them)
        ladder = [r for r in ladder if r[0]]
    choice = choose(rungs, ladder, batch, seq, room)
    on_host = None
    if host_embedding:
        choice, on_host = embedding_decision(
            choice,
            lambda extra: choose(rungs, ladder, batch, seq, room + extra),
            host_embedding,
            room,
            batch,
            ladder,
        )
        if on_host is not None and on_host.value == "host":
            fixed, room = fixed - host_embedding, room + host_embedding
    (fused_ce, gc, captured), micro = choice.rung, choice.micro
    loss = rungs.kind(fused_ce)
    tokens = choice.pass_tokens if choice.by_tokens else micro * seq
    estimate = rungs.estimate(choice.rung, tokens, choice.checkpoint_layers)
    fits = estimate["peak"] <= room
    what = f"passes of up to {tokens:,} tokens" if choice.by_tokens else f"{micro} × {seq} tokens"
    need = f"{format_bytes(estimate['peak'])} of activations for {what}"
    rest = f"the {format_bytes(max(room, 0))} left beside weights and LoRA state"
    fit_text = f"{need} fit {rest}" if fits else f"{need} exceed {rest} (the smallest the plan can go)"
    why_fused = None  # the fused loss taken for another reason than memory
    if fused_ce and allocation_cap is not None and capped(micro):
        why_fused = cap_text(logits_bytes(micro, seq, shape.vocab), allocation_cap)
    elif fused_ce and fused_first:
        why_fused = PACKED_LOSS if packed else FUSED_LOSS
    decisions = (
        gc_decision(
            gc, user_gc, fit_text, list(choice.tried), partly(choice.checkpoint_layers, shape.layers)
        ),
        liger_decision(loss == "liger", user_liger, liger_ok, liger_why, fit_text, why_fused),
        loss_decision(
            loss, "lora={'liger': False} given" if user_liger is False else liger_why, why_fused or fit_text
        ),
        _micro_batch_decision(choice, batch, seq, fit_text),
    ) + ((on_host,) if on_host is not None else ())
    moved = host_embedding if on_host is not None and on_host.value == "host" else 0
    fixed_rule = _fixed_rule(weights, lora_params, moved)
    return TrainingPlan(
        batch_size=batch,
        seq_len=seq,
        batch_given=batch_size is not None,
        seq_given=seq_len is not None,
        micro_batch=micro,
        gradient_accumulation_steps=max(1, batch // micro),
        gradient_checkpointing=gc,
        liger=loss == "liger",
        budget=budget,
        budget_rule=budget_rule,
        fixed=fixed,
        fixed_rule=fixed_rule,
        estimate=estimate,
        estimates=choice.tried,
        fits=fits,
        decisions=decisions,
        loss=loss,
        pass_tokens=choice.pass_tokens if packed else None,
        split_by_tokens=choice.by_tokens,
        graphs=captured,
        embedding_on_host=on_host is not None and on_host.value == "host",
        checkpoint_layers=choice.checkpoint_layers,
    )


def _capped(allocation_cap: int | None, seq: int, vocab: int, micro: int) -> bool:
    """The plain loss's logits of ``micro`` sequences: one tensor above the allocation cap."""
    return allocation_cap is not None and logits_bytes(micro, seq, vocab) > allocation_cap


def _ladder(request: LoraRequest, backend: str, graphs: bool, fused_first: bool) -> list[Rung]:
    """The rungs to try, fastest first: the user's checkpointing and liger choices kept."""
    user_gc, user_liger = request.gradient_checkpointing_given, request.liger
    on_graphs: tuple[bool, ...] = ((True,) if request.graphs else (True, False)) if graphs else (False,)
    return ladder_of(
        request.gradient_checkpointing if user_gc else None,
        True if fused_first else user_liger,
        offload=backend != "cpu",
        graphs=on_graphs,
    )


def _fixed_rule(weights: int, lora_params: int, moved: int) -> str:
    """How the fixed part of the training memory is counted, in words (``moved``: bytes of the input
    embedding in host memory, 0 when it stays)."""
    rule = (
        f"weights {format_bytes(weights)} + LoRA state {format_bytes(LORA_STATE_BYTES * lora_params)} "
        f"({lora_params:,} params × {LORA_STATE_BYTES} B: weight, grad, AdamW) + reserve "
        f'{format_bytes(TRAINING_RESERVE)} (calibrated, docs/training-plan.md "The activation estimate")'
    )
    return rule + (f" − the input embedding's {format_bytes(moved)}, in host memory" if moved else "")


# What the training plan keeps free beside weights, LoRA state and the activation estimate. Calibrated
# on the H200 (docs/training-plan.md "The activation estimate"): weights + LoRA state + the estimate gave the
# measured max_memory_allocated peaks of every rung within -3..+11 % with no reserve at all (the 8 GB
# run: 7.56 GB planned, 7.74 GB measured), so the reserve only covers what that peak does not show
# (the allocator's rounding, library workspaces). The 10 % of the weights it also held before is in
# no measured peak, and made the plan split a batch that fits (4 x 512 of the 8B shape under 8 GB).
TRAINING_RESERVE = HEADROOM_FIXED


def check_step_size(value: object, name: str) -> int | None:
    """``batch_size=`` / ``seq_len=`` as a positive int (``None`` stays ``None``), else refused."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidRequestError(
            f"{name}={value!r}: must be a positive int (sequences per optimizer step for batch_size, "
            f"tokens per sequence for seq_len), or None for the default ({DEFAULT_BATCH_SIZE} × "
            f"{DEFAULT_SEQ_LEN}, capped at the model's context)."
        )
    return value


def training_plan_for(
    request: LoraRequest | None,
    *,
    config: PreTrainedConfig | None,
    max_positions: int | None,
    memory: MemoryEstimate,
    device: DeviceFacts,
    dtype: str,
    batch_size: int | None,
    seq_len: int | None,
    fused: bool = False,
    quantized: bool = False,
    packed: bool = False,
    allocation_cap: int | None = None,
    graphs: bool = False,
    single_process: bool = True,
) -> tuple[TrainingPlan | None, LoraRequest | None]:
    """The training plan for adapters to train (new ones, or a saved one with ``trainable=True``), and
    the request updated to follow it.

    Returns ``(None, request)`` unchanged for no LoRA, an adapter loaded for inference, or a model
    whose config has no decoder shape (then the request's own defaults stand: checkpointing for
    quantised models).
    """
    if request is None or not request.trains:
        return None, request
    shape = model_shape(config) if config is not None else None
    if shape is None:
        return None, request
    if (too_big := rank_problem(request, shape.hidden)) is not None:
        raise InvalidRequestError(too_big)
    names = {device.torch_device} | ({str(device.index)} if device.backend != "cpu" else set())
    budget = next((b for b in memory.budgets if b.device in names), None)  # max_memory keys: "0"
    if budget is None:
        return None, request
    if budget.weights_budget is not None:
        limit, rule = budget.weights_budget, f"max_memory for {budget.device}"
    else:
        limit, rule = budget.usable, f"{budget.device} usable: {budget.rule}"
    plan = plan_training(
        shape,
        request,
        compute_dtype=dtype,
        backend=device.backend,
        weights=memory.weights,
        budget=limit,
        budget_rule=rule,
        batch_size=batch_size,
        seq_len=seq_len,
        max_positions=max_positions,
        liger_available=_family_liger(getattr(config, "model_type", None))
        or liger_availability(device.backend),
        fused=fused,
        quantized=quantized,
        packed=packed,
        allocation_cap=allocation_cap,
        graphs=graphs,
        host_embedding=host_embedding_bytes(
            config,
            shape,
            request,
            backend=device.backend,
            compute_bytes=4 if dtype == "float32" else 2,
            single_process=single_process,
        ),
    )
    updated = replace(
        request,
        gradient_checkpointing=plan.gradient_checkpointing,
        liger=plan.liger,
        loss=plan.loss,
        checkpoint_layers=plan.checkpoint_layers,
    )
    return plan, updated


def _family_liger(model_type: object) -> tuple[bool, str] | None:
    """``(False, why)`` where liger-kernel refuses the model family's fused loss
    (:mod:`xpukit.planning.model.families`), else ``None``."""
    known = family(model_type)
    return (False, known.no_liger_loss) if known is not None and known.no_liger_loss else None


def liger_availability(backend: str) -> tuple[bool, str]:
    """Whether liger-kernel can run for this backend, from installed packages (docs/training.md
    "liger-kernel (extra `liger`)")."""
    if backend not in _TRITON_BACKENDS:
        return False, f"liger-kernel's Triton kernels do not run on {backend}"
    if not is_installed("liger_kernel"):
        return False, 'liger-kernel is not installed (pip install "xpukit[liger]")'
    if not is_installed("triton"):
        return False, "liger-kernel is installed but triton is not"
    return True, f"liger-kernel {installed_version('liger-kernel')} can run on {backend}"


def step_keywords(plan: TrainingPlan | None) -> tuple[dict[str, Any], list[str]]:
    """The ``TrainingArguments`` keywords that make ``Trainer`` run the step the plan was made for."""
    if plan is None:
        return {}, []
    out: dict[str, Any] = {
        "per_device_train_batch_size": plan.micro_batch,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
    }
    why = [
        f"per_device_train_batch_size={plan.micro_batch}, gradient_accumulation_steps="
        f"{plan.gradient_accumulation_steps}: the plan's micro-batch for batch {plan.batch_size}"
    ]
    # Always explicit: TRL's config classes turn checkpointing on by default, behind the plan's back.
    out["gradient_checkpointing"] = bool(plan.gradient_checkpointing)
    chosen = plan.gradient_checkpointing
    why.append(f"gradient_checkpointing={out['gradient_checkpointing']}: the plan chose {chosen!r}")
    return out, why
