"""The training plan by fit: the activation estimate against measured CPU peaks, and the decisions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from xpukit import plan_load
from xpukit.cli.main import main as cli_main
from xpukit.errors import InvalidRequestError
from xpukit.machine.profiles import device_profile
from xpukit.planning.model.reference_models import reference_config
from xpukit.planning.model.shape import ModelShape, model_shape
from xpukit.planning.training.activation_memory import activation_bytes
from xpukit.planning.training.fit import micro_batches, plan_training
from xpukit.planning.training.lora_request import resolve_lora
from xpukit.training.keywords import TrainingContext, training_kwargs

# ~6 M parameters (Qwen3 layout): at 2 × 1024 tokens the activations (~0.1–0.4 GB) dwarf the rest.
SHAPE = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "tie_word_embeddings": False,
}
CASES = [
    {"lora_dropout": 0.0, "gradient_checkpointing": False},
    {"lora_dropout": 0.05, "gradient_checkpointing": False},
    {"lora_dropout": 0.0, "gradient_checkpointing": True},
]

# The peak is the process's RSS high-water mark (VmHWM, reset through /proc/self/clear_refs) above
# the RSS before the step, in a child whose malloc maps every buffer >= 64 KiB on its own
# (MALLOC_MMAP_THRESHOLD_), so freed tensors leave RSS at once and RSS follows what torch holds.
# One untimed step first, so lazily created state (LoRA gradients, autograd threads) is in the baseline.
_CHILD = textwrap.dedent(
    """
    import gc, json, sys
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config
    from xpukit.loading.lora import apply_lora
    from xpukit.machine.probe import cpu_facts
    from xpukit.planning.training.lora_request import resolve_lora

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    torch.set_num_threads(1)
    shape, cases, batch, seq = json.loads(sys.argv[1])
    out = []
    for case in cases:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=torch.float32)
        request = resolve_lora(case, quantized=False)
        model, _ = apply_lora(model, request, compute_dtype="float32", quantized=False, device=cpu_facts())
        model.train()
        ids = torch.randint(0, shape["vocab_size"], (batch, seq))
        for step in range(2):
            if step:
                gc.collect()
                base = status("VmRSS:")
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            model(input_ids=ids, labels=ids).loss.backward()
            for p in model.parameters():
                p.grad = None if step == 0 else p.grad
        out.append(status("VmHWM:") - base)
        del model
        gc.collect()
    print(json.dumps(out))
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak reset")
def test_estimate_matches_measured_cpu_peaks() -> None:
    batch, seq = 1, 1024
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([SHAPE, CASES, batch, seq])],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    shape = ModelShape(
        hidden=256, intermediate=768, layers=4, heads=4, kv_heads=2, head_dim=64, vocab=4096, qk_norm=True
    )
    for case, peak in zip(CASES, measured, strict=True):
        estimate = activation_bytes(
            shape,
            batch * seq,
            compute_bytes=4,
            lora_r=16,
            targets="all-linear",
            dropout=case["lora_dropout"] > 0,
            mask_bytes=4,
            checkpointing=case["gradient_checkpointing"],
            fused_loss=False,
        )["peak"]
        assert abs(estimate / peak - 1) <= 0.15, (case, estimate, peak)
    # The savers really save: dropout costs, checkpointing saves.
    assert measured[1] > measured[0] > measured[2]


def _plan(**kw: Any) -> Any:
    kw.setdefault("lora", True)
    return plan_load(reference_config("qwen3-8b"), quantize="4bit", batch_size=4, seq_len=512, **kw)


