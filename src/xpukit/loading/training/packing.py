"""No compute on padding: a padded training batch runs through the decoder as its real tokens only.

:func:`install_packing` wraps the forward of the decoder (``model.model``, the stack of layers under
the causal LM head) on the instance, under peft's wrappers, the causal LM's loss and any library
that patches the head (liger-kernel's fused loss, xpukit's chunked loss, TRL's fused LM head): the
user's collator, the labels and the loss are untouched (docs/training-plan.md "Packing: no compute on
padding"). A training call whose batch is ``[B, L]`` with a 2-D ``attention_mask`` (any mix of right
and left padding) runs the layers on one row of the real tokens:

* the tokens where the mask is 1, example after example; ``position_ids`` restart at 0 for each
  example and no mask is passed, so transformers builds a causal mask per example from the
  positions (SDPA, eager and flex attention; the flash-attention kernels run them as
  variable-length batches). With rotary positions an example computes exactly what it computes
  alone. With ``varlen`` (the ``packed_attention`` decision) the call also gets the examples'
  boundaries and the ``xpukit_varlen`` attention builds no mask (:mod:`.varlen_attention`);
* the row is padded at its end to a multiple of ``bucket`` tokens (positions of their own, so the
  tail is a separate sequence nobody attends to): steps then take one of a few shapes, and the
  graphs of the layers (``layer_graphs``) replay instead of running eagerly; once the graphs hold
  all the shapes they keep, a row whose bucket is not among them takes the shortest captured shape
  that holds it (:func:`padded_length`);
* the last hidden states go back to the batch's ``[B, L, H]`` layout, zeros at the padding, so the
  head, the loss over the labels, ``num_items_in_batch`` and whatever reads the logits see the
  shapes they expect. The loss is the padded batch's loss over the same targets; only a target
  predicted from a padding position (left padding without masked labels) differs, as it was
  computed from padding before.

A batch of several rows without padding (no mask, or a mask of ones) runs as it is: there is nothing
to remove, and its rows keep plain causal attention, which SDPA runs with its flash kernel, where a
packed row needs a per-example mask. A batch that arrives already flattened (one row,
``position_ids``, no mask: TRL's ``padding_free=True`` or ``DataCollatorWithFlattening``) is only
padded to its bucket. Everything
else runs unchanged and is counted with its reason in :attr:`Packing.passed`: evaluation and
``generate``, a KV cache, a mask that is not one run of ones per row, position ids with a padded
batch, per-layer outputs.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol, TypeAlias, cast

from xpukit.loading.training.layer_calls import given_cache
from xpukit.loading.training.packing_rows import (
    example_groups,
    example_lengths,
    padded_length,
    tensor_arg,
    token_groups,
    tokens_arg,
)
from xpukit.loading.training.varlen_attention import boundaries, run_packed

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PreTrainedModel
    from transformers.utils import ModelOutput

__all__ = ["CapturedShapes", "Packing", "install_packing", "padded_length", "token_groups"]

# The decoder's forward (``model.model``): keyword arguments in, a ``ModelOutput`` with
# ``last_hidden_state`` out (``BaseModelOutputWithPast``, or its mixture-of-experts sibling).
DecoderForward: TypeAlias = Callable[..., "ModelOutput"]


class CapturedShapes(Protocol):
    """What packing reads of the layers' graphs (:class:`.layer_graphs.LayerGraphs`)."""

    def captured_tokens(self) -> list[int]: ...

    def full(self) -> bool: ...

    def eager_inside(self, why: str) -> contextlib.AbstractContextManager[None]: ...


_MARK = "_xpukit_packing"
_OUTPUT_FLAGS = ("output_attentions", "output_hidden_states")


