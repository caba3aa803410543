"""What a decoder layer's call hands to the graphs of the stack, and what those graphs read.

:mod:`xpukit.loading.training.layer_graphs` runs the stack of decoder layers as one captured graph;
each layer hands over the arguments the decoder gave it. Here:

* :func:`flatten`: those arguments as graph inputs (one per distinct tensor: each layer type's mask
  and position embeddings), a template per layer to rebuild the call, and the signature a replay
  must match (shapes, dtypes, plain values with their types);
* :func:`outputs_recorded`: whether transformers records layer outputs through hooks in this
  forward (``output_hidden_states`` and the like), which replayed layers cannot feed;
* :class:`Watch`: the storage and adapter state the captured graphs depend on, to drop them when a
  merge, move or adapter switch changes it.

docs/layer-graphs.md "CUDA graphs of the decoder layers".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias, cast

if TYPE_CHECKING:
    import torch
    from transformers import Cache

__all__ = [
    "NO_CACHE",
    "Call",
    "LayerForward",
    "Signature",
    "Unsupported",
    "Watch",
    "fill",
    "fill_call",
    "flatten",
    "given_cache",
    "outputs_recorded",
]

# One layer call's (positional arguments after the hidden states, keyword arguments): tensors, the
# KV cache, plain values, whatever the decoder hands its layers; passed on, read only by name.
Call: TypeAlias = tuple[tuple[object, ...], dict[str, object]]
# What a replay must match, as nested tuples of shapes, dtypes and plain values (hashable).
Signature: TypeAlias = tuple[object, ...]
# A decoder layer's forward over the hidden states and the decoder's arguments: the next hidden
# states (a tuple that starts with them in transformers before 4.54, which the graphs refuse).
LayerForward: TypeAlias = Callable[..., "torch.Tensor"]


class _Collector(Protocol):
    """transformers' context variable of the outputs being recorded."""

    def get(self) -> object: ...


def outputs_recorded() -> bool:
    """Whether transformers is recording outputs of this forward through module hooks
    (``output_hidden_states``, attentions, router logits; from the call or the config): the hooks of
    a replayed layer do not run, and a handing-over layer's output is the stack's input."""
    collector = _collector()
    return collector is not None and bool(collector.get())


@functools.cache
def _collector() -> _Collector | None:
    """transformers' context variable of the outputs being recorded (looked up once), or ``None`` for a
    transformers without it (it records by return values)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return cast("_Collector", _active_collector)


# Each tensor's (address, requires_grad); each LoRA module's (merged, disabled, active) adapters.
_WatchState: TypeAlias = tuple[
    tuple[tuple[int, bool], ...], tuple[tuple[tuple[str, ...], bool, tuple[str, ...]], ...]
]


class Watch:
    """What the captured graphs read by address, and the adapter state they were captured in: every
    parameter's and buffer's storage (a merge, unmerge or move replaces them), which parameters are
    trained, and each LoRA module's merged / disabled / active-adapter flags. The objects are listed
    once, at capture; each training call only reads them (36 layers of a tiny LoRA Qwen3 on the
    CPU: 0.28 ms a call, against 11 ms for walking the module tree each time)."""

    def __init__(self, layers: Sequence[torch.nn.Module]) -> None:
        self.tensors: list[torch.Tensor] = [
            t for layer in layers for t in (*layer.parameters(), *layer.buffers())
        ]
        # peft's LoRA layers (their merged / disabled / active-adapter flags)
        self.adapters: list[torch.nn.Module] = [
            m for layer in layers for m in layer.modules() if hasattr(m, "merged_adapters")
        ]
        self.state = self.read()

    def read(self) -> _WatchState:
        storage = tuple((t.data_ptr(), t.requires_grad) for t in self.tensors)
        flags = tuple(
            (tuple(m.merged_adapters), m.disable_adapters, tuple(m.active_adapters)) for m in self.adapters
        )
        return storage, flags

    def changed(self) -> bool:
        return self.read() != self.state


class Unsupported(Exception):
    """A layer argument the graphs cannot carry (the message is the eager reason)."""


# Layer arguments the captured stack leaves out: training passes have no KV cache to fill. The cache
# is ``cache=`` from transformers 5.25 (``past_key_values=`` before, still accepted until 5.40).
NO_CACHE = {"cache": None, "past_key_values": None, "past_key_value": None, "use_cache": False}


def given_cache(kwargs: Mapping[str, object]) -> Cache | None:
    """The KV cache a model or layer call was given, under either of transformers' names."""
    cache = kwargs.get("cache")
    return cast("Cache | None", cache if cache is not None else kwargs.get("past_key_values"))


def flatten(calls: list[Call]) -> tuple[list[torch.Tensor], list[Call], Signature]:
    """The layers' arguments as graph inputs: (the distinct tensors, one template per layer with
    each tensor replaced by its input's index, the signature of shapes, dtypes and plain values
    that a replay must match). A tensor several layers share (the mask and position embeddings of
    one layer type) is one input."""
    import torch

    inputs: list[torch.Tensor] = []
    index: dict[int, int] = {}

    def visit(value: object) -> tuple[object, object]:
        if isinstance(value, torch.Tensor):
            if value.requires_grad:  # the graphs return a gradient for the stack's input only
                raise Unsupported("a layer argument besides the hidden states that requires grad")
            if id(value) not in index:
                index[id(value)] = len(inputs)
                inputs.append(value)
            i = index[id(value)]
            return _Input(i), ("tensor", i, tuple(value.shape), value.dtype)
        if isinstance(value, (tuple, list)):
            parts = [visit(v) for v in value]
            return type(value)(p[0] for p in parts), (type(value).__name__, *(p[1] for p in parts))
        if value is None or isinstance(value, (bool, int, float, str)):
            return value, (type(value).__name__, value)  # True, 1 and 1.0 are different calls
        raise Unsupported(f"a layer argument of type {type(value).__name__}")

    templates: list[Call] = []
    signature: list[Signature] = []
    for args, kwargs in calls:
        kept = {k: v for k, v in kwargs.items() if k not in NO_CACHE}
        arg_parts = [visit(a) for a in args]
        kwarg_parts = {k: visit(v) for k, v in sorted(kept.items())}
        call_kwargs = {k: p[0] for k, p in kwarg_parts.items()} | {
            k: v for k, v in NO_CACHE.items() if k in kwargs
        }
        templates.append((tuple(p[0] for p in arg_parts), call_kwargs))
        signature.append((tuple(p[1] for p in arg_parts), tuple((k, p[1]) for k, p in kwarg_parts.items())))
    return inputs, templates, tuple(signature)


class _Input(int):
    """A graph input's index inside a layer's argument template."""


def fill(template: object, values: Sequence[torch.Tensor]) -> object:
    """``template`` with every :class:`_Input` replaced by its value."""
    if isinstance(template, _Input):
        return values[template]
    if isinstance(template, dict):
        return {k: fill(v, values) for k, v in template.items()}
    if isinstance(template, (tuple, list)):
        return type(template)(fill(v, values) for v in template)
    return template


def fill_call(template: Call, values: Sequence[torch.Tensor]) -> Call:
    """A layer call's template (:func:`flatten`) with its graph inputs filled in."""
    args, kwargs = template
    return tuple(fill(v, values) for v in args), {k: fill(v, values) for k, v in kwargs.items()}
