"""Inference quantization chosen for speed: the decision on every device profile, and torchao on the CPU.

The decision (docs/planning.md "Quantization for inference") is pure given the device, the dtype and the
torchao version, which the tests inject. The CPU tests load torchao's int4 and int8 weight-only formats
for real (torchao, from ``xpukit[serve]``) and compare them with the same model unquantized.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from xpukit.errors import InvalidRequestError
from xpukit.machine.profiles import profile_names
from xpukit.planning.device import layout as layout_module
from xpukit.planning.device.serve_quant import TORCHAO_MIN, serve_format
from xpukit.planning.model.reference_models import reference_config
from xpukit.planning.plan import plan_load

FOUND = "0.18.0"

# profile -> (what quantize="4bit" takes, what quantize="8bit" takes) with torchao installed.
# "4bit"/"8bit" are bitsandbytes; the rest are the decision's values.
EXPECTED = {
    "max-1550": ("torchao int4 (plain_int32)", "torchao int8"),
    "max-1100": ("torchao int4 (plain_int32)", "torchao int8"),
    "arc-a770": ("torchao int4 (plain_int32)", "torchao int8"),
    "arc-b580": ("torchao int4 (plain_int32)", "torchao int8"),
    "arc-pro-b60": ("torchao int4 (plain_int32)", "torchao int8"),
    "lunar-lake": ("torchao int4 (plain_int32)", "torchao int8"),
    "meteor-lake": ("torchao int4 (plain_int32)", "torchao int8"),  # float16: the XPU kernel takes it
    "h100": ("torchao int4 (tile_packed_to_4d)", "torchao int8"),
    "h200": ("torchao int4 (tile_packed_to_4d)", "torchao int8"),
    "t4": ("4bit", "torchao int8"),  # compute capability 7.5, float16: no tinygemm
    "cpu-bf16": ("torchao int4 (cpu)", "torchao int8"),
    "laptop-16g": ("4bit", "torchao int8"),  # no native bf16: float32
    "cpu": ("4bit", "torchao int8"),  # float32: torchao int4 measured slower than nf4 there
}


@pytest.fixture
def torchao(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Pretend a torchao version (or none) is installed, as package metadata would say."""

    def set_version(version: str | None) -> None:
        monkeypatch.setattr(layout_module, "torchao_version", lambda: version)

    return set_version


def test_every_profile_is_in_the_table() -> None:
    assert set(EXPECTED) | {"apple-m2"} == set(profile_names())


@pytest.mark.parametrize("profile", sorted(EXPECTED))
@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_decision_on_every_profile(torchao: Any, profile: str, bits: str) -> None:
    torchao(FOUND)
    plan = plan_load(reference_config("qwen3-0.6b"), facts=profile, quantize=bits)
    decision = plan.decision("quantization")
    want = EXPECTED[profile][0 if bits == "4bit" else 1]
    assert decision.value == want
    if want.startswith("torchao"):
        assert plan.quantization == "torchao"
        assert plan.quantization_config is not None
        assert plan.quantization_config["quant_method"] == "torchao"
        assert "TorchAoConfig" in decision.reason
        assert any("bitsandbytes" in str(value) for value, _ in decision.rejected)
        assert plan.memory.weights == plan.model_facts.weights(plan.dtype, bits)  # sized as the bit width
        # where torchao writes this format to disk for the device's family, the command that does it once
        on_disk = bits == "8bit" or plan.device.backend in {"cuda", "xpu"}
        export = f"--quantize {'int4' if bits == '4bit' else 'int8'} --for {plan.device.backend}`"
        assert (export in decision.reason) is on_disk, decision.reason
    else:
        assert plan.quantization == bits
        assert "does not run here" in decision.reason
        assert decision.rejected and str(decision.rejected[0][0]).startswith("torchao")
    # Without torchao the same request falls back to bitsandbytes and says what would fix it.
    torchao(None)
    fallback = plan_load(reference_config("qwen3-0.6b"), facts=profile, quantize=bits)
    assert fallback.quantization == bits
    if want.startswith("torchao"):
        assert fallback.decision("quantization").source == "fallback"
        assert "pip install 'xpukit[serve]'" in fallback.decision("quantization").reason


