"""A saved adapter's base record, training a saved adapter further, one adapter check for every path,
and ``xpukit merge``'s short output (CPU, tiny Qwen3, float32)."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from xpukit.errors import InvalidRequestError
from xpukit.loading.adapter_record import read_base_record
from xpukit.planning.training.base_record import RECORD_FILE, parse_record, record_from

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0}


@pytest.fixture(scope="module")
def saved(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, perturbed_adapter: Callable[..., Path]
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recorded-adapters")
    full = perturbed_adapter(tiny_model, root / "full", quantize=None)
    bare = root / "no-record"  # the same adapter as if another tool had saved it
    shutil.copytree(full, bare)
    (bare / RECORD_FILE).unlink()
    return {"full": full, "4bit": perturbed_adapter(tiny_model, root / "4bit", quantize="4bit"), "bare": bare}


def _logits(model: Any, base: Path) -> Any:
    import torch
    from transformers import AutoTokenizer

    from xpukit.demo.tiny import corpus_lines

    tok = AutoTokenizer.from_pretrained(base)
    batch = tok(corpus_lines()[:4], return_tensors="pt", padding=True, truncation=True, max_length=24)
    with torch.no_grad():
        return model(**batch).logits.float()


# --- 1. the record, and merge following it -------------------------------------------------------


def test_save_pretrained_writes_how_the_base_was_held(saved: dict[str, Path]) -> None:
    four = json.loads((saved["4bit"] / RECORD_FILE).read_text())
    assert four["quantization"] == "4bit" and four["dtype"] == "float32"
    config = four["quantization_config"]
    assert config["quant_method"] == "bitsandbytes"  # the enum's value, not its repr
    assert config["bnb_4bit_quant_type"] == "nf4" and config["bnb_4bit_use_double_quant"] is True
    full = read_base_record(saved["full"])
    assert full is not None and full.quantization is None and full.quantization_config is None
    assert full.held() == "in full precision (float32)" and full.merge_base() == ("original", None)
    assert read_base_record(saved["bare"]) is None


def test_trainers_checkpoints_carry_the_record(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import Trainer

    from xpukit import load_for_xpu, training_args

    model = load_for_xpu(tiny_model, device="cpu", dtype="float32", lora=LORA)
    trainer = Trainer(model=model, args=training_args(model, output_dir=str(tmp_path / "run")))
    trainer.save_model(str(tmp_path / "run" / "final"))
    record = read_base_record(tmp_path / "run" / "final")
    assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()
    assert record is not None and record.quantization is None and record.dtype == "float32"
    assert any(RECORD_FILE in e.actual for e in model.xpukit_plan.events)
    twin = copy.deepcopy(model)  # a copy saves itself, not the model it was copied from
    assert twin.save_pretrained.model is twin and model.save_pretrained.model is model


def test_merge_true_follows_the_record_of_a_full_precision_adapter(
    tiny_model: Path, saved: dict[str, Path]
) -> None:
    """The reported case: xpukit trained the adapter on the full-precision base; merge=True used to merge
    it into the dequantised 4-bit base and change the model."""
    import torch

    from xpukit import load_for_xpu

    merged = load_for_xpu(tiny_model, device="cpu", dtype="float32", lora=str(saved["full"]), merge=True)
    plan = merged.xpukit_plan
    assert plan.merge is not None and plan.merge.base == "original" and plan.merge.base_from == "record"
    assert f"{RECORD_FILE} says the adapter trained with its base held in full precision" in (
        plan.decision("merge").reason
    )
    trained = load_for_xpu(tiny_model, device="cpu", dtype="float32", lora=str(saved["full"]))
    torch.testing.assert_close(_logits(merged, tiny_model), _logits(trained, tiny_model), rtol=0, atol=1e-4)


def test_no_record_keeps_the_default_and_warns_at_the_top(tiny_model: Path, saved: dict[str, Path]) -> None:
    from xpukit import plan_load

    plan = plan_load(tiny_model, facts="cpu", lora=saved["bare"], merge=True)
    assert plan.merge is not None and plan.merge.base == "dequantized" and plan.merge.base_from == "default"
    [warning] = [w for w in plan.warnings if RECORD_FILE in w]
    assert "merge='original'" in warning and "--into original" in warning
    assert plan.merge.warning == warning
    top = plan.explain().splitlines()[2]  # after the plan's and the machine's lines
    assert top.startswith("! ") and f"has no {RECORD_FILE}" in top
    assert plan.explain().count(f"has no {RECORD_FILE}") == 1
    asked = plan_load(tiny_model, facts="cpu", lora=saved["bare"], merge="dequantized")
    assert asked.merge is not None and asked.merge.warning is None and not asked.warnings


def test_a_merge_against_the_record_is_done_as_asked_with_a_warning(
    tiny_model: Path, saved: dict[str, Path]
) -> None:
    from xpukit import plan_load

    plan = plan_load(tiny_model, facts="cpu", lora=saved["full"], merge="dequantized")
    assert plan.merge is not None and plan.merge.base == "dequantized" and plan.merge.base_from == "asked"
    assert plan.merge.warning is not None and "merge='original' (or merge=True)" in plan.merge.warning


def test_the_recorded_4bit_settings_rebuild_the_base(
    tiny_model: Path, saved: dict[str, Path], tmp_path: Path
) -> None:
    from xpukit import plan_load

    adapter = tmp_path / "fp4"
    shutil.copytree(saved["4bit"], adapter)
    record = json.loads((adapter / RECORD_FILE).read_text())
    record["quantization_config"].update(bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False)
    (adapter / RECORD_FILE).write_text(json.dumps(record))
    plan = plan_load(tiny_model, facts="cpu", lora=adapter, merge=True)
    assert plan.merge is not None and plan.merge.quantization_config == {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "fp4",
        "bnb_4bit_use_double_quant": False,
        "bnb_4bit_compute_dtype": plan.dtype,
    }
    (adapter / RECORD_FILE).write_text('{"format": 1, "quantization": 4}')
    with pytest.raises(InvalidRequestError, match=r"xpukit_base\.json: its quantization fields .*Fix: save"):
        plan_load(tiny_model, facts="cpu", lora=adapter, merge=True)


def test_records_xpukit_cannot_rebuild_merge_into_the_original_weights() -> None:
    for config, kind in (
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "8bit"),
        ({"quant_method": "gptq"}, "gptq"),
    ):
        record = parse_record(record_from(config, dtype="bfloat16", base_model="m"), "r.json")
        assert record.quantization == kind
        base, warning = record.merge_base()
        assert base == "original" and warning is not None and "nearest" in warning


# --- 3. loading a trained adapter: the base it trained on ---------------------------------------


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_an_adapter_loads_on_the_base_it_trained_on(arch: str, tiny_models: Any, tmp_path: Path) -> None:
    """The reported case: an adapter trained on the 4-bit base, loaded with ``lora=DIR`` alone (the
    line the demo prints), went onto the full-precision base: argmax agreed on 58.7 % of positions."""
    import torch

    from xpukit import load_for_xpu

    base = tiny_models[arch]
    trained = load_for_xpu(base, device="cpu", dtype="float32", quantize="4bit", lora=LORA, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    trained.save_pretrained(tmp_path / "adapter")
    want = _logits(trained, base)
    del trained

    loaded = load_for_xpu(base, lora=str(tmp_path / "adapter"))  # nothing else: the record decides
    plan = loaded.xpukit_plan
    assert plan.quantization == "4bit" and plan.dtype == "float32"
    assert "as the adapter trained" in plan.decision("quantization").reason
    assert RECORD_FILE in plan.decision("dtype").reason and not plan.warnings
    got = _logits(loaded, base)
    assert bool((got.argmax(-1) == want.argmax(-1)).all())  # every position, as trained
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_a_load_against_the_record_is_done_as_asked_with_a_warning(
    tiny_model: Path, saved: dict[str, Path]
) -> None:
    from xpukit import plan_load

    full = plan_load(tiny_model, facts="cpu", lora=saved["4bit"], quantize=False)
    assert full.quantization is None
    [warning] = [w for w in full.warnings if "not the trained model" in w]
    assert "quantize=False" in warning and "in 4-bit (nf4, double quantisation)" in warning
    assert 'docs/training.md "Loading an adapter"' in warning and "Fix: leave quantize= out" in warning
    other = plan_load(tiny_model, facts="cpu", lora=saved["4bit"], dtype="bfloat16")
    assert other.quantization == "4bit" and other.dtype == "bfloat16"
    [warning] = [w for w in other.warnings if "trained computing in float32" in w]
    assert "Fix: leave dtype= out" in warning
    same = plan_load(tiny_model, facts="cpu", lora=saved["4bit"], quantize="4bit", dtype="float32")
    assert same.quantization == "4bit" and not same.warnings
    assert "given, as recorded" in same.decision("quantization").reason
    plain = plan_load(tiny_model, facts="cpu", lora=saved["full"])  # trained on full precision
    assert plain.quantization is None and plain.dtype == "float32" and not plain.warnings


def test_the_recorded_settings_hold_the_base_for_a_load_and_for_training(
    tiny_model: Path, saved: dict[str, Path], tmp_path: Path
) -> None:
    from xpukit import plan_load

    adapter = tmp_path / "fp4"
    shutil.copytree(saved["4bit"], adapter)
    record = json.loads((adapter / RECORD_FILE).read_text())
    record["quantization_config"].update(bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False)
    (adapter / RECORD_FILE).write_text(json.dumps(record))
    for extra in ({}, {"trainable": True}):
        plan = plan_load(tiny_model, facts="cpu", lora=adapter, **extra)
        config = plan.quantization_config or {}
        assert config["bnb_4bit_quant_type"] == "fp4" and config["bnb_4bit_use_double_quant"] is False
        assert not [w for w in plan.warnings if "trained" in w]
    eight = parse_record(
        record_from(
            {"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_threshold": 5.0},
            dtype="bfloat16",
            base_model="m",
        ),
        "r.json",
    )
    assert eight.load_quantization("bfloat16") == {"load_in_8bit": True, "llm_int8_threshold": 5.0}
    gptq = parse_record(record_from({"quant_method": "gptq"}, dtype="bfloat16", base_model="m"), "r.json")
    assert gptq.load_quantization("bfloat16") is None


# --- 4. training a saved adapter further ---------------------------------------------------------


def test_a_frozen_model_is_refused_by_training_args_with_the_fix(
    tiny_model: Path, saved: dict[str, Path]
) -> None:
    from xpukit import load_for_xpu, training_args

    frozen = load_for_xpu(tiny_model, device="cpu", dtype="float32", lora=str(saved["full"]))
    with pytest.raises(InvalidRequestError) as err:
        training_args(frozen, output_dir="unused")
    message = str(err.value)
    assert "element 0 of tensors does not require grad" in message
    assert f"lora={str(saved['full'])!r}, trainable=True" in message


def test_trainable_adapter_trains_further(
    tiny_model: Path, saved: dict[str, Path], tmp_path: Path, train_losses: Any
) -> None:
    import torch

    from xpukit import load_for_xpu, training_args
    from xpukit.demo.tiny import corpus_lines

    model = load_for_xpu(tiny_model, device="cpu", dtype="float32", lora=str(saved["full"]), trainable=True)
    plan = model.xpukit_plan
    assert "trained further (trainable=True)" in plan.decision("lora").value
    assert plan.training is not None and plan.decision("micro_batch") is not None  # the training plan
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert lora and all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
    # It starts from the saved weights, not from a fresh init (B would be zeros).
    assert any(n.endswith("lora_B.default.weight") and p.abs().sum() > 0 for n, p in lora.items())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    data = [tok(line, truncation=True, max_length=24) for line in corpus_lines()[:8]]
    args = training_args(model, output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4)
    train_losses(model, args, tok, data)
    changed = [n for n, p in model.named_parameters() if n in lora and not torch.equal(p, lora[n])]
    assert changed, "no adapter weight changed in the step"
    model.save_pretrained(tmp_path / "again")
    assert read_base_record(tmp_path / "again") is not None


def test_trainable_warns_when_the_base_is_held_otherwise(tiny_model: Path, saved: dict[str, Path]) -> None:
    from xpukit import plan_load

    plan = plan_load(tiny_model, facts="cpu", lora=saved["4bit"], trainable=True, quantize=False)
    [warning] = [w for w in plan.warnings if w.startswith("trainable=True")]
    assert "in 4-bit (nf4, double quantisation)" in warning and "Fix: quantize='4bit'" in warning
    same = plan_load(tiny_model, facts="cpu", lora=saved["4bit"], trainable=True, quantize="4bit")
    assert not [w for w in same.warnings if w.startswith("trainable=True")]


@pytest.mark.parametrize(
    ("kwargs", "found"),
    [
        ({"lora": True, "trainable": True}, "new adapters (lora=True or a config) are trainable already"),
        ({"trainable": True}, "trainable=True with lora=None"),
        ({"lora": "ADAPTER", "trainable": "yes"}, "trainable='yes': must be True or False"),
    ],
)
def test_trainable_refusals(
    tiny_model: Path, saved: dict[str, Path], kwargs: dict[str, Any], found: str
) -> None:
    from xpukit import plan_load

    kwargs = {k: (saved["full"] if v == "ADAPTER" else v) for k, v in kwargs.items()}
    with pytest.raises(InvalidRequestError, match=found.replace("(", r"\(").replace(")", r"\)")):
        plan_load(tiny_model, facts="cpu", **kwargs)


# --- 5. one adapter check for every path ---------------------------------------------------------


@pytest.mark.parametrize("path", ["inference", "trainable", "merge"])
def test_an_adapter_of_another_base_is_refused_before_any_weight_is_read(
    tiny_model_factory: Callable[..., Path],
    saved: dict[str, Path],
    path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import AutoModelForCausalLM

    from xpukit import load_for_xpu

    wider = tiny_model_factory("qwen3", hidden_size=128, intermediate_size=256)

    def no_weights(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("weights were read before the adapter was checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    extra = {"inference": {}, "trainable": {"trainable": True}, "merge": {"merge": True}}[path]
    with pytest.raises(InvalidRequestError) as err:
        load_for_xpu(wider, device="cpu", lora=str(saved["full"]), **extra)
    message = str(err.value)
    assert "of its 28 tensors do not match the base's modules" in message
    assert "Fix: pass the base it was trained on" in message
    assert ("xpukit merge --force" in message) is (path == "merge")


def test_force_loads_an_adapter_that_does_not_fit_with_a_warning(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, saved: dict[str, Path]
) -> None:
    from xpukit import plan_load

    deeper = tiny_model_factory("qwen3", num_hidden_layers=1)  # the adapter's layer 1 has no module here
    with pytest.raises(InvalidRequestError, match="no such module in the base"):
        plan_load(deeper, facts="cpu", lora=saved["full"])
    plan = plan_load(deeper, facts="cpu", lora=saved["full"], force=True)
    assert any(w.startswith("force=True: ") for w in plan.warnings)
    assert "adapter check: force=True" in plan.decision("lora").reason


# --- 10. xpukit merge: a short summary; the plan with --explain; libraries' output with --verbose --


def test_merge_prints_a_summary_and_the_plan_only_when_asked(
    tiny_model: Path, saved: dict[str, Path], tmp_path: Path
) -> None:
    from xpukit.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["merge", str(tiny_model), str(saved["bare"]), str(tmp_path / "a")])
    assert code == 0, err.getvalue()
    lines = out.getvalue().splitlines()
    assert len(lines) <= 14 and "Plan for" not in out.getvalue()
    first = " ".join(line.strip() for line in lines[:4])  # wrapped at 100 columns: the path's length varies
    assert first.startswith(f"warning: {saved['bare']} has no {RECORD_FILE}")
    said = " ".join(out.getvalue().split())
    assert "--into original" in said and "into the dequantised 4-bit base of" in said
    assert "dtype float32:" in said and f"wrote {tmp_path / 'a'}:" in said and " s; --explain" in said
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["merge", str(tiny_model), str(saved["full"]), str(tmp_path / "b"), "--explain"])
    assert code == 0 and out.getvalue().startswith("Plan for ")
    assert "(as its xpukit_base.json says), on cpu" in " ".join(out.getvalue().split())


def test_library_output_is_collected_and_restored() -> None:
    from transformers.utils import logging as hf_logging

    from xpukit.cli.logs import command_logging, library_output

    transformers_log = logging.getLogger("transformers")
    before = (
        list(transformers_log.handlers),
        transformers_log.propagate,
        hf_logging.is_progress_bar_enabled(),
    )
    with command_logging(verbose=False) as collected, library_output(verbose=False):
        assert not hf_logging.is_progress_bar_enabled()
        logging.getLogger("transformers.modeling_utils").warning("from transformers")
        logging.getLogger("torch.utils._pytree").warning("from torch")
        import warnings

        warnings.warn("from peft", UserWarning, stacklevel=1)
    assert [r.name for r in collected.records] == [
        "transformers.modeling_utils",
        "torch.utils._pytree",
        "py.warnings",
    ]
    after = (
        list(transformers_log.handlers),
        transformers_log.propagate,
        hf_logging.is_progress_bar_enabled(),
    )
    assert after == before
