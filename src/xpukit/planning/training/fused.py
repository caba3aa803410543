"""Whether new LoRA adapters on a 4-bit base train through xpukit's fused path (pure).

The fused path (``loading/training/fused_lora.py``, docs/planning.md "Fused LoRA") computes a decoder
block's projections together with their adapters: each 4-bit weight dequantised once in forward and
once in backward, the LoRA term added in place. It expresses plain LoRA (no dropout, no DoRA, no bias
adapters) over bitsandbytes 4-bit weights on the block shapes below, one rule per shape
(:data:`ATTENTION_SHAPES`, :data:`MLP_SHAPES`, the gating activations of :data:`GATE_ACTIVATIONS`).
From the config alone the plan says which of them it expects to fuse; loading then proves each
distinct block type against peft's own block before it trains through it
(``loading/training/fused_check.py``). Anything else keeps peft's own modules, and the decision says why.

``lora={"fused": False}`` turns it off; ``lora={"fused": True}`` insists, on any device, the CPU
included, and is refused with the reason where the model cannot be fused. Without either, it is on
where Triton-backed devices run the training (cuda, xpu), off on the CPU and MPS, where the fused path
was not measured faster (it is the same arithmetic in fewer, larger operations).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from xpukit.errors import InvalidRequestError
from xpukit.planning.model.families import SEPARATE_GATE_UP, SEPARATE_QKV, STORED_GATE_UP, STORED_QKV
from xpukit.planning.vocabulary import Decision

if TYPE_CHECKING:
    from xpukit.planning.model.facts import ModelFacts
    from xpukit.planning.training.lora_request import LoraRequest

__all__ = [
    "ATTENTION_SHAPES",
    "GATE_ACTIVATIONS",
    "MLP_SHAPES",
    "BlockShape",
    "FusedBlocks",
    "decide_fused",
    "fused_blocks",
    "fused_problem",
    "fused_will_run",
]


@dataclass(frozen=True, slots=True)
class BlockShape:
    """One block shape the fused path computes: the projections it needs and what it does with them."""

    part: str  # "attention" or "MLP"
    projections: tuple[str, ...]
    computes: str


# One rule per shape; the first whose projections the model has applies. Each family's entry in
# planning/model/families.py names the shape its blocks have.
ATTENTION_SHAPES = (
    BlockShape(
        "attention",
        SEPARATE_QKV,
        "q/k/v in one function over their shared input, o_proj in another",
    ),
    BlockShape(
        "attention",
        STORED_QKV,
        "the stored qkv_proj (one adapter on the fused weight, as peft puts it) and o_proj, one "
        "function each",
    ),
)
MLP_SHAPES = (
    BlockShape("MLP", SEPARATE_GATE_UP, "down(act(gate(x)) * up(x)) in one function"),
    BlockShape(
        "MLP",
        STORED_GATE_UP,
        "down(act(gate) * up) in one function, gate and up the halves of the stored gate_up_proj",
    ),
)
# The gating activations the fused MLP computes, by the config's name (transformers' ACT2FN):
# SiLU (SwiGLU: Llama, Mistral, Qwen, Granite, OLMo 2, SmolLM3, Phi-3, GLM-4) and GELU, exact or
# tanh-approximated (GeGLU: Gemma 1-3).
GATE_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu": "gelu",
}
_ACTIVATION_WORDS = {
    "silu": "SiLU (SwiGLU)",
    "gelu_tanh": "tanh-approximated GELU (GeGLU)",
    "gelu": "GELU (GeGLU)",
}


@dataclass(frozen=True, slots=True)
class FusedBlocks:
    """What the plan expects the fused path to compute in each decoder block, read from the config.

    ``attention``/``mlp``: the matching :class:`BlockShape`, ``None`` where no rule applies (then
    ``attention_problem``/``mlp_problem`` says why); ``activation``: the fused MLP's gating activation
    (a value of :data:`GATE_ACTIVATIONS`); ``experts``: the MLP is a mixture of experts.
    """

    attention: BlockShape | None
    mlp: BlockShape | None
    activation: str | None
    attention_problem: str | None
    mlp_problem: str | None
    experts: bool = False

    @property
    def whole(self) -> bool:
        """Attention and MLP both fused (what the activation estimate and layer graphs count)."""
        return self.attention is not None and self.mlp is not None

    @property
    def projections(self) -> tuple[str, ...]:
        return tuple(p for s in (self.attention, self.mlp) if s is not None for p in s.projections)

    def expected(self) -> str:
        """Which parts of each block the plan expects to fuse, and how, in words."""
        parts = []
        if self.attention is not None:
            parts.append(f"attention: {self.attention.computes}")
        if self.mlp is not None:
            act = _ACTIVATION_WORDS.get(self.activation or "", self.activation)
            parts.append(f"MLP: {self.mlp.computes}, act = {act}")
        else:
            parts.append(f"the MLP keeps peft's modules ({self.mlp_problem})")
        return "; ".join(parts)


def fused_blocks(facts: ModelFacts) -> FusedBlocks:
    """Match the model's linear layers and config to one attention and one MLP rule (pure)."""
    names = set(facts.linear_layers)
    attention = next((s for s in ATTENTION_SHAPES if set(s.projections) <= names), None)
    attention_problem = None
    if attention is None:
        wanted = " or ".join("/".join(s.projections) for s in ATTENTION_SHAPES)
        attention_problem = f"{facts.architecture} has no {wanted}"
    experts = facts.num_experts > 0
    activation = GATE_ACTIVATIONS.get(facts.mlp_activation or "")
    mlp = next((s for s in MLP_SHAPES if set(s.projections) <= names), None)
    mlp_problem = None
    if experts:
        mlp, mlp_problem = (
            None,
            (
                f"a mixture of {facts.num_experts} experts: their weights are 3-D parameters, which "
                "bitsandbytes does not quantise and peft adapts as parameters; they run transformers' "
                "expert code with peft's adapters"
            ),
        )
    elif mlp is None:
        wanted = " or ".join("/".join(s.projections) for s in MLP_SHAPES)
        mlp_problem = f"{facts.architecture} has no {wanted}"
    elif activation is None:
        mlp, mlp_problem = (
            None,
            (
                f"activation {facts.mlp_activation!r} is not one the fused MLP computes "
                f"({', '.join(sorted(GATE_ACTIVATIONS))})"
            ),
        )
    return FusedBlocks(
        attention=attention,
        mlp=mlp,
        activation=activation if mlp is not None else None,
        attention_problem=attention_problem,
        mlp_problem=mlp_problem,
        experts=experts,
    )


