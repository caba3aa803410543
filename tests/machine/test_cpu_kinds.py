"""The decisions that depend on the CPU's features, run as on both kinds of CPU in every run.

The facts are injected (``cpu_kind`` sets ``XPUKIT_CPU_FLAGS``), never read from the host, so a green
run on an AMD EPYC without AVX-512 means green on an AMX Xeon and the other way round.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from xpukit import detect, load_for_xpu, plan_load, training_args

NATIVE = {"native-bf16": True, "no-bf16": False}


def test_detected_cpu_follows_the_injected_kind(cpu_kind: str) -> None:
    cpu = detect(devices=False).cpu
    assert cpu.native_bf16 is NATIVE[cpu_kind]


def test_plan_dtype_on_the_cpu(tiny_model: Path, cpu_kind: str) -> None:
    plan = plan_load(tiny_model, device="cpu")
    assert plan.dtype == ("bfloat16" if NATIVE[cpu_kind] else "float32")
    assert ("native" in plan.decision("dtype").reason) is True


def test_training_precision_on_the_cpu(tiny_model: Path, cpu_kind: str, tmp_path: Path) -> None:
    model = load_for_xpu(tiny_model, device="cpu")
    args = training_args(model, output_dir=str(tmp_path), report_to="none")
    assert (args.bf16, args.fp16) == (NATIVE[cpu_kind], False)
    assert args.use_cpu


def test_qlora_trains_on_the_cpu(tiny_model: Path, cpu_kind: str, tmp_path: Path, six_steps: Any) -> None:
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    model = load_for_xpu(tiny_model, device="cpu", quantize="4bit", lora=True)
    assert model.xpukit_plan.dtype == ("bfloat16" if NATIVE[cpu_kind] else "float32")
    losses = six_steps(model, tiny_model, tmp_path)
    assert len(losses) == 6 and losses[-1] < losses[0]
