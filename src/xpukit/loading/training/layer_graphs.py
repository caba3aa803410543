"""Device graphs of the decoder layers for LoRA training: the host's Python leaves the training step.

A 4-bit LoRA step of 2 048 tokens on an 8B model is bound by the host: on an H200 the device was
busy 31 % of the step (docs/benchmarks.md, QLoRA section), the rest is Python launching some 6 000
kernels. :func:`install_layer_graphs` captures the decoder layers' forward and backward as graphs
(``torch.cuda.graph``; ``torch.xpu.graph`` on Intel GPUs; :mod:`.graph_capture`) and replays them;
the step then costs what the device needs (4 995 → 13 043 tokens/s, measured there).

How it stays correct, in short (the rules, with what was measured, are in docs/layer-graphs.md "CUDA
graphs of the decoder layers"):

* each layer's ``forward`` is wrapped on the instance; layer 0 decides whether a call may replay,
  every layer hands over its arguments, and the last layer runs the whole stack as one captured
  callable whose graph inputs are every tensor argument (masks and position embeddings of each layer
  type); any other call (evaluation, ``generate``, other attention kernels) runs eagerly, counted in
  :attr:`LayerGraphs.stats`;
* up to ``max_shapes`` shapes share one memory pool and one set of adapter gradients
  (:class:`.graph_capture.SharedGrads`; the per-shape bookkeeping is :mod:`.layer_captures`); passes
  never overlap: a second forward before the first one's backward runs eagerly;
* the first training call runs eagerly, each layer checkpointed; a new shape after it is captured on
  first sight (the first one after a warm-up pass), on stand-in parameters
  (:class:`.graph_capture.StandIns`), with liger-kernel's RoPE where it agrees with the model's own
  (:mod:`.graph_rope`);
* with gradient checkpointing each layer is checkpointed inside the captured stack (the backward
  graph recomputes it); with offloaded checkpointing its input also waits in a pinned host slot the
  graphs copy to and back (:mod:`.graph_offload`);
* only the layers are captured; a capture that fails turns the graphs off for the model, with a
  warning and the reason in :attr:`LayerGraphs.failed`.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from xpukit.loading.training.graph_capture import CaptureBackend
from xpukit.loading.training.layer_calls import Call, Unsupported, flatten, given_cache, outputs_recorded
from xpukit.loading.training.layer_captures import GRAPH_BACKENDS, MAX_SHAPES, LayerCaptures
from xpukit.loading.training.varlen_attention import NAME as VARLEN

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import Cache, PreTrainedModel

__all__ = ["GRAPH_BACKENDS", "MAX_SHAPES", "LayerGraphs", "install_layer_graphs"]

# Attention implementations that take everything they need from the layers' tensor arguments: the
# mask and the rotary tensors, and for packed rows under ``xpukit_varlen`` the row's boundaries (one
# more graph input, of a fixed shape per bucket: varlen_attention.boundaries) and its padded length.
_MASK_ATTENTION = ("sdpa", "eager", VARLEN)
_FIRST_CALL = "first training call (warms lazily built state; shapes are captured from the next)"


class LayerGraphs(LayerCaptures):
    """The decoder layers of one model and their graphs (one per captured shape, kept by
    :class:`.layer_captures.LayerCaptures`): which calls replay, which run eagerly.

    Attributes:
        stats: passes run as graphs (``graphed``), eagerly (``eager``), and ``captures``.
        eager_reasons: why passes ran eagerly, counted.
        failed: why capturing failed (graphs are then off for this model), else ``None``.
        unsupported: why these layers can never replay (seen on an eager pass), else ``None``.
        keys: the captured calls' shapes, dtypes, autocast states and input ``requires_grad``.
        max_shapes: how many shapes are captured at most.
        rope: whether the captures run liger-kernel's RoPE (:class:`.graph_rope.GraphRope`).
    """

    def __init__(
        self,
        layers: list[torch.nn.Module],
        *,
        attention: str = "sdpa",
        backend: CaptureBackend | None = None,
        checkpoint: bool | str = False,
        rope: bool = False,
        checkpoint_layers: int | None = None,
    ) -> None:
        super().__init__(
            layers, backend=backend, checkpoint=checkpoint, rope=rope, checkpoint_layers=checkpoint_layers
        )
        self.attention = attention
        self._forced: str | None = None  # every call runs eagerly, for this reason (eager_inside)
        self.eager_reasons: Counter[str] = Counter()
        self.unsupported: str | None = None  # why these layers never replay (seen on an eager pass)
        self._warm = False
        # A pass to run as a stack: its input, and each layer's arguments.
        self._input: torch.Tensor | None = None
        self._calls: list[Call] = []
        self._active = False
        self._pending = False
        # The last replayed pass's autograd node (or output), while that pass's graph lives.
        self._last_out: weakref.ref[object] | None = None

    # ---- one model call: decided at layer 0, run at the last layer
    def _why_eager(
        self, hidden: torch.Tensor, cache: Cache | None, kwargs: Mapping[str, object]
    ) -> str | None:
        """Why this call cannot replay, from what layer 0 sees (``None``: it may)."""
        import torch

        if self._forced is not None:
            return self._forced
        if self.unsupported is not None:
            return self.unsupported
        if self.failed is not None:
            return "capture failed"
        if not torch.is_grad_enabled() or not self.layers[0].training:
            return "no grad or eval mode"
        if cache is not None and cache.get_seq_length() > 0:
            return "a filled KV cache"
        if kwargs.get("position_embeddings") is None or (
            hidden.device.type not in GRAPH_BACKENDS and self.backend is None
        ):
            return "not a CUDA/XPU call with position embeddings"
        if self.attention not in _MASK_ATTENTION:
            return f"attention {self.attention!r} reads per-call arguments the graphs do not carry"
        if kwargs.get("output_attentions") or outputs_recorded():
            return "hidden states, attentions or router logits recorded from the layers"
        if getattr(self.layers[0], "gradient_checkpointing", False):
            return "gradient checkpointing"
        if self._graphs and self._watch is not None and self._watch.changed():
            self._drop()  # weights moved or merged, or the adapters switched: captured again
            self.eager_reasons["the layers' weights or adapters changed: graphs captured again"] += 1
        if self._pending and self._alive():
            return "a forward before the previous one's backward"
        if not self._warm:
            self._warm = True
            return _FIRST_CALL
        return None

    @contextlib.contextmanager
    def eager_inside(self, why: str) -> Iterator[None]:
        """Every call inside runs eagerly, counted under ``why`` (a pass split by tokens,
        ``loading/training/packing.py``)."""
        before, self._forced = self._forced, why
        try:
            yield
        finally:
            self._forced = before

    def _alive(self) -> bool:
        """Whether the last replayed pass's autograd graph is still referenced."""
        return self._last_out is not None and self._last_out() is not None

    def _eager(self, why: str) -> None:
        self.stats["eager"] += 1
        self.eager_reasons[why] += 1

    def forward(
        self, index: int, hidden_states: torch.Tensor, *args: object, **kwargs: object
    ) -> torch.Tensor:
        """Layer ``index``'s forward. A call that may replay is decided at layer 0; every layer then
        hands over its arguments (its mask and position embeddings, which differ by layer type in
        models with sliding-window layers) and passes the stack's input on, and the last layer runs
        the stack: the captured graph of this shape, or the layers eagerly over what they handed
        over. Any other call runs each layer's own forward."""
        if index == 0:
            why = self._why_eager(hidden_states, given_cache(kwargs), kwargs)
            # The first call's activations would stay cached beside the graphs' pool: checkpointed,
            # it holds only the layers' inputs (its backward recomputes each layer once).
            self._light = why == _FIRST_CALL
            self._active = why is None
            if why is not None:
                self._eager(why)
            else:
                self._input, self._calls = hidden_states, []
        if not self._active:
            out = self._layer(self.forwards[index], hidden_states, args, kwargs, capturing=False, index=index)
            if isinstance(out, tuple) and self.unsupported is None:
                # The stack hands one tensor from layer to layer; a decoder that indexes a tuple
                # would read the wrong thing from it.
                self.unsupported = f"the layers return a {type(out).__name__}, not the hidden states alone"
            return out
        self._calls.append((args, kwargs))
        if index < len(self.layers) - 1:
            return hidden_states  # the stack's input, run at the last layer
        self._active = False
        hidden, calls = self._input, self._calls
        self._input, self._calls = None, []
        assert hidden is not None  # set at layer 0 of this active call
        return self._run_stack(hidden, calls)

    def _run_stack(self, hidden: torch.Tensor, calls: list[Call]) -> torch.Tensor:
        try:
            inputs, templates, signature = flatten(calls)
        except Unsupported as exc:
            return self._stack_eagerly(hidden, calls, str(exc))
        key = self._call_key(hidden, signature)
        if key not in self._graphs:
            if len(self._graphs) >= self.max_shapes:
                return self._stack_eagerly(hidden, calls, f"a shape beyond the {self.max_shapes} captured")
            why = self._capture(hidden, inputs, templates, key, calls)
            if why is not None:
                return self._stack_eagerly(hidden, calls, why)
        self.stats["graphed"] += 1
        self._pending = True
        out = self._graphs[key](hidden, *inputs)
        if out.requires_grad:
            out.register_hook(self._backward_reached_the_stack)
        self._remember(out)
        return out

    def _stack_eagerly(self, hidden: torch.Tensor, calls: list[Call], why: str) -> torch.Tensor:
        """The layers' own forwards over the arguments they handed over (what the decoder's loop
        would have run)."""
        self._eager(why)
        for index, (forward, (args, kwargs)) in enumerate(zip(self.forwards, calls, strict=True)):
            hidden = self._layer(forward, hidden, args, kwargs, capturing=False, index=index)
        return hidden

    def _remember(self, out: torch.Tensor) -> None:
        """Keep a weak reference to a replayed pass's autograd node (the replay's own function),
        alive while that pass's graph is; only replayed passes share buffers, so only they are
        remembered. Not the output tensor: a final norm that casts it to float32 keeps only its
        copy, so the output dies while ``loss`` still holds the pass."""
        node = getattr(out, "grad_fn", None)
        try:
            self._last_out = weakref.ref(node) if node is not None else None
        except TypeError:  # a built-in op's node (not the replay's function) takes no weak reference
            self._last_out = weakref.ref(out)

    def _backward_reached_the_stack(self, grad: torch.Tensor) -> None:
        self._pending = False


