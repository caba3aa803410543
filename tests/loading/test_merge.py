"""merge=: a trained LoRA adapter merged into full-precision weights, and ``xpukit merge`` (CPU, float32).

The adapters are made on the tiny Qwen3 with ``lora_B`` drawn from a fixed seed (a trained adapter's
B is far from its zero start), once on the 4-bit base (QLoRA) and once on the full-precision base.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from xpukit.errors import InvalidRequestError, PlanError, XpukitError


@pytest.fixture(scope="module")
def adapters(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, perturbed_adapter: Callable[..., Path]
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("merge-adapters")
    return {
        "qlora": perturbed_adapter(tiny_model, root / "qlora", quantize="4bit"),
        "lora": perturbed_adapter(tiny_model, root / "lora", quantize=None),
    }


def _inputs(path: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from xpukit.demo.tiny import corpus_lines

    tok = AutoTokenizer.from_pretrained(path)
    return dict(tok(corpus_lines()[:4], return_tensors="pt", padding=True, truncation=True, max_length=24))


def _logits(model: Any, inputs: dict[str, Any]) -> Any:
    import torch

    with torch.no_grad():
        return model(**inputs).logits.float()


def _greedy(model: Any, inputs: dict[str, Any]) -> Any:
    import torch

    with torch.no_grad():
        return model.generate(input_ids=inputs["input_ids"][:2, :4], max_new_tokens=8, do_sample=False)


def _reference(base: Path, adapter: Path, *, quantize: str | None) -> Any:
    """The base + adapter, unmerged, as it was trained (4-bit layers on the training kernel)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from xpukit import plan_load

    kwargs = plan_load(base, device="cpu", dtype="float32", quantize=quantize).from_pretrained_kwargs()
    model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
    for module in model.modules():  # bitsandbytes' CPU repacking off: the kernel training used
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return PeftModel.from_pretrained(model, adapter).eval()


def _merged(base: Path, adapter: Path, merge: Any) -> Any:
    from xpukit import load_for_xpu

    return load_for_xpu(base, device="cpu", dtype="float32", lora=str(adapter), merge=merge)


def _is_plain(model: Any) -> bool:
    return not hasattr(model, "peft_config") and not any(hasattr(m, "lora_A") for m in model.modules())


# --- merged outputs -------------------------------------------------------------------------------