def test_mps_has_no_4bit_format(torchao: Any) -> None:
    torchao(FOUND)
    with pytest.raises(InvalidRequestError, match="no MPS backend"):
        plan_load(reference_config("qwen3-0.6b"), facts="apple-m2", quantize="4bit")


def test_torchao_too_old_is_a_fallback() -> None:
    from xpukit.machine.profiles import device_profile

    fmt = serve_format(device_profile("arc-b580"), "4bit", "bfloat16", "0.13.0")
    assert fmt.library == "bitsandbytes" and fmt.torchao_missing
    assert f">={TORCHAO_MIN}" in fmt.reason


@pytest.mark.parametrize("profile", ["arc-b580", "h200", "cpu-bf16"])
def test_nf4_adapters_and_configs_keep_bitsandbytes(torchao: Any, profile: str) -> None:
    torchao(FOUND)
    config = reference_config("qwen3-0.6b")
    nf4 = plan_load(config, facts=profile, quantize="nf4")
    assert nf4.quantization == "4bit" and "'nf4' given" in nf4.decision("quantization").reason
    assert nf4.quantization_config is not None and nf4.quantization_config["bnb_4bit_quant_type"] == "nf4"
    qlora = plan_load(config, facts=profile, quantize="4bit", lora=True)
    assert qlora.quantization == "4bit"  # QLoRA trains against nf4


def test_auto_takes_the_fast_format_when_4bit_is_needed(torchao: Any) -> None:
    torchao(FOUND)
    plan = plan_load(reference_config("qwen3-8b"), facts="arc-b580", quantize="auto")
    assert plan.decision("quantization").value == "torchao int4 (plain_int32)"
    assert "does not fit" in plan.decision("quantization").reason
    fits = plan_load(reference_config("qwen3-0.6b"), facts="arc-b580", quantize="auto")
    assert fits.quantization is None


def test_an_explicit_torchao_config_wins(torchao: Any) -> None:
    torchao(FOUND)
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    given = TorchAoConfig(Int8WeightOnlyConfig())
    plan = plan_load(reference_config("qwen3-0.6b"), facts="arc-b580", quantize=given)
    assert plan.quantization == "torchao" and plan.user_quantization_config is given
    assert "passed to from_pretrained unchanged" in plan.decision("quantization").reason


# --- fast_decode over quantized weights ----------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "quantize", "static", "compiled", "said"),
    [
        ("h200", "4bit", True, "reduce-overhead", None),
        ("h200", "8bit", True, "reduce-overhead", None),
        ("arc-b580", "4bit", True, "default", None),
        ("arc-b580", "8bit", True, "default", None),
        ("h200", "nf4", False, False, "12.7 tokens/s in 10.32 GB against 19.0"),
        ("arc-b580", "nf4", False, False, "transformers' generate() does not compile them"),
    ],
)
def test_fast_decode_is_taken_only_where_it_beats_plain(
    torchao: Any, profile: str, quantize: str, static: bool, compiled: Any, said: str | None
) -> None:
    torchao(FOUND)
    plan = plan_load(reference_config("qwen3-8b"), facts=profile, quantize=quantize, fast_decode=True)
    decision = plan.decision("fast_decode")
    assert plan.decode is not None
    assert plan.decode.static_cache is static
    assert decision.value["compile"] == compiled
    if said is not None:
        assert said in decision.reason and decision.source == "fallback"
    else:
        # The cache is what the headroom's KV budget holds, never more.
        assert plan.decode.kv_bytes == plan.decode.max_cache_len * plan.model_facts.kv_bytes_per_token
        assert plan.decode.kv_bytes <= plan.memory.headroom
        # torchao int8 on CUDA: the step compiles with inductor's pattern matcher off (its int8
        # rewrite is aten._weight_int8pack_mm, the slow kernel), captured by the loop as always.
        int8 = quantize == "8bit" and profile == "h200"
        assert plan.decode.inductor_patterns is not int8
        assert ("pattern matcher off" in decision.reason) is int8
        options = plan.decode.loop_compile_options()
        assert options == (
            {"fullgraph": True, "dynamic": False, "options": {"pattern_matcher": False}}
            if int8
            else {"fullgraph": True, "dynamic": False, "mode": "default"}
        )


