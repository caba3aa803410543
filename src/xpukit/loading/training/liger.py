"""liger-kernel's fused Triton kernels for training, where they can run.

liger-kernel (extra ``liger``) replaces a model's RMSNorm, SwiGLU MLP, RoPE and, most usefully, the
``lm_head`` + cross-entropy pair with fused Triton kernels; the fused linear cross-entropy never
materialises the ``[tokens, vocab]`` logits. It trades speed for memory. Measured on an H200
(Qwen3-8B shape, nf4 + LoRA, one step of 4 × 512 tokens, docs/training.md): lean 11.05 GB at
4 088 tok/s → with liger 7.84 GB at 2 954 tok/s, 29 % less peak memory at 28 % fewer tokens/s (an
earlier run of the same shape, with liger's RoPE: 10.88 → 7.76 GB, 4 226 → 3 948 tok/s).

It is on by default where it can run, because installing it is already the opt-in: the ``liger``
extra is not part of ``all``, and the usual reason to train QLoRA is that memory is the limit.
``lora={"liger": False}`` turns it off where the model fits without it and speed matters more.

Triton runs on CUDA (and ROCm) and on XPU (``triton-xpu``), not on CPU or MPS. The choice is a pure
function of facts (:func:`xpukit.planning.training.liger.decide_liger`); :func:`apply_liger` acts
and returns notes, including the fallback when liger fails. liger patches through its own per-
architecture entry point (``_apply_liger_kernel_to_instance``, the same call transformers'
``Trainer(use_liger_kernel=True)`` makes), with each architecture's default kernels except RoPE, and
only on this model instance.

liger's entry point also rewrites the architecture's transformers modeling module: it swaps the
norm/MLP classes and the module-level ``apply_rotary_pos_emb`` for Triton versions. Left in place,
every later model of that architecture in the process runs them, a CPU model included, which then
fails ("Pointer argument cannot be accessed from Triton (cpu tensor?)"; seen on an H200). xpukit
puts those module attributes back after the call, so only this model changes; the instance patches
(norm and MLP forwards, the fused loss in ``forward``) stay. RoPE has no instance-level patch, so
liger's RoPE runs only where xpukit's layer graphs capture the layers, put in place for the capture
alone (:mod:`xpukit.loading.training.graph_rope`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from xpukit._compat import installed_version, is_installed
from xpukit.machine.facts import DeviceFacts
from xpukit.planning.training.liger import TRITON_BACKENDS, LigerDecision, decide_liger

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PreTrainedModel

__all__ = ["apply_liger"]

logger = logging.getLogger(__name__)


def apply_liger(
    model: PreTrainedModel | PeftModel,
    device: DeviceFacts,
    *,
    wanted: bool | None = None,
    given: bool = False,
    loss_chunk: int | None = None,
) -> list[str]:
    """Apply liger-kernel to a transformers model (before peft wraps it) where it can run.

    Args:
        model: a ``PreTrainedModel`` (a peft wrapper is unwrapped).
        device: the device the model trains on.
        wanted: ``False`` never applies it; ``None``/``True`` apply it where it can run.
        given: ``wanted`` came from the user's ``lora=`` (else from the training plan), for the notes.
        loss_chunk: tokens per chunk of the fused loss (docs/training-plan.md "liger's loss chunk"); the
            loss then goes through :func:`xpukit.loading.training.chunked_loss.apply_chunked_loss`
            with liger's kernel where the model and liger's version allow, else through liger's own
            model forward (its default chunk). ``None``: liger's own.

    Returns:
        Notes of what happened: applied, not applied and why, or the fallback after a failure.
    """
    base, model_type, version, decision = _decide(model, device, wanted=wanted, given=given)
    if not decision.use:
        if wanted:
            who = "lora={'liger': True} asked for" if given else "the training plan chose"
            logger.warning("%s liger-kernel, but: %s", who, decision.reason)
        return [decision.reason]
    own_loss, why_not = _own_loss(base, loss_chunk)
    failed = _patch(base, rope=False, cross_entropy=False, fused_linear_cross_entropy=not own_loss)
    if failed is not None:
        note = (
            f"liger-kernel {version} failed on {model_type!r} ({failed}); "
            "training without it (the model may be partly patched: reload it to be sure)"
        )
        logger.warning(note)
        return [note]
    notes = [
        f"applied {decision.reason} to this model only (fused linear cross-entropy, RMSNorm, "
        "SwiGLU/GeGLU; RoPE only inside the layer graphs, where they run). On the unfused path it "
        "traded speed for memory (H200, with liger's own loss chunks: 29 % less peak memory, 28 % "
        "fewer tokens/s); lora={'liger': False} turns it off"
    ]
    if own_loss:
        from xpukit.loading.training.chunked_loss import apply_chunked_loss

        notes.append(apply_chunked_loss(base, kernel="liger", chunk=loss_chunk))
    elif why_not:
        notes.append(f"liger's fused loss in its own chunks: {why_not}")
    return notes


def _own_loss(base: PreTrainedModel, loss_chunk: int | None) -> tuple[bool, str | None]:
    """Whether xpukit calls liger's loss kernel itself with ``loss_chunk``, and why not."""
    if not loss_chunk:
        return False, None
    import inspect

    from xpukit.loading.training.chunked_loss import chunked_loss_problem

    try:
        from liger_kernel.transformers import functional
    except Exception as exc:  # a third-party import: liger's own forward then, never fail
        return False, f"liger-kernel's functional entry point did not import ({type(exc).__name__}: {exc})"
    if "chunk_mem_const" not in inspect.signature(functional.liger_fused_linear_cross_entropy).parameters:
        return False, "this liger-kernel has no chunk_mem_const (0.8.5 has)"
    problem = chunked_loss_problem(base)
    return (problem is None), problem


