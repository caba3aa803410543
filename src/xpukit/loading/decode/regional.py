"""Regional compilation of the decode step: one decoder layer compiled, its code run by every layer.

The whole-step compile traces and compiles every decoder layer of the step: 36 copies of the same
code for Qwen3-8B. torch's regional-compilation recipe compiles each repeated ``nn.Module`` instead:
dynamo keys its cache by the code object and (with ``inline_inbuilt_nn_modules``, torch's default)
treats the layer's parameters as inputs, so the second and later layers hit the first layer's
compiled code (docs/decode-kernels.md "Regional compilation").

What stands in the way in a decoder layer is the cache: the attention calls
``cache.update(key, value, self.layer_idx)``, and the static cache picks the layer's tensors from a
Python list by that index, so a trace through it depends on which layer it is. Here each layer's
call gets a stand-in for the cache, :class:`LayerCache`, that holds only that layer's part of the
static cache (transformers' ``StaticLayer``) and ignores the index: what differs from layer to layer
is then an input of the compiled code (the layer's weights, its cache tensors), not a constant of
the trace. The static cache's tensors are marked unguarded static addresses by transformers (no
identity guard), so a new layer's tensors do not recompile.

:func:`compile_layers` sets the compiled call on every decoder layer (``nn.Module``'s
``_compiled_call_impl``, what ``Module.compile()`` sets), routed through :func:`regional_layers`
only while xpukit's loop runs its decode step; any other call of the layer (the prefill,
transformers' ``generate``, training) runs the layer as before.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Concatenate, ParamSpec

from xpukit.loading.decode.step import decode_step

if TYPE_CHECKING:
    import torch
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    from xpukit.loading.decode.interfaces import DecodeModel

__all__ = ["LayerCache", "compile_layers", "decoder_layers", "regional_layers", "regional_step"]

P = ParamSpec("P")

# The keyword a decoder layer takes its cache by (transformers 5.25 renamed past_key_values).
_CACHE_KEYWORDS = ("cache", "past_key_values")
_ACTIVE = threading.local()


class LayerCache:
    """One decoder layer's part of a static cache, standing in for the whole cache in its call.

    ``update`` is the only method a decoder layer's attention calls; the layer index it passes is
    not read (the part is already this layer's).
    """

    def __init__(self, layer: StaticLayer) -> None:
        self.layer = layer

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's keys and values into this layer's part; returns the whole part."""
        keys_values: tuple[torch.Tensor, torch.Tensor] = self.layer.update(key_states, value_states)
        return keys_values


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder layers of ``model`` (a ``ModuleList`` of one class, each with a
    ``self_attn.layer_idx``), or an empty list where the model has none in a known place."""
    base = getattr(model, "model", model)
    base = getattr(base, "language_model", base)
    layers = getattr(base, "layers", None)
    if layers is None or len(layers) == 0:
        return []
    kinds = {type(layer) for layer in layers}
    attention = [getattr(layer, "self_attn", None) for layer in layers]
    if len(kinds) != 1 or any(not isinstance(getattr(a, "layer_idx", None), int) for a in attention):
        return []
    return list(layers)


def _layer_call(
    layer: torch.nn.Module,
    part: StaticLayer,
    keyword: str,
    args: tuple[object, ...],
    kwargs: dict[str, object],
) -> object:
    """A decoder layer's forward with ``part`` as its cache (what dynamo traces once)."""
    return layer.forward(*args, **{**kwargs, keyword: LayerCache(part)})


def compile_layers(model: torch.nn.Module, options: Mapping[str, object]) -> int:
    """Give every decoder layer of ``model`` a regional compiled call; returns how many layers.

    Args:
        model: the model whose decode step xpukit's loop runs.
        options: ``torch.compile`` keyword arguments (one compiled function for all layers).
    """
    import torch

    layers = decoder_layers(model)
    compiled = torch.compile(_layer_call, **options)
    for layer in layers:
        layer._compiled_call_impl = _Routed(layer, compiled)
    return len(layers)


class _Routed:
    """A layer's ``_compiled_call_impl``: the compiled layer inside :func:`regional_layers`, else
    the layer's own call."""

    def __init__(self, layer: torch.nn.Module, compiled: Callable[..., object]) -> None:
        self.layer = layer
        self.compiled = compiled

    def __call__(self, *args: object, **kwargs: object) -> object:
        cache = getattr(_ACTIVE, "cache", None)
        keyword = next((k for k in _CACHE_KEYWORDS if kwargs.get(k) is cache), None)
        if cache is None or keyword is None:
            return self.layer._call_impl(*args, **kwargs)
        part = cache.layers[self.layer.self_attn.layer_idx]
        return self.compiled(self.layer, part, keyword, args, kwargs)


@contextlib.contextmanager
def regional_layers(cache: StaticCache) -> Iterator[None]:
    """While inside, decoder layers called with ``cache`` run their compiled code."""
    previous = getattr(_ACTIVE, "cache", None)
    _ACTIVE.cache = cache
    try:
        yield
    finally:
        _ACTIVE.cache = previous


def _with_regional_layers(
    step: Callable[Concatenate[DecodeModel, StaticCache, P], None],
) -> Callable[Concatenate[DecodeModel, StaticCache, P], None]:
    """``step`` run with the decoder layers' compiled code in place (the rest eager)."""

    def run(model: DecodeModel, cache: StaticCache, /, *args: P.args, **kwargs: P.kwargs) -> None:
        with regional_layers(cache):
            step(model, cache, *args, **kwargs)

    return run


# :func:`~xpukit.loading.decode.step.decode_step` with the decoder layers' compiled code (the rest eager).
regional_step = _with_regional_layers(decode_step)
