"""What the demo shows and how quietly: narration, the loss plot, known harmless log noise,
peak memory, and one CPU thread for the tiny model.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from xpukit import _platform
from xpukit._compat import require
from xpukit.demo.training_run import TrainingRun, lora_layers_updated, loss_callback, train  # noqa: F401

__all__ = [
    "KNOWN_NOISE",
    "DropMessages",
    "Narrator",
    "one_cpu_thread",
    "peak_memory",
    "plot_losses",
    "quiet_known_noise",
]


def peak_memory(backend: str) -> tuple[int | None, str]:
    """Peak device memory from the allocator on CUDA/XPU; else the process's peak resident memory."""
    if backend in ("cuda", "xpu"):
        import torch

        return int(getattr(torch, backend).max_memory_allocated()), f"torch.{backend}.max_memory_allocated"
    peak = _platform.peak_rss()  # getrusage, or the peak working set on Windows
    if peak is None:
        return None, "not measured on this platform"
    return peak, "peak resident memory of the process"


def plot_losses(losses: tuple[tuple[int, float], ...], path: str | os.PathLike[str], *, title: str) -> Path:
    """Save a loss curve (every step, and a running mean) as an image.

    Args:
        losses: ``(step, loss)`` pairs.
        path: the image file; the type follows the suffix (``.png``, ``.svg``, ``.pdf``…).
        title: the plot's title.

    Returns:
        The path written.

    Raises:
        MissingExtraError: matplotlib is not installed (extra ``plot``).
    """
    require("matplotlib", "plot_losses")
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
    from matplotlib.ticker import MaxNLocator

    steps = [s for s, _ in losses]
    values = [v for _, v in losses]
    window = max(1, len(values) // 12)
    mean = []
    for i in range(len(values)):
        recent = values[max(0, i - window + 1) : i + 1]
        mean.append(sum(recent) / len(recent))
    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(steps, values, color="#9bb7d4", linewidth=1, label="loss per step")
    ax.plot(
        steps, mean, color="#1f4e79", linewidth=2, label=f"mean of {window} step{'s' if window > 1 else ''}"
    )
    ax.set(xlabel="step", ylabel="training loss", title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(path)
    fig.savefig(out, dpi=120)
    return out


@contextlib.contextmanager
def one_cpu_thread() -> Iterator[None]:
    """Run torch on one CPU thread, then restore the thread count.

    The embedded model is too small to gain from more (measured on two cores: 60 steps in 10.8 s
    with two threads, 11.3 s with one). With two, a CPU shared with any other busy process makes
    OpenMP threads wait on each other: the same 60 steps took 60-115 s.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Narrator:
    """Prints lines to the stream, or nothing when there is none."""

    def __init__(self, stream: IO[str] | None) -> None:
        self.stream = stream

    def __call__(self, *lines: str) -> None:
        if self.stream is not None:
            for line in lines:
                print(line, file=self.stream, flush=True)


class DropMessages(logging.Filter):
    def __init__(self, needles: tuple[str, ...]) -> None:
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(needle in message for needle in self.needles)


# Messages that are no news to a demo user, by logger. bitsandbytes (on avx512_bf16 CPUs) tries to
# fetch an optional CPU kernel from the Hub at import, and says so when it cannot, then uses its
# bundled code, which is what it would use anyway offline.
# deepspeed (extra `deepspeed`), imported by transformers/peft during training, announces on a machine
# without an accelerator that it uses the CPU, through its own handler on stdout (which would also
# break `xpukit demo --json`); the demo says which device it uses already.
KNOWN_NOISE: dict[str, tuple[str, ...]] = {
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward",),
    "kernels.hf_hub": ("kernels-community/quantization-bitsandbytes",),
    "DeepSpeed": ("Setting accelerator to CPU",),
}


@contextlib.contextmanager
def quiet_known_noise(*, embedded: bool) -> Iterator[None]:
    """Drop the known harmless messages above, for the demo only; every other warning still shows.

    For the embedded model also hide transformers' weight-loading progress bar (a fraction of a
    second for a tiny model); a real model keeps it.
    """
    filters = [(logging.getLogger(name), DropMessages(needles)) for name, needles in KNOWN_NOISE.items()]
    for log, flt in filters:
        log.addFilter(flt)
    restore: Callable[[], None] | None = None
    if embedded:
        from transformers.utils import logging as hf_logging

        if hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
            restore = hf_logging.enable_progress_bar
    try:
        yield
    finally:
        for log, flt in filters:
            log.removeFilter(flt)
        if restore is not None:
            restore()
