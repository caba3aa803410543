"""Reading a torchao checkpoint without walks of the whole checkpoint per weight (docs/export.md "To
another machine").

transformers rebuilds each quantized weight of a torchao safetensors checkpoint in three steps that
each cost the size of the whole checkpoint, once per weight:

- it deep-copies the weight's converter, and with it the quantizer that holds the checkpoint's whole
  metadata (about 900 objects a copy for the Qwen3-8B shape, a copy per tensor);
- it checks that metadata with torchao's ``is_metadata_torchao``, which decodes every entry;
- it calls torchao's ``unflatten_tensor_state_dict`` with the whole metadata, which tests every tensor
  name against every entry (40.7 million prefix tests for the 8B shape's 252 weights).

While :func:`scoped_torchao_read` is active, the copies share the quantizer (it is only read), the
check runs once per metadata object, and each weight is rebuilt from its own entries, found through
an index built once. The same tensors come back. The Qwen3-8B shape's 36 layers at tiny widths, int8,
on a 2-core CPU: 3.71 s a load with none of this, 0.21-0.25 s with all of it (as fast as quantizing
the full weights at load).

The patches are in place for the duration of one ``from_pretrained`` and are put back after it, also
when the load fails.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["MetadataIndex", "checked_once", "own_metadata", "scoped_torchao_read", "scoped_unflatten"]

Rebuilt = tuple[dict[str, Any], dict[str, Any]]  # the rebuilt weights, the tensors left over
Unflatten = Callable[[dict[str, Any], dict[str, Any]], Rebuilt]
Check = Callable[[dict[str, Any]], bool]


class MetadataIndex:
    """A checkpoint's torchao ``metadata`` indexed by module: which weights a call's tensors belong to.

    torchao stores a weight ``M.weight`` as tensors ``M._weight_<part>`` (a tensor subclass) or as
    ``M.weight`` itself (a plain tensor); ``tensor_names`` lists every weight of the checkpoint.
    """

    def __init__(self, metadata: dict[str, Any]) -> None:
        self.metadata = metadata
        self.names: list[str] = json.loads(metadata["tensor_names"])
        self.order = {name: i for i, name in enumerate(self.names)}
        self.by_module: dict[str, list[tuple[str, str]]] = {}
        for name in self.names:
            module, _, attr = name.rpartition(".")
            self.by_module.setdefault(module, []).append((name, f"{module}._{attr}_"))

    def own(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """The part of the metadata that describes the weights in ``tensors``."""
        found: set[str] = set()
        for key in tensors:
            if key in self.order:
                found.add(key)
                continue
            for name, prefix in self.by_module.get(key.rpartition(".")[0], ()):
                if key.startswith(prefix):
                    found.add(name)
        own = sorted(found, key=self.order.__getitem__)
        scoped = {name: self.metadata[name] for name in own if name in self.metadata}
        scoped["tensor_names"] = json.dumps(own)
        return scoped


def own_metadata(tensors: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """The part of a checkpoint's torchao ``metadata`` that describes the weights in ``tensors``."""
    return MetadataIndex(metadata).own(tensors)


def scoped_unflatten(original: Unflatten) -> Unflatten:
    """``original`` (torchao's ``unflatten_tensor_state_dict``) given only the metadata it needs; the
    index of one metadata object is built at its first call."""
    indexes: list[MetadataIndex] = []  # few: one per checkpoint read while the wrapper is in place

    def unflatten(tensors_data_dict: dict[str, Any], metadata: dict[str, Any]) -> Rebuilt:
        if not isinstance(metadata, dict) or "tensor_names" not in metadata:
            return original(tensors_data_dict, metadata)  # torchao's own error for a bad checkpoint
        index = next((i for i in indexes if i.metadata is metadata), None)
        if index is None:
            index = MetadataIndex(metadata)
            indexes.append(index)
        return original(tensors_data_dict, index.own(tensors_data_dict))

    unflatten.__wrapped__ = original  # type: ignore[attr-defined]
    return unflatten


def checked_once(original: Check) -> Check:
    """``original`` (torchao's ``is_metadata_torchao``) run once per metadata object it accepts; the
    objects are kept so that an identity stays theirs while the wrapper lives."""
    valid: list[dict[str, Any]] = []

    def check(metadata: dict[str, Any]) -> bool:
        if any(seen is metadata for seen in valid):
            return True
        ok = bool(original(metadata))
        if ok:
            valid.append(metadata)
        return ok

    check.__wrapped__ = original  # type: ignore[attr-defined]
    return check


def _copy_sharing_the_quantizer(self: object, memo: dict[int, Any]) -> object:
    """A converter operation's deep copy that keeps its quantizer (read only while loading)."""
    return copy.copy(self)


@contextlib.contextmanager
def scoped_torchao_read(active: bool) -> Iterator[bool]:
    """While active, transformers' torchao integration reads each weight without whole-checkpoint
    walks (the module's docstring).

    Yields whether the patches are in place (``False`` when not asked, or when this transformers has
    no such calls: then the load runs as transformers wrote it)."""
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
        yield False  # absent in this release, or already patched by an enclosing load
        return
    check = getattr(integration, "is_metadata_torchao", None)
    op = getattr(integration, "TorchAoDeserialize", None)
    share = op is not None and "__deepcopy__" not in vars(op)
    integration.unflatten_tensor_state_dict = scoped_unflatten(original)
    if check is not None:
        integration.is_metadata_torchao = checked_once(check)
    if share:
        op.__deepcopy__ = _copy_sharing_the_quantizer  # type: ignore[union-attr]
    try:
        yield True
    finally:
        integration.unflatten_tensor_state_dict = original
        if check is not None:
            integration.is_metadata_torchao = check
        if share:
            del op.__deepcopy__  # type: ignore[union-attr]
