"""Whether padded training batches run as one row of their real tokens, and how (pure).

A user's collator pads every example of a batch to the longest one; the decoder layers then compute
on the padding too. ``loading/training/packing.py`` flattens such a batch, inside the model's
``forward``, to its real tokens with positions restarting per example (docs/training-plan.md "Packing: no
compute on padding"). That is exact where the positions are rotary: an example's attention
depends only on the distance between its own tokens, so it computes what it computes alone, and the
loss is the same mean over the same targets. Models with learned absolute positions or none are not
checked here and keep the padded batch.

The decision's value is the bucket: the packed row is padded at its end to a multiple of that many
tokens, so that steps come in a few shapes and the CUDA graphs of the layers replay (1 when the
graphs are off: padding would only cost compute). ``lora={"packing": False}`` turns it off;
``lora={"packing": True}`` insists and is refused where it cannot work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xpukit.errors import InvalidRequestError
from xpukit.planning.training.activation_memory import GRAPH_BUCKET, graph_bucket
from xpukit.planning.vocabulary import Decision

if TYPE_CHECKING:
    from xpukit.planning.model.facts import ModelFacts
    from xpukit.planning.training.lora_request import LoraRequest

__all__ = ["GRAPH_BUCKET", "decide_packing", "packing_problem", "packing_wanted"]


def packing_problem(facts: ModelFacts) -> str | None:
    """Why this model's padded batches cannot be packed exactly (``None`` when they can)."""
    if not facts.auto_class.endswith("ForCausalLM"):
        return f"it is a {facts.architecture} ({facts.auto_class}), not a causal language model"
    if not any(name.endswith("rotary_emb") for name in facts.module_names):
        return (
            f"{facts.architecture} has no rotary position embeddings: restarting the positions per "
            "example is not known to give each example what it computes alone"
        )
    return None


def packing_wanted(request: LoraRequest | None, facts: ModelFacts) -> bool:
    """Whether padded batches will run packed (the decision below says so with its bucket and why)."""
    return (
        request is not None
        and request.kind == "new"
        and request.packing is not False
        and packing_problem(facts) is None
    )


def decide_packing(
    request: LoraRequest | None, facts: ModelFacts, *, graphs: bool, checkpointing: bool | str = False
) -> Decision | None:
    """The ``packing`` decision for new adapters (``None`` for no LoRA or a trained adapter).

    Args:
        request: the resolved ``lora=``.
        facts: the model's facts.
        graphs: the layers run as CUDA graphs (the ``layer_graphs`` decision): pad to buckets.
        checkpointing: the training plan's checkpointing: inside the graphs the buckets are coarser
            (:func:`.activation_memory.graph_bucket`).

    Raises:
        InvalidRequestError: ``lora={"packing": True}`` where packing cannot work.
    """
    if request is None or request.kind != "new":
        return None
    if request.packing is False:
        why = "lora={'packing': False} given: padded batches run as the collator made them"
        return Decision(name="packing", value=False, source="user", reason=why)
    problem = packing_problem(facts)
    if problem is not None:
        if request.packing:
            raise InvalidRequestError(
                f"lora={{'packing': True}} asks to train padded batches as one row of their real tokens, "
                f"but {problem}. Fix: drop 'packing' (batches then run padded, and the plan says why), "
                "or train a decoder with rotary positions (Llama, Qwen, Mistral, Gemma, Phi-3 …)."
            )
        return Decision(
            name="packing",
            value=False,
            reason=f"padded batches run as given: {problem}",
            rejected=((True, problem),),
        )
    bucket = graph_bucket(checkpointing) if graphs else 1
    who = "lora={'packing': True} given: " if request.packing else ""
    tail = (
        f"; the row is padded to a multiple of {bucket} tokens so that the layers' CUDA graphs replay"
        if bucket > 1
        else ""
    )
    if bucket > GRAPH_BUCKET:
        tail += " (checkpointed: a capture also records the recomputation, so fewer, coarser shapes)"
    return Decision(
        name="packing",
        value=bucket,
        source="user" if request.packing else "auto",
        reason=f"{who}a padded training batch runs as one row of its real tokens, positions restarting "
        f"per example (no compute on padding; the same loss over the same targets){tail}; "
        "lora={'packing': False} turns it off",
        rejected=((False, "the layers would compute on the collator's padding"),),
    )