def test_room_means_no_savers_and_a_budget_means_savers(liger: Any) -> None:
    liger(False)  # the savers without liger's fused loss; with it, below
    roomy = _plan(facts="h200")
    assert roomy.decision("gradient_checkpointing").value is False
    assert roomy.decision("micro_batch").value == 4
    assert roomy.lora.gradient_checkpointing is False  # the request apply_lora gets follows the plan
    small = _plan(facts="arc-b580")
    assert small.decision("gradient_checkpointing").value is True
    assert small.lora.gradient_checkpointing is True
    rejected = [v for v, _ in small.decision("gradient_checkpointing").rejected]
    # liger-kernel off (arranged); the layers run as graphs on every rung tried first
    assert rejected == ["no savers, graphs", "chunked CE, graphs"]
    assert small.decision("layer_graphs").value is True  # checkpointing inside the graphs
    liger(True)  # liger's fused loss is the first thing tried, before any saver
    with_liger = _plan(facts="arc-b580").decision("gradient_checkpointing")
    assert with_liger.rejected[0][0] == "liger's fused CE, graphs"
    liger(False)
    tight = _plan(facts="h200", max_memory={0: "8GB"})
    assert tight.decision("gradient_checkpointing").value == "offload"
    # the calibrated reserve keeps the whole batch (measured 7.74 GB on the H200: it fits 8 GB)
    assert tight.decision("micro_batch").value == 4
    # tighter: the worst case (4 × 512) no longer fits in one pass, even with the input embedding in
    # host memory; packing knows each batch's real tokens, so the whole batch is kept and only a step
    # over the token budget is split
    tighter = _plan(facts="h200", max_memory={0: "6.55GB"})
    assert tighter.training.embedding_on_host
    assert tighter.training is not None and tighter.training.split_by_tokens
    assert tighter.decision("micro_batch").value == 4 and 512 <= (tighter.training.pass_tokens or 0) < 2048
    # without packing the batch is split by sequences, as many as Trainer's batch
    unpacked = _plan(facts="h200", max_memory={0: "6.55GB"}, lora={"packing": False})
    assert unpacked.decision("micro_batch").value < 4
    assert unpacked.training.gradient_accumulation_steps * unpacked.training.micro_batch == 4


def test_micro_batch_times_accumulation_is_the_batch_asked_for() -> None:
    assert micro_batches(6) == [6, 3, 2, 1] and micro_batches(5) == [5, 1] and micro_batches(1) == [1]
    shape = ModelShape(
        hidden=4096,
        intermediate=12288,
        layers=36,
        heads=32,
        kv_heads=8,
        head_dim=128,
        vocab=151936,
        qk_norm=True,
    )
    request = resolve_lora(True, quantized=True)
    assert request is not None
    seen = set()
    for batch in (5, 6, 7, 8, 12):
        for budget_gb in [7 + i / 4 for i in range(12)]:
            plan = plan_training(
                shape,
                request,
                compute_dtype="bfloat16",
                backend="cuda",
                weights=int(6e9),
                budget=int(budget_gb * 1e9),
                budget_rule="test",
                batch_size=batch,
                seq_len=2048,
                max_positions=None,
                liger_available=(False, "not installed"),
                quantized=True,
            )
            # Trainer runs micro_batch × accumulation sequences a step: never another batch than asked.
            assert plan.micro_batch * plan.gradient_accumulation_steps == batch, (batch, budget_gb)
            seen.add((batch, plan.micro_batch))
    assert (6, 3) in seen or (6, 2) in seen  # divisors that are not halvings are used
    assert (5, 2) not in seen  # batch 5 at micro-batch 2 was 2 × 2 = 4 sequences


def test_a_step_that_does_not_fit_warns_with_the_numbers_and_the_fix() -> None:
    over = plan_load(
        reference_config("qwen3-8b"),
        facts="h200",
        quantize="4bit",
        lora=True,
        batch_size=4,
        seq_len=8192,
        max_memory={0: "8GB"},
    )
    assert over.training is not None and not over.training.fits
    [warning] = [w for w in over.warnings if w.startswith("training: a step")]
    assert "may run out of device memory" in warning and "cuda:0" in warning
    assert "seq_len=" in warning and "max_memory=" in warning  # the fixes
    fits = plan_load(
        reference_config("qwen3-8b"), facts="h200", quantize="4bit", lora=True, batch_size=4, seq_len=512
    )
    assert fits.training is not None and fits.training.fits
    assert not [w for w in fits.warnings if w.startswith("training: a step")]


