"""Packed training rows through torch's ``varlen_attn``: the examples' boundaries instead of a mask.

The ``packed_attention`` decision (:mod:`xpukit.planning.training.packed_attention`) says ``varlen``
where it can run; :func:`use_varlen` then sets the model's attention to :data:`NAME`, registered here
with transformers' ``AttentionInterface`` (the attention function) and ``AttentionMaskInterface``
(the mask function). Packing (:mod:`.packing`) makes the decoder call of a packed row through
:func:`run_packed`, which passes the row's boundaries under transformers' flash-attention keyword
names (``cu_seq_lens_q``/``_k``, ``max_length_q``/``_k``) inside :func:`packed_call`:

* inside it the mask function builds nothing (returns ``None``); outside it, it is transformers'
  ``sdpa_mask``, so evaluation, ``generate`` and unpacked batches see SDPA's masks;
* the attention function runs ``varlen_attn`` when it is given ``cu_seq_lens_q``, else transformers'
  ``sdpa_attention_forward``;
* a packed call ``varlen_attn`` cannot take (not CUDA, float32, dropout, a head size it has no
  kernel for, softcapping or sinks, a window or a scale this torch's ``varlen_attn`` does not take,
  or ``varlen_attn`` missing or raising ``NotImplementedError``, as it does on the CPU) runs
  :func:`reference_attention`: SDPA with the block-diagonal causal mask of the boundaries, counted
  with its reason in :data:`FALLBACKS`.

The boundaries (:func:`boundaries`) come in a fixed number of entries per multiple of :data:`SLOTS`
examples, so the rows of one bucket are one shape for the layers' graphs whatever their number of
examples. docs/training-plan.md "Packed rows without a mask" and docs/known-issues.md "torch:
varlen_attn" have the facts.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PreTrainedModel

__all__ = [
    "FALLBACKS",
    "NAME",
    "SLOTS",
    "block_mask",
    "boundaries",
    "keywords",
    "packed_call",
    "reference_attention",
    "register",
    "run_packed",
    "use_varlen",
    "varlen_attention",
]

NAME = "xpukit_varlen"
# Boundaries come in multiples of this many examples (empty examples fill the rest).
SLOTS = 8
# Packed calls that ran the reference path instead of varlen_attn, by reason.
FALLBACKS: Counter[str] = Counter()
# FlashAttention's head sizes: up to 256, a multiple of 8 (docs/known-issues.md "torch: varlen_attn").
_MAX_HEAD = 256
_PACKED: contextvars.ContextVar[bool] = contextvars.ContextVar("xpukit_packed_call", default=False)
_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@contextlib.contextmanager
def packed_call() -> Iterator[None]:
    """Inside: the decoder call is a packed row with its boundaries; the mask function builds no mask."""
    token = _PACKED.set(True)
    try:
        yield
    finally:
        _PACKED.reset(token)


def varlen_mask(*args: object, **kwargs: object) -> torch.Tensor | None:
    """The mask function of :data:`NAME`: ``None`` inside :func:`packed_call` (the boundaries keep the
    examples apart), else transformers' ``sdpa_mask``."""
    if _PACKED.get():
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def boundaries(lengths: Sequence[int], slots: int = SLOTS) -> torch.Tensor:
    """``cu_seqlens`` (int32, on the CPU) of a packed row whose examples have ``lengths`` (the bucket
    padding at the row's end given as one more example), padded with empty examples to a multiple of
    ``slots`` examples: ``slots * k + 1`` entries, the same for every row of 1 to ``slots * k``
    examples."""
    import torch

    count = max(len(lengths), 1)
    total = -(-count // slots) * slots
    ends = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return torch.cat([ends, ends[-1:].expand(total + 1 - ends.numel())])


def block_mask(cu_seqlens: torch.Tensor, length: int, window: int | None = None) -> torch.Tensor:
    """The ``[1, 1, length, length]`` boolean mask of a packed row: each token sees the earlier tokens
    of its own example (within ``window`` tokens, itself counted, where there is one). Built on the
    boundaries' device without reading them on the host (a graph capture may be running)."""
    import torch

    pos = torch.arange(length, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    example = torch.searchsorted(cu_seqlens[1:].contiguous(), pos, right=True)
    mask = (example[:, None] == example[None, :]) & (pos[None, :] <= pos[:, None])
    if window is not None:
        mask &= (pos[:, None] - pos[None, :]) < window
    return mask[None, None]


@functools.cache
def _parameters() -> frozenset[str] | None:
    """The keyword parameters of this torch's ``varlen_attn`` (``None``: it has none)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


def keywords(
    *,
    window: int | None,
    scale: float | None,
    gqa: bool,
    parameters: frozenset[str] | None = None,
) -> dict[str, object] | str:
    """``varlen_attn``'s keywords for a causal call (``window``: transformers' sliding window; ``scale``:
    a scale other than the head size's; ``gqa``: fewer key/value heads than query heads), or why this
    torch's ``varlen_attn`` cannot take it. ``parameters``: its signature's names (default: read once
    from the installed torch). torch 2.10 takes ``is_causal`` and no scale or window; later releases
    take ``window_size`` (``(W - 1, 0)``, or ``(-1, 0)`` for plain causal) and ``scale``; ``enable_gqa``
    where it exists (else the caller repeats the key/value heads: ``enable_gqa`` is then ``False``)."""
    params = _parameters() if parameters is None else parameters
    if params is None:
        return "torch.nn.attention.varlen.varlen_attn is missing (torch < 2.10)"
    out: dict[str, object] = {}
    if "window_size" in params:
        out["window_size"] = (window - 1, 0) if window is not None else (-1, 0)
    elif window is not None:
        return "a sliding window, which this torch's varlen_attn (is_causal only) does not take"
    else:
        out["is_causal"] = True
    if scale is not None:
        if "scale" not in params:
            return "a custom attention scale, which this torch's varlen_attn does not take"
        out["scale"] = scale
    if gqa and "enable_gqa" in params:
        out["enable_gqa"] = True
    return out


def _why_reference(
    module: torch.nn.Module, query: torch.Tensor, dropout: float, kwargs: dict[str, object]
) -> str | None:
    """Why this packed call cannot run ``varlen_attn`` whatever its keywords (``None``: it may)."""
    import torch

    head = int(query.shape[-1])
    if query.device.type != "cuda":
        return f"not CUDA ({query.device.type})"
    if query.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {str(query.dtype).removeprefix('torch.')} (varlen_attn takes bf16 or fp16)"
    if dropout > 0:
        return "attention dropout"
    if head > _MAX_HEAD or head % 8:
        return f"head size {head} (FlashAttention: up to {_MAX_HEAD}, a multiple of 8)"
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or hasattr(module, "sinks"):
        return "softcapping or attention sinks"
    return None


def _custom_scale(scaling: float | None, head: int) -> float | None:
    """``scaling`` where it differs from the head size's ``head ** -0.5`` (``None`` where it does not)."""
    if scaling is None or abs(scaling - head**-0.5) <= 1e-6 * head**-0.5:
        return None
    return float(scaling)


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The attention function of :data:`NAME` (transformers' attention interface: ``query`` is
    ``[B, H, L, D]``, the output ``[B, L, H, D]``): ``varlen_attn`` over a packed row given
    ``cu_seq_lens_q``, transformers' SDPA for every other call."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        out = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return cast("tuple[torch.Tensor, None]", out)
    rest = {k: v for k, v in kwargs.items() if k not in _KEYS}
    window = rest.get("sliding_window")
    window = int(window) if isinstance(window, int) and window > 0 else None
    given = kwargs.get("max_length_q")
    length = given if isinstance(given, int) else int(query.shape[2])
    why = _why_reference(module, query, dropout, rest)
    if why is None:
        groups = int(query.shape[1]) // int(key.shape[1])
        call = keywords(window=window, scale=_custom_scale(scaling, int(query.shape[-1])), gqa=groups > 1)
        if isinstance(call, str):
            why = call
        else:
            try:
                return _varlen(query, key, value, cu, length, call, groups), None
            except NotImplementedError as exc:
                why = f"varlen_attn raised NotImplementedError ({str(exc).splitlines()[0][:80]})"
    FALLBACKS[why] += 1
    return reference_attention(
        module,
        query,
        key,
        value,
        cu,
        window=window,
        dropout=dropout,
        scaling=scaling,
        **rest,
    )


def _varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    length: int,
    call: dict[str, object],
    groups: int,
) -> torch.Tensor:
    """``varlen_attn`` over one packed row (``[1, H, L, D]`` in, ``[1, L, H, D]`` out)."""
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [L, H, D]
    if groups > 1 and "enable_gqa" not in call:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = varlen_attn(q, k, v, cu, cu, length, length, **call)
    return out[None]


def reference_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    window: int | None = None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """A packed row through transformers' SDPA with the block-diagonal causal mask of its boundaries
    (:func:`block_mask`): what ``varlen_attn`` computes, where it cannot run."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mask = block_mask(cu_seqlens, int(query.shape[2]), window)
    kwargs.pop("is_causal", None)
    out = sdpa_attention_forward(
        module, query, key, value, mask, dropout=dropout, scaling=scaling, is_causal=False, **kwargs
    )
    return cast("tuple[torch.Tensor, None]", out)


@functools.cache
def register() -> str:
    """Register :data:`NAME` with transformers' attention and mask interfaces (once); returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, varlen_mask)
    return NAME


def run_packed(
    forward: Callable[..., object], cu_seqlens: torch.Tensor, length: int, **kwargs: object
) -> object:
    """The decoder call of one packed row of ``length`` tokens with its boundaries (:func:`boundaries`,
    on the row's device), inside :func:`packed_call`."""
    with packed_call():
        return forward(
            **kwargs,
            cu_seq_lens_q=cu_seqlens,
            cu_seq_lens_k=cu_seqlens,
            max_length_q=length,
            max_length_k=length,
        )


def use_varlen(model: PreTrainedModel | PeftModel) -> str:
    """Set the attention of ``model`` (a PeftModel or a transformers model) to :data:`NAME`; a note."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_attn_implementation(register())
    return (
        f"packed attention: {NAME}: a packed training row runs torch's varlen_attn from its examples' "
        "boundaries, no mask built (other calls: SDPA; fallbacks counted in "
        "xpukit.loading.training.varlen_attention.FALLBACKS)"
    )