# --- torchao on the CPU, for real ----------------------------------------------------------------

# The model: conftest's wide_model, the tiny qwen3 with widths torchao's int4 groups divide.
# Relative L2 error of the last-position logits against the same model in float32, measured on
# 2026-12-02 (torchao 0.18.0, bitsandbytes 0.50.2, torch 2.13.0+cpu, an AMD EPYC): torchao int8 1.5e-2,
# torchao int4 1.76e-1 (bitsandbytes nf4 1.63e-1: the same order for 4 bits of random weights),
# bfloat16 alone 7.8e-3. The tolerances leave room for other CPUs' rounding, not for a wrong kernel
# (test_int4_matches_its_own_dequantized_weights checks the int4 product itself to 2e-2).
TOLERANCE = {"8bit": 0.05, "4bit": 0.3}


def _ids(n: int = 12) -> Any:
    import torch

    return torch.arange(3, 3 + 7 * n, 7).remainder(1000).unsqueeze(0)


def _load(path: Path, quantize: Any, dtype: str = "bfloat16") -> Any:
    from xpukit import load_for_xpu

    return load_for_xpu(str(path), device="cpu", dtype=dtype, quantize=quantize)


def _rel(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("bits", ["8bit", "4bit"])
def test_torchao_logits_close_to_full_precision(wide_model: Path, bits: str) -> None:
    import torch
    from torch._inductor import config as inductor

    reference = _load(wide_model, None, "float32")
    before = inductor.coordinate_descent_tuning
    model = _load(wide_model, bits)
    assert inductor.coordinate_descent_tuning == before  # set_inductor_config=False: no process-wide change
    kind = {"8bit": "Int8Tensor", "4bit": "Int4OpaqueTensor"}[bits]
    assert model.xpukit_plan.quantization == "torchao"
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head]
    assert linears and all(type(m.weight).__name__ == kind for m in linears)
    with torch.no_grad():
        got = model(_ids()).logits[0, -1]
        want = reference(_ids()).logits[0, -1]
        bf16 = _load(wide_model, None)(_ids()).logits[0, -1]
    assert _rel(got, want) < TOLERANCE[bits]
    assert _rel(bf16, want) < TOLERANCE["8bit"]  # the bf16 baseline itself, for scale


def test_int4_matches_its_own_dequantized_weights(wide_model: Path) -> None:
    """The int4 kernel computes what its weights say: same as a bf16 model holding them dequantized.

    The packed format has no ``dequantize``; a product with the identity reads the weights back.
    """
    import torch

    model = _load(wide_model, "4bit")
    plain = _load(wide_model, None)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and type(module.weight).__name__ == "Int4OpaqueTensor":
                eye = torch.eye(module.in_features, dtype=torch.bfloat16)
                plain.get_submodule(name).weight.copy_(torch.nn.functional.linear(eye, module.weight).T)
        assert _rel(model(_ids()).logits, plain(_ids()).logits) < 0.02  # bf16 rounding of two orders


