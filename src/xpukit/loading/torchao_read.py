"""Reading a torchao checkpoint without a walk of all its metadata per weight (docs/export.md "To another
machine").

transformers rebuilds each quantized weight of a torchao safetensors checkpoint by calling torchao's
``unflatten_tensor_state_dict`` with that weight's tensors and the metadata of the whole checkpoint;
the function walks every tensor name in the metadata against every metadata entry, so a load does
``weights x names x entries`` prefix tests (40.7 million for the Qwen3-8B shape's 252 weights).
:func:`scoped_unflatten` hands each call the metadata of its own weight only: the same tensors come
back after ``weights x names`` cheap tests instead (the Qwen3-8B shape's 36 layers at tiny widths,
int8, on a 2-core CPU: 3.71 s a load before, 0.69 s after).

The wrapper is in place for the duration of one ``from_pretrained`` and is put back after it, also
when the load fails.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["own_metadata", "scoped_torchao_read", "scoped_unflatten"]

Rebuilt = tuple[dict[str, Any], dict[str, Any]]  # the rebuilt weights, the tensors left over
Unflatten = Callable[[dict[str, Any], dict[str, Any]], Rebuilt]


def own_metadata(tensors: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """The part of a checkpoint's torchao ``metadata`` that describes the weights in ``tensors``.

    torchao stores a weight ``M.weight`` as tensors ``M._weight_<part>`` (a tensor subclass) or as
    ``M.weight`` itself (a plain tensor); ``tensor_names`` lists every weight of the checkpoint.
    """
    names = json.loads(metadata["tensor_names"])
    own = []
    for name in names:
        module, _, attr = name.rpartition(".")
        prefix = f"{module}._{attr}_"
        if name in tensors or any(key.startswith(prefix) for key in tensors):
            own.append(name)
    scoped = {name: metadata[name] for name in own if name in metadata}
    scoped["tensor_names"] = json.dumps(own)
    return scoped


def scoped_unflatten(original: Unflatten) -> Unflatten:
    """``original`` (torchao's ``unflatten_tensor_state_dict``) given only the metadata it needs."""

    def unflatten(tensors_data_dict: dict[str, Any], metadata: dict[str, Any]) -> Rebuilt:
        if not isinstance(metadata, dict) or "tensor_names" not in metadata:
            return original(tensors_data_dict, metadata)  # torchao's own error for a bad checkpoint
        return original(tensors_data_dict, own_metadata(tensors_data_dict, metadata))

    unflatten.__wrapped__ = original  # type: ignore[attr-defined]
    return unflatten


@contextlib.contextmanager
def scoped_torchao_read(active: bool) -> Iterator[bool]:
    """While active, transformers' torchao integration rebuilds each weight from its own metadata.

    Yields whether the wrapper is in place (``False`` when not asked, or when this transformers has no
    such call: then the load runs as transformers wrote it)."""
    if not active:
        yield False
        return
    try:
        from transformers.integrations import torchao as integration
    except ImportError:
        yield False
        return
    original = getattr(integration, "unflatten_tensor_state_dict", None)
    if original is None or getattr(original, "__wrapped__", None) is not None:
        yield False  # absent in this release, or already wrapped by an enclosing load
        return
    integration.unflatten_tensor_state_dict = scoped_unflatten(original)
    try:
        yield True
    finally:
        integration.unflatten_tensor_state_dict = original
