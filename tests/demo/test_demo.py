"""``xpukit demo``: the main job end to end in a fresh process, plus its pieces in-process.

One demo run (20 steps, ``--json --plot --output-dir``) is shared by the end-to-end tests; it takes
about 20-30 s on two CPU cores. The in-process tests need neither a model nor training.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from xpukit.cli.main import main
from xpukit.demo.run import DemoResult, run_demo
from xpukit.demo.tiny import DEMO_PROMPTS
from xpukit.errors import InvalidRequestError, MissingExtraError

STEPS = 20
# Each decoder layer of the demo model has seven linear layers, all targeted by lora=True
# ("all-linear"): q, k, v, o, gate, up and down projections.
LINEARS_PER_LAYER = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.fixture(scope="module")
def demo_run(once_per_run: Callable[..., Any], demo_model: Path) -> dict[str, Any]:
    """``xpukit demo`` in a subprocess, as a user would run it (the cache and offline env from conftest);
    one run for the whole test run, whichever worker its tests land on."""
    pytest.importorskip("peft")  # the demo fine-tunes LoRA adapters (extra: lora)

    def run(out: Path) -> dict[str, Any]:
        # The demo's cache in the shared directory, holding this worker's demo model (each worker's
        # own cache goes when that worker ends, and the other may still read the model's config).
        cache = out / "cache"
        model = cache / "models" / demo_model.name
        shutil.copytree(demo_model, model)
        adapter = out / "adapter"
        plot = out / "loss.png" if importlib.util.find_spec("matplotlib") else None  # extra: plot
        cmd = [sys.executable, "-m", "xpukit.cli.main", "demo", "--steps", str(STEPS), "--json"]
        cmd += ["--output-dir", str(adapter)] + (["--plot", str(plot)] if plot else [])
        env = {**os.environ, "XPUKIT_CACHE_DIR": str(cache)}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return {
            "result": json.loads(proc.stdout),
            "stderr": proc.stderr,
            "adapter": str(adapter),
            "plot": str(plot) if plot else None,
            "model": str(model),
        }

    shared = once_per_run("demo", run)
    return {
        "result": shared["result"],
        "stderr": shared["stderr"],
        "adapter": Path(shared["adapter"]),
        "plot": Path(shared["plot"]) if shared["plot"] else None,
        "model": Path(shared["model"]),
    }


# --- end to end ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_loss_falls_clearly(demo_run: dict[str, Any]) -> None:
    result = demo_run["result"]
    losses = result["losses"]
    assert [step for step, _ in losses] == list(range(1, STEPS + 1))  # every step recorded
    assert result["first_loss"] == losses[0][1]
    assert result["last_loss"] < 0.6 * result["first_loss"], losses


@pytest.mark.slow
def test_demo_summary_fields(demo_run: dict[str, Any]) -> None:
    r = demo_run["result"]
    assert r["embedded"] is True
    assert Path(r["model"]) == demo_run["model"]
    assert r["device"].split(":")[0] in {"xpu", "cuda", "mps", "cpu"}
    assert r["dtype"] in {"bfloat16", "float16", "float32"}
    if r["device"] != "mps" and importlib.util.find_spec("bitsandbytes"):
        assert r["quantization"] == "4bit"
        assert "nf4" in r["quantization_note"]
    assert 0 < r["trainable_params"] < r["total_params"]
    assert r["steps"] == STEPS and r["batch_size"] >= 1 and 0 < r["learning_rate"] < 1
    assert r["steps_per_second"] > 0 and 0 < r["train_seconds"] < r["wall_seconds"]
    assert r["peak_memory"] > 0 and r["memory_source"]
    if r["device"] == "cpu":
        assert r["fallbacks"] == []  # nothing on the CPU path needs the Hub
    assert r["plot"] == (str(demo_run["plot"]) if demo_run["plot"] else None)
    assert r["output_dir"] == str(demo_run["adapter"])


@pytest.mark.slow
def test_demo_generated_text_changes(demo_run: dict[str, Any]) -> None:
    before, after = demo_run["result"]["before"], demo_run["result"]["after"]
    assert [b["prompt"] for b in before] == [a["prompt"] for a in after] == list(DEMO_PROMPTS)
    assert all(b["text"] != a["text"] for b, a in zip(before, after, strict=True))
    assert all(a["text"] for a in after)


@pytest.mark.slow
def test_demo_trains_every_lora_layer(demo_run: dict[str, Any]) -> None:
    """Generating before training must not cost gradients (the bitsandbytes CPU repacking trap).

    The demo counts the lora_B weights with a non-zero gradient at step 1 (every lora_B starts at
    zero, so a gradient then can only come through the base model); the adapter it saved is read
    back independently: every lora_B of every targeted layer moved from zero.
    """
    from safetensors.torch import load_file

    layers = json.loads((demo_run["model"] / "config.json").read_text())["num_hidden_layers"]
    weights = load_file(str(demo_run["adapter"] / "adapter_model.safetensors"))
    lora_b = {name: t for name, t in weights.items() if "lora_B" in name}
    targeted = {name.split(".lora_B")[0].rsplit(".", 1)[-1] for name in lora_b}
    assert targeted == LINEARS_PER_LAYER
    assert len(lora_b) == layers * len(LINEARS_PER_LAYER)
    untrained = sorted(name for name, t in lora_b.items() if not t.abs().max().item() > 0)
    assert untrained == []
    result = demo_run["result"]
    assert result["lora_layers"] == result["lora_layers_updated"] == len(lora_b)
    assert result["lora_layers_with_gradient"] == len(lora_b)


def _first_step_broken_layers(model: Any, demo_model: Path, tmp_path: Path) -> set[str]:
    """Train one step with the demo's own run; the LoRA layers whose lora_B got no gradient."""
    from transformers import AutoTokenizer

    from xpukit.demo.tiny import corpus_lines
    from xpukit.demo.training_run import train

    run = train(
        model,
        AutoTokenizer.from_pretrained(demo_model),
        corpus_lines(),
        steps=1,
        batch_size=8,
        learning_rate=1e-2,
        max_tokens=64,
        log_every=1,
        seed=0,
        output_dir=tmp_path,
        stream=None,
    )
    return {name.split(".lora_B")[0].rsplit(".", 1)[-1] for name, ok in run.first_gradients.items() if not ok}