def test_original_merge_equals_full_precision_base_plus_adapter(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    import torch

    inputs = _inputs(tiny_model)
    reference = _reference(tiny_model, adapters["lora"], quantize=None)
    merged = _merged(tiny_model, adapters["lora"], "original")
    assert type(merged).__name__ == "Qwen3ForCausalLM" and _is_plain(merged)
    want, got = _logits(reference, inputs), _logits(merged, inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert torch.equal(_greedy(merged, inputs), _greedy(reference, inputs))
    assert "merged 14 LoRA layers into the original weights" in " ".join(
        e.actual for e in merged.xpukit_plan.events
    )


def test_dequantized_merge_equals_the_trained_4bit_model(tiny_model: Path, adapters: dict[str, Path]) -> None:
    """The default reproduces the QLoRA model; the original weights move it by the quantisation error."""
    import torch

    inputs = _inputs(tiny_model)
    reference = _reference(tiny_model, adapters["qlora"], quantize="4bit")
    want = _logits(reference, inputs)
    merged = _merged(tiny_model, adapters["qlora"], True)
    assert _is_plain(merged) and merged.dtype == torch.float32
    assert not getattr(merged.config, "quantization_config", None)
    got = _logits(merged, inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
    assert torch.equal(_greedy(merged, inputs), _greedy(reference, inputs))
    into_original = _logits(_merged(tiny_model, adapters["qlora"], "original"), inputs)
    effect = (into_original - want).abs().mean().item()
    assert effect > 100 * (got - want).abs().mean().item(), effect


# --- the plan -------------------------------------------------------------------------------------


def test_merge_decision_source_and_reason(tiny_model: Path, adapters: dict[str, Path]) -> None:
    from xpukit import plan_load

    plan = plan_load(tiny_model, facts="cpu", lora=adapters["qlora"], merge=True)
    decision = plan.decision("merge")
    assert decision.source == "user" and decision.value == "dequantized, cpu"
    assert "xpukit_base.json says the adapter trained with its base held in 4-bit (nf4" in decision.reason
    assert plan.merge is not None and plan.merge.base_from == "record" and not plan.warnings
    assert "fit cpu alone" in decision.reason and "the plan's dtype decision" in decision.reason
    assert "all 28 tensors match" in decision.reason
    assert {v for v, _ in decision.rejected} == {"4bit", "original"}
    assert plan.merge is not None and plan.merge.quantization_config["bnb_4bit_use_double_quant"] is True
    as_json = json.loads(json.dumps(plan.to_dict()))
    assert as_json["merge"]["base"] == "dequantized" and as_json["merge"]["device"] == "cpu"
    original = plan_load(tiny_model, facts="cpu", lora=adapters["lora"], merge="Original")
    assert original.decision("merge").reason.startswith("merge='original': ")
    assert original.merge is not None and original.merge.quantization_config is None


def _fake_adapter(root: Path, tensors: dict[str, list[int]], base_name: str = "Qwen/Qwen3-8B") -> Path:
    """An adapter directory whose safetensors header has these shapes (the data is zeros)."""
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    (root / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 1, "lora_alpha": 2, "base_model_name_or_path": base_name})
    )
    save_file(
        {k: torch.zeros(shape) for k, shape in tensors.items()}, str(root / "adapter_model.safetensors")
    )
    return root


_Q8B = {  # Qwen3-8B: hidden 4096, 32 query heads and 8 KV heads of 128
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": [1, 4096],
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": [4096, 1],
    "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight": [1024, 1],
}


@pytest.mark.parametrize(
    ("profile", "shape", "device", "moved"),
    [
        ("h100", "qwen3-8b", "cuda:0", False),
        ("arc-b580", "qwen3-8b", "cpu", True),
        ("cpu", "qwen3-0.6b", "cpu", False),
    ],
)
def test_merge_placed_by_fit(tmp_path: Path, profile: str, shape: str, device: str, moved: bool) -> None:
    from xpukit import plan_load
    from xpukit.planning.model.reference_models import reference_config

    adapter = _fake_adapter(tmp_path / "a", _Q8B if shape == "qwen3-8b" else {})
    plan = plan_load(reference_config(shape), facts=profile, lora=adapter, merge="original", dtype="bfloat16")
    assert plan.merge is not None and plan.merge.device == device and plan.merge.moved_to_cpu is moved
    assert plan.device_map == device
    reason = plan.decision("merge").reason
    if moved:  # 15.26 GiB of bf16 weights do not fit a 12 GB Arc B580: on the CPU, said with the numbers
        assert "do not fit xpu:0 alone" in reason and "merged on the CPU" in reason
        assert plan.device.backend == "cpu" and plan.max_memory is None
        assert plan.decision("device_map").value == "cpu" and "merge:" in plan.decision("device_map").reason
    else:
        assert f"fit {device} alone" in reason


def test_merge_that_fits_nowhere_is_a_plan_error(tmp_path: Path) -> None:
    from xpukit import plan_load
    from xpukit.planning.model.reference_models import reference_config

    adapter = _fake_adapter(tmp_path / "a", {})
    # 61 GiB of bf16 weights: split over the two 64 GiB stacks, but a merge needs them in one memory.
    with pytest.raises(
        PlanError, match=r"one memory .*the CPU has 24\.00 GiB usable.*Fix: merge on a machine"
    ):
        plan_load(reference_config("qwen3-32b"), facts="max-1550", lora=adapter, merge=True, dtype="bfloat16")


def test_shapes_of_another_base_refused_unless_forced(tmp_path: Path) -> None:
    from xpukit import plan_load
    from xpukit.planning.model.reference_models import reference_config

    wrong = {**_Q8B, "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight": [4096, 1]}
    adapter = _fake_adapter(tmp_path / "a", wrong, base_name="meta-llama/Llama-3.1-8B")
    config = reference_config("qwen3-8b")
    with pytest.raises(InvalidRequestError) as err:
        plan_load(config, facts="h100", lora=adapter, merge=True)
    message = str(err.value)
    assert "1 of its 3 tensors do not match" in message
    assert "has shape [4096, 1], the base's model.layers.0.self_attn.k_proj has out_features 1024" in message
    assert "'meta-llama/Llama-3.1-8B'" in message and "force=True" in message
    plan = plan_load(config, facts="h100", lora=adapter, merge=True, force=True)
    assert any(w.startswith("force=True: ") and "k_proj" in w for w in plan.warnings)
    assert plan.merge is not None and plan.merge.adapter_check.startswith("force=True")


def test_another_base_name_with_matching_shapes_is_a_warning(tmp_path: Path) -> None:
    from xpukit import plan_load
    from xpukit.planning.model.reference_models import reference_config

    plan = plan_load(
        reference_config("qwen3-8b"),
        facts="h100",
        lora=_fake_adapter(tmp_path / "a", _Q8B, base_name="someone/another-model"),
        merge=True,
    )
    assert any("'someone/another-model'" in w and "shape matches" in w for w in plan.warnings)
    assert plan.merge is not None and "(a warning only)" in plan.merge.adapter_check
    same = plan_load(
        reference_config("qwen3-8b"),
        facts="h100",
        lora=_fake_adapter(
            tmp_path / "b", _Q8B, base_name="/models/hub/models--Qwen--qwen3-8b/snapshots/abc"
        ),
        merge=True,
    )
    assert (
        same.merge is not None and same.merge.adapter_check == "all 3 tensors match the base's module shapes"
    )


def test_a_real_adapter_of_a_smaller_model_is_refused_before_loading(
    tiny_model_factory: Callable[..., Path], adapters: dict[str, Path]
) -> None:
    from xpukit import load_for_xpu

    wider = tiny_model_factory("qwen3", hidden_size=128, intermediate_size=256)
    with pytest.raises(InvalidRequestError, match=r"\d+ of its 28 tensors do not match the base's modules"):
        load_for_xpu(wider, device="cpu", lora=adapters["lora"], merge=True)


# --- refusals -------------------------------------------------------------------------------------

REFUSALS = [
    ({"merge": True}, "no lora= was given", "lora='path/to/adapter'"),
    ({"merge": True, "lora": True}, "new adapters have nothing trained to merge", "save_pretrained"),
    ({"merge": "fp16", "lora": "ADAPTER"}, "merge='fp16' is not understood", "'original'"),
    (
        {"merge": True, "lora": "ADAPTER", "quantize": "4bit"},
        "never merges into quantized weights",
        "drop quantize=",
    ),
    ({"merge": True, "lora": "ADAPTER", "quantize": "auto"}, "quantize='auto'", "drop quantize="),
    ({"lora": True, "force": True}, "names no adapter directory", "lora='adapter_dir', force=True"),
    ({"merge": True, "lora": "ADAPTER", "trainable": True}, "no adapter left to train", "drop merge="),
    (
        {"merge": True, "lora": "ADAPTER", "strategy": "ddp"},
        "strategy='ddp'",
        "xpukit merge BASE ADAPTER OUT",
    ),
    ({"merge": True, "lora": "ADAPTER", "max_memory": {"cpu": "1GiB"}}, "max_memory=", "pass device="),
]


@pytest.mark.parametrize(("kwargs", "found", "fix"), REFUSALS, ids=[f"{i}" for i in range(len(REFUSALS))])
def test_refusals_name_the_fix_and_leave_the_environment(
    tiny_model: Path, adapters: dict[str, Path], kwargs: dict[str, Any], found: str, fix: str
) -> None:
    from xpukit import load_for_xpu

    kwargs = {k: (str(adapters["qlora"]) if v == "ADAPTER" else v) for k, v in kwargs.items()}
    env = dict(os.environ)
    with pytest.raises(InvalidRequestError) as err:
        load_for_xpu(tiny_model, device="cpu", **kwargs)
    assert found in str(err.value) and fix in str(err.value), str(err.value)
    assert dict(os.environ) == env


# --- xpukit merge ---------------------------------------------------------------------------------


def _header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    header.pop("__metadata__", None)
    return header


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "xpukit", "merge", *argv], capture_output=True, text=True, timeout=240
    )