class Packing:
    """The packing wrapper of one decoder and what it did.

    Attributes:
        bucket: the packed row is padded to a multiple of this many tokens (1: not padded), or to a
            captured shape (:func:`padded_length`).
        graphs: the layers' graphs (``LayerGraphs``: its ``captured_tokens()`` and ``full()``), or
            ``None`` when the layers run eagerly.
        stats: ``packed`` calls, ``tokens`` (real tokens run), ``padding_removed`` (padding tokens
            of the collator's batches not run through the layers), ``bucket_padding`` (tokens added
            to reach a bucket), ``flattened_input`` (calls that arrived already flattened), ``varlen``
            (decoder calls given the row's boundaries for varlen attention).
        varlen: each packed row's decoder call gets its examples' boundaries
            (:func:`.varlen_attention.run_packed`): the ``xpukit_varlen`` attention needs no mask.
        passed: calls that ran unchanged, counted by reason.
    """

    def __init__(
        self,
        forward: DecoderForward,
        *,
        bucket: int,
        pad_id: int,
        graphs: CapturedShapes | None = None,
        max_tokens: int | None = None,
        varlen: bool = False,
    ) -> None:
        self.forward = forward
        self.varlen = varlen
        self.bucket = max(int(bucket), 1)
        self.pad_id = pad_id
        self.graphs = graphs
        self.max_tokens = max_tokens
        # Capture a bucket only once it recurs: on first sight a row takes a captured shape that holds
        # it (docs/layer-graphs.md "What a capture costs"); the buckets seen so far, counted.
        self.capture_on_recurrence = False
        self.seen: Counter[int] = Counter()
        self.stats: Counter[str] = Counter()
        self.passed: Counter[str] = Counter()

    def __call__(self, *args: object, **kwargs: object) -> ModelOutput:
        import torch

        why = self._why_not(args, kwargs) if torch.is_grad_enabled() else "no grad (evaluation, generate)"
        if why is not None:
            self.passed[why] += 1
            return self.forward(*args, **kwargs)
        if kwargs.get("attention_mask") is None and kwargs.get("position_ids") is not None:
            return self._bucketed(kwargs)
        return self._packed(kwargs)

    def _why_not(self, args: tuple[object, ...], kwargs: Mapping[str, object]) -> str | None:
        if args:
            return "positional arguments"
        mask, positions = tensor_arg(kwargs, "attention_mask"), tensor_arg(kwargs, "position_ids")
        cache = given_cache(kwargs)
        tokens = tokens_arg(kwargs)
        if tokens is None or tokens.dim() != (2 if kwargs.get("input_ids") is not None else 3):
            return "no [batch, length] input"
        if cache is not None and cache.get_seq_length() > 0:
            return "a filled KV cache"
        if any(kwargs.get(flag) for flag in _OUTPUT_FLAGS):
            return "per-layer outputs asked for"
        if mask is not None and (mask.dim() != 2 or tuple(mask.shape) != tuple(tokens.shape[:2])):
            return "an attention mask that is not [batch, length]"
        if positions is not None and (mask is not None or tokens.shape[0] != 1):
            return "position_ids given with a padded batch"
        return None

    def _packed(self, kwargs: dict[str, object]) -> ModelOutput:
        import torch

        mask, tokens = tensor_arg(kwargs, "attention_mask"), tokens_arg(kwargs)
        assert tokens is not None  # _why_not let only a call with tokens through
        batch, length = tokens.shape[:2]
        keep = torch.ones(batch, length, dtype=torch.bool) if mask is None else mask.detach().to("cpu") != 0
        if batch > 1 and bool(keep.all()):
            # No padding: nothing to remove, and the rows keep the causal attention without a mask
            # (SDPA's flash kernel), where a packed row needs a per-example mask.
            self.passed["no padding: the rows run as they are"] += 1
            if kwargs.get("use_cache") is None:  # a training pass fills no cache (as packed calls)
                kwargs = {**kwargs, "use_cache": False}
            return self.forward(**kwargs)
        lengths = keep.sum(1)
        starts = keep.to(torch.int8).argmax(1)
        span = torch.arange(length)
        if not torch.equal((span >= starts[:, None]) & (span < (starts + lengths)[:, None]), keep):
            self.passed["an attention mask with gaps (not one run of ones per row)"] += 1
            return self.forward(**kwargs)
        index = keep.flatten().nonzero().squeeze(1)
        lengths = lengths[lengths > 0]
        total = int(index.numel())
        firsts = torch.cumsum(lengths, 0) - lengths
        positions = torch.arange(total) - torch.repeat_interleave(firsts, lengths)
        index_dev = index.to(tokens.device, non_blocking=True)
        flat = tokens.flatten(0, 1).index_select(0, index_dev)
        positions = positions.to(tokens.device, non_blocking=True)
        sizes = lengths.tolist()
        groups = example_groups(sizes, self.max_tokens)
        if len(groups) > 1:
            out, hidden = self._split(kwargs, flat, positions, groups)
        else:
            out = self._run(kwargs, flat, positions, sizes)
            hidden = out.last_hidden_state[0, :total]
        self.stats["padding_removed"] += batch * length - total
        full = hidden.new_zeros(batch * length, hidden.shape[-1]).index_copy(0, index_dev, hidden)
        out["last_hidden_state"] = full.view(batch, length, -1)
        return out

    def _split(
        self, kwargs: dict[str, object], flat: torch.Tensor, positions: torch.Tensor, groups: list[list[int]]
    ) -> tuple[ModelOutput, torch.Tensor]:
        """A row over the token budget, run as passes of whole examples (``groups``: the examples'
        lengths of each), each checkpointed: its activations are dropped after its forward and recomputed in
        backward one pass at a time, so no more than one pass's activations are held (docs/training-plan.md
        "A token budget per pass"). The passes run eagerly, each layer as the plan's rung has it."""
        import torch
        from torch.utils.checkpoint import checkpoint

        why = f"a step over the token budget of {self.max_tokens}, split by tokens"
        graphs = self.graphs

        def one(part: torch.Tensor, where: torch.Tensor, sizes: list[int]) -> torch.Tensor:
            if graphs is None:
                return self._run(kwargs, part, where, sizes, pad=False).last_hidden_state
            with graphs.eager_inside(why):
                return self._run(kwargs, part, where, sizes, pad=False).last_hidden_state

        from transformers.modeling_outputs import BaseModelOutputWithPast

        outs, start = [], 0
        for sizes in groups:
            size = sum(sizes)
            part, where = flat[start : start + size], positions[start : start + size]
            outs.append(checkpoint(one, part, where, sizes, use_reentrant=False)[0, :size])
            start += size
        self.stats["split_steps"] += 1
        self.stats["split_passes"] += len(groups)
        hidden = torch.cat(outs)
        return BaseModelOutputWithPast(last_hidden_state=hidden[None]), hidden

    def _bucketed(self, kwargs: dict[str, object]) -> ModelOutput:
        """A batch already flattened by the collator: only padded to the bucket."""
        tokens, positions = tokens_arg(kwargs), tensor_arg(kwargs, "position_ids")
        assert tokens is not None and positions is not None  # as __call__ and _why_not found them
        total = int(tokens.shape[1])
        self.stats["flattened_input"] += 1
        lengths = example_lengths(positions) if self.varlen else [total]
        out = self._run(kwargs, tokens[0], positions.reshape(-1), lengths)
        out["last_hidden_state"] = out.last_hidden_state[:, :total]
        return out

    def _run(
        self,
        kwargs: dict[str, object],
        tokens: torch.Tensor,
        positions: torch.Tensor,
        lengths: list[int],
        *,
        pad: bool = True,
    ) -> ModelOutput:
        """The decoder over one packed row of examples of ``lengths`` (``pad``: to its bucket, for the
        graphs), given the row's boundaries with varlen attention."""
        import torch

        total = int(tokens.shape[0])
        graphs = self.graphs
        captured = graphs.captured_tokens() if graphs is not None else ()
        full = graphs is not None and graphs.full()
        extra = 0
        if pad:
            bucket = -(-total // self.bucket) * self.bucket
            seen = self.seen[bucket] if self.capture_on_recurrence else None
            self.seen[bucket] += 1
            extra = padded_length(total, captured, self.bucket, full=full, seen=seen) - total
        if extra:
            filler = (
                tokens.new_full((extra,), self.pad_id)
                if tokens.dim() == 1
                else tokens.new_zeros(extra, tokens.shape[1])
            )
            tokens = torch.cat([tokens, filler])
            positions = torch.cat(
                [positions, torch.arange(extra, device=positions.device, dtype=positions.dtype)]
            )
        rest = {
            k: v
            for k, v in kwargs.items()
            if k
            not in (
                "input_ids",
                "inputs_embeds",
                "attention_mask",
                "position_ids",
                "past_key_values",
                "cache",
            )
        }
        rest["use_cache"] = False  # a cache would turn transformers' per-example masks off
        name = "input_ids" if tokens.dim() == 1 else "inputs_embeds"
        call = {name: tokens[None], "position_ids": positions[None], "attention_mask": None, **rest}
        if self.varlen:
            cu = boundaries([*lengths, extra] if extra else lengths).to(tokens.device, non_blocking=True)
            out = cast("ModelOutput", run_packed(self.forward, cu, total + extra, **call))
            self.stats["varlen"] += 1
        else:
            out = self.forward(**call)
        self.stats["packed"] += 1
        self.stats["tokens"] += total
        self.stats["bucket_padding"] += extra
        return out


def _decoder(model: PreTrainedModel | PeftModel) -> torch.nn.Module | None:
    """The decoder whose forward is packed (``model.model`` of a causal LM), or ``None``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(base, "model", None)
    return decoder if getattr(decoder, "layers", None) is not None else None


def install_packing(
    model: PreTrainedModel | PeftModel,
    *,
    bucket: int = 1,
    graphs: CapturedShapes | None = None,
    max_tokens: int | None = None,
    varlen: bool = False,
) -> str:
    """Wrap the decoder under ``model`` (a PeftModel or a transformers causal LM) with
    :class:`Packing`; returns a note. ``model.xpukit_packing`` is the wrapper (``stats``, ``passed``).
    ``graphs``: the layers' ``LayerGraphs``, whose captured shapes a row takes once they are full
    (:func:`padded_length`). ``max_tokens``: the plan's token budget per pass (a row with more is
    split, :func:`token_groups`). ``varlen``: each packed row's decoder call gets its boundaries for
    the ``xpukit_varlen`` attention (:func:`.varlen_attention.use_varlen` sets it)."""
    decoder = _decoder(model)
    if decoder is None:
        return "packing: not installed (no decoder with layers under the model's head)"
    forward = decoder.forward
    if getattr(forward, _MARK, None) is not None:
        model.xpukit_packing = getattr(forward, _MARK)
        return "packing already installed"
    config = (
        decoder.config.get_text_config() if hasattr(decoder.config, "get_text_config") else decoder.config
    )
    pad_id = next(
        (
            int(v)
            for v in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None))
            if isinstance(v, int) and v >= 0
        ),
        0,
    )
    packing = Packing(
        forward, bucket=bucket, pad_id=pad_id, graphs=graphs, max_tokens=max_tokens, varlen=varlen
    )

    @functools.wraps(forward)
    def packed(*args: object, **kwargs: object) -> ModelOutput:
        return packing(*args, **kwargs)

    setattr(packed, _MARK, packing)
    decoder.forward = packed
    model.xpukit_packing = packing
    tail = f", the row padded to a multiple of {packing.bucket} tokens" if packing.bucket > 1 else ""
    if max_tokens:
        tail += f", a row over {max_tokens:,} tokens split by tokens into passes of whole examples"
    if varlen:
        tail += ", its examples' boundaries given to the attention (varlen_attn, no mask)"
    return (
        "packing: the decoder layers run a padded training batch as one row of its real tokens, positions "
        f"restarting per example{tail} (model.xpukit_packing.stats)"
    )
