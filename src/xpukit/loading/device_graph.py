"""The graph API of one torch device module (``torch.cuda`` or ``torch.xpu``), for the two places
that capture device graphs themselves: the training layers
(:mod:`xpukit.loading.training.graph_capture`) and the decode step
(:mod:`xpukit.loading.decode.step_graph`). A CPU test passes a stand-in with the same methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["GraphBackend"]


class GraphBackend:
    """The graph API of one torch device module (``torch.cuda`` or ``torch.xpu``)."""

    def __init__(self, kind: str) -> None:
        import torch

        self.kind = kind
        self.module = getattr(torch, kind)
        self.graph_class = getattr(self.module, "CUDAGraph" if kind == "cuda" else f"{kind.upper()}Graph")

    def new_graph(self) -> Any:
        return self.graph_class()

    def pool(self) -> Any:
        return self.module.graph_pool_handle()

    def capture(self, graph: Any, body: Callable[[], None], pool: Any) -> None:
        # Captures happen mid-training, where a data loader's pin-memory thread may call into CUDA;
        # "thread_local" keeps those calls from invalidating this thread's capture (torch.cuda.graph).
        options = {"capture_error_mode": "thread_local"} if self.kind == "cuda" else {}
        with self.module.graph(graph, pool=pool, **options):
            body()

    def synchronize(self) -> None:
        self.module.synchronize()

    def side_stream(self) -> Any:
        return self.module.stream(self.module.Stream())
