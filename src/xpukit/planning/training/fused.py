"""Whether new LoRA adapters on a 4-bit base train through xpukit's fused path (pure).

The fused path (``loading/training/fused_lora.py``, docs/planning.md "Fused LoRA") computes a decoder
block's projections together with their adapters: each 4-bit weight dequantised once in forward and
once in backward, the LoRA term added in place. It expresses exactly one shape of adapter: plain LoRA
(no dropout, no DoRA, no bias adapters) on all seven projections of a block whose attention has
q/k/v/o_proj and whose MLP has gate/up/down_proj, over bitsandbytes 4-bit weights. Anything else keeps
peft's own modules, and the decision says why.

``lora={"fused": False}`` turns it off; ``lora={"fused": True}`` insists, on any device, the CPU
included, and is refused with the reason where the model cannot be fused. Without either, it is on
where Triton-backed devices run the training (cuda, xpu), off on the CPU and MPS, where the fused path
was not measured faster (it is the same arithmetic in fewer, larger operations).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xpukit.errors import InvalidRequestError
from xpukit.planning.vocabulary import Decision

if TYPE_CHECKING:
    from xpukit.planning.model.facts import ModelFacts
    from xpukit.planning.training.lora_request import LoraRequest

__all__ = [
    "FUSED_PROJECTIONS",
    "SILU_NAMES",
    "SWIGLU_MLP_TYPES",
    "decide_fused",
    "fused_problem",
    "fused_will_run",
    "mlp_problem",
]

# The projections of a block the fused path computes (attention, then MLP).
FUSED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Model types whose MLP is exactly down(silu(gate(x)) * up(x)) (their transformers modeling files);
# loading checks the activation again on the module (loading/training/fused_lora.py).
SWIGLU_MLP_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
SILU_NAMES = ("silu", "swish")


def mlp_problem(model_type: str | None) -> str | None:
    """Why the fused path cannot compute this model type's MLP (its attention may still be fused)."""
    if model_type not in SWIGLU_MLP_TYPES:
        return f"model type {model_type!r} is not known to compute down(silu(gate(x)) * up(x))"
    return None


# Where the fused path is on without being asked: the devices whose training it was built for.
_AUTO_BACKENDS = frozenset({"cuda", "xpu"})


def _targets_all(targets: Any, linear_layers: tuple[str, ...]) -> bool:
    if targets == "all-linear":
        return True
    if isinstance(targets, str):  # a regex: cannot be told from the names alone
        return False
    names = set(targets or ())
    return set(FUSED_PROJECTIONS) <= names or (not names and bool(linear_layers))


def fused_problem(request: LoraRequest, facts: ModelFacts, quantization: str | None) -> str | None:
    """Why the fused path cannot express this request on this model (``None`` when it can)."""
    config = request.config
    if quantization != "4bit":
        what = "no quantization" if quantization is None else f"{quantization} weights"
        return f"the fused path is for bitsandbytes 4-bit weights; this plan has {what}"
    if float(config.get("lora_dropout", 0) or 0) > 0:
        return f"lora_dropout={config.get('lora_dropout')} (the fused path has no dropout; 0 is the default)"
    if config.get("use_dora"):
        return "use_dora=True (DoRA's magnitude vector is not in the fused path)"
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        return "bias adapters (bias= / lora_bias=) are not in the fused path"
    missing = [p for p in FUSED_PROJECTIONS if p not in facts.linear_layers]
    if missing:
        return (
            f"{facts.architecture} has no {', '.join(missing)}: its blocks are not the q/k/v/o + "
            "gate/up/down shape the fused path computes"
        )
    if not _targets_all(config.get("target_modules"), facts.linear_layers):
        return (
            f"target_modules={config.get('target_modules')!r} does not adapt all of "
            f"{', '.join(FUSED_PROJECTIONS)}"
        )
    return None


def fused_will_run(
    request: LoraRequest | None, facts: ModelFacts, *, quantization: str | None, backend: str
) -> bool:
    """Whether :func:`decide_fused` turns the fused path on for whole blocks (attention and MLP);
    never raises (for the estimate of a layout that may still be replaced, where an insisted
    ``fused`` that cannot run is refused later)."""
    try:
        decision = decide_fused(request, facts, quantization=quantization, backend=backend)
    except InvalidRequestError:
        return False
    full = mlp_problem(facts.model_type) is None  # attention-only fusion counts as unfused here
    return decision is not None and bool(decision.value) and full


def decide_fused(
    request: LoraRequest | None, facts: ModelFacts, *, quantization: str | None, backend: str
) -> Decision | None:
    """The ``fused_lora`` decision for new adapters (``None`` for no LoRA or a trained adapter).

    Raises:
        InvalidRequestError: ``lora={"fused": True}`` where the request or model cannot be fused.
    """
    if request is None or request.kind != "new":
        return None
    asked = request.fused
    if asked is False:
        return Decision(
            name="fused_lora", value=False, reason="lora={'fused': False} given: peft's LoRA modules",
            source="user",
        )  # fmt: skip
    problem = fused_problem(request, facts, quantization)
    if problem is not None:
        if asked:
            raise InvalidRequestError(
                f"lora={{'fused': True}} asks for xpukit's fused 4-bit LoRA path, but {problem}. "
                "Fix: drop 'fused' (peft's path is used, and the plan says why), or change what stands "
                "in the way (quantize='4bit', lora_dropout=0, no DoRA or bias adapters, all-linear targets)."
            )
        return Decision(
            name="fused_lora", value=False, reason=f"peft's LoRA modules: {problem}",
            rejected=((True, problem),),
        )  # fmt: skip
    partial = mlp_problem(facts.model_type)
    if asked and partial:
        raise InvalidRequestError(
            f"lora={{'fused': True}} asks for xpukit's fused 4-bit LoRA path on every block, but the "
            f"MLP cannot be fused: {partial}. Fix: drop 'fused' (the attention projections are fused "
            "and the MLP keeps peft's modules, and the plan says so), or lora={'fused': False}."
        )
    if asked:
        return Decision(
            name="fused_lora", value=True, source="user",
            reason="lora={'fused': True} given: each block's 4-bit projections and adapters in fused "
            "autograd functions (loading/training/fused_lora.py)",
        )  # fmt: skip
    if backend not in _AUTO_BACKENDS:
        return Decision(
            name="fused_lora", value=False,
            reason=f"peft's LoRA modules: the fused path is on by default on cuda and xpu only, not "
            f"{backend} (lora={{'fused': True}} uses it here too)",
            rejected=((True, f"not measured faster on {backend}"),),
        )  # fmt: skip
    what = "4-bit projections and their adapters computed together per block"
    if partial:
        what = (
            "the attention's 4-bit projections and their adapters computed together (the MLP keeps "
            f"peft's modules: {partial})"
        )
    return Decision(
        name="fused_lora", value=True,
        reason=f"{what}: one dequantisation per weight in forward and one in backward, the LoRA term "
        "added in place (lora={'fused': False} turns it off)",
    )  # fmt: skip
