"""CUDA graphs of the decoder layers for LoRA training: the host's Python leaves the training step.

A 4-bit LoRA step of 2 048 tokens on an 8B model is bound by the host, not the device: on an H200
the device was busy 31 % of the step (docs/benchmarks.md, QLoRA section), the rest is Python
launching some 6 000 kernels one by one (autograd, peft, the fused functions, Triton's launcher).
:func:`install_layer_graphs` captures every decoder layer's forward and backward as CUDA graphs
(``torch.cuda.make_graphed_callables``, all layers in one call so they share one memory pool) and
replays them; the step then costs what the device needs (4 995 → 13 043 tokens/s, measured there).

How it stays correct (docs/training.md "CUDA graphs of the decoder layers"):

* Each layer's ``forward`` is wrapped on the instance (module names, saved adapters and merging are
  unchanged). A model call replays the graphs only when it matches the captured one: grad enabled,
  training mode, no attention mask (unpadded sequences: SDPA runs causal), no filled KV cache, the
  same input shape, dtype, autocast state and ``requires_grad``. Anything else (evaluation,
  ``generate``, padded batches, another shape) runs the layers eagerly, counted in :attr:`stats`.
* The graphs capture the second call of one shape (the first runs eagerly and warms the kernels'
  autotuning); one shape is kept, so the graphs' memory is one step's activations, as eagerly.
* The capture runs on stand-in parameters: every trainable parameter of the layers is swapped, for
  the capture only, for a new leaf sharing its storage, and the gradients the graphs give those
  leaves are added to the real parameters' ``.grad`` (a post-accumulate hook). An autograd graph of
  an earlier step that is still referenced (a loop that keeps last step's ``loss`` while the next
  forward runs) keeps the real parameters' gradient accumulators, made on the default stream; a
  capture through them has to wait for the default stream, which invalidates it (seen on an H200:
  ``cudaErrorStreamCaptureInvalidated``). The optimizer updates the shared storage in place, so the
  graphs read the current values.
* A graph's buffers hold one pass at a time: a second forward before the first one's backward (two
  forwards, one backward) runs eagerly, as does everything while that first pass is alive. A pass
  whose outputs are dropped without backward frees the graphs for the next one.
* Only the layers are captured; embeddings, the final norm, the loss and the optimizer stay eager.
  A capture that fails turns the graphs off for this model, with a warning and the reason in
  :attr:`LayerGraphs.failed`.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections import Counter
from typing import Any

__all__ = ["LayerGraphs", "install_layer_graphs"]

logger = logging.getLogger(__name__)


class LayerGraphs:
    """The decoder layers of one model and their CUDA graphs (one captured shape).

    Attributes:
        stats: passes run as graphs (``graphed``), eagerly (``eager``), and ``captures``.
        eager_reasons: why passes ran eagerly, counted.
        failed: why capturing failed (graphs are then off for this model), else ``None``.
        key: the captured call's shape, dtype, autocast state and input ``requires_grad``.
    """

    def __init__(self, layers: list[Any]) -> None:
        self.layers = layers
        self.forwards = [layer.forward for layer in layers]
        self.stats: Counter[str] = Counter()
        self.eager_reasons: Counter[str] = Counter()
        self.failed: str | None = None
        self.key: tuple[Any, ...] | None = None
        self._runs: list[Any] | None = None
        self._seen: tuple[Any, ...] | None = None
        self._active = False
        self._pending = False
        self._last_out: Any = None

    # ---- one model call: decided at layer 0, followed by the others
    def _why_eager(
        self, hidden: Any, mask: Any, cache: Any, rotary: Any, kwargs: dict[str, Any]
    ) -> str | None:
        import torch

        if self.failed is not None:
            return "capture failed"
        if not torch.is_grad_enabled() or not self.layers[0].training:
            return "no grad or eval mode"
        if mask is not None:
            return "an attention mask (padded batch)"
        if cache is not None and cache.get_seq_length() > 0:
            return "a filled KV cache"
        if rotary is None or hidden.device.type != "cuda":
            return "not a CUDA call with position embeddings"
        if kwargs.get("output_attentions"):
            return "output_attentions"
        if getattr(self.layers[0], "gradient_checkpointing", False):
            return "gradient checkpointing"
        if self._pending and self._alive():
            return "a forward before the previous one's backward"
        return None

    def _alive(self) -> bool:
        """Whether the previous grad-enabled pass's autograd graph is still referenced."""
        return self._last_out is not None and self._last_out() is not None

    def _call_key(self, hidden: Any) -> tuple[Any, ...]:
        import torch

        autocast = torch.is_autocast_enabled("cuda")
        return (
            tuple(hidden.shape), hidden.dtype, hidden.device, hidden.requires_grad, autocast,
            torch.get_autocast_dtype("cuda") if autocast else None,
        )  # fmt: skip

    def _start(self, hidden: Any, mask: Any, cache: Any, rotary: Any, kwargs: dict[str, Any]) -> None:
        why = self._why_eager(hidden, mask, cache, rotary, kwargs)
        key = self._call_key(hidden) if why is None else None
        if why is None and self._runs is None and key is not None:
            if self._seen != key:
                self._seen = key
                why = "first call of this shape (captured on the next)"
            else:
                self._capture(hidden, rotary, key)
                if self._runs is None:
                    why = "capture failed"
        if why is None and key != self.key:
            why = "another shape, dtype or autocast state than the captured one"
        self._active = why is None
        if why is not None:
            self.stats["eager"] += 1
            self.eager_reasons[why] += 1
        else:
            self.stats["graphed"] += 1
            self._pending = True

    def _capture(self, hidden: Any, rotary: tuple[Any, Any], key: tuple[Any, ...]) -> None:
        import torch

        cos, sin = (t.detach().clone() for t in rotary)
        autocast = torch.is_autocast_enabled("cuda")
        dtype = torch.get_autocast_dtype("cuda") if autocast else hidden.dtype

        class Inner(torch.nn.Module):  # type: ignore[misc]
            def __init__(self, layer: Any, forward: Any) -> None:
                super().__init__()
                self.layer = layer  # its parameters are the graph's trainable inputs
                self._forward = forward

            def forward(self, h: Any, c: Any, s: Any) -> Any:
                return self._forward(h, attention_mask=None, position_embeddings=(c, s), use_cache=False)

        samples = tuple(
            (torch.randn(hidden.shape, device=hidden.device, dtype=hidden.dtype)
             .requires_grad_(i > 0 or hidden.requires_grad), cos, sin)
            for i in range(len(self.layers))
        )  # fmt: skip
        swapped = _stand_ins(self.layers)
        try:
            with torch.autocast("cuda", dtype=dtype, enabled=autocast, cache_enabled=False):
                runs = torch.cuda.make_graphed_callables(
                    tuple(Inner(layer, fwd) for layer, fwd in zip(self.layers, self.forwards, strict=True)),
                    samples,
                )
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "CUDA graphs of the decoder layers failed (%s); the layers run eagerly. After a failed "
                "capture torch may leave CUDA's random generator in capture mode: if CUDA random ops "
                "then fail ('Offset increment outside graph capture'), restart with "
                "lora={'graphs': False}",
                self.failed,
            )
            return
        finally:
            for module, name, real, _ in swapped:
                module._parameters[name] = real
        for _, _, real, stand_in in swapped:
            stand_in.register_post_accumulate_grad_hook(functools.partial(_add_to, real))
        self._runs, self.key = list(runs), key
        self.stats["captures"] += 1

    def forward(self, index: int, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        """Layer ``index``'s forward: a graph replay when this call is graphed, else the layer's own."""
        mask = kwargs.get("attention_mask", args[0] if args else None)
        rotary = kwargs.get("position_embeddings")
        if index == 0:
            self._start(hidden_states, mask, kwargs.get("past_key_values"), rotary, kwargs)
        if not self._active or mask is not None or self._runs is None or rotary is None:
            out = self.forwards[index](hidden_states, *args, **kwargs)
            if index == len(self.layers) - 1 and getattr(out, "requires_grad", False):
                self._remember(out)  # a pass with an autograd graph
            return out
        out = self._runs[index](hidden_states, *rotary)
        if index == 0 and out.requires_grad:
            out.register_hook(self._backward_reached_first_layer)
        if index == len(self.layers) - 1:
            self._remember(out)
        return out

    def _remember(self, out: Any) -> None:
        """Keep a weak reference to a pass's last output: alive while that pass's graph is."""
        first = out[0] if isinstance(out, tuple) else out
        self._last_out = weakref.ref(first) if hasattr(first, "grad_fn") else None

    def _backward_reached_first_layer(self, grad: Any) -> None:
        self._pending = False


def _stand_ins(layers: list[Any]) -> list[tuple[Any, str, Any, Any]]:
    """Swap every trainable parameter of ``layers`` for a new leaf on the same storage; returns
    ``(module, name, real, stand_in)`` for putting them back."""
    import torch

    swapped = []
    for layer in layers:
        for module in layer.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and param.requires_grad:
                    stand_in = torch.nn.Parameter(param.detach(), requires_grad=True)
                    module._parameters[name] = stand_in
                    swapped.append((module, name, param, stand_in))
    return swapped


def _add_to(real: Any, stand_in: Any) -> None:
    """A stand-in's gradient goes to its real parameter (then the stand-in holds none)."""
    grad, stand_in.grad = stand_in.grad, None
    if real.grad is None:
        real.grad = grad
    else:
        real.grad.add_(grad)


def install_layer_graphs(model: Any) -> str:
    """Wrap the decoder layers' ``forward`` of ``model`` (a PeftModel or transformers model) so that
    matching training calls replay CUDA graphs; returns a note. ``model.xpukit_layer_graphs`` is the
    :class:`LayerGraphs` (its ``stats`` say how many passes ran as graphs)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(base, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None or not len(layers) or getattr(decoder, "rotary_emb", None) is None:
        return "CUDA graphs of the decoder layers: not installed (no model.layers with rotary embeddings)"
    graphs = LayerGraphs(list(layers))
    for index, layer in enumerate(layers):
        layer.forward = functools.partial(graphs.forward, index)
    model.xpukit_layer_graphs = graphs
    return (
        f"CUDA graphs of the {len(layers)} decoder layers: forward and backward captured on the second "
        "training call of one shape, replayed for matching calls (model.xpukit_layer_graphs.stats)"
    )