# Where the fused path is on without being asked: the devices whose training it was built for.
_AUTO_BACKENDS = frozenset({"cuda", "xpu"})


def _targets_all(
    targets: str | Iterable[str] | None, wanted: tuple[str, ...], linear_layers: tuple[str, ...]
) -> bool:
    if targets == "all-linear":
        return True
    if isinstance(targets, str):  # a regex: cannot be told from the names alone
        return False
    names = set(targets or ())
    return set(wanted) <= names or (not names and bool(linear_layers))


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
    blocks = fused_blocks(facts)
    if blocks.attention_problem is not None:
        return f"{blocks.attention_problem}: its blocks are not a shape the fused path computes"
    if not _targets_all(config.get("target_modules"), blocks.projections, facts.linear_layers):
        return (
            f"target_modules={config.get('target_modules')!r} does not adapt all of "
            f"{', '.join(blocks.projections)}"
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
    # attention-only fusion counts as unfused here
    return decision is not None and bool(decision.value) and fused_blocks(facts).whole


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
            name="fused_lora",
            value=False,
            reason="lora={'fused': False} given: peft's LoRA modules",
            source="user",
        )
    problem = fused_problem(request, facts, quantization)
    if problem is not None:
        if asked:
            raise InvalidRequestError(
                f"lora={{'fused': True}} asks for xpukit's fused 4-bit LoRA path, but {problem}. "
                "Fix: drop 'fused' (peft's path is used, and the plan says why), or change what stands "
                "in the way (quantize='4bit', lora_dropout=0, no DoRA or bias adapters, all-linear targets)."
            )
        return Decision(
            name="fused_lora",
            value=False,
            reason=f"peft's LoRA modules: {problem}",
            rejected=((True, problem),),
        )
    blocks = fused_blocks(facts)
    if asked and blocks.mlp is None and not blocks.experts:
        raise InvalidRequestError(
            f"lora={{'fused': True}} asks for xpukit's fused 4-bit LoRA path on every block, but the "
            f"MLP cannot be fused: {blocks.mlp_problem}. Fix: drop 'fused' (the attention projections "
            "are fused and the MLP keeps peft's modules, and the plan says so), or lora={'fused': False}."
        )
    expected = f"{blocks.expected()}; each distinct block type is checked against peft's block at load"
    if asked:
        return Decision(
            name="fused_lora",
            value=True,
            source="user",
            reason=f"lora={{'fused': True}} given: each block's 4-bit projections and adapters in fused "
            f"autograd functions (loading/training/fused_lora.py): {expected}",
        )
    if backend not in _AUTO_BACKENDS:
        return Decision(
            name="fused_lora",
            value=False,
            reason=f"peft's LoRA modules: the fused path is on by default on cuda and xpu only, not "
            f"{backend} (lora={{'fused': True}} uses it here too)",
            rejected=((True, f"not measured faster on {backend}"),),
        )
    return Decision(
        name="fused_lora",
        value=True,
        reason="4-bit projections and their adapters computed together per block, one dequantisation "
        f"per weight in forward and one in backward, the LoRA term added in place ({expected}; "
        "lora={'fused': False} turns it off)",
    )