def _decide(
    model: PreTrainedModel | PeftModel, device: DeviceFacts, *, wanted: bool | None, given: bool
) -> tuple[PreTrainedModel, str | None, str | None, LigerDecision]:
    """The base model, its type, liger's version and :func:`decide_liger` on this machine's facts."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    version = installed_version("liger-kernel") if is_installed("liger_kernel") else None
    supported: frozenset[str] | None = None
    if version is not None and device.backend in TRITON_BACKENDS and wanted is not False:
        supported = _supported_model_types()
    decision = decide_liger(
        device,
        model_type,
        wanted=wanted,
        given=given,
        liger_version=version,
        triton=is_installed("triton"),
        supported_types=supported,
    )
    return base, model_type, version, decision


def _patch(base: PreTrainedModel, **kernels: bool) -> str | None:
    """liger's patches on this model instance only; the failure as text (``None`` when it worked)."""
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        with _module_globals_restored(base):
            _apply_liger_kernel_to_instance(model=base, **kernels)
    except Exception as exc:  # a third-party monkey-patch: record it and train without, never fail
        return f"{type(exc).__name__}: {exc}"
    return None


@contextlib.contextmanager
def _module_globals_restored(model: torch.nn.Module) -> Iterator[None]:
    """Put back every attribute liger changes in the transformers modules the model is built from."""
    names = {type(m).__module__ for m in model.modules()} | {
        "transformers.loss.loss_utils",
        "torch.nn.functional",
    }
    modules = [
        sys.modules[n] for n in names if n.startswith(("transformers.", "torch.")) and n in sys.modules
    ]
    saved = [(module, dict(vars(module))) for module in modules]
    try:
        yield
    finally:
        for module, before in saved:
            now = vars(module)
            for key in [k for k in now if k not in before]:
                delattr(module, key)
            for key, value in before.items():
                if now.get(key) is not value:
                    setattr(module, key, value)


def _supported_model_types() -> frozenset[str] | None:
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception:  # an older or newer layout: let liger decide (it logs unsupported types)
        return None
    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)
