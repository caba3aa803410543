"""A model's weights quantized once and written (``xpukit export SOURCE OUT --quantize``).

int8 runs end to end on the CPU: written from the wide tiny Qwen3, loaded by ``load_for_xpu`` and
by transformers alone without quantizing again, the same logits as the same weights quantized at
load. Every refusal comes before any weight is read (the writer is replaced by one that fails).
int4 for CUDA and XPU is packed on that device only (tests/loading/test_saved_quant_gpu.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from xpukit.errors import InvalidRequestError, PlanError
from xpukit.planning.device.saved_quant import SAVED_KEY


@pytest.fixture(scope="module")
def int8_export(wide_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wide tiny Qwen3 exported by the CLI: ``--quantize int8`` for this machine (the CPU)."""
    from xpukit.cli.main import main

    out = tmp_path_factory.mktemp("export-int8") / "int8"
    assert main(["export", str(wide_model), str(out), "--quantize", "int8", "--dtype", "bfloat16"]) == 0
    return out


def test_an_exported_int8_checkpoint_loads_without_quantizing(
    int8_export: Path, wide_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from torchao.quantization import Int8Tensor
    from transformers import AutoModelForCausalLM

    from xpukit import load_for_xpu

    config = json.loads((int8_export / "config.json").read_text())
    assert config[SAVED_KEY]["format"] == "torchao int8" and config[SAVED_KEY]["for"] == "cpu"
    assert config["quantization_config"]["quant_method"] == "torchao"
    assert (int8_export / "tokenizer.json").is_file() or (int8_export / "tokenizer_config.json").is_file()
    assert not list(int8_export.parent.glob(".*.partial"))
    at_load = load_for_xpu(str(wide_model), device="cpu", dtype="bfloat16", quantize="8bit")

    def no_quantizing(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an exported int8 checkpoint was quantized again at load")

    monkeypatch.setattr(Int8Tensor, "from_hp", classmethod(no_quantizing))
    saved = load_for_xpu(str(int8_export), device="cpu")
    plain = AutoModelForCausalLM.from_pretrained(int8_export)
    assert saved.xpukit_plan.decision("quantization").value == "torchao int8"
    assert type(plain.model.layers[0].self_attn.q_proj.weight).__name__ == "Int8Tensor"
    ids = torch.arange(3, 3 + 7 * 12, 7).remainder(1000).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(saved(ids).logits, at_load(ids).logits)
        assert torch.equal(plain(ids).logits, at_load(ids).logits)


@pytest.fixture
def no_weights_read(monkeypatch: pytest.MonkeyPatch) -> None:
    from xpukit.loading import save_quantized

    monkeypatch.setattr(save_quantized, "write_quantized", lambda *a, **k: pytest.fail("weights were read"))


@pytest.mark.usefixtures("no_weights_read")
@pytest.mark.parametrize(
    ("quantize", "family", "match"),
    [
        ("int4", "cpu", "--quantize int8"),
        ("int4", "cuda", "no cuda device"),
        ("int3", None, "Valid: int4, int8"),
    ],
)
def test_a_format_that_cannot_be_written_here_is_refused_before_any_weight(
    wide_model: Path, tmp_path: Path, quantize: str, family: str | None, match: str
) -> None:
    from xpukit.loading.save_quantized import save_quantized

    out = tmp_path / "out"
    with pytest.raises(InvalidRequestError, match=match):
        save_quantized(wide_model, out, quantize=quantize, for_family=family, dtype="bfloat16")
    assert not out.exists() and not list(tmp_path.glob(".*.partial"))


@pytest.mark.usefixtures("no_weights_read")
def test_an_existing_out_a_bad_dtype_and_too_little_disk_are_refused(
    wide_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from xpukit.loading import save_quantized as module
    from xpukit.loading.save_quantized import save_quantized

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(InvalidRequestError, match="not an empty directory"):
        save_quantized(wide_model, taken, quantize="int8")
    with pytest.raises(InvalidRequestError, match="is the base's directory"):
        save_quantized(wide_model, wide_model, quantize="int8")
    with pytest.raises(InvalidRequestError, match="Valid: bfloat16"):
        save_quantized(wide_model, tmp_path / "f32", quantize="int8", dtype="float32")
    with pytest.raises(InvalidRequestError, match="--dtype bfloat16"):  # the checkpoint is float32
        save_quantized(wide_model, tmp_path / "f32", quantize="int4", for_family="cuda")
    monkeypatch.setattr(module, "free_bytes", lambda out: 2**20)
    with pytest.raises(PlanError, match=r"MiB free\. Nothing was written"):
        save_quantized(wide_model, tmp_path / "full-disk", quantize="int8")
    assert (taken / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_the_cli_refuses_gguf_options_with_quantize(
    wide_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from xpukit.cli.main import main

    out = tmp_path / "out"
    assert main(["export", str(wide_model), str(out), "--quantize", "int8", "--ollama"]) == 1
    assert "xpukit merge" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: --gguf and --quantize are one choice
        main(["export", str(wide_model), str(out), "--quantize", "int8", "--gguf"])
    assert not out.exists()
