"""The training plan for new LoRA adapters: which memory savers to use, decided by fit (pure).

From the model's shape (read from its config), the batch and sequence length and the LoRA settings,
:func:`activation_bytes` estimates the activation memory of one training step under each set of
savers. :func:`plan_training` takes the fastest set that fits the device's memory beside the weights
and the adapters' training state, trying them in the order of docs/training.md "Training plan by
fit": none → liger-kernel's fused linear cross-entropy → gradient checkpointing → checkpointing with
the saved activations offloaded to host memory → a smaller micro-batch with gradient accumulation.
The formula and its derivation are in docs/training.md "The activation estimate"; the measured
peaks it was checked against are in tests/test_training_plan.py.

An explicit choice wins: ``lora={"gradient_checkpointing": True | False | "offload"}`` and
``lora={"liger": True | False}`` are taken as given, and only the rest is decided around them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from xpukit._compat import installed_version, is_installed
from xpukit.errors import InvalidRequestError
from xpukit.planning.budgets import HEADROOM_FIXED, format_bytes
from xpukit.planning.model.shape import ModelShape, model_shape
from xpukit.planning.training.activation_memory import (
    activation_bytes,
    dequant_transient,
    graph_buffer_bytes,
    lora_parameters,
)
from xpukit.planning.training.allocation import cap_text, logits_bytes
from xpukit.planning.training.fit_reasons import (
    FUSED_LOSS,
    PACKED_LOSS,
    gc_decision,
    liger_decision,
    loss_decision,
)
from xpukit.planning.training.training_plan import TrainingPlan, option_text
from xpukit.planning.vocabulary import Decision

if TYPE_CHECKING:
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


# One rung of the ladder: (fused cross-entropy, gradient checkpointing, the layers as graphs).
Rung = tuple[bool, bool | str, bool]


@dataclass(frozen=True)
class _Rungs:
    """What sizing a pass needs, fixed before any rung is tried: the shape, the request, the device's
    backend and the paths that will run (:func:`plan_training`'s arguments)."""

    shape: ModelShape
    request: LoraRequest
    compute_bytes: int
    backend: str
    fused: bool
    packed: bool
    graphs: bool
    dequant: int
    liger_ok: bool

    def kind(self, fused_ce: bool) -> str:
        """Which cross-entropy: plain, else liger's where it may run, else xpukit's chunked one."""
        if not fused_ce:
            return "plain"
        return "liger" if self.liger_ok and self.request.liger is not False else "chunked"

    def estimate(self, rung: Rung, tokens: int) -> dict[str, int]:
        """The activation estimate of a pass of ``tokens`` tokens on this rung (docs/training.md "The
        activation estimate"), the graphs' own buffers included where the layers run as graphs."""
        fused_ce, gc, graphs = rung
        # The fused path's and liger's smaller saved tensors are counted on the rung without
        # checkpointing, where they were measured (H200); the checkpointed rungs keep the unfused terms,
        # which the 8 GB budget runs fit.
        request, a, measured = self.request, self.compute_bytes, not gc
        out = activation_bytes(
            self.shape, tokens, compute_bytes=a, lora_r=int(request.config.get("r", 16)),
            targets=request.config.get("target_modules"),
            dropout=float(request.config.get("lora_dropout", 0) or 0) > 0,
            mask_bytes=1 if self.backend in ("cuda", "xpu") else a, checkpointing=gc, fused_loss=fused_ce,
            fused_lora=self.fused and measured, dequant_bytes=self.dequant,
            chunked_loss=self.kind(fused_ce) == "chunked",
            kernel_norms=measured and self.kind(fused_ce) == "liger",
        )  # fmt: skip
        if graphs:  # the graphs' own buffers: one shape, or a packed row's buckets
            held = graph_buffer_bytes(self.shape, tokens, compute_bytes=a, packed=self.packed)
            if gc:  # the recomputation lives in the graphs' pool, which the eager loss cannot reuse
                held += min(out["loss"], out["recompute"])
            out = {**out, "graph_buffers": held, "peak": out["peak"] + held}
        return out

    def peak(self, rung: Rung, tokens: int) -> int:
        return self.estimate(rung, tokens)["peak"]

    def text(self, rung: Rung, micro: int, batch: int) -> str:
        """The rung in words; where the layers may run as graphs, whether they do on it."""
        text = option_text(self.kind(rung[0]), rung[1], micro, batch)
        return text + (", graphs" if rung[2] else ", eager") if self.graphs else text

    def pass_tokens(self, rung: Rung, room: int) -> int:
        """The most tokens one pass may carry on this rung within ``room`` (0: not even one)."""
        low, high = 0, 1 << 22  # 4 M tokens: beyond any pass a device holds
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.peak(rung, mid) <= room else (low, mid - 1)
        return low


@dataclass(frozen=True)
class _Choice:
    """The rung chosen, its micro-batch and the tokens a pass may carry, and the options tried."""

    rung: Rung
    micro: int
    pass_tokens: int
    by_tokens: bool  # the whole batch in one pass, split by tokens at run time where needed
    tried: tuple[tuple[str, int], ...]


def _choose(rungs: _Rungs, ladder: list[Rung], batch: int, seq: int, room: int) -> _Choice:
    """The fastest rung whose worst step (``batch × seq`` tokens) fits; else, with packing, the rung
    that carries the most tokens a pass, with the whole batch in passes of the tokens that fit (split
    by tokens at run time, only for steps that carry more); else the leanest rung at the largest
    micro-batch that fits."""
    tried: list[tuple[str, int]] = []
    worst = batch * seq
    for rung in ladder:
        p = rungs.peak(rung, worst)
        tried.append((rungs.text(rung, batch, batch), p))
        if p <= room:
            return _Choice(rung, batch, max(rungs.pass_tokens(rung, room), worst), False, tuple(tried))
    if rungs.packed and batch > 1:
        # The rung that carries the most tokens a pass, so that the fewest steps are split: a split
        # step runs eagerly, and what it leaves cached in the device's default pool stays beside the
        # graphs' pool (H200, 8 GB: 9.07 GB reserved with the graphs' leanest rung, docs/benchmarks.md).
        rung = max(ladder, key=lambda r: (rungs.pass_tokens(r, room), r[2]))
        tokens = rungs.pass_tokens(rung, room)
        if tokens >= seq:  # one longest example fits a pass
            tried.append((rungs.text(rung, batch, batch) + f", passes of up to {tokens:,} tokens",
                          rungs.peak(rung, tokens)))  # fmt: skip
            return _Choice(rung, batch, tokens, True, tuple(tried))
    rung = min(ladder, key=lambda r: rungs.peak(r, worst))
    micro = next((m for m in micro_batches(batch) if rungs.peak(rung, m * seq) <= room), 1)
    tried.append((rungs.text(rung, micro, batch), rungs.peak(rung, micro * seq)))
    return _Choice(rung, micro, micro * seq, False, tuple(tried))


def _micro_batch_decision(choice: _Choice, batch: int, seq: int, fit_text: str) -> Decision:
    micro = choice.micro
    if choice.by_tokens:
        return Decision(
            name="micro_batch",
            value=micro,
            reason=f"the whole batch of {batch} in one pass of its real tokens (packing knows them per "
            f"batch at run time) up to {choice.pass_tokens:,} tokens: {fit_text}; a step that carries "
            'more is split by tokens into passes of at most that many (docs/training.md "A token '
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
    rungs = _Rungs(
        shape, request, a, backend, fused, packed, graphs,
        dequant_transient(shape, compute_bytes=a, fused_lora=fused) if quantized else 0, liger_ok,
    )  # fmt: skip
    fused_first = (packed or fused) and liger_ok and user_liger is not False  # PACKED_LOSS, FUSED_LOSS
    on_graphs: tuple[bool, ...] = ((True,) if request.graphs else (True, False)) if graphs else (False,)
    ladder = _ladder(
        request.gradient_checkpointing if user_gc else None, True if fused_first else user_liger,
        offload=backend != "cpu", graphs=on_graphs,
    )  # fmt: skip

    def capped(micro: int) -> bool:  # the plain loss's logits, one tensor above the allocation cap
        return allocation_cap is not None and logits_bytes(micro, seq, shape.vocab) > allocation_cap

    if capped(batch):  # only the fused losses (the ladder always holds them)
        ladder = [r for r in ladder if r[0]]
    choice = _choose(rungs, ladder, batch, seq, room)
    (fused_ce, gc, captured), micro = choice.rung, choice.micro
    loss = rungs.kind(fused_ce)
    tokens = choice.pass_tokens if choice.by_tokens else micro * seq
    estimate = rungs.estimate(choice.rung, tokens)
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
        gc_decision(gc, user_gc, fit_text, list(choice.tried)),
        liger_decision(loss == "liger", user_liger, liger_ok, liger_why, fit_text, why_fused),
        loss_decision(
            loss, "lora={'liger': False} given" if user_liger is False else liger_why, why_fused or fit_text
        ),
        _micro_batch_decision(choice, batch, seq, fit_text),
    )
    return TrainingPlan(
        batch_size=batch, seq_len=seq, batch_given=batch_size is not None, seq_given=seq_len is not None,
        micro_batch=micro, gradient_accumulation_steps=max(1, batch // micro), gradient_checkpointing=gc,
        liger=loss == "liger", budget=budget, budget_rule=budget_rule, fixed=fixed,
        fixed_rule=(
            f"weights {format_bytes(weights)} + LoRA state {format_bytes(LORA_STATE_BYTES * lora_params)} "
            f"({lora_params:,} params × {LORA_STATE_BYTES} B: weight, grad, AdamW) + reserve "
            f'{format_bytes(TRAINING_RESERVE)} (calibrated, docs/training.md "The activation estimate")'
        ),
        estimate=estimate, estimates=choice.tried, fits=fits, decisions=decisions, loss=loss,
        pass_tokens=choice.pass_tokens if packed else None, split_by_tokens=choice.by_tokens,
        graphs=captured,
    )  # fmt: skip


def micro_batches(batch: int) -> list[int]:
    """The micro-batches a step of ``batch`` sequences can be split into, largest first: the divisors
    of ``batch``, so that micro-batch × accumulation steps is the batch asked for (batch 6: 6, 3, 2, 1;
    a micro-batch of 4 would make it 4 or 8)."""
    return [m for m in range(batch, 0, -1) if batch % m == 0]


def _ladder(
    gc: bool | str | None, liger: bool | None, *, offload: bool, graphs: tuple[bool, ...]
) -> list[Rung]:
    """The rungs in the order tried (fastest first), as (fused cross-entropy, checkpointing, graphs):
    every set of savers with the layers as graphs, then every set eagerly (a step bound by the host
    runs slower eagerly without savers than captured with checkpointing: H200, docs/benchmarks.md). A
    user's choice pins its saver (``lora={"liger": True}``: the fused loss, liger's where it runs)."""
    gcs: list[bool | str] = [gc] if gc is not None else [False, True] + (["offload"] if offload else [])
    losses = [True] if liger else [False, True]
    return [(ce, g, on) for on in graphs for g in gcs for ce in losses]


# What the training plan keeps free beside weights, LoRA state and the activation estimate. Calibrated
# on the H200 (docs/training.md "The activation estimate"): weights + LoRA state + the estimate gave the
# measured max_memory_allocated peaks of every rung within -3..+11 % with no reserve at all (the 8 GB
# run: 7.56 GB planned, 7.74 GB measured), so the reserve only covers what that peak does not show
# (the allocator's rounding, library workspaces). The 10 % of the weights it also held before is in
# no measured peak, and made the plan split a batch that fits (4 x 512 of the 8B shape under 8 GB).
TRAINING_RESERVE = HEADROOM_FIXED


def check_step_size(value: Any, name: str) -> int | None:
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
    config: Any,
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
        liger_available=liger_availability(device.backend),
        fused=fused,
        quantized=quantized,
        packed=packed,
        allocation_cap=allocation_cap,
        graphs=graphs,
    )
    updated = replace(
        request, gradient_checkpointing=plan.gradient_checkpointing, liger=plan.liger, loss=plan.loss
    )
    return plan, updated


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
