"""Whether liger-kernel's fused Triton kernels are applied when adapters are put on: a pure decision.

The training plan's ``liger`` decision (:mod:`xpukit.planning.training.fit`) says whether the plan
wants them; this rule, taken at load on the machine's facts (liger's version, whether triton
imports, the model types liger patches), says whether they can run; acting on it is
:func:`xpukit.loading.training.liger.apply_liger`.
"""

from __future__ import annotations

from dataclasses import dataclass

from xpukit.machine.facts import DeviceFacts

__all__ = ["TRITON_BACKENDS", "LigerDecision", "decide_liger"]

# Device types on which Triton (and so liger-kernel) runs.
TRITON_BACKENDS = ("cuda", "xpu")


@dataclass(frozen=True, kw_only=True, slots=True)
class LigerDecision:
    """Whether to apply liger-kernel, and why."""

    use: bool
    reason: str


def decide_liger(
    device: DeviceFacts,
    model_type: str | None,
    *,
    wanted: bool | None,
    given: bool = False,
    liger_version: str | None,
    triton: bool,
    supported_types: frozenset[str] | None,
) -> LigerDecision:
    """Decide from facts alone whether liger-kernel is applied.

    Args:
        device: the device the model trains on.
        model_type: ``config.model_type`` of the model.
        wanted: the plan's (or the user's) choice (``None`` = automatic).
        given: ``wanted`` is the user's own ``lora={"liger": ...}``, not the training plan's choice.
        liger_version: the installed liger-kernel version, ``None`` when missing.
        triton: whether the ``triton`` module can be imported.
        supported_types: the model types liger can patch (``None`` when unknown).
    """
    if wanted is False:
        who = "lora={'liger': False} given" if given else "the training plan's choice (its liger decision)"
        return LigerDecision(use=False, reason=f"liger-kernel off: {who}")
    if device.backend not in TRITON_BACKENDS:
        return LigerDecision(
            use=False, reason=f"liger-kernel not used: its Triton kernels do not run on {device.backend}"
        )
    if liger_version is None:
        return LigerDecision(
            use=False,
            reason='liger-kernel not installed (pip install "xpukit[liger]": its fused loss keeps no '
            "logits, and in xpukit's 512-token chunks it is faster than the plain loss on an H200)",
        )
    if not triton:
        return LigerDecision(use=False, reason="liger-kernel installed but triton is not: not used")
    if supported_types is not None and model_type not in supported_types:
        return LigerDecision(
            use=False, reason=f"liger-kernel {liger_version} has no kernels for model type {model_type!r}"
        )
    return LigerDecision(
        use=True, reason=f"liger-kernel {liger_version} on {device.backend} for {model_type!r}"
    )
