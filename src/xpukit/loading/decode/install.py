"""Installing xpukit's decode loop behind one model's ``generate`` (docs/decode-internals.md "How it works"):
the loop itself is :class:`xpukit.loading.decode.loop.DecodeLoop`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from xpukit.loading.decode.loop import DecodeLoop

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["install_decode_loop"]


def install_decode_loop(
    model: PreTrainedModel,
    *,
    max_cache_len: int,
    compile_options: dict[str, object] | None,
    cache_dir: Path | None = None,
    step_graphs: bool = False,
    cache_fields: Mapping[str, object] | None = None,
    regional: bool = False,
    tiered: bool = False,
) -> DecodeLoop:
    """Give ``model`` xpukit's decode loop behind its own ``generate`` (on this instance only).

    ``model.generate(...)`` then asks :func:`~xpukit.loading.decode.request.triage` per call;
    ``model.xpukit_decode_loop`` is the loop, ``model.xpukit_last_decode`` says which loop ran last.
    ``step_graphs=True`` captures the compiled step as one device graph (``compile_options`` must then
    make no graphs of their own: docs/decode-internals.md "Own step graphs"). ``cache_fields`` go into the
    compile cache's key (the weights' format, whether projections are fused). ``regional=True``
    compiles one decoder layer for all of them instead of the whole step (docs/decode-kernels.md
    "Regional compilation"). ``tiered=True`` serves the uncompiled step while a thread builds the
    compiled one (docs/decode.md "Tiered decoding").
    """
    import functools

    loop = DecodeLoop(model, max_cache_len=max_cache_len, cache_dir=cache_dir, cache_fields=cache_fields)
    loop.set_compile(compile_options, step_graphs=step_graphs, regional=regional, tiered=tiered)
    original = model.generate

    @functools.wraps(original)
    def generate(*args: object, **kwargs: object) -> object:
        return loop.dispatch(original, args, kwargs)

    model.generate = generate
    model.xpukit_decode_loop = loop
    model.xpukit_last_decode = None
    return loop
