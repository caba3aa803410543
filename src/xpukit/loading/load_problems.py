"""Why ``from_pretrained`` failed, in xpukit's words: the exceptions of a load that have a known cause
and fix (a weights file that cannot be read, a 4-bit model that does not fit the device under the
budget), each turned into the message of an :class:`~xpukit.errors.InvalidRequestError`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xpukit.planning.loadplan import LoadPlan

__all__ = ["missing_weights_problem", "weights_problem"]

# bitsandbytes' quantizer refuses a device map with modules on the CPU or disk (transformers'
# quantizer_bnb_4bit / quantizer_bnb_8bit validate_environment).
_BNB_DISPATCHED = "Some modules are dispatched on the CPU or the disk"


# What from_pretrained reads weights from (safetensors, torch .bin, sharded indexes, TF/Flax, GGUF):
# a local directory with none of these has nothing to load.
_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".index.json",
    ".h5",
    ".msgpack",
    ".ckpt.index",
    ".gguf",
    ".pt",
    ".pth",
)


def missing_weights_problem(plan: LoadPlan) -> str | None:
    """The message for a local model directory that holds a config but no weights file, else ``None``;
    asked before ``from_pretrained``, so nothing is built."""
    if plan.model is None:
        return None
    local = Path(str(plan.model))
    subfolder = plan.passthrough.get("subfolder")
    where = local / str(subfolder) if subfolder else local
    if not local.is_dir() or not where.is_dir():
        return None
    if any(p.name.endswith(_WEIGHT_SUFFIXES) for p in where.iterdir() if p.is_file()):
        return None
    files = sorted(p.name for p in where.iterdir())
    shown = ", ".join(files[:8]) + (" ..." if len(files) > 8 else "")
    return (
        f"Loading {str(plan.model)!r}: the directory has a config.json but no weights (no model.safetensors, "
        f"pytorch_model.bin or sharded index; it holds {shown or 'nothing'}). Nothing was loaded. Fix: "
        "pass the directory save_pretrained() wrote with the weights, or copy the weights in (an "
        "interrupted download or copy: download the model again)."
    )


def weights_problem(plan: LoadPlan, exc: BaseException) -> str | None:
    """The message for a failed load whose cause is known (module docstring), else ``None``."""
    if isinstance(exc, ValueError) and _BNB_DISPATCHED in str(exc):
        return _placement_problem(plan)
    return _unreadable_problem(plan, exc)


def _placement_problem(plan: LoadPlan) -> str:
    device = plan.device.torch_device
    budget = next((d for d in plan.decisions if d.name == "max_memory"), None)
    given = f"max_memory {budget.value}" if budget is not None else "the device's memory"
    weights = plan.memory.weights if plan.memory is not None else None
    size = f" for {weights / 2**30:.2f} GiB of weights" if weights else ""
    return (
        f"Loading {plan.model!r} in {plan.quantization or 'k-bit'} on {device}: under {given}{size}, "
        "accelerate's device map put some modules on the CPU or the disk (it keeps room for the largest "
        "layer beside the weights), and bitsandbytes' quantized weights must all be on the device. "
        "Nothing was loaded. Fix: a larger max_memory= (the weights plus their largest layer, the "
        "output head on most models), no max_memory=, or a smaller model."
    )


def _unreadable_problem(plan: LoadPlan, exc: BaseException) -> str | None:
    """The message for a weights file safetensors cannot read (truncated, corrupt), else ``None``."""
    from safetensors import SafetensorError, safe_open

    if not isinstance(exc, SafetensorError):
        return None
    broken = []
    local = Path(str(plan.model))
    for file in sorted(local.glob("*.safetensors")) if local.is_dir() else ():
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except SafetensorError as bad:
            broken.append(f"{file.name} ({bad})")
    what = ", ".join(broken) if broken else f"a .safetensors file ({exc})"
    return (
        f"Loading {plan.model!r}: {what} cannot be read: the file is truncated or corrupt (an interrupted "
        "download or copy). Fix: download the model again (hf download <id> --force-download) or write it "
        "again with save_pretrained(); nothing was loaded."
    )
