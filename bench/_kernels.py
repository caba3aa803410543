"""Device-kernel categories for the benchmarks' profiles (bench_qlora ``--profile``, bench_decode
``--breakdown``): one table, so both scripts count GEMM, attention, copies … the same way."""

from __future__ import annotations

# Kernel-name fragments by category, checked in this order (lower-case).
KERNEL_CATEGORIES = (
    ("dequant_4bit", ("kdequantize", "dequant", "nf4")),
    ("gemm", ("gemm", "gemv", "cutlass", "cublas", "nvjet", "xmma", "matmul", "_mm_", "splitk")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "mha", "efficient")),
    ("optimizer", ("multi_tensor_apply", "adam", "fused_adam")),
    ("copy_cast", ("copy", "memcpy", "memset")),  # dtype casts are direct_copy_kernel on CUDA
    ("elementwise", ("elementwise", "vectorized", "reduce", "silu", "swiglu", "rms", "norm", "softmax",
                     "mul", "add", "sigmoid", "cross_entropy", "rope", "fill", "triton")),
)  # fmt: skip


def kernel_category(name: str) -> str:
    """The category of a device kernel, from its name; ``other`` when no fragment matches."""
    low = name.lower()
    for category, fragments in KERNEL_CATEGORIES:
        if any(f in low for f in fragments):
            return category
    return "other"


def ms_per_step_by_category(us_by_name: dict[str, float], steps: int, digits: int = 2) -> dict[str, float]:
    """Device milliseconds per step by category, from microseconds per kernel name."""
    out: dict[str, float] = {}
    for name, us in us_by_name.items():
        category = kernel_category(name)
        out[category] = out.get(category, 0.0) + us
    return {k: round(v / 1e3 / steps, digits) for k, v in sorted(out.items())}
