"""Whether a LoRA training with the layer graphs switches CUDA's allocator to expandable segments (pure).

torch's CUDA caching allocator keeps the blocks it once asked the driver for. The layer graphs'
private pool grows with each captured shape, and with ordinary segments it keeps a set of blocks for
every shape's activations. With *expandable segments* the allocator grows one mapped segment per
pool and maps pages as needed, so what it holds sits closer to what is used. unsloth turns this on
for its whole process when it is imported.

It was measured on an H100 with the Qwen3-8B shape in 4-bit and LoRA through ``Trainer``: less
reserved, tokens/s within the rounds' spread. The table is in
docs/layer-graphs.md "Expandable segments in the allocator"; ``_MEASURED`` below is its summary,
shown in the decision's reason.

The decision is on for CUDA with torch 2.11 or newer, where it was measured and where the graphs'
private pools take expandable segments. The loader switches the allocator once the load has
succeeded (``loading/training/expandable_segments.py``), so a refused load leaves the process as it was.

It stays off where the user configured the allocator. That means ``PYTORCH_ALLOC_CONF`` or
``PYTORCH_CUDA_ALLOC_CONF`` is set, to anything: ``PYTORCH_ALLOC_CONF=expandable_segments:False`` keeps
the ordinary segments. It is also off on Intel GPUs, where it has not been measured.
"""

from __future__ import annotations

from xpukit.planning.training.graphs import torch_release
from xpukit.planning.vocabulary import Decision

__all__ = ["ALLOC_VARIABLES", "EXPANDABLE_SETTING", "EXPANDABLE_TORCH", "decide_expandable_segments"]

# torch reads the first of these that is set (PYTORCH_CUDA_ALLOC_CONF is the older name).
ALLOC_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE_SETTING = "expandable_segments:True"
# The torch release it was measured on (docs/layer-graphs.md "Expandable segments in the allocator").
EXPANDABLE_TORCH = (2, 11)
_MEASURED = (
    "H100, Qwen3-8B shape, 60 steps: 16.97 -> 16.21 GB reserved with room (3 rounds), 11.83 -> 11.00 GB "
    "under 12 GB (one round), tokens/s within the rounds' spread"
)


def decide_expandable_segments(
    *, graphs: bool, backend: str, torch_version: str | None, env: dict[str, str]
) -> Decision | None:
    """The ``expandable_segments`` decision of a training with the layer graphs (``None`` without them).

    Args:
        graphs: whether the layer graphs run (the ``layer_graphs`` decision's value).
        backend: the main device's backend (``cuda``, ``xpu``…).
        torch_version: the installed torch's version.
        env: the environment the plan was made in (the allocator variables are read from it).
    """
    if not graphs:
        return None
    given = next(((name, env[name]) for name in ALLOC_VARIABLES if name in env), None)
    if given is not None:
        name, value = given
        return Decision(
            name="expandable_segments",
            value="expandable_segments:true" in value.replace(" ", "").lower(),
            source="user",
            reason=f"{name}={value} is set in your environment: the allocator stays as you configured it",
        )
    if backend != "cuda":
        why = f"not measured with the layer graphs on {backend}: the allocator stays as it is"
        return Decision(name="expandable_segments", value=False, reason=why, rejected=((True, why),))
    release = torch_release(torch_version)
    if release is None or release < EXPANDABLE_TORCH:
        why = (
            f"torch {torch_version}: measured with the graphs' pools on torch "
            f"{EXPANDABLE_TORCH[0]}.{EXPANDABLE_TORCH[1]} and newer only"
        )
        return Decision(name="expandable_segments", value=False, reason=why, rejected=((True, why),))
    return Decision(
        name="expandable_segments",
        value=True,
        reason=(
            "CUDA's allocator switched to expandable segments for this process once the model is "
            "loaded, as unsloth does at import: the graphs' pool grows one mapped segment instead of "
            f"keeping blocks per shape ({_MEASURED}); PYTORCH_ALLOC_CONF set to anything keeps the "
            "allocator as configured "
            '(docs/layer-graphs.md "Expandable segments in the allocator")'
        ),
    )