# The layers whose only gradient at step 1 arrives through the frozen base weights above them
# (o_proj and down_proj): with a broken base backward these get none.
_BEHIND_THE_BASE = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}


def test_first_step_gradient_check_catches_a_broken_base_backward(
    demo_model: Path, tmp_path: Path, cpu_kind: str
) -> None:
    """The demo's step-1 check must be able to fail, on any CPU: the 4-bit base layers' outputs are
    cut from the graph (what bitsandbytes' CPU repacking does to their backward), so the layers
    whose gradient only arrives through base weights must be reported as zero."""
    pytest.importorskip("peft")
    bnb = pytest.importorskip("bitsandbytes")
    from xpukit.loading.load import load_for_xpu

    model = load_for_xpu(demo_model, device="cpu", quantize="4bit", lora=True)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.register_forward_hook(lambda _m, _args, out: out.detach())
    assert _first_step_broken_layers(model, demo_model, tmp_path) >= _BEHIND_THE_BASE


def test_first_step_gradient_check_passes_an_intact_model(
    demo_model: Path, tmp_path: Path, cpu_kind: str
) -> None:
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from xpukit.loading.load import load_for_xpu

    model = load_for_xpu(demo_model, device="cpu", quantize="4bit", lora=True)
    assert _first_step_broken_layers(model, demo_model, tmp_path) == set()


def test_first_step_gradient_check_catches_the_real_repacking_trap(
    demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real trap: re-enable bitsandbytes' CPU repacking (which xpukit turns off when it attaches
    LoRA), switch off training_args' own repair, generate, train one step."""
    pytest.importorskip("peft")
    bnb = pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import has_avx512bf16

    if not has_avx512bf16():
        pytest.skip(
            "bitsandbytes registers its repacking CPU kernel (gemv_4bit without a backward) only on CPUs "
            "with avx512_bf16, and this one has none; the broken-backward test above covers the check"
        )
    from transformers import AutoTokenizer

    from xpukit.demo.run import _generate
    from xpukit.loading.load import load_for_xpu
    from xpukit.training import arguments as train

    monkeypatch.setattr(train, "_restore_repacked_4bit", lambda model: None)  # both guards off
    # bf16 pinned: the repacked kernel serves bf16 inputs.
    model = load_for_xpu(demo_model, device="cpu", dtype="bfloat16", quantize="4bit", lora=True)
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = True  # undo xpukit's guard
    _generate(model, AutoTokenizer.from_pretrained(demo_model), DEMO_PROMPTS[:1], 2)
    assert any(getattr(layer.weight.quant_state, "packing_format_for_cpu", False) for layer in layers)
    assert _first_step_broken_layers(model, demo_model, tmp_path) >= _BEHIND_THE_BASE


