"""What the installed libraries' versions enable in xpukit: one line per feature, for ``xpukit doctor``.

A pure function of the versions ``doctor`` already gathered (:class:`xpukit.doctor.host.HostFacts`),
so it is tested with hand-made facts. The rules are the ones the planner applies (docs/known-issues.md
"transformers: the kernels version window", "transformers 5.25: use_kernels on by default").
"""

from __future__ import annotations

from collections.abc import Mapping

from xpukit._compat import EXTRAS, version_at_least

__all__ = ["enabled_by_versions"]


def enabled_by_versions(
    packages: Mapping[str, str | None], *, kernels_accepted: bool | None, kernels_reason: str
) -> list[str]:
    """One line per optional feature: the versions it rests on and whether it is on, or why not."""
    v = packages.get
    lines: list[str] = []
    tf = v("transformers")
    if kernels_accepted:
        lines.append(
            f"Hub kernels: on where cached or the Hub answers (flash-attn2 on XPU/CUDA, use_kernels): "
            f"{kernels_reason}"
        )
    else:
        lines.append(f"Hub kernels: off ({kernels_reason or 'kernels is not installed'})")
    if version_at_least(tf, "5.25"):
        lines.append(
            f"transformers {tf} turns use_kernels on when it is not given: xpukit always passes the "
            "plan's choice"
        )
    if v("liger-kernel") and v("triton"):
        lines.append(
            f"liger-kernel {v('liger-kernel')} (triton {v('triton')}): fused loss, RMSNorm, SwiGLU and RoPE "
            "in training on CUDA/XPU"
        )
    else:
        lines.append('liger-kernel: off (needs liger-kernel and triton: pip install "xpukit[liger]")')
    bnb = v("bitsandbytes")
    if bnb:
        xpu = "" if version_at_least(bnb, "0.48") else " (no XPU backend before 0.48)"
        lines.append(f"bitsandbytes {bnb}: 4-bit/8-bit loads and QLoRA{xpu}")
    else:
        lines.append('bitsandbytes: no quantize="4bit"/"8bit" (pip install "xpukit[quant]")')
    torchao, needed = v("torchao"), EXTRAS["torchao"].minimum or "0"
    if torchao and version_at_least(torchao, needed):
        lines.append(
            f'torchao {torchao}: quantize="4bit"/"8bit" loads to run (no adapters) in torchao int4/int8 '
            "weight-only, the faster format (QLoRA stays bitsandbytes nf4)"
        )
    else:
        why = f"torchao {torchao} is older than {needed}" if torchao else "no torchao"
        lines.append(
            f'torchao: {why}, so quantize="4bit"/"8bit" loads to run use bitsandbytes, the slower '
            'format (pip install "xpukit[serve]")'
        )
    lines.append(
        f"peft {v('peft')}: LoRA and QLoRA" if v("peft") else 'peft: no lora= (pip install "xpukit[lora]")'
    )
    lines.append(
        f"deepspeed {v('deepspeed')}: training_args(strategy='deepspeed')"
        if v("deepspeed")
        else "deepspeed: no strategy='deepspeed' (pip install \"xpukit[deepspeed]\")"
    )
    return lines
