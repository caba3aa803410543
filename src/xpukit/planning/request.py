"""The request: ``plan_load``'s and ``load_for_xpu``'s keywords, their types, defaults and checks.

:class:`LoadRequest` is the one place the request is written. ``plan_load`` and ``load_for_xpu`` take
its keywords (:func:`takes_request` gives them its signature) and build it through its constructor,
which checks every argument that can be checked without reading anything: ``xpukit plan`` builds one
too, before it builds a built-in shape's config (which imports transformers), so a typo in any
argument is refused in a fraction of a second (docs/cli.md, ``xpukit plan``).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import FrozenInstanceError
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, Literal, ParamSpec, Protocol, TypeAlias, TypeVar, cast

from xpukit.errors import InvalidRequestError
from xpukit.planning.arguments import (
    check_model_class,
    check_seed,
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
from xpukit.planning.model.reference_models import BUILTIN_SHAPES
from xpukit.planning.training.fit import check_step_size
from xpukit.planning.training.lora_request import LoraRequest, LoraSettings, resolve_lora
from xpukit.planning.training.merge import MergeRequest, parse_merge
from xpukit.sources.adapter_files import read_adapter_files
from xpukit.sources.model_config import ConfigRead, read_config

if TYPE_CHECKING:
    import torch
    from peft import LoraConfig
    from transformers import KernelConfig, PretrainedConfig
    from transformers.utils.quantization_config import QuantizationConfigMixin

    from xpukit.machine.facts import MachineFacts

__all__ = [
    "AttnArg",
    "DeviceArg",
    "DeviceMapArg",
    "DtypeArg",
    "KernelsArg",
    "LoadRequest",
    "LoraArg",
    "LoraSettings",
    "MergeArg",
    "ModelArg",
    "QuantizeArg",
    "SizeArg",
    "read_model_config",
    "takes_request",
]

# What each keyword accepts. Torch and transformers types are named for type checkers only:
# `import xpukit` imports neither.
ModelArg: TypeAlias = "str | os.PathLike[str] | PretrainedConfig"
DeviceArg: TypeAlias = "str | torch.device | None"
DtypeArg: TypeAlias = "torch.dtype | Literal['auto', 'bfloat16', 'float16', 'float32'] | str"
AttnArg: TypeAlias = (
    "Literal['auto', 'sdpa', 'eager', 'flex_attention', 'flash_attention_2', 'flash_attention_3', "
    "'flash_attention_4'] | str"
)
KernelsArg: TypeAlias = "Literal['auto', 'on', 'off'] | bool | KernelConfig | Mapping[str, object]"
DeviceMapArg: TypeAlias = (
    "Literal['auto', 'balanced', 'balanced_low_0', 'sequential'] | str | dict[str, Any] | None"
)
SizeArg: TypeAlias = "int | str"
# a transformers quantization config: BitsAndBytesConfig, TorchAoConfig, QuantoConfig, GPTQConfig…
QuantizeArg: TypeAlias = (
    "Literal['4bit', '8bit', 'auto', 'nf4', 'int4', 'int8', 'none'] | QuantizationConfigMixin | None"
)
LoraArg: TypeAlias = "bool | LoraSettings | LoraConfig | str | os.PathLike[str] | None"
MergeArg: TypeAlias = "bool | Literal['dequantized', 'original']"
StrategyArg: TypeAlias = "Literal['auto', 'ddp', 'fsdp', 'deepspeed'] | None"
FastDecodeArg: TypeAlias = "bool | Literal['auto', 'unfused', 'regional']"


class LoadRequest:
    """What ``plan_load`` and ``load_for_xpu`` are asked: every keyword, its type, default and check.

    Frozen once built. The constructor checks every argument that can be checked without reading
    anything, and the attributes hold the checked values, normalised (``dtype="bf16"`` is held as
    ``"bfloat16"``, ``headroom="2GiB"`` in bytes, ``strategy`` in lower case, ``merge`` as a
    ``MergeRequest`` or ``None``), with what was derived from them: ``quant`` (the quantization
    asked), ``device_text`` (the device asked, from ``device=`` or ``device_map=``), ``class_name``
    and ``lora_request`` (``lora=`` resolved). Any keyword not listed here is kept in
    :attr:`from_pretrained_kwargs` and goes to ``from_pretrained`` unchanged (transformers' own
    spellings ``torch_dtype=``, ``attn_implementation=``, ``quantization_config=``,
    ``use_kernels=``/``kernel_config=`` are folded into ``dtype``, ``attn``, ``quantize``, ``kernels``).

    Args:
        device: ``"xpu"``, ``"xpu:1"``, ``"cuda"``, ``"mps"``, ``"cpu"`` or a ``torch.device``; default:
            the first available of xpu, cuda, mps, cpu.
        dtype: ``"auto"`` (per device family) or ``bfloat16`` / ``float16`` / ``float32`` (a name or a
            ``torch.dtype``).
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
            adapters are checked against the model's modules while planning (this imports peft).
        offload: allow CPU offload when the model fits nowhere else (else :class:`PlanError`);
            default ``None``: allowed (with a warning) for inference, refused for training new
            LoRA adapters (``True`` allows it there too; docs/planning.md "Training layout").
        headroom: memory kept free beside the weights (bytes or ``"2GiB"``); default: the rule in
            docs/planning.md.
        facts: the machine to plan for: :class:`MachineFacts`, or a profile such as
            ``"max-1550"`` (one card: two FLAT stacks); default: this machine (:func:`xpukit.detect`).
        model_class: the transformers class to load with, or its name (default: the Auto class for
            the config).
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
        warmup: ``load_for_xpu`` only: with ``fast_decode``, run one short generation at load and
            record its time (the compile) as a ``warmup`` event (docs/decode.md); ``plan_load``
            ignores it.
        batch_size: with new LoRA adapters, the sequences per optimizer step to plan training for
            (default 8); the memory savers are chosen by fit (docs/training-plan.md "Training plan by fit").
        seq_len: with new LoRA adapters, the tokens per sequence (default 2048, capped at the
            model's context).
        merge: with ``lora=`` an adapter directory: ``True`` (or ``"dequantized"``) merges it into the
            base as 4-bit training saw it, ``"original"`` into the checkpoint's own weights; never into
            4-bit weights (``quantize=`` is refused). Placed by fit: the device, else the CPU. The
            plan's ``merge`` decision says which and why (docs/merging.md "Merging an adapter").
        force: with ``lora=`` an adapter directory, load or merge it even when its tensors do not
            all fit the base (a warning instead of :class:`InvalidRequestError`); every trained
            adapter is checked against the base's modules before any weight is read.
        trainable: with ``lora=`` an adapter directory, load it to train further: its weights
            trainable, the training plan made for it as for new adapters (docs/training.md
            "Training a saved adapter further"); default: loaded for inference.
        **from_pretrained_kwargs: passed to ``from_pretrained`` unchanged.

    Raises:
        InvalidRequestError: a bad or conflicting argument, with the valid choices.
        MissingExtraError: an extra the request needs is missing.

    Example:
        >>> from xpukit.planning.request import LoadRequest
        >>> LoadRequest(dtype="bf16", quantize="4bit").dtype
        'bfloat16'
    """

    def __init__(
        self,
        *,
        device: DeviceArg = None,
        dtype: DtypeArg = "auto",
        attn: AttnArg = "auto",
        kernels: KernelsArg = "auto",
        device_map: DeviceMapArg = "auto",
        max_memory: dict[int | str, SizeArg] | None = None,
        quantize: QuantizeArg = None,
        lora: LoraArg = None,
        offload: bool | None = None,
        headroom: SizeArg | None = None,
        facts: MachineFacts | str | None = None,
        model_class: type | str | None = None,
        seed: int | None = None,
        strategy: StrategyArg = None,
        fast_decode: FastDecodeArg = "auto",
        warmup: bool = False,
        batch_size: int | None = None,
        seq_len: int | None = None,
        merge: MergeArg = False,
        force: bool = False,
        trainable: bool = False,
        **from_pretrained_kwargs: object,
    ) -> None:
        # Checked in this order, each before anything is read (a typo fails in a fraction of a second).
        kwargs = dict(from_pretrained_kwargs)
        asked_dtype, asked_attn, folded, asked_kernels = reconcile(
            kwargs, dtype=dtype, attn=attn, quantize=quantize, kernels=kernels
        )
        self.dtype: str = normalize_dtype_arg(asked_dtype)
        self.attn: str = normalize_attn(asked_attn)
        self.quantize = quantize  # as given; transformers' quantization_config= is folded into quant
        self.quant: QuantRequest = parse_quantize(folded)
        parse_kernels(asked_kernels)
        self.kernels = cast("KernelsArg", asked_kernels)  # one of those: parse_kernels checked it
        self.headroom: int | None = parse_size(headroom, "headroom") if headroom is not None else None
        self.max_memory = normalize_max_memory(max_memory)
        self.device, self.device_map = device, device_map
        self.device_text = _device_text(device, device_map)  # device=, or the device device_map= names
        self.model_class, self.class_name = model_class, check_model_class(model_class)
        self.seed = check_seed(seed)
        self.strategy = parse_strategy(strategy)
        self.fast_decode = check_fast_decode(fast_decode)
        self.batch_size = check_step_size(batch_size, "batch_size")
        self.seq_len = check_step_size(seq_len, "seq_len")
        self.lora, self.trainable, self.force = lora, trainable, force
        self.lora_request = _lora(lora, quantized=self.quant.kind in {"4bit", "8bit"}, trainable=trainable)
        self.merge: MergeRequest | None = parse_merge(
            merge,
            lora=lora,
            quantize=folded,
            quant_kind=self.quant.kind,
            force=force,
            strategy=self.strategy,
            device_map=device_map,
            max_memory=max_memory,
            trainable=trainable,
        )
        self.offload, self.facts, self.warmup = offload, facts, warmup
        self.from_pretrained_kwargs: dict[str, Any] = kwargs  # without transformers' spellings of ours
        self._frozen = True

    def __setattr__(self, name: str, value: object) -> None:
        if getattr(self, "_frozen", False):
            raise FrozenInstanceError(f"cannot assign to field {name!r}: a LoadRequest is frozen")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}: a LoadRequest is frozen")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LoadRequest):
            return NotImplemented
        return vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]  # mutable values (dicts) inside

    def __repr__(self) -> str:
        given = [f"{name}={getattr(self, name)!r}" for name in keywords() if _differs(self, name)]
        given += [f"{k}={v!r}" for k, v in self.from_pretrained_kwargs.items()]
        return f"LoadRequest({', '.join(given)})"


def _differs(request: LoadRequest, name: str) -> bool:
    default, value = _PARAMETERS[name].default, getattr(request, name)
    return value is not None and value is not default and bool(value != default)


def keywords() -> tuple[str, ...]:
    """The request's keywords, in :class:`LoadRequest`'s order (the "did you mean" of unknown ones)."""
    return tuple(_PARAMETERS)


P = ParamSpec("P")
R = TypeVar("R")
M = TypeVar("M")


class _GivesKeywords(Protocol[P]):
    def __call__(self, fn: Callable[Concatenate[M, ...], R], /) -> Callable[Concatenate[M, P], R]: ...


def takes_request(request: Callable[P, LoadRequest]) -> _GivesKeywords[P]:
    """``@takes_request(LoadRequest)`` gives ``fn(model, **keywords)`` the request's keywords as its
    signature (for help(), ``inspect`` and type checkers): ``plan_load`` and ``load_for_xpu`` take
    exactly :class:`LoadRequest`'s keywords, written once."""
    listed = list(inspect.signature(request).parameters.values())

    def give(fn: Callable[Concatenate[M, ...], R], /) -> Callable[Concatenate[M, P], R]:
        own = inspect.signature(fn)
        model = own.parameters["model"].replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
        fn.__signature__ = own.replace(parameters=[model, *listed])  # type: ignore[attr-defined]
        return fn

    return give


def _lora(lora: object, *, quantized: bool, trainable: bool) -> LoraRequest | None:
    """``lora=`` resolved once (its checkpointing default fitted to the layout while planning)."""
    if lora is None and trainable is False:
        return None
    # a trained adapter's files, read once here, before any decision (xpukit/sources/)
    files = None
    if isinstance(lora, str | os.PathLike) and isinstance(trainable, bool):
        files = read_adapter_files(Path(os.fspath(lora)))
    return resolve_lora(lora, quantized=quantized, trainable=trainable, files=files)


def read_model_config(model: ModelArg, req: LoadRequest) -> ConfigRead:
    """The model's config, read before any decision (never the weights; xpukit/sources/): from a
    directory, the Hub (offline rules honoured), a built-in shape's name, or as given."""
    return read_config(model, req.from_pretrained_kwargs, shapes=BUILTIN_SHAPES)


def _device_text(device: object, device_map: object) -> str | None:
    """``device=``, or the device ``device_map=`` names (the two must agree)."""
    device_text = parse_device(device)
    if isinstance(device_map, str) and DEVICE_PATTERN.match(device_map.strip().lower()):
        mapped = device_map.strip().lower()
        if device_text is not None and device_text != mapped:
            raise InvalidRequestError(
                f"device={device!r} and device_map={device_map!r} disagree. Fix: pass one of them."
            )
        return mapped
    if device_map is not None and not isinstance(device_map, (str, dict)):
        raise InvalidRequestError(
            f"device_map={device_map!r} must be 'auto', a device, an accelerate strategy or a dict."
        )
    return device_text


_SIGNATURE = inspect.signature(LoadRequest)
_PARAMETERS = {
    name: p for name, p in _SIGNATURE.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY
}
