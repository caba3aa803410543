"""Quantized checkpoints on disk (``xpukit merge --quantize int4|int8 --for cuda|xpu|cpu``).

The format for each device family is a pure decision, tested with injected torchao versions; the
refusal of a checkpoint written for another family is planned from its config alone (no weights).
int8 runs end to end on the CPU: written by the merge, loaded without quantizing again, the same
tokens as the same weights quantized at load. int4 for CUDA and XPU is packed by torch's operator
of that device only: tests/loading/test_saved_quant_gpu.py writes and loads it there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from xpukit.errors import InvalidRequestError, PlanError
from xpukit.planning.device.saved_quant import SAVED_KEY, check_merge_disk, saved_format

FOUND = "0.18.0"


# --- the format per family (pure) ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "family", "dtype", "label", "runs_on", "write_on"),
    [
        ("4bit", "cuda", "bfloat16", "torchao int4 (tile_packed_to_4d)", ("cuda",), "cuda"),
        ("4bit", "xpu", "bfloat16", "torchao int4 (plain_int32)", ("xpu",), "xpu"),
        ("4bit", "xpu", "float16", "torchao int4 (plain_int32)", ("xpu",), "xpu"),
        ("8bit", "cuda", "bfloat16", "torchao int8", ("cuda", "xpu", "cpu"), "cpu"),
        ("8bit", "xpu", "float16", "torchao int8", ("cuda", "xpu", "cpu"), "cpu"),
        ("8bit", "cpu", "float32", "torchao int8", ("cuda", "xpu", "cpu"), "cpu"),
    ],
)
def test_each_family_gets_the_format_its_quantized_load_takes(
    kind: str, family: str, dtype: str, label: str, runs_on: tuple[str, ...], write_on: str
) -> None:
    saved = saved_format(kind, family, dtype, FOUND)
    assert saved.on_disk and saved.label == label and saved.runs_on == runs_on and saved.write_on == write_on
    record = saved.record()
    assert record["for"] == family and record["dtype"] == dtype
    assert record["config"]["quant_method"] == "torchao"
    json.dumps(record)  # config.json holds it


@pytest.mark.parametrize(
    ("kind", "family", "dtype", "torchao", "why"),
    [
        ("4bit", "cpu", "bfloat16", FOUND, "no safetensors form"),  # Int4OpaqueTensor
        ("4bit", "cuda", "float16", FOUND, "bfloat16 only"),  # tinygemm: bitsandbytes would run instead
        ("8bit", "cuda", "bfloat16", None, "torchao is not installed"),
    ],
)
def test_no_on_disk_format_keeps_full_precision_and_says_why(
    kind: str, family: str, dtype: str, torchao: str | None, why: str
) -> None:
    saved = saved_format(kind, family, dtype, torchao)
    assert not saved.on_disk and saved.config is None
    assert "quantized at each load" in saved.reason and why in saved.reason


def test_an_unknown_family_is_refused_with_the_valid_ones() -> None:
    with pytest.raises(InvalidRequestError, match="cuda, xpu, cpu"):
        saved_format("8bit", "mps", "float16", FOUND)


def test_the_disk_check_counts_the_full_and_the_quantized_weights() -> None:
    saved = saved_format("4bit", "cuda", "bfloat16", FOUND)
    # 1000 quantizable weights of 2 bytes plus 100 bytes of others; at 4 bits: 500 + 100.
    args = {"out": "o", "full_bytes": 2100, "four_bit_bytes": 600, "quantizable": 1000}
    need = check_merge_disk(**args, saved=saved, free=None)
    assert need == 2100 + 100 + 1000 * 4.25 // 8
    assert check_merge_disk(**args, saved=None, free=None) == 2100
    with pytest.raises(PlanError, match="Nothing was written"):
        check_merge_disk(**args, saved=saved, free=need)  # the margin is missing


# --- a checkpoint written for another family (planned from its config) ---------------------------


def _int4_cuda_config_only(wide_model: Path, out: Path) -> Path:
    """The config.json of an int4 checkpoint written for CUDA (no weights: the plan reads none)."""
    saved = saved_format("4bit", "cuda", "bfloat16", FOUND)
    config = json.loads((wide_model / "config.json").read_text())
    kwargs = {"group_size": 128, "int4_packing_format": "tile_packed_to_4d", "set_inductor_config": False}
    config["quantization_config"] = {
        "quant_method": "torchao",
        "quant_type": {"default": {"_type": "Int4WeightOnlyConfig", "_version": 2, "_data": kwargs}},
    }
    config[SAVED_KEY] = saved.record()
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_checkpoint_for_another_family_is_refused_before_any_weight(
    wide_model: Path, tmp_path: Path
) -> None:
    from xpukit.planning.plan import plan_load

    path = _int4_cuda_config_only(wide_model, tmp_path / "int4-cuda")
    with pytest.raises(InvalidRequestError) as info:
        plan_load(str(path), device="cpu")
    said = str(info.value)
    assert "written for cuda" in said and "torchao int4 (tile_packed_to_4d)" in said
    assert "device='cuda'" in said and "--quantize int4 --for cpu" in said
    # Planned for an H200 it is the plan's format, loaded as it is: no quantization_config passed.
    plan = plan_load(str(path), facts="h200")
    assert plan.decision("quantization").value == "torchao int4 (tile_packed_to_4d)"
    assert plan.quantization == "torchao" and plan.model_facts.pre_quantized_bits == 4
    assert "not quantized again" in plan.decision("quantization").reason
    assert "quantization_config" not in plan.from_pretrained_kwargs()
    assert plan.decode is not None and not plan.decode.fused_projections  # as a quantized load decides


# --- int8 end to end on the CPU ------------------------------------------------------------------


@pytest.fixture(scope="module")
def int8_merge(wide_model: Path, tmp_path_factory: pytest.TempPathFactory, perturbed_adapter: Any) -> Path:
    """An adapter on the wide tiny qwen3, merged in bfloat16 by the CLI twice: ``full`` (full precision)
    and ``int8`` (``--quantize 8bit``, for this machine: the CPU)."""
    from xpukit.cli.main import main

    root = tmp_path_factory.mktemp("saved-int8")
    perturbed_adapter(wide_model, root / "adapter", quantize=None)
    common = ["--into", "original", "--dtype", "bfloat16"]
    merge = ["merge", str(wide_model), str(root / "adapter")]
    assert main([*merge, str(root / "full"), *common]) == 0
    assert main([*merge, str(root / "int8"), *common, "--quantize", "8bit"]) == 0
    return root


def test_cli_merge_int8_writes_a_checkpoint_that_loads_without_quantizing(
    int8_merge: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from torchao.quantization import Int8Tensor
    from transformers import AutoModelForCausalLM

    from xpukit import load_for_xpu

    out, full = int8_merge / "int8", int8_merge / "full"
    config = json.loads((out / "config.json").read_text())
    assert "xpukit_quantize" not in config  # the older record is not written for real quantized weights
    assert config[SAVED_KEY]["format"] == "torchao int8" and config[SAVED_KEY]["for"] == "cpu"
    assert config["quantization_config"]["quant_method"] == "torchao"
    assert not list(out.glob(".full-precision*")) and not list(out.parent.glob(".*.partial"))
    assert (out / "model.safetensors").stat().st_size < 0.7 * (full / "model.safetensors").stat().st_size

    at_load = load_for_xpu(str(full), device="cpu", dtype="bfloat16", quantize="8bit")

    def no_quantizing(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a saved int8 checkpoint was quantized again at load")

    monkeypatch.setattr(Int8Tensor, "from_hp", classmethod(no_quantizing))  # any quantizing fails
    saved = load_for_xpu(str(out), device="cpu")  # dtype from the checkpoint's record: bfloat16
    plain = AutoModelForCausalLM.from_pretrained(out)  # transformers alone reads it too
    assert saved.xpukit_plan.dtype == "bfloat16"
    assert "written in" in saved.xpukit_plan.decision("dtype").reason
    assert saved.xpukit_plan.decision("quantization").value == "torchao int8"
    assert type(saved.model.layers[0].mlp.up_proj.weight).__name__ == "Int8Tensor"
    assert type(plain.model.layers[0].mlp.up_proj.weight).__name__ == "Int8Tensor"
    ids = torch.arange(3, 3 + 7 * 12, 7).remainder(1000).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(saved(ids).logits, at_load(ids).logits)  # the same int8 weights and scales
        got = saved.generate(ids, max_new_tokens=8, do_sample=False)
        want = at_load.generate(ids, max_new_tokens=8, do_sample=False)
    assert got.tolist() == want.tolist()
    # each weight rebuilt from its own metadata (docs/export.md "To another machine"), then put back
    from transformers.integrations import torchao as integration

    assert any(e.what == "torchao read" for e in saved.xpukit_plan.events)
    assert not any(e.what == "torchao read" for e in at_load.xpukit_plan.events)
    assert not hasattr(integration.unflatten_tensor_state_dict, "__wrapped__")


def test_int4_for_a_family_this_machine_lacks_is_refused_before_any_weight(
    int8_merge: Path, wide_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from xpukit.loading import load as load_module
    from xpukit.loading.save_merged import save_merged

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("weights were read")

    monkeypatch.setattr(load_module, "load_for_xpu", never)
    out = int8_merge / "int4-cuda"
    with pytest.raises(InvalidRequestError, match="no cuda device") as info:
        save_merged(
            str(wide_model),
            int8_merge / "adapter",
            out,
            dtype="bfloat16",
            merge="original",
            quantize="int4",
            for_family="cuda",
        )
    assert "--quantize int8" in str(info.value)
    with pytest.raises(InvalidRequestError, match="without --quantize"):
        save_merged(str(wide_model), int8_merge / "adapter", out, merge="original", for_family="xpu")
    assert not out.exists() and not list(int8_merge.glob(".*.partial"))


def test_too_little_disk_is_refused_before_any_weight(
    int8_merge: Path, wide_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from xpukit.loading import load as load_module
    from xpukit.loading import quantized_checkpoint
    from xpukit.loading.save_merged import save_merged

    monkeypatch.setattr(load_module, "load_for_xpu", lambda *a, **k: pytest.fail("weights were read"))
    monkeypatch.setattr(quantized_checkpoint, "free_bytes", lambda out: 2**20)
    out = int8_merge / "no-room"
    with pytest.raises(PlanError, match=r"MiB free\. Nothing was written"):
        save_merged(str(wide_model), int8_merge / "adapter", out, merge="original", quantize="int8")
    assert not out.exists()


def test_a_load_cannot_quantize_a_saved_checkpoint_again(int8_merge: Path, wide_model: Path) -> None:
    from xpukit.planning.plan import plan_load

    out = int8_merge / "int8"
    with pytest.raises(InvalidRequestError, match="already quantized"):
        plan_load(str(out), device="cpu", quantize="4bit")
    copy = int8_merge / "copy"
    shutil.copytree(out, copy)
    config = json.loads((copy / "config.json").read_text())
    config[SAVED_KEY]["runs_on"] = ["xpu"]  # as a plain_int32 checkpoint says
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequestError, match="--for cpu"):
        plan_load(str(copy), device="cpu")


# --- each weight rebuilt from its own metadata (docs/export.md "To another machine") ------------


def _checkpoint_metadata(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return dict(f.metadata())


def test_own_metadata_keeps_the_weights_in_the_call_only() -> None:
    from xpukit.loading.torchao_read import own_metadata

    metadata = {
        "tensor_names": json.dumps(["a.q.weight", "a.q.bias", "a.k.weight", "norm.weight"]),
        "a.q.weight": "{q}",
        "a.q.bias": "{qb}",
        "a.k.weight": "{k}",
        "norm.weight": "{n}",
    }
    scoped = own_metadata({"a.q._weight_qdata": 1, "a.q._weight_scale": 2, "a.q.bias": 3}, metadata)
    assert json.loads(scoped.pop("tensor_names")) == ["a.q.weight", "a.q.bias"]
    assert scoped == {"a.q.weight": "{q}", "a.q.bias": "{qb}"}
    assert json.loads(own_metadata({"norm.weight": 0}, metadata)["tensor_names"]) == ["norm.weight"]


def test_the_scoped_rebuild_equals_torchaos_on_a_real_checkpoint(int8_merge: Path) -> None:
    """Every weight of a real int8 checkpoint, handed over as transformers hands it (its own tensors,
    the whole metadata): the same tensors, type and attributes as torchao's own call gives."""
    import torch
    from safetensors.torch import load_file
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    from xpukit.loading.torchao_read import scoped_unflatten

    out = int8_merge / "int8"
    metadata, tensors = _checkpoint_metadata(out), load_file(str(out / "model.safetensors"))
    scoped = scoped_unflatten(unflatten_tensor_state_dict)
    names = json.loads(metadata["tensor_names"])
    quantized = [n for n in names if json.loads(metadata[n])["_type"] != "Tensor"]
    assert len(quantized) >= 7  # every linear layer of the tiny model
    for name in names:
        module, _, attr = name.rpartition(".")
        own = {k: v for k, v in tensors.items() if k == name or k.startswith(f"{module}._{attr}_")}
        want, want_left = unflatten_tensor_state_dict(own, metadata)
        got, got_left = scoped(own, metadata)
        if not own:  # a tied weight listed without tensors of its own (lm_head): nothing either way
            assert got == want == {} and not got_left and not want_left
            continue
        assert list(got) == list(want) == [name] and not got_left and not want_left
        a, b = got[name], want[name]
        assert type(a) is type(b)
        if type(a).__name__ == "Int8Tensor":
            assert torch.equal(a.qdata, b.qdata) and torch.equal(a.scale, b.scale)
            assert a.block_size == b.block_size and a.shape == b.shape
        else:
            assert torch.equal(a, b)