@pytest.mark.slow
def test_cli_round_trip(bf16_base: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    proc = _cli(str(bf16_base), str(adapters["qlora"]), str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = " ".join(proc.stdout.split())  # unwrapped
    # The adapter trained in float32 (its record says so): merged in it, not in the base's bf16.
    assert "dtype float32: the dtype the adapter was trained in (float32), recorded with it in" in said
    assert "into the dequantised 4-bit base of" in said and "(as its xpukit_base.json says), on cpu" in said
    assert f"the tokenizer from {bf16_base}" in said
    assert "Plan for" not in proc.stdout and len(proc.stdout.splitlines()) < 15  # --explain prints it
    # Other libraries' messages and progress bars only with --verbose.
    assert "Loading weights" not in proc.stderr and "Writing model shards" not in proc.stderr
    assert "[transformers]" not in proc.stderr and not re.search(r"^W\d{4} ", proc.stderr, re.M)
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= names
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    assert {v["dtype"] for v in _header(out / "model.safetensors").values()} == {"F32"}
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and "quantization_config" not in config
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(reloaded).__name__ == "Qwen3ForCausalLM" and reloaded.dtype == torch.float32
    assert AutoTokenizer.from_pretrained(out).vocab_size > 0
    inputs = _inputs(bf16_base)
    from xpukit import load_for_xpu

    in_process = load_for_xpu(bf16_base, device="cpu", lora=str(adapters["qlora"]), merge=True)
    torch.testing.assert_close(_logits(reloaded, inputs), _logits(in_process, inputs), rtol=0, atol=0)

    again = _cli(str(bf16_base), str(adapters["qlora"]), str(out))  # OUT is not empty now
    assert again.returncode == 1 and "already exists and is not an empty directory" in again.stderr


@pytest.mark.slow
def test_cli_dtype_json_and_tokenizer_from_the_adapter(
    bf16_base: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    adapter = tmp_path / "adapter"
    shutil.copytree(adapters["lora"], adapter)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bf16_base / name, adapter / name)
    out = tmp_path / "merged"
    proc = _cli(
        str(bf16_base),
        str(adapter),
        str(out),
        "--dtype",
        "float32",
        "--into",
        "original",
        "--json",
        "--verbose",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Loading weights" in proc.stderr  # --verbose: transformers' own output, on stderr
    report = json.loads(proc.stdout)  # stdout is the JSON alone (tests/cli/test_cli_output.py)
    if importlib.util.find_spec("deepspeed") is not None:  # peft imports it: its line goes to stderr
        assert "Setting accelerator to CPU" in proc.stderr
    assert report["dtype"] == "float32" and report["dtype_reason"] == "asked (--dtype)"
    assert report["tokenizer_from"] == str(adapter)
    assert report["plan"]["merge"]["base"] == "original" and "model.safetensors" in report["files"]
    assert {v["dtype"] for v in _header(out / "model.safetensors").values()} == {"F32"}


def test_cli_refusals_in_process(tiny_model: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    import contextlib
    import io

    from xpukit.cli.main import main

    cases = [
        (["--dtype", "int8"], "--dtype 'int8' is not a dtype", "Valid: bfloat16, float16, float32"),
        (
            ["--into", "original", "--dtype", "fp8"],
            "--dtype 'fp8'",
            "Default: the dtype the adapter was trained in, as its xpukit_base.json records, else",
        ),
    ]
    for extra, found, fix in cases:
        env = dict(os.environ)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(["merge", str(tiny_model), str(adapters["lora"]), str(tmp_path / "out"), *extra])
        assert code == 1 and err.getvalue().startswith("xpukit merge: error: ")
        assert found in err.getvalue() and fix in err.getvalue()
        assert dict(os.environ) == env and not (tmp_path / "out").exists()
    with pytest.raises(XpukitError, match="is the adapter's directory"):
        from xpukit.loading.save_merged import save_merged

        save_merged(tiny_model, adapters["lora"], adapters["lora"])


def test_without_a_record_the_merge_takes_the_base_checkpoints_dtype_and_says_so(
    bf16_base: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    from xpukit.cli.merge import summary
    from xpukit.loading.save_merged import save_merged

    adapter = tmp_path / "adapter"
    shutil.copytree(adapters["lora"], adapter)
    (adapter / "xpukit_base.json").unlink()
    result = save_merged(bf16_base, adapter, tmp_path / "merged", merge="original")
    assert (result.dtype, result.dtype_from) == ("bfloat16", "checkpoint")
    said = " ".join(" ".join(summary(result, str(bf16_base))).split())  # unwrapped
    assert "dtype bfloat16: the base checkpoint's own dtype" in said
    assert "config.json says bfloat16); no xpukit_base.json records the dtype the adapter trained in" in said
    assert result.to_dict()["dtype_from"] == "checkpoint"


def test_a_device_too_small_merges_on_the_cpu_for_real(tiny_model: Path, adapters: dict[str, Path]) -> None:
    """Planned for an Arc B580 with 100 MiB free: the merge runs, and the model stays, on the CPU."""
    import dataclasses

    import torch

    from xpukit import load_for_xpu
    from xpukit.machine.profiles import machine_profile

    machine = machine_profile("arc-b580")
    small = dataclasses.replace(machine.devices[0], total_memory=100 * 2**20, free_memory=100 * 2**20)
    facts = dataclasses.replace(machine, devices=(small,))
    merged = load_for_xpu(tiny_model, facts=facts, dtype="float32", lora=str(adapters["qlora"]), merge=True)
    plan = merged.xpukit_plan
    assert plan.merge is not None and plan.merge.moved_to_cpu and plan.device.backend == "cpu"
    assert str(merged.device) == "cpu" and _is_plain(merged)
    assert "do not fit xpu:0 alone" in plan.decision("merge").reason
    assert plan.decision("device_map").value == "cpu" and plan.attn_implementation in {"sdpa", "eager"}
    inputs = _inputs(tiny_model)
    on_cpu = _merged(tiny_model, adapters["qlora"], True)
    torch.testing.assert_close(_logits(merged, inputs), _logits(on_cpu, inputs), rtol=0, atol=0)


@pytest.mark.slow  # a real `xpukit merge` process interrupted: the process is the point
def test_ctrl_c_after_a_complete_merge_exits_0_and_took_is_the_wall_time(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """The summary is printed when OUT is complete; a Ctrl-C while the interpreter then shuts down
    (about a second, freeing torch) leaves the exit code 0. "took" counts from the command's start."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "merged"
    argv = [sys.executable, "-m", "xpukit", "merge", str(tiny_model), str(adapters["qlora"]), str(out)]
    started = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    took = None
    for line in proc.stdout:
        if line.startswith("took "):
            seen = time.perf_counter() - started
            took = float(line.split()[1])
            proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0, proc.stderr.read() if proc.stderr else ""
    assert took is not None and (out / "model.safetensors").is_file()
    assert seen - 1.0 < took <= seen, (took, seen)  # the command's wall time, start-up included