def install_layer_graphs(
    model: PreTrainedModel | PeftModel,
    *,
    checkpoint: bool | str = False,
    rope: bool = True,
    checkpoint_layers: int | None = None,
) -> str:
    """Wrap the decoder layers' ``forward`` of ``model`` (a PeftModel or transformers model) so that
    matching training calls replay device graphs; returns a note. ``model.xpukit_layer_graphs`` is
    the :class:`LayerGraphs` (its ``stats`` say how many passes ran as graphs). ``checkpoint``: each
    layer is checkpointed inside the graphs (and on the eager passes) instead of by transformers,
    whose checkpointing flags are turned off here (so ``training_args`` does not ask ``Trainer`` to
    turn them on again). ``rope``: the captures run liger-kernel's RoPE where it agrees with the
    model's own (:mod:`.graph_rope`; ``False`` when the user turned liger off). ``checkpoint_layers``:
    with ``checkpoint=True``, only the first this many layers are checkpointed (the plan's fit)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(base, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None or not len(layers) or getattr(decoder, "rotary_emb", None) is None:
        return "graphs of the decoder layers: not installed (no model.layers with rotary embeddings)"
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    attention = str(getattr(config, "_attn_implementation", None) or "sdpa")
    if checkpoint:
        # transformers' checkpoint would wrap the stack's run in the last layer's call; and a flag left
        # on anywhere (the decoder keeps one) makes training_args ask Trainer to turn it on again.
        for module in base.modules():
            if getattr(module, "gradient_checkpointing", False) is True:
                module.gradient_checkpointing = False
        if getattr(base, "_require_grads_hook", None) is not None:  # only reentrant checkpoints need it
            base.disable_input_require_grads()
    graphs = LayerGraphs(
        list(layers),
        attention=attention,
        checkpoint=checkpoint,
        rope=rope,
        checkpoint_layers=checkpoint_layers,
    )
    for index, layer in enumerate(layers):
        layer.forward = functools.partial(graphs.forward, index)
    model.xpukit_layer_graphs = graphs
    partly = checkpoint is True and checkpoint_layers is not None
    which = f"the first {checkpoint_layers} layers" if partly else "each layer"
    inside = f", {which} checkpointed inside them (the backward graph recomputes it)" if checkpoint else ""
    if checkpoint == "offload":
        inside += ", its input copied to a pinned host slot and back inside the graphs"
    rope_note = "; liger-kernel's RoPE where it agrees with the model's own (.rope.note)" if rope else ""
    return (
        f"graphs of the {len(layers)} decoder layers: forward and backward of the whole stack captured "
        f"per training shape (up to {graphs.max_shapes}, one memory pool) from the second training "
        f"call (the first runs eagerly, each layer checkpointed), replayed for matching calls{inside}"
        f"{rope_note} (model.xpukit_layer_graphs.stats)"
    )