def test_the_wrapper_is_put_back_when_the_load_fails() -> None:
    from transformers.integrations import torchao as integration

    from xpukit.loading.torchao_read import scoped_torchao_read

    original, check = integration.unflatten_tensor_state_dict, integration.is_metadata_torchao
    with pytest.raises(RuntimeError), scoped_torchao_read(True) as scoped:
        assert scoped and integration.unflatten_tensor_state_dict is not original
        assert integration.is_metadata_torchao is not check
        assert "__deepcopy__" in vars(integration.TorchAoDeserialize)
        with scoped_torchao_read(True) as inner:  # a load inside a load does not wrap twice
            assert not inner
        raise RuntimeError("the load failed")
    assert integration.unflatten_tensor_state_dict is original
    assert integration.is_metadata_torchao is check
    assert "__deepcopy__" not in vars(integration.TorchAoDeserialize)
    with scoped_torchao_read(False) as scoped:
        assert not scoped and integration.unflatten_tensor_state_dict is original


def test_a_copied_converter_shares_its_quantizer_only_while_reading() -> None:
    """transformers deep-copies a weight's converter per tensor; while reading, the copy keeps the
    quantizer (and the checkpoint's metadata it holds) instead of copying it."""
    import copy

    from transformers.integrations.torchao import TorchAoDeserialize

    from xpukit.loading.torchao_read import scoped_torchao_read

    quantizer = SimpleNamespace(metadata={"tensor_names": "[]", "big": ["entries"] * 3})
    op = TorchAoDeserialize(quantizer)
    with scoped_torchao_read(True):
        shared = copy.deepcopy(op)
    assert shared is not op and shared.hf_quantizer is quantizer
    copied = copy.deepcopy(op)
    assert copied.hf_quantizer is not quantizer and copied.hf_quantizer.metadata == quantizer.metadata


def test_the_metadata_check_runs_once_per_object_it_accepts() -> None:
    from xpukit.loading.torchao_read import checked_once

    calls: list[object] = []

    def original(metadata: dict[str, Any]) -> bool:
        calls.append(metadata)
        return metadata.get("ok") is True

    check = checked_once(original)
    good, equal, bad = {"ok": True}, {"ok": True}, {"ok": False}
    assert [check(good) for _ in range(3)] == [True] * 3 and calls == [good]
    assert check(equal) and len(calls) == 2  # another object (even an equal one) is checked itself
    assert not check(bad) and not check(bad) and len(calls) == 4  # a rejection is never remembered