@pytest.mark.slow
def test_demo_output_is_clean(demo_run: dict[str, Any]) -> None:
    err = demo_run["stderr"]
    for expected in ("Plan for", "Before training", f"step {STEPS}/{STEPS}", "After training"):
        assert expected in err
    # Known noise is dropped; warnings that would signal a real problem must never appear.
    for unexpected in (
        "Failed to load CPU gemm_4bit_forward",
        "autograd kernel was not registered",
        "Traceback",
        "{'loss':",
    ):
        assert unexpected not in err
    if demo_run["plot"]:
        assert demo_run["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- pieces, in-process --------------------------------------------------------------------------


def test_plot_without_matplotlib_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec now reports it missing
    with pytest.raises(MissingExtraError, match=r"xpukit\[plot\]"):
        run_demo(plot=tmp_path / "loss.png")
    assert main(["demo", "--plot", str(tmp_path / "loss.png")]) == 1
    err = capsys.readouterr().err
    assert 'pip install "xpukit[plot]"' in err and "Traceback" not in err
    assert not (tmp_path / "loss.png").exists()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 0}, "steps=0"),
        ({"batch_size": -1}, "batch_size=-1"),
        ({"steps": True}, "steps=True"),
        ({"learning_rate": 5.0}, "learning_rate=5.0"),
        ({"plot": "loss.txt"}, "unknown image type '.txt'"),
        ({"plot": "/no/such/dir/loss.png"}, "does not exist"),
    ],
)
def test_bad_arguments_are_refused_before_loading(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        run_demo(**kwargs)


def test_cli_reports_bad_steps_as_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("xpukit demo: error:") and "steps=0" in err and "\n" not in err


def test_cli_error_names_the_command_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--lr", "-1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("xpukit demo: error: learning_rate=-1.0 (--lr)") and err.count("xpukit demo") == 1


def test_the_demos_plan_says_the_seed_it_runs_with(
    demo_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import xpukit.demo.run as demo

    plan, _ = demo._plan(str(demo_model), device="cpu", quantize=False, seed=0)
    (seed,) = [d for d in plan.decisions if d.name == "seed"]
    assert seed.value == 0 and "set_seed(0)" in seed.reason and "unseeded" not in seed.reason
    assert plan.seed == 0  # what load_for_xpu(plan) applies
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "(default 0)" in " ".join(capsys.readouterr().out.split())


def test_demo_modules_import_no_torch() -> None:
    code = (
        "import sys, xpukit.demo.run, xpukit.cli.demo\n"
        "sys.exit(bool({'torch', 'transformers', 'peft', 'bitsandbytes'} & set(sys.modules)))"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_quantization_falls_back_when_bitsandbytes_is_missing(
    monkeypatch: pytest.MonkeyPatch, demo_model: Path
) -> None:
    import xpukit.demo.run as demo

    real = demo.is_installed
    monkeypatch.setattr(demo, "is_installed", lambda name: name != "bitsandbytes" and real(name))
    plan, note = demo._plan(str(demo_model), device="cpu", quantize=True)
    assert plan.quantization is None and plan.lora is not None
    assert "xpukit[quant]" in note


@pytest.mark.slow
def test_run_demo_on_another_model_quietly(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--model`` path, in-process: its own tokenizer, the pretrained learning rate, full weights,
    nothing printed without a stream, and the adapter kept in ``output_dir``."""
    pytest.importorskip("peft")
    result = run_demo(model=tiny_model, steps=3, quantize=False, output_dir=tmp_path / "out")
    assert capsys.readouterr().out == ""
    assert result.model == str(tiny_model) and not result.embedded
    assert result.quantization is None and "--no-quantize" in result.quantization_note
    assert result.learning_rate == 2e-4 and [s for s, _ in result.losses] == [1, 2, 3]
    assert result.lora_layers_with_gradient == result.lora_layers > 0
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert result.output_dir == str(tmp_path / "out") and result.plot is None


def _result(**changes: Any) -> DemoResult:
    fields: dict[str, Any] = {
        "model": "/m",
        "embedded": True,
        "device": "cpu",
        "device_name": "A CPU",
        "dtype": "bfloat16",
        "quantization": "4bit",
        "quantization_note": "bitsandbytes nf4",
        "trainable_params": 10,
        "total_params": 100,
        "lora_layers": 28,
        "lora_layers_with_gradient": 28,
        "lora_layers_updated": 28,
        "steps": 2,
        "batch_size": 8,
        "learning_rate": 0.01,
        "train_seconds": 1.0,
        "steps_per_second": 2.0,
        "losses": ((1, 9.0), (2, 4.5)),
        "first_loss": 9.0,
        "last_loss": 4.5,
        "peak_memory": 3 * 2**20,
        "memory_source": "peak resident memory of the process",
        "before": (("The baker", "x y"),),
        "after": (("The baker", "bakes bread"),),
        "fallbacks": (),
        "plot": None,
        "output_dir": None,
        "wall_seconds": 3.0,
    }
    return DemoResult(**{**fields, **changes})


def test_result_renders_and_serialises() -> None:
    result = _result(fallbacks=("attn_implementation: flash -> sdpa (offline)",))
    text = result.render()
    for expected in (
        "cpu (A CPU)",
        "4bit",
        "reached 28 of 28 layers at step 1",
        "9.00 at step 1 -> 4.50",
        "2.00 steps/s",
    ):
        assert expected in text
    assert "fallback" in text and "3.00 MiB" in text
    data = json.loads(json.dumps(result.to_dict()))
    assert data["losses"] == [[1, 9.0], [2, 4.5]]
    assert data["after"] == [{"prompt": "The baker", "text": "bakes bread"}]
    assert "unknown" in _result(peak_memory=None).render()


@pytest.mark.gpu
def test_demo_uses_the_gpu(demo_model: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "xpukit.cli.main", "demo", "--steps", str(STEPS), "--json"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout)
    assert r["device"].split(":")[0] in {"cuda", "xpu"}
    assert r["memory_source"].startswith("torch.") and r["peak_memory"] > 0
    assert r["last_loss"] < 0.6 * r["first_loss"]
    assert r["lora_layers_updated"] == r["lora_layers"] > 0
