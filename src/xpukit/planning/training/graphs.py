"""Whether the decoder layers of a LoRA training run as CUDA graphs (pure).

:mod:`xpukit.loading.training.layer_graphs` captures each decoder layer's forward and backward as CUDA graphs
and replays them, which takes the host's Python out of a step that is bound by the host (H200,
Qwen3-8B shape, 4-bit + fused LoRA, 4 × 512 tokens: 4 995 → 10 272 tokens/s, docs/benchmarks.md).
It is on where that was measured: CUDA, the fused 4-bit LoRA path on whole blocks (attention and
MLP; a model whose MLP keeps peft's modules does not qualify), no gradient checkpointing (a
checkpointed layer recomputes inside backward, which the graphs do not capture).
It is off in a launched job of several processes: DDP and FSDP hook each parameter's gradient
accumulator, and the capture's stand-in parameters (loading/training/layer_graphs.py) bypass those.
``lora={"graphs": False}`` turns it off, ``lora={"graphs": True}`` insists (refused where it cannot
run). docs/training.md "CUDA graphs of the decoder layers" has the rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xpukit.errors import InvalidRequestError
from xpukit.planning.vocabulary import Decision

if TYPE_CHECKING:
    from xpukit.planning.training.fit import TrainingPlan
    from xpukit.planning.training.lora_request import LoraRequest

__all__ = ["decide_layer_graphs", "layer_graphs_problem"]


def layer_graphs_problem(
    fused: bool, training: TrainingPlan | None, backend: str, world_size: int = 1
) -> str | None:
    """Why the layers cannot run as CUDA graphs here (``None`` when they can)."""
    if world_size > 1:
        return (
            f"a launched job of {world_size} processes: DDP and FSDP hook the parameters' gradient "
            "accumulators, which the graphs' stand-in parameters bypass"
        )
    if backend != "cuda":
        return (
            f"CUDA graphs of the decoder layers need CUDA (torch.cuda.make_graphed_callables), not {backend}"
        )
    if not fused:
        return "they were measured on the fused 4-bit LoRA path only, which this plan does not take"
    if training is not None and training.gradient_checkpointing:
        return "gradient checkpointing recomputes each layer inside backward, which the graphs do not capture"
    return None


def decide_layer_graphs(
    request: LoraRequest | None,
    *,
    fused: bool,
    training: TrainingPlan | None,
    backend: str,
    world_size: int = 1,
) -> Decision | None:
    """The ``layer_graphs`` decision for new adapters (``None`` for no LoRA or a trained adapter).

    Raises:
        InvalidRequestError: ``lora={"graphs": True}`` where the layers cannot run as graphs.
    """
    if request is None or request.kind != "new":
        return None
    if request.graphs is False:
        return Decision(name="layer_graphs", value=False, source="user",
                        reason="lora={'graphs': False} given: the decoder layers run eagerly")  # fmt: skip
    problem = layer_graphs_problem(fused, training, backend, world_size)
    if problem is not None:
        if request.graphs:
            raise InvalidRequestError(
                f"lora={{'graphs': True}} asks for CUDA graphs of the decoder layers, but {problem}. "
                "Fix: drop 'graphs' (the layers then run eagerly, and the plan says why), or train on "
                "CUDA with quantize='4bit', the fused path and gradient_checkpointing=False."
            )
        return Decision(name="layer_graphs", value=False, reason=f"the layers run eagerly: {problem}",
                        rejected=((True, problem),))  # fmt: skip
    who = "lora={'graphs': True} given: " if request.graphs else ""
    return Decision(
        name="layer_graphs",
        value=True,
        source="user" if request.graphs else "auto",
        reason=f"{who}each decoder layer's forward and backward captured as CUDA graphs on the second "
        "training call of one shape and replayed (the step is bound by the host: 4 995 → 13 043 tokens/s "
        "on an H200); evaluation, padded batches and other shapes run eagerly (lora={'graphs': False} "
        "turns it off)",
    )
