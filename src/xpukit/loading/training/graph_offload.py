"""Offloaded checkpointing inside the layer graphs: each layer's input waits in host memory.

With ``gradient_checkpointing="offload"`` each decoder layer is checkpointed and keeps only its input
for backward; the eager rung (:mod:`.offload`) copies that input into pinned host memory it allocates
per call, which a device graph cannot capture (an allocation is not a kernel). Here every captured
layer copies its input into a **slot** of one pinned host buffer made before the capture, and the
backward graph copies it back into device memory from the graphs' pool just before the layer is
recomputed. Both copies are ordinary asynchronous copies on the capture's stream, which CUDA graphs
record as memory-copy nodes (CUDA programming guide, "CUDA Graphs": memcpy nodes between device and
page-locked host memory; docs/layer-graphs.md "Offloaded checkpointing in the graphs"). The device then
holds one layer's input and its recomputation at a time, as on the eager rung, and the step replays
without the host.

Passes never overlap (a second forward before the first one's backward runs eagerly,
:mod:`.layer_graphs`), so every captured shape uses the same buffer, each from its start; a shape
larger than the buffer gets a larger one (sized for the next power of two of tokens, so it grows a
few times at most), and every buffer a captured graph copies to stays alive as long as the graphs do:
a replay writes to the addresses it was captured with (freed pinned memory there crashed the process
on an H200).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["HostSlots", "offload_input"]


class HostSlots:
    """One pinned host buffer, cut into a slot per layer for the shape being captured.

    ``pin``: page-locked memory (on CUDA and XPU; the CPU tests' stand-in backend has none).
    """

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self.buffer: torch.Tensor | None = None  # flat, of the compute dtype: the one new captures use
        self.kept: list[torch.Tensor] = []  # every buffer a captured graph copies to
        self.bytes = 0  # all of them

    def slots(self, layers: int, like: torch.Tensor) -> list[torch.Tensor]:
        """``layers`` host tensors of ``like``'s shape and dtype, views of the current buffer."""
        import torch

        n = like.numel()
        need = layers * n
        buffer = self.buffer
        if buffer is None or buffer.dtype != like.dtype or buffer.numel() < need:
            rows = like.shape[-2] if like.dim() >= 2 else 1
            grown = need * (1 << max(rows - 1, 0).bit_length()) // max(rows, 1)  # the next power of two
            buffer = torch.empty(max(grown, need), dtype=like.dtype, device="cpu", pin_memory=self.pin)
            self.buffer = buffer
            self.kept.append(buffer)
            self.bytes = sum(b.numel() * b.element_size() for b in self.kept)
        return [buffer[i * n : (i + 1) * n].view(like.shape) for i in range(layers)]

    def clear(self) -> None:
        """The graphs were dropped: their buffers may go."""
        self.buffer = None
        self.kept.clear()
        self.bytes = 0


@contextlib.contextmanager
def offload_input(hidden: torch.Tensor, slot: torch.Tensor) -> Iterator[None]:
    """Inside: a tensor saved for backward that is ``hidden`` (the layer's input, which a
    non-reentrant checkpoint saves) goes to ``slot`` on the host and comes back as a new device
    tensor when backward needs it; everything else is saved as usual."""
    import torch

    def same(tensor: torch.Tensor) -> bool:
        return bool(
            tensor.data_ptr() == hidden.data_ptr()
            and tensor.shape == hidden.shape
            and tensor.dtype == hidden.dtype
            and tensor.device == hidden.device
        )

    def pack(tensor: torch.Tensor) -> torch.Tensor | _Offloaded:
        if not same(tensor):
            return tensor
        slot.copy_(tensor.detach(), non_blocking=True)
        return _Offloaded(slot, tensor.device)

    def unpack(packed: torch.Tensor | _Offloaded) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        out = torch.empty(packed.slot.shape, dtype=packed.slot.dtype, device=packed.device)
        out.copy_(packed.slot, non_blocking=True)
        return out

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


class _Offloaded:
    """A saved tensor that waits in a host slot."""

    __slots__ = ("device", "slot")

    def __init__(self, slot: torch.Tensor, device: torch.device) -> None:
        self.slot = slot
        self.device = device
