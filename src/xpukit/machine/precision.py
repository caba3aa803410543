"""Which floating-point precision a device should compute in: pure rules over :class:`DeviceFacts`.

Shared by the load planner (inference dtype) and :func:`xpukit.training_args` (mixed precision),
so both always agree. Rules (docs/platform-notes.md §3, docs/planning.md "Decision rules"):

* XPU: bf16 on families with native bf16 (Max, Flex, Arc A/B, Lunar Lake, Arrow Lake-H, Panther
  Lake); fp16 on Meteor Lake / Arrow Lake-S, whose bf16 is only emulated. Never
  ``torch.xpu.is_bf16_supported()``, which is True on every XPU.
* CUDA: bf16 from compute capability 8.0, else fp16.
* CPU: bf16 only with native bf16 (avx512_bf16 / AMX / Arm BF16), else fp32.
* MPS: fp16.
* Training: never fp16 with a GradScaler on a device without fp64 (Arc A-series fails in the
  scaler with "Required aspect fp64 is not supported", pytorch#147731); fp32 there instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from xpukit.machine.facts import DeviceFacts

__all__ = [
    "DTYPES",
    "DtypeChoice",
    "TrainingPrecision",
    "inference_dtype",
    "normalize_dtype",
    "slow_precision",
    "training_precision",
    "training_precision_for_dtype",
]

DtypeName = Literal["bfloat16", "float16", "float32"]
DTYPES: tuple[DtypeName, ...] = ("bfloat16", "float16", "float32")

# Spellings users write, mapped to torch's names.
_ALIASES: dict[str, DtypeName] = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "torch.float16": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "torch.float32": "float32",
}


def normalize_dtype(value: object) -> DtypeName | None:
    """``"bf16"``, ``torch.bfloat16`` … → ``"bfloat16"``; ``None`` when not a known float dtype."""
    return _ALIASES.get(str(value).strip().lower())


@dataclass(frozen=True, kw_only=True, slots=True)
class DtypeChoice:
    """A dtype with the reason for it and the alternatives rejected (with why)."""

    dtype: DtypeName
    reason: str
    rejected: tuple[tuple[str, str], ...] = ()


def inference_dtype(device: DeviceFacts) -> DtypeChoice:
    """The dtype to load weights in on ``device`` when the user did not name one."""
    if device.backend == "mps":
        return DtypeChoice(
            dtype="float16",
            reason="MPS computes fastest in fp16",
            rejected=(("bfloat16", "not native on MPS"), ("float32", "twice the memory")),
        )
    if device.native_bf16:
        where = _where(device)
        return DtypeChoice(
            dtype="bfloat16",
            reason=f"{where} has native bf16 (same range as fp32, half the memory)",
            rejected=(
                ("float16", "narrower range than bf16 (overflow risk) with no speed gain here"),
                ("float32", "twice the memory and slower"),
            ),
        )
    if device.backend == "cpu":
        if device.fp16:  # AVX512-FP16 / AMX-FP16 / Arm FP16 without bf16 (docs/platform-notes.md §3.5)
            fp16, why_not = "fp16 is native but narrower in range than fp32", "narrower range (overflow risk)"
        else:
            fp16, why_not = "fp16 matmuls are slow on CPUs", "slow on CPU"
        return DtypeChoice(
            dtype="float32",
            reason=f"{device.name} has no native bf16 (no avx512_bf16/amx_bf16): bf16 would be "
            f"emulated and slow, {fp16}",
            rejected=(("bfloat16", "emulated on this CPU"), ("float16", why_not)),
        )
    return DtypeChoice(
        dtype="float16",
        reason=f"{_where(device)} has no native bf16 (only emulated), so fp16",
        rejected=(
            ("bfloat16", "emulated: slow, and reported to give bad output on old iGPUs"),
            ("float32", "twice the memory"),
        ),
    )


def slow_precision(device: DeviceFacts, dtype: str) -> str | None:
    """Why computing in ``dtype`` on ``device`` is slow (only emulated), or ``None`` when it is not.

    bf16 without native bf16 (a CPU without avx512_bf16/AMX, Meteor Lake, a T4), and fp16 on a CPU
    without native fp16 arithmetic (AVX512-FP16 / AMX-FP16 / Arm FP16: the ``fp16`` fact,
    docs/platform-notes.md §3.5). One rule for ``load_for_xpu(dtype=...)``,
    ``training_args(bf16=/fp16=)`` and ``xpukit doctor``'s "native / emulated" line, so all say alike.
    """
    if (dtype == "bfloat16" and not device.native_bf16) or (
        dtype == "float16" and device.backend == "cpu" and not device.fp16
    ):
        native = inference_dtype(device).dtype
        return f"{dtype} on {device.name} is only emulated (slow); {native} is native here"
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingPrecision:
    """Mixed-precision flags for ``TrainingArguments`` with the reason."""

    bf16: bool
    fp16: bool
    reason: str

    @property
    def name(self) -> DtypeName:
        """The compute dtype these flags give."""
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"


def training_precision(device: DeviceFacts) -> TrainingPrecision:
    """bf16 where native; fp16 (with GradScaler) only where fp64 exists and fp16 works; else fp32."""
    if device.native_bf16:
        return TrainingPrecision(bf16=True, fp16=False, reason=f"{_where(device)} has native bf16")
    if device.backend == "cpu":
        return TrainingPrecision(
            bf16=False, fp16=False, reason=f"{device.name} has no native bf16: fp32 training"
        )
    if device.backend == "mps":
        return TrainingPrecision(
            bf16=False,
            fp16=False,
            reason="MPS has no fp64 for the fp16 GradScaler and no native bf16: fp32 training",
        )
    if not device.fp64:
        return TrainingPrecision(
            bf16=False,
            fp16=False,
            reason=f"{_where(device)} has no native bf16 and no fp64, which fp16's GradScaler needs "
            '("Required aspect fp64 is not supported"): fp32 training',
        )
    return TrainingPrecision(
        bf16=False,
        fp16=True,
        reason=f"{_where(device)} has no native bf16 but has fp64: fp16 with GradScaler",
    )


def training_precision_for_dtype(device: DeviceFacts, dtype: DtypeName) -> TrainingPrecision:
    """Mixed-precision flags for a model that computes in ``dtype`` on ``device``.

    bfloat16 → bf16; float16 → fp16 with GradScaler where the device has fp64, else fp32 (the
    scaler needs fp64); float32 → neither.
    """
    loaded = f"the model was loaded to compute in {dtype}"
    if dtype == "bfloat16":
        native = "" if device.native_bf16 else f" ({device.name} only emulates bf16: slow)"
        return TrainingPrecision(bf16=True, fp16=False, reason=f"bf16: {loaded}{native}")
    if dtype == "float16":
        if device.fp64:
            return TrainingPrecision(bf16=False, fp16=True, reason=f"fp16 with GradScaler: {loaded}")
        return TrainingPrecision(
            bf16=False,
            fp16=False,
            reason=f"fp32: {loaded}, but fp16 training needs GradScaler, which needs fp64, and "
            f'{device.name} has none ("Required aspect fp64 is not supported"); the trainable (LoRA) '
            "weights are fp32 and train without autocast",
        )
    return TrainingPrecision(bf16=False, fp16=False, reason=f"fp32: {loaded}")


def _where(device: DeviceFacts) -> str:
    if device.backend == "cuda" and device.compute_capability:
        major, minor = device.compute_capability
        return f"{device.name} (compute capability {major}.{minor})"
    if device.backend == "xpu":
        return f"{device.name} ({device.family})"
    return device.name