def test_user_choices_win() -> None:
    plan = _plan(facts="arc-b580", lora={"gradient_checkpointing": False, "liger": False, "packing": False})
    gc = plan.decision("gradient_checkpointing")
    assert (gc.value, gc.source) == (False, "user")
    assert plan.decision("liger").source == "user"
    assert plan.decision("micro_batch").value < 4  # the rest is decided around the choice
    assert (
        _plan(facts="h200", lora={"gradient_checkpointing": "offload"}).lora.gradient_checkpointing
        == "offload"
    )
    with pytest.raises(InvalidRequestError, match="'offload'"):
        resolve_lora({"gradient_checkpointing": "yes"}, quantized=True)
    with pytest.raises(InvalidRequestError, match="positive int"):
        plan_load(reference_config("qwen3-8b"), facts="h200", lora=True, batch_size=0)


def test_ladder_order_with_liger_and_cpu_has_no_offload() -> None:
    shape = ModelShape(
        hidden=4096,
        intermediate=12288,
        layers=36,
        heads=32,
        kv_heads=8,
        head_dim=128,
        vocab=151936,
        qk_norm=True,
    )
    request = resolve_lora(True, quantized=True)
    assert request is not None

    def plan(budget: float, backend: str = "cuda") -> Any:
        return plan_training(
            shape,
            request,
            compute_dtype="bfloat16",
            backend=backend,
            weights=int(6e9),
            budget=int(budget),
            budget_rule="test",
            batch_size=4,
            seq_len=512,
            max_positions=None,
            liger_available=(True, "installed"),
        )

    tight = plan(8e9)
    order = [o for o, _ in tight.estimates]
    assert order[:4] == ["no savers", "liger's fused CE", "checkpointing", "liger's fused CE + checkpointing"]
    (_, none), (_, fused) = tight.estimates[:2]
    roomy = plan(tight.fixed + none)
    assert (roomy.liger, roomy.loss) == (False, "plain")  # room: the faster plain loss
    assert roomy.decisions[2].name == "loss" and roomy.decisions[2].value == "plain"
    between = plan(tight.fixed + (none + fused) // 2)
    assert (between.liger, between.loss, between.gradient_checkpointing) == (True, "liger", False)
    assert all("offload" not in o for o, _ in plan(8e9, "cpu").estimates)


def test_without_liger_the_fused_loss_is_xpukits_chunked_one() -> None:
    shape = ModelShape(
        hidden=4096,
        intermediate=12288,
        layers=36,
        heads=32,
        kv_heads=8,
        head_dim=128,
        vocab=151936,
        qk_norm=True,
    )
    request = resolve_lora(True, quantized=True)
    assert request is not None

    def plan(budget: float, liger: tuple[bool, str], req: Any = request) -> Any:
        return plan_training(
            shape,
            req,
            compute_dtype="bfloat16",
            backend="xpu",
            weights=int(6e9),
            budget=int(budget),
            budget_rule="test",
            batch_size=4,
            seq_len=512,
            max_positions=None,
            liger_available=liger,
        )

    missing = (False, "liger-kernel is not installed")
    tight = plan(8e9, missing)
    assert [o for o, _ in tight.estimates][:2] == ["no savers", "chunked CE"]
    (_, none), (_, chunked) = tight.estimates[:2]
    liger_peak = plan(8e9, (True, "installed")).estimates[1][1]
    assert liger_peak < chunked < none  # one chunk's logits in flight cost more than liger's none
    between = plan(tight.fixed + (none + chunked) // 2, missing)
    assert (between.loss, between.liger, between.gradient_checkpointing) == ("chunked", False, False)
    loss = next(d for d in between.decisions if d.name == "loss")
    assert loss.value == "chunked" and "liger-kernel is not installed" in loss.reason
    turned_off = resolve_lora({"liger": False}, quantized=True)
    off = plan(tight.fixed + (none + chunked) // 2, (True, "installed"), turned_off)
    assert off.loss == "chunked" and "lora={'liger': False} given" in off.decisions[2].reason


def test_a_chunked_plan_loads_with_the_chunked_loss(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from xpukit import load_for_xpu
    from xpukit.planning.plan import plan_load as plan_for
    from xpukit.planning.training import activation_memory

    # The tiny model's 1 024 words fit one 256 MiB chunk whole (no saving): 64-token chunks here.
    monkeypatch.setattr(activation_memory, "CHUNK_BYTES", 4 * 1024 * 64)
    probe = plan_for(
        tiny_model,
        device="cpu",
        dtype="float32",
        lora=True,
        batch_size=8,
        seq_len=256,
        max_memory={"cpu": "1MiB"},
    )  # no room to train: every option is estimated
    assert probe.training is not None
    (_, plain), (option, chunked) = probe.training.estimates[:2]
    assert option == "chunked CE" and chunked < plain
    budget = probe.training.fixed + chunked + 1  # chunked fits, plain does not
    model = load_for_xpu(
        tiny_model,
        device="cpu",
        dtype="float32",
        lora=True,
        batch_size=8,
        seq_len=256,
        max_memory={"cpu": budget},
    )
    assert model.xpukit_plan.training.loss == "chunked"
    notes = [e.actual for e in model.xpukit_plan.events if e.what == "lora"]
    assert any(str(n).startswith("chunked cross-entropy: lm_head + loss in chunks of 64") for n in notes)


def test_explain_cli_and_training_args_follow_the_plan(
    capsys: pytest.CaptureFixture[str], liger: Any
) -> None:
    liger(False)  # the step as it is without liger-kernel: no savers, the plain loss
    plan = _plan(facts="h200", max_memory={0: "8GB"})
    text = plan.explain(verbose=True)
    assert "Training memory (batch 4 [given] × seq 512 [given]" in text
    assert "activations with no savers" in text
    assert json.loads(json.dumps(plan.to_dict()))["training"]["micro_batch"] == plan.training.micro_batch
    keywords = training_kwargs(device_profile("h200"), context=TrainingContext(training=plan.training))
    assert keywords["per_device_train_batch_size"] == plan.training.micro_batch
    assert keywords["gradient_accumulation_steps"] == plan.training.gradient_accumulation_steps
    assert keywords["gradient_checkpointing"] is True
    mine = training_kwargs(
        device_profile("h200"), context=TrainingContext(training=plan.training), per_device_train_batch_size=2
    )
    assert mine["per_device_train_batch_size"] == 2  # the user's keyword wins
    assert (
        cli_main(
            [
                "plan",
                "qwen3-8b",
                "--assume",
                "arc-b580",
                "--quantize",
                "4bit",
                "--train",
                "4x512",
                "--explain",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "gradient_checkpointing" in out and "Training memory (batch 4" in out
    assert (
        cli_main(["plan", "qwen3-8b", "--assume", "arc-b580", "--quantize", "4bit", "--train", "4x512"]) == 0
    )
    assert "Training: batch 4 × seq 512: " in capsys.readouterr().out  # the short form, one line
    assert cli_main(["plan", "qwen3-8b", "--assume", "arc-b580", "--train", "4by512"]) == 1


def test_offloaded_checkpointing_trains_the_same(tiny_model: Any) -> None:
    import torch

    from xpukit import load_for_xpu

    grads = []
    for gc in (True, "offload"):
        model = load_for_xpu(
            tiny_model, device="cpu", dtype="float32", lora={"gradient_checkpointing": gc}, seed=0
        )
        ids = torch.arange(32).reshape(2, 16)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        notes = [e.actual for e in model.xpukit_plan.events if e.what == "lora"]
        assert any("offloaded to host" in n for n in notes) == (gc == "offload")
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


# The LoRA gradients (43 646 976 fp32 parameters) are in the measured peak above the weights, and in
# the plan's fixed part (LoRA state), not in its activation estimate: subtracted here.
_LORA_GRADS_GB = 43_646_976 * 4 / 1e9


@pytest.mark.parametrize(
    ("lora", "liger", "measured_gb"),
    [
        # measured unpacked (the fixed 4 x 512 step, packing off)
        ({"fused": False, "packing": False}, True, 17.754),  # peft's modules, no savers
        ({"fused": True, "liger": False, "packing": False}, True, 14.131),  # the fused path, no liger
        # the default on the H200 since liger's loss runs in 512-token chunks: fused + liger's norms and
        # loss (measured with liger's own chunks; the larger chunk's 0.16 GB of logits are estimated)
        ({"packing": False}, True, 8.650),
        ({"liger": True, "gradient_checkpointing": False}, True, 8.650),  # + liger's fused loss
        # measured eagerly (the graphs' own buffers are not in these peaks)
        ({"liger": False, "gradient_checkpointing": True, "graphs": False}, True, 4.375),  # checkpointing
        ({"liger": True, "gradient_checkpointing": "offload", "graphs": False}, True, 1.058),  # + fused loss
    ],
    ids=["peft", "fused", "default", "fused-loss", "checkpointing", "offload+fused-loss"],
)
def test_estimate_matches_the_h200_peaks(
    monkeypatch: pytest.MonkeyPatch, lora: Any, liger: bool, measured_gb: float
) -> None:
    """The activations measured above the weights on the H200 (docs/benchmarks.md, 2026-12-02:
    Qwen3-8B shape, nf4, 4 × 512 in one pass, every rung of the ladder) against the plan's estimate
    for the same 2 048 tokens, within ±15 %."""
    import xpukit.planning.training.fit as fit

    monkeypatch.setattr(fit, "liger_availability", lambda backend: (liger, "injected"))
    plan = plan_load(
        reference_config("qwen3-8b"), facts="h200", quantize="4bit", lora=lora, batch_size=4, seq_len=512
    )
    assert plan.training is not None and plan.training.micro_batch == 4
    estimate = plan.training.estimate["peak"] / 1e9
    measured = measured_gb - _LORA_GRADS_GB
    assert abs(estimate - measured) / measured <= 0.15, (estimate, measured)


@pytest.mark.parametrize(
    ("family", "measured_gb", "lora_grads_gb"),
    [("gemma-3-4b", 7.758, 0.119), ("llama-3.1-8b", 9.135, 0.168)],
)
def test_estimate_matches_the_h200_graph_peaks_of_other_families(
    monkeypatch: pytest.MonkeyPatch, family: str, measured_gb: float, lora_grads_gb: float
) -> None:
    """The one call with room on the H200 (docs/benchmarks.md "Other families", 2026-12-02: nf4, fused
    LoRA, liger's norms and loss, the layer graphs, 4 × 512): activations above the weights, the
    graphs' pool included, less the LoRA gradients, against the plan's estimate within ±15 %. Gemma 3
    has four RMSNorms a layer; counted as two, its estimate was 24 % low."""
    from transformers import Gemma3TextConfig

    import xpukit.planning.training.fit as fit

    monkeypatch.setattr(fit, "liger_availability", lambda backend: (True, "injected"))
    gemma = {
        "vocab_size": 262208,
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 1024,
    }
    config = Gemma3TextConfig(**gemma) if family == "gemma-3-4b" else reference_config(family)
    plan = plan_load(config, facts="h200", quantize="4bit", lora=True, batch_size=4, seq_len=512)
    assert plan.training is not None and plan.training.micro_batch == 4
    assert plan.decision("layer_graphs").value and plan.decision("fused_lora").value
    estimate = plan.training.estimate["peak"] / 1e9
    measured = measured_gb - lora_grads_gb
    assert abs(estimate - measured) / measured <= 0.15, (estimate, measured)


def test_a_step_whose_logits_cross_the_arc_allocation_cap_takes_a_fused_loss(liger: Any) -> None:
    """Arc GPUs refuse one allocation above 4 GiB (docs/platform-install.md §6.5): the plain loss's fp32
    logits of Qwen3-0.6B at 4 x 2 048 tokens are 4.98 GB, so the plan takes a fused loss there, says
    why, and keeps the plain one where the logits fit under the cap or the card has none (arranged
    without liger-kernel, whose fused loss the plan takes wherever it can run)."""
    liger(False)
    from dataclasses import replace

    from xpukit.machine.profiles import machine_profile
    from xpukit.planning.training.allocation import RELAXED_VARIABLE

    args: dict[str, Any] = {"quantize": "4bit", "lora": True, "batch_size": 4, "seq_len": 2048}
    arc = plan_load(reference_config("qwen3-0.6b"), facts="arc-pro-b60", **args)
    loss = arc.decision("loss")
    assert loss.value in ("liger", "chunked") and "4.64 GiB tensor" in loss.reason  # 4.98 GB
    assert RELAXED_VARIABLE in loss.reason
    lifted = replace(machine_profile("arc-pro-b60"), env={RELAXED_VARIABLE: "1"})
    lifted_loss = plan_load(reference_config("qwen3-0.6b"), facts=lifted, **args).decision("loss")
    assert "allocation cap" not in lifted_loss.reason  # (the 24 GB card needs a fused loss to fit, here)
    small = plan_load(reference_config("qwen3-0.6b"), facts="arc-pro-b60", **(args | {"seq_len": 1024}))
    assert small.decision("loss").value == "plain"  # 2.49 GB of logits: under the cap
    assert (
        plan_load(reference_config("qwen3-0.6b"), facts="max-1550", **args).decision("loss").value == "plain"
    )
    liger(True)
    small = plan_load(reference_config("qwen3-0.6b"), facts="arc-pro-b60", **(args | {"seq_len": 1024}))
    assert small.decision("loss").value == "liger" and "allocation cap" not in small.decision("loss").reason


def test_the_graphs_buffers_are_in_the_estimate_one_shape_or_a_packed_rows_buckets() -> None:
    """Beside one step's activations (shared by every captured shape in one pool) the graphs hold
    each shape's stack input, output and their gradients: one shape for fixed steps, at most 8
    buckets of 256 tokens for packed rows."""
    from xpukit.planning.training.activation_memory import graph_buffer_bytes

    args: dict[str, Any] = {"facts": "h200", "quantize": "4bit", "batch_size": 4, "seq_len": 512}
    packed = plan_load(reference_config("qwen3-8b"), lora=True, **args).training
    fixed = plan_load(reference_config("qwen3-8b"), lora={"packing": False}, **args).training
    off = plan_load(reference_config("qwen3-8b"), lora={"graphs": False}, **args).training
    assert packed is not None and fixed is not None and off is not None
    one_shape = 4 * 2048 * 4096 * 2  # 4 x bucket x hidden x bf16
    assert fixed.estimate["graph_buffers"] == one_shape
    buckets = 2048 + 1792 + 1536 + 1280 + 1024 + 768 + 512 + 256  # the 8 largest a step can take
    assert packed.estimate["graph_buffers"] == 4 * buckets * 4096 * 2
    assert "graph_buffers" not in off.estimate
    shape = model_shape(reference_config("qwen3-8b"))
    assert shape is not None and graph_buffer_bytes(shape, 300, compute_bytes=2) == 4 * (512 + 256) * 4096 * 2


@pytest.mark.parametrize("liger", [True, False])
def test_the_fused_path_takes_liger_s_loss_first_where_it_runs(
    monkeypatch: pytest.MonkeyPatch, liger: bool
) -> None:
    """In 512-token chunks liger's loss is faster than the plain one (docs/training-plan.md "liger's loss
    chunk"): on the fused path it is taken even when the plain loss fits; without liger, plain."""
    import xpukit.planning.training.fit as fit

    monkeypatch.setattr(fit, "liger_availability", lambda backend: (liger, "injected"))
    plan = plan_load(
        reference_config("qwen3-8b"),
        facts="h200",
        quantize="4bit",
        lora={"packing": False},
        batch_size=4,
        seq_len=512,
    )
    training = plan.training
    assert training is not None and training.fits and training.gradient_checkpointing is False
    assert training.loss == ("liger" if liger else "plain")
    decision = next(d for d in training.decisions if d.name == "liger")
    assert ("faster than the plain loss" in decision.reason) == liger
    assert plan.decision("fused_lora").value is True
