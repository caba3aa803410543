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
from typing import Any

__all__ = ["NO_CACHE", "Call", "Unsupported", "Watch", "fill", "flatten", "given_cache", "outputs_recorded"]

# One layer call's (positional arguments after the hidden states, keyword arguments).
Call = tuple[tuple[Any, ...], dict[str, Any]]


def outputs_recorded() -> bool:
    """Whether transformers is recording outputs of this forward through module hooks
    (``output_hidden_states``, attentions, router logits; from the call or the config): the hooks of
    a replayed layer do not run, and a handing-over layer's output is the stack's input."""
    collector = _collector()
    return collector is not None and bool(collector.get())


@functools.cache
def _collector() -> Any:
    """transformers' context variable of the outputs being recorded (looked up once), or ``None`` for a
    transformers without it (it records by return values)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector


class Watch:
    """What the captured graphs read by address, and the adapter state they were captured in: every
    parameter's and buffer's storage (a merge, unmerge or move replaces them), which parameters are
    trained, and each LoRA module's merged / disabled / active-adapter flags. The objects are listed
    once, at capture; each training call only reads them (36 layers of a tiny LoRA Qwen3 on the
    CPU: 0.28 ms a call, against 11 ms for walking the module tree each time)."""

    def __init__(self, layers: list[Any]) -> None:
        self.tensors = [t for layer in layers for t in (*layer.parameters(), *layer.buffers())]
        self.adapters = [m for layer in layers for m in layer.modules() if hasattr(m, "merged_adapters")]
        self.state = self.read()

    def read(self) -> tuple[Any, ...]:
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


def given_cache(kwargs: dict[str, Any]) -> Any:
    """The KV cache a model or layer call was given, under either of transformers' names."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def flatten(
    calls: list[Call],
) -> tuple[list[Any], list[Any], tuple[Any, ...]]:
    """The layers' arguments as graph inputs: (the distinct tensors, one template per layer with
    each tensor replaced by its input's index, the signature of shapes, dtypes and plain values
    that a replay must match). A tensor several layers share (the mask and position embeddings of
    one layer type) is one input."""
    import torch

    inputs: list[Any] = []
    index: dict[int, int] = {}

    def visit(value: Any) -> tuple[Any, Any]:
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

    templates, signature = [], []
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


def fill(template: Any, values: tuple[Any, ...]) -> Any:
    """``template`` with every :class:`_Input` replaced by its value."""
    if isinstance(template, _Input):
        return values[template]
    if isinstance(template, dict):
        return {k: fill(v, values) for k, v in template.items()}
    if isinstance(template, (tuple, list)):
        return type(template)(fill(v, values) for v in template)
    return template
