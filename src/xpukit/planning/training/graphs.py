"""Whether the decoder layers of a LoRA training run as device graphs (pure).

:mod:`xpukit.loading.training.layer_graphs` captures the decoder layers' forward and backward as
graphs and replays them, which takes the host's Python out of a step that is bound by the host
(H200, Qwen3-8B shape, 4-bit + fused LoRA, 4 × 512 tokens: 4 995 → 10 272 tokens/s,
docs/benchmarks.md). It is on where that was measured: CUDA, the fused 4-bit LoRA path on whole
blocks (attention and MLP; a model whose MLP keeps peft's modules does not qualify), no gradient
checkpointing, and every checkpointing rung too: with plain checkpointing each layer is checkpointed
inside the graphs (the backward graph recomputes it; on an H200 under an 8 GB budget 1.55× the
offloaded eager step), with offloaded checkpointing each layer's input is also copied to a pinned host
slot and back by the graphs themselves (docs/layer-graphs.md "Offloaded checkpointing in the graphs"). The
training plan counts the graphs' own buffers in its fit, so a budget that takes a checkpointing rung
takes the graphs with it.

On Intel GPUs the same capture runs through ``torch.xpu.graph`` (torch ≥ 2.11,
docs/platform-notes.md "Graphs on Intel GPUs"); it is on there by the same rules, with the reason
saying it was not run on an Intel GPU by this project (``xpukit doctor --selftest`` captures and
replays one training layer so an owner can check). On an older torch it is off with that reason.

It is off in a launched job of several processes: DDP and FSDP hook each parameter's gradient
accumulator, and the capture's stand-in parameters (loading/training/graph_capture.py) bypass those.
``lora={"graphs": False}`` turns it off, ``lora={"graphs": True}`` insists (refused where it cannot
run). docs/layer-graphs.md "CUDA graphs of the decoder layers" has the rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xpukit.errors import InvalidRequestError
from xpukit.planning.vocabulary import Decision

if TYPE_CHECKING:
    from xpukit.planning.training.lora_request import LoraRequest
    from xpukit.planning.training.training_plan import TrainingPlan

__all__ = [
    "XPU_GRAPHS_TORCH",
    "decide_layer_graphs",
    "graph_api",
    "graphs_possible",
    "layer_graphs_problem",
    "torch_release",
]

# The first torch whose XPU build has torch.xpu.graph and XPUGraph.
XPU_GRAPHS_TORCH = (2, 11)


def torch_release(text: str | None) -> tuple[int, int] | None:
    """``(major, minor)`` of a torch version string (``None`` where it cannot be read)."""
    if not text:
        return None
    parts = text.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def graph_api(backend: str, torch_version: str | None) -> str | None:
    """The graph API the layers would be captured with on ``backend`` (``None``: none there)."""
    if backend == "cuda":
        return "torch.cuda.graph"
    version = torch_release(torch_version)
    if backend == "xpu" and version is not None and version >= XPU_GRAPHS_TORCH:
        return "torch.xpu.graph"
    return None


def layer_graphs_problem(
    fused: bool, backend: str, world_size: int = 1, torch_version: str | None = None
) -> str | None:
    """Why the layers cannot run as graphs here (``None`` when they can), whatever the checkpointing."""
    if world_size > 1:
        return (
            f"a launched job of {world_size} processes: DDP and FSDP hook the parameters' gradient "
            "accumulators, which the graphs' stand-in parameters bypass"
        )
    if backend == "xpu" and graph_api(backend, torch_version) is None:
        need = ".".join(map(str, XPU_GRAPHS_TORCH))
        api = "torch.xpu.graph"
        return f"graphs on Intel GPUs need torch >= {need} ({api}), not {torch_version}"
    if graph_api(backend, torch_version) is None:
        return f"graphs of the decoder layers need CUDA or an Intel GPU (XPU), not {backend}"
    if not fused:
        return "they were measured on the fused 4-bit LoRA path only, which this plan does not take"
    return None


def graphs_possible(
    request: LoraRequest | None, *, fused: bool, backend: str, world_size: int, torch_version: str | None
) -> bool:
    """Whether the layers may run as graphs, whatever checkpointing the training plan then chooses: the
    plan counts the graphs' buffers where they may."""
    return (
        request is not None
        and request.kind == "new"
        and request.graphs is not False
        and layer_graphs_problem(fused, backend, world_size, torch_version) is None
    )


def decide_layer_graphs(
    request: LoraRequest | None,
    *,
    fused: bool,
    training: TrainingPlan | None,
    backend: str,
    world_size: int = 1,
    torch_version: str | None = None,
) -> Decision | None:
    """The ``layer_graphs`` decision for new adapters (``None`` for no LoRA or a trained adapter).

    Raises:
        InvalidRequestError: ``lora={"graphs": True}`` where the layers cannot run as graphs.
    """
    if request is None or request.kind != "new":
        return None
    if request.graphs is False:
        return Decision(
            name="layer_graphs",
            value=False,
            source="user",
            reason="lora={'graphs': False} given: the decoder layers run eagerly",
        )
    # The checkpointing that will run: the training plan's, else the request's (what loading applies).
    checkpointing = (training or request).gradient_checkpointing
    problem = layer_graphs_problem(fused, backend, world_size, torch_version)
    if problem is not None:
        if request.graphs:
            raise InvalidRequestError(
                f"lora={{'graphs': True}} asks for graphs of the decoder layers, but {problem}. "
                "Fix: drop 'graphs' (the layers then run eagerly, and the plan says why), or train on "
                "CUDA or an Intel GPU with quantize='4bit' and the fused path."
            )
        return Decision(
            name="layer_graphs",
            value=False,
            reason=f"the layers run eagerly: {problem}",
            rejected=((True, problem),),
        )
    if training is not None and not training.graphs:
        why = (
            "the step fits the budget only without the graphs' own memory (their buffers and the "
            "recomputation in their pool): the training plan's estimates of both are in its rungs"
        )
        return Decision(
            name="layer_graphs", value=False, reason=f"the layers run eagerly: {why}", rejected=((True, why),)
        )
    who = "lora={'graphs': True} given: " if request.graphs else ""
    api = graph_api(backend, torch_version)
    where = (
        "the step is bound by the host: 4 995 → 13 043 tokens/s on an H200"
        if backend == "cuda"
        else "measured on CUDA (4 995 → 13 043 tokens/s on an H200); not yet run on an Intel GPU by "
        "xpukit: `xpukit doctor --selftest` captures and replays one training layer"
    )
    recompute = {
        True: ", each layer checkpointed inside the graphs (the backward graph recomputes it; on an H200 "
        "under 8 GB 1.55x the offloaded eager step)",
        "offload": ", each layer checkpointed inside the graphs with its input copied to a pinned host slot "
        'and back by the graphs themselves (docs/layer-graphs.md "Offloaded checkpointing in the graphs")',
    }.get(checkpointing, "")
    return Decision(
        name="layer_graphs",
        value=True,
        source="user" if request.graphs else "auto",
        reason=f"{who}the decoder layers' forward and backward captured with {api} per training shape "
        f"and replayed ({where}){recompute}; evaluation and other attention kernels run eagerly "
        "(lora={'graphs': False} turns it off)",
    )