def test_quantized_fast_path_gives_the_plain_greedy_tokens(wide_model: Path) -> None:
    """xpukit's decode loop (static cache, fixed buffers) over torchao int8 weights, eager on the CPU."""
    import torch

    from xpukit.loading.decode.install import install_decode_loop

    new = 10
    model = _load(wide_model, "8bit", "float32")
    with torch.no_grad():
        plain = model.generate(
            _ids(), max_new_tokens=new, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
    top = torch.stack(plain.scores, 1).topk(2, -1).values
    assert (top[..., 0] - top[..., 1]).min().item() > 1e-3  # clear margins: equal tokens mean equal paths
    install_decode_loop(model, max_cache_len=256, compile_options=None)
    got = model.generate(_ids(), max_new_tokens=new, do_sample=False)
    assert model.xpukit_last_decode["loop"] == "xpukit"
    assert got.tolist() == plain.sequences.tolist()


# --- merge --quantize: a checkpoint that loads quantized -----------------------------------------


def test_merged_int4_for_the_cpu_records_it_and_loads_quantized(
    wide_model: Path, tmp_path: Path, perturbed_adapter: Any
) -> None:
    import json

    from xpukit.loading.save_merged import save_merged

    perturbed_adapter(wide_model, tmp_path / "adapter", quantize=None)
    # torchao's CPU int4 has no on-disk form: full precision, recorded to load quantized (the older record)
    result = save_merged(
        str(wide_model),
        tmp_path / "adapter",
        tmp_path / "out",
        dtype="bfloat16",
        merge="original",
        quantize="int4",
    )
    assert result.quantize == "4bit" and result.to_dict()["quantize"] == "4bit"
    assert result.quantized is not None and not result.quantized["on_disk"]
    assert "no safetensors form" in result.quantized["reason"]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["xpukit_quantize"] == "4bit"
    model = _load(tmp_path / "out", None)  # quantize left out: the record decides
    decision = model.xpukit_plan.decision("quantization")
    assert decision.value == "torchao int4 (cpu)" and "recorded in the checkpoint" in decision.reason
    assert type(model.model.layers[0].self_attn.q_proj.weight).__name__ == "Int4OpaqueTensor"
    full = _load(tmp_path / "out", "none")
    assert full.xpukit_plan.quantization is None
    with pytest.raises(InvalidRequestError, match="int4, int8 "):
        save_merged(str(wide_model), tmp_path / "adapter", tmp_path / "bad", quantize="nf4")


def test_cli_merge_quantize_flag(
    wide_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], perturbed_adapter: Any
) -> None:
    import json

    from xpukit.cli.main import main

    perturbed_adapter(wide_model, tmp_path / "adapter", quantize=None)
    argv = ["merge", str(wide_model), str(tmp_path / "adapter"), str(tmp_path / "out"), "--into", "original"]
    assert main([*argv, "--quantize", "int8", "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert said["quantize"] == "8bit" and said["quantized"]["on_disk"] and said["quantized"]["for"] == "cpu"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "xpukit_quantize" not in config and config["xpukit_quantized"]["format"] == "torchao int8"
    assert (
        _load(tmp_path / "out", None, "float32").xpukit_plan.decision("quantization").value == "torchao int8"
    )


def test_a_cpu_int4_load_says_how_many_layers_it_quantized(tmp_path: Path) -> None:
    """A 64-wide tiny model: torchao's CPU int4 takes only the layers whose input width is a multiple
    of its group size; the load says how many of the linear layers it quantized."""
    pytest.importorskip("torchao")
    from xpukit import load_for_xpu
    from xpukit.demo.tiny import build_tiny_model

    path = build_tiny_model("qwen3", tmp_path / "m", seed=0)
    model = load_for_xpu(path, device="cpu", dtype="bfloat16", quantize="4bit")  # torchao int4 on the CPU
    said = [str(e.actual) for e in model.xpukit_plan.events if e.what == "quantized_layers"]
    assert len(said) == 1, (model.xpukit_plan.quantization, [e.what for e in model.xpukit_plan.events])
    assert " linear layers quantized" in said[0]
    import re

    done, total = map(int, re.search(r"(\d+) of (\d+) linear layers", said[0]).groups())
    assert 0 < done < total and "group size" in said[0]
