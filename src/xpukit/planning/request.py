"""The arguments of ``plan_load``, every one checked before anything is read or heavy is imported.

:func:`check_request` is the first step of :func:`xpukit.planning.plan.plan_load`; ``xpukit plan``
calls it too, before it builds a built-in shape's config (which imports transformers), so a typo in
any argument is refused in a fraction of a second (docs/cli.md, ``xpukit plan``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xpukit.errors import InvalidRequestError
from xpukit.planning.arguments import (
    check_model_class,
    check_seed,
    lora_request_for,
    normalize_dtype_arg,
    normalize_max_memory,
    parse_device,
    reconcile,
)
from xpukit.planning.budgets import parse_size
from xpukit.planning.device.attention import normalize_attn
from xpukit.planning.device.choice import DEVICE_PATTERN
from xpukit.planning.device.decode import check_fast_decode
from xpukit.planning.device.distributed import parse_strategy
from xpukit.planning.device.layer_kernels import parse_kernels
from xpukit.planning.device.quantization import QuantRequest, parse_quantize
from xpukit.planning.training.fit import check_step_size
from xpukit.planning.training.merge import MergeRequest, parse_merge

__all__ = ["LoadRequest", "check_request"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadRequest:
    """``plan_load``'s arguments, normalised (transformers' spellings folded into xpukit's)."""

    dtype: str
    attn: str
    quantize: Any
    quant: QuantRequest
    kernels: Any
    headroom: int | None
    max_memory: dict[int | str, int] | None
    device_text: str | None
    class_name: str | None
    seed: int | None
    strategy: str | None
    fast_decode: bool | str
    batch_size: int | None
    seq_len: int | None
    merge: MergeRequest | None
    lora: Any = None  # the resolved LoraRequest (None without lora=)


def check_request(
    kwargs: dict[str, Any],
    *,
    device: Any = None,
    dtype: Any = "auto",
    attn: Any = "auto",
    kernels: Any = "auto",
    device_map: Any = "auto",
    max_memory: dict[Any, Any] | None = None,
    quantize: Any = None,
    lora: Any = None,
    headroom: Any = None,
    model_class: Any = None,
    seed: Any = None,
    strategy: Any = None,
    fast_decode: Any = "auto",
    batch_size: Any = None,
    seq_len: Any = None,
    merge: Any = False,
    force: Any = False,
    trainable: Any = False,
) -> LoadRequest:
    """Check every argument that can be checked without reading anything; ``kwargs`` (the
    ``from_pretrained`` keywords) loses transformers' spellings of xpukit's choices.

    Raises:
        InvalidRequestError: a bad or conflicting argument, with the valid choices.
        MissingExtraError: an extra the request needs (peft for ``lora=``) is missing.
    """
    dtype, attn, quantize, kernels = reconcile(
        kwargs, dtype=dtype, attn=attn, quantize=quantize, kernels=kernels
    )
    dtype_req = normalize_dtype_arg(dtype)
    attn = normalize_attn(attn)
    quant = parse_quantize(quantize)
    parse_kernels(kernels)
    given_headroom = parse_size(headroom, "headroom") if headroom is not None else None
    memory_limits = normalize_max_memory(max_memory)
    device_text = parse_device(device)
    if isinstance(device_map, str) and DEVICE_PATTERN.match(device_map.strip().lower()):
        mapped = device_map.strip().lower()
        if device_text is not None and device_text != mapped:
            raise InvalidRequestError(
                f"device={device!r} and device_map={device_map!r} disagree. Fix: pass one of them."
            )
        device_text = mapped
    elif device_map is not None and not isinstance(device_map, (str, dict)):
        raise InvalidRequestError(
            f"device_map={device_map!r} must be 'auto', a device, an accelerate strategy or a dict."
        )
    class_name = check_model_class(model_class)
    seed = check_seed(seed)
    strategy = parse_strategy(strategy)
    fast_decode = check_fast_decode(fast_decode)
    batch_size, seq_len = check_step_size(batch_size, "batch_size"), check_step_size(seq_len, "seq_len")
    # validated before reading anything
    given_lora = lora_request_for(lora, quantized=quant.kind in {"4bit", "8bit"}, trainable=trainable)
    merge_request = parse_merge(
        merge, lora=lora, quantize=quantize, quant_kind=quant.kind, force=force, strategy=strategy,
        device_map=device_map, max_memory=max_memory, trainable=trainable,
    )  # fmt: skip
    return LoadRequest(
        dtype=dtype_req,
        attn=attn,
        quantize=quantize,
        quant=quant,
        kernels=kernels,
        headroom=given_headroom,
        max_memory=memory_limits,
        device_text=device_text,
        class_name=class_name,
        seed=seed,
        strategy=strategy,
        fast_decode=fast_decode,
        batch_size=batch_size,
        seq_len=seq_len,
        merge=merge_request,
        lora=given_lora,
    )
