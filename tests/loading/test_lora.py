"""LoRA: resolving ``lora=``, the lean QLoRA preparation, the CPU repacking trap, adapters, liger.

The model tests run real bitsandbytes 4-bit + peft on the CPU with the tiny Qwen3 model.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from xpukit.errors import InvalidRequestError, MissingExtraError
from xpukit.loading.lora import apply_lora
from xpukit.machine.profiles import device_profile
from xpukit.planning.request import LoadRequest
from xpukit.planning.training.liger import decide_liger
from xpukit.planning.training.lora_request import DEFAULT_LORA, LoraRequest, resolve_lora
from xpukit.sources.adapter_files import read_adapter_files

# ---------------------------------------------------------------------------------------------
# resolve_lora: pure
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, False])
def test_no_lora(value: object) -> None:
    assert resolve_lora(value, quantized=True) is None


@pytest.mark.parametrize("quantized", [True, False])
def test_lora_true_defaults(quantized: bool) -> None:
    req = resolve_lora(True, quantized=quantized)
    assert req is not None and req.kind == "new" and req.adapter_path is None
    assert req.config == DEFAULT_LORA
    assert req.config["target_modules"] == "all-linear" and req.config["task_type"] == "CAUSAL_LM"
    assert req.gradient_checkpointing is quantized  # on by default for quantised training only
    line = req.describe()
    assert "\n" not in line and "r=16" in line and "all-linear" in line


def test_lora_dict_overlays_defaults_and_xpukit_keys() -> None:
    req = resolve_lora(
        {"r": 4, "target_modules": ["q_proj"], "gradient_checkpointing": False}, quantized=True
    )
    assert req is not None
    assert req.config["r"] == 4 and req.config["target_modules"] == ["q_proj"]
    assert req.config["lora_alpha"] == DEFAULT_LORA["lora_alpha"]
    assert "gradient_checkpointing" not in req.config and req.gradient_checkpointing is False
    assert resolve_lora({"liger": False}, quantized=True).liger is False  # type: ignore[union-attr]


def test_lora_dict_unknown_key_suggests() -> None:
    with pytest.raises(InvalidRequestError, match=r"'lora_alpah' \(did you mean 'lora_alpha'\?\)"):
        resolve_lora({"lora_alpah": 8}, quantized=False)
    with pytest.raises(InvalidRequestError, match="True or False"):
        resolve_lora({"gradient_checkpointing": "yes"}, quantized=False)


def test_lora_wrong_type() -> None:
    with pytest.raises(InvalidRequestError, match="not understood"):
        resolve_lora(3, quantized=False)


def test_lora_path_errors(tmp_path: Path) -> None:
    """A trained adapter's files are read with the request (xpukit/sources/), refused there."""
    with pytest.raises(InvalidRequestError, match="no such directory"):
        LoadRequest(lora=tmp_path / "missing")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(InvalidRequestError, match=r"adapter_config\.json is missing \(found: weights\.bin\)"):
        read_adapter_files(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(InvalidRequestError, match="unreadable"):
        LoadRequest(lora=str(tmp_path))
    with pytest.raises(InvalidRequestError, match="files were not read"):
        resolve_lora(tmp_path, quantized=False)  # the resolver reads nothing itself


def test_lora_path_ok(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"r": 8, "target_modules": ["v_proj", "q_proj"]})
    )
    req = LoadRequest(lora=tmp_path, quantize="4bit").lora_request
    assert req is not None and req.kind == "adapter" and req.adapter_path == str(tmp_path)
    assert req.files is not None and req.files.tensors is None and req.files.record is None
    assert req.gradient_checkpointing is False
    assert req.describe().endswith("(r=8, targets q_proj,v_proj), inference only")


def test_resolve_imports_nothing_heavy() -> None:
    code = (
        "import sys; from xpukit.planning.training.lora_request import resolve_lora;"
        "import xpukit.training.arguments, xpukit.loading.training.liger;"
        "resolve_lora(True, quantized=True); resolve_lora({'r': 4}, quantized=False);"
        "heavy = {'torch', 'transformers', 'peft', 'bitsandbytes'} & set(sys.modules); print(sorted(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# liger: the decision is pure
# ---------------------------------------------------------------------------------------------

_LIGER_TYPES = frozenset({"qwen3", "llama"})


@pytest.mark.parametrize(
    ("profile", "model_type", "wanted", "version", "triton", "use"),
    [
        ("h100", "qwen3", None, "0.8.5", True, True),
        ("max-1550", "llama", None, "0.8.5", True, True),  # Triton runs on XPU (triton-xpu)
        ("h100", "qwen3", False, "0.8.5", True, False),  # the user turned it off
        ("h100", "qwen3", None, None, True, False),  # not installed
        ("h100", "qwen3", None, "0.8.5", False, False),  # no triton
        ("h100", "gpt2", None, "0.8.5", True, False),  # no kernels for that architecture
        ("cpu-bf16", "qwen3", True, "0.8.5", True, False),  # no Triton on CPU, even when asked
        ("apple-m2", "qwen3", None, "0.8.5", True, False),
    ],
)
def test_decide_liger(
    profile: str, model_type: str, wanted: bool | None, version: str | None, triton: bool, use: bool
) -> None:
    decision = decide_liger(
        device_profile(profile),
        model_type,
        wanted=wanted,
        liger_version=version,
        triton=triton,
        supported_types=_LIGER_TYPES,
    )
    assert decision.use is use
    assert decision.reason


def _fake_liger(monkeypatch: pytest.MonkeyPatch, apply: Any) -> None:
    """Stand in for liger-kernel, installed or not, with ``apply`` as its instance entry point and no
    functional entry point (the real one, imported by an earlier test in this process, hidden too)."""
    import types

    import xpukit.loading.training.liger as liger

    package = types.ModuleType("liger_kernel")
    transformers_module = types.ModuleType("liger_kernel.transformers")
    transformers_module._apply_liger_kernel_to_instance = apply  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", transformers_module)
    transformers_module.__path__ = []  # a package with no submodules: `import ….functional` fails
    monkeypatch.delitem(sys.modules, "liger_kernel.transformers.functional", raising=False)
    monkeypatch.setattr(liger, "is_installed", lambda module: True)
    monkeypatch.setattr(liger, "installed_version", lambda package: "0.8.5")
    monkeypatch.setattr(liger, "_supported_model_types", lambda: frozenset({"qwen3"}))


def test_liger_patches_the_instance_only(monkeypatch: pytest.MonkeyPatch, tiny_model: Path) -> None:
    """liger's entry point also rewrites the modeling module (process-wide); xpukit undoes that part."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3 import modeling_qwen3

    from xpukit.loading.training.liger import apply_liger

    calls: list[dict[str, Any]] = []

    def apply(*, model: Any, **kwargs: Any) -> None:  # what liger does, in miniature
        calls.append(kwargs)
        modeling_qwen3.apply_rotary_pos_emb = lambda *a, **k: None
        modeling_qwen3.Qwen3RMSNorm = torch.nn.Identity
        modeling_qwen3.liger_added = True
        model.model.norm.forward = lambda hidden: hidden * 0  # instance patch: must stay

    _fake_liger(monkeypatch, apply)
    module_before = dict(vars(modeling_qwen3))
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    notes = apply_liger(model, device_profile("h100"))
    assert calls == [{"rope": False, "cross_entropy": False, "fused_linear_cross_entropy": True}]
    assert notes[0].startswith("applied liger-kernel 0.8.5 on cuda for 'qwen3' to this model only")
    assert dict(vars(modeling_qwen3)) == module_before
    assert float(model.model.norm(torch.ones(2)).sum()) == 0.0


def test_liger_failure_is_a_recorded_fallback(monkeypatch: pytest.MonkeyPatch, tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    from xpukit.loading.training.liger import apply_liger

    def apply(*, model: Any, **kwargs: Any) -> None:
        raise RuntimeError("Triton compilation failed")

    _fake_liger(monkeypatch, apply)
    notes = apply_liger(AutoModelForCausalLM.from_pretrained(tiny_model), device_profile("max-1550"))
    assert len(notes) == 1 and "failed" in notes[0] and "Triton compilation failed" in notes[0]
    assert "training without it" in notes[0]


# ---------------------------------------------------------------------------------------------
# apply_lora on a real tiny 4-bit model (CPU)
# ---------------------------------------------------------------------------------------------


def _load_4bit(path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True,
    )
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=bnb, dtype=torch.bfloat16, device_map="cpu"
    )


def _cpu() -> Any:
    from xpukit.machine.probe import cpu_facts

    return cpu_facts()


def _apply(
    model: Any, lora: object = True, dtype: str = "bfloat16", quantized: bool = True
) -> tuple[Any, list[str]]:
    request = resolve_lora(lora, quantized=quantized)
    assert request is not None
    return apply_lora(model, request, compute_dtype=dtype, quantized=quantized, device=_cpu())


def _batch(path: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from xpukit.demo.tiny import corpus_lines

    tok = AutoTokenizer.from_pretrained(path)
    enc = tok(corpus_lines()[:4], return_tensors="pt", padding=True, truncation=True, max_length=24)
    enc["labels"] = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    return dict(enc)


def _lora_b_grads(model: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """One training forward/backward; the lora_B gradient of every LoRA layer (B starts at zero)."""
    model.train()
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}


def _bnb_layers(model: Any) -> list[Any]:
    import bitsandbytes as bnb

    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def _packed(model: Any) -> int:
    return sum(
        bool(getattr(m.weight.quant_state, "packing_format_for_cpu", False)) for m in _bnb_layers(model)
    )


def test_lean_qlora_structure(tiny_model: Path) -> None:
    import torch

    model, notes = _apply(_load_4bit(tiny_model))
    assert type(model).__name__ == "PeftModelForCausalLM"
    assert len(_bnb_layers(model)) == 14  # 7 projections x 2 layers, now the LoRA layers' base layers
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, _ in trainable)
    n_trainable = sum(p.numel() for _, p in trainable)
    n_total = sum(p.numel() * (2 if type(p).__name__ == "Params4bit" else 1) for p in model.parameters())
    assert n_trainable / n_total < 0.25  # tiny model: hidden 64, so r=16 is large; ~0.5 % on an 8B
    # Lean: the non-quantised weights stay in the compute dtype (peft's recipe makes them fp32).
    frozen_float = [p for n, p in model.named_parameters() if not p.requires_grad and p.is_floating_point()]
    assert frozen_float and all(p.dtype == torch.bfloat16 for p in frozen_float)
    assert model.base_model.model.is_gradient_checkpointing
    assert any("gradient checkpointing on" in n for n in notes)
    assert any("liger-kernel not used" in n and "cpu" in n for n in notes)


def test_generate_then_train_keeps_gradients(tiny_model: Path) -> None:
    """docs/known-issues.md "bitsandbytes: CPU repacking of 4-bit weights" TRAP: a generate() before LoRA
    repacks the 4-bit weights for CPU inference,
    after which q/k/v/gate/up get exactly zero LoRA gradients. apply_lora must undo it."""
    import torch

    batch = _batch(tiny_model)
    model = _load_4bit(tiny_model)
    if not all(getattr(m, "support_avx512bf16_for_cpu", False) for m in _bnb_layers(model)):
        pytest.skip("bitsandbytes repacks only on CPUs with avx512_bf16; this one has none")
    model.generate(input_ids=batch["input_ids"][:1, :4], max_new_tokens=2, do_sample=False)
    assert _packed(model) == 14, "generate() should have repacked every 4-bit layer (the trap's cause)"

    lora = {"lora_dropout": 0.0}  # deterministic forwards, so the gradients can be compared below
    torch.manual_seed(0)  # the same LoRA A initialisation for both models
    model, notes = _apply(model, lora)
    assert _packed(model) == 0
    assert any("restored 14 4-bit weights" in n for n in notes)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # gemv_4bit's "no autograd kernel" warning
        grads = _lora_b_grads(model, batch)
    assert len(grads) == 14
    zero = [n for n, g in grads.items() if not g.abs().sum() > 0]
    assert not zero, f"zero LoRA gradients after generate(): {zero}"

    # The same gradients as a model that never ran generate (up to the bf16 rounding of the
    # restored absmax): the restored weights are the trained-on weights.
    fresh = _load_4bit(tiny_model)
    torch.manual_seed(0)
    fresh, _ = _apply(fresh, lora)
    reference = _lora_b_grads(fresh, batch)
    for name, grad in grads.items():
        cos = torch.nn.functional.cosine_similarity(grad.flatten(), reference[name].flatten(), dim=0)
        assert cos > 0.98, (name, float(cos))

    # An eval-mode forward during training (generate, Trainer evaluation) no longer repacks.
    model.generate(input_ids=batch["input_ids"][:1, :4], max_new_tokens=2, do_sample=False)
    assert _packed(model) == 0
    assert all(g.abs().sum() > 0 for g in _lora_b_grads(model, batch).values())


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma", "phi3", "gpt2", "granite"])
def test_lean_qlora_on_each_architecture(tiny_models: Mapping[str, Path], arch: str) -> None:
    """all-linear finds every projection (fused qkv_proj on Phi-3, Conv1D on GPT-2) and trains."""
    model, notes = _apply(_load_4bit(tiny_models[arch]))
    grads = _lora_b_grads(model, _batch(tiny_models[arch]))
    assert len(grads) == len(_bnb_layers(model)) > 0
    assert all(g.abs().sum() > 0 for g in grads.values()), [
        n for n, g in grads.items() if not g.abs().sum() > 0
    ]
    assert any("trainable of" in n for n in notes)


def test_bad_targets_refused_and_model_untouched(tiny_model: Path) -> None:
    model = _load_4bit(tiny_model)
    before = {n: (p.requires_grad, p.dtype) for n, p in model.named_parameters()}
    with pytest.raises(InvalidRequestError, match=r"match no module.*down_proj, gate_proj, k_proj") as err:
        _apply(model, {"target_modules": ["query", "value"]})
    assert "lm_head" in str(err.value) and "all-linear" in str(err.value)
    assert {n: (p.requires_grad, p.dtype) for n, p in model.named_parameters()} == before
    assert not model.is_gradient_checkpointing
    with pytest.raises(InvalidRequestError, match="rank must be a positive integer"):
        _apply(model, {"r": -1})
    with pytest.raises(InvalidRequestError, match="LoraConfig rejected"):
        _apply(model, {"layers_pattern": "layers"})


def test_lora_config_object_and_explicit_targets(tiny_model: Path) -> None:
    from peft import LoraConfig

    req = resolve_lora(LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), quantized=False)
    assert req is not None and req.config["target_modules"] == ["q_proj", "v_proj"] and req.config["r"] == 4
    assert req.gradient_checkpointing is False
    model, _ = apply_lora(_load_4bit(tiny_model), req, compute_dtype="bf16", quantized=True, device=_cpu())
    targeted = {n.split(".")[-4] for n, p in model.named_parameters() if p.requires_grad}
    assert {"q_proj", "v_proj"} <= targeted and not targeted & {"k_proj", "o_proj", "up_proj"}


@pytest.mark.parametrize(("compute", "frozen"), [("float16", "float16"), ("float32", "float32")])
def test_dtype_policy_for_fp16_and_fp32_compute(tiny_model: Path, compute: str, frozen: str) -> None:
    """fp16: GradScaler needs fp32 trainable weights, the frozen ones stay fp16. fp32: all fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float16 if compute == "float16" else torch.bfloat16
    )
    peft_model, notes = _apply(model, {"r": 4}, dtype=compute, quantized=False)
    for name, p in peft_model.named_parameters():
        want = torch.float32 if p.requires_grad else getattr(torch, frozen)
        assert p.dtype == want, (name, p.dtype)
    assert any(compute in n for n in notes)


def test_adapter_save_and_reload_gives_same_logits(tiny_model: Path, tmp_path: Path) -> None:
    import torch

    batch = _batch(tiny_model)
    model, _ = _apply(_load_4bit(tiny_model), {"r": 4, "lora_dropout": 0.0})
    torch.manual_seed(0)
    with torch.no_grad():  # a trained adapter: B far from its zero start
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    model.save_pretrained(tmp_path / "adapter")

    request = resolve_lora(
        tmp_path / "adapter", quantized=True, files=read_adapter_files(tmp_path / "adapter")
    )
    assert request is not None and request.kind == "adapter" and request.config["r"] == 4
    base = _load_4bit(tiny_model)
    with torch.no_grad():
        base_logits = base(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits.float()
    reloaded, notes = apply_lora(base, request, compute_dtype="bfloat16", quantized=True, device=_cpu())
    assert not reloaded.training and not any(p.requires_grad for p in reloaded.parameters())
    assert "inference" in notes[0]
    with torch.no_grad():
        again = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    # Inference may take bitsandbytes' repacked CPU kernel (bf16 scales, another summation order), so
    # compare to the adapter's own effect, which a reload that lost the adapter would miss entirely.
    effect = (base_logits - trained).abs().mean().item()
    assert effect > 0.05
    assert (again - trained).abs().mean().item() < 0.05 * effect
    # Through the same kernel as the trained model, the reloaded adapter gives the same logits.
    fresh_reload, _ = apply_lora(
        _no_repack(_load_4bit(tiny_model)), request, compute_dtype="bfloat16", quantized=True, device=_cpu()
    )
    with torch.no_grad():
        same_path = fresh_reload(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(same_path.float(), trained, rtol=0, atol=1e-6)


def _no_repack(model: Any) -> Any:
    for layer in _bnb_layers(model):
        layer.support_avx512bf16_for_cpu = False
    return model


def test_adapter_for_another_model_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["c_attn"]})
    )
    request = resolve_lora(tmp_path, quantized=True, files=read_adapter_files(tmp_path))
    assert request is not None
    with pytest.raises(InvalidRequestError, match="does not fit this model"):
        apply_lora(_load_4bit(tiny_model), request, compute_dtype="bfloat16", quantized=True, device=_cpu())


def test_missing_peft_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import xpukit._compat as compat

    monkeypatch.setattr(compat, "installed_version", lambda package: None)
    request = LoraRequest(
        kind="new", config=dict(DEFAULT_LORA), adapter_path=None, gradient_checkpointing=False, reason="test"
    )
    with pytest.raises(MissingExtraError, match=r"xpukit\[lora\]"):
        apply_lora(object(), request, compute_dtype="bfloat16", quantized=False, device=device_profile("cpu"))


# ---------------------------------------------------------------------------------------------
# On a CUDA/XPU machine: liger-kernel and the lean recipe on the real device
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_qlora_on_gpu_with_liger_where_installed(tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from xpukit._compat import is_installed
    from xpukit.machine.probe import detect

    facts = detect()
    if facts.accelerator not in ("cuda", "xpu"):
        pytest.skip("needs a CUDA or XPU device")
    device = facts.devices[0]
    bnb = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    )
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model, quantization_config=bnb, dtype=torch.bfloat16, device_map=device.torch_device
    )
    from transformers.models.qwen3 import modeling_qwen3

    module_before = (modeling_qwen3.apply_rotary_pos_emb, modeling_qwen3.Qwen3RMSNorm)
    request = resolve_lora(True, quantized=True)
    assert request is not None
    model, notes = apply_lora(model, request, compute_dtype="bfloat16", quantized=True, device=device)
    liger_notes = [n for n in notes if "liger" in n]
    if is_installed("liger_kernel") and is_installed("triton"):
        assert liger_notes and liger_notes[0].startswith("applied liger-kernel"), liger_notes
        assert "LigerRMSNorm" in repr(model.base_model.model.model.norm)  # patched on this instance
        # ... and on this instance only: the modeling module is as it was, so a CPU model still runs.
        assert (modeling_qwen3.apply_rotary_pos_emb, modeling_qwen3.Qwen3RMSNorm) == module_before
        cpu_model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
        cpu_model(input_ids=torch.tensor([[1, 2, 3]]))
    batch = {k: v.to(device.torch_device) for k, v in _batch(tiny_model).items()}
    grads = _lora_b_grads(model, batch)
    assert grads and all(g.abs().sum() > 0 for g in grads.values())


def test_plain_nf4_repacking_is_restored_exactly(tiny_model: Path) -> None:
    """Without double quantisation bitsandbytes' own inverse leaves absmax in the repacked layout;
    bnb_cpu puts it back. The packed weights must come back bit for bit, absmax to bf16 rounding."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from xpukit.loading.bnb_cpu import restore_trainable_4bit_layout

    plain = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=False,
    )
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model, quantization_config=plain, dtype=torch.bfloat16, device_map="cpu"
    )
    layers = _bnb_layers(model)
    if not all(getattr(m, "support_avx512bf16_for_cpu", False) for m in layers):
        pytest.skip("bitsandbytes repacks only on CPUs with avx512_bf16; this one has none")
    before = {
        id(m): (m.weight.data.clone(), m.weight.quant_state.absmax.clone(), m.weight.quant_state.shape)
        for m in layers
    }
    model.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
    assert _packed(model) == len(layers) > 0
    notes = restore_trainable_4bit_layout(model)
    assert _packed(model) == 0 and any(f"restored {len(layers)}" in n for n in notes)
    for m in layers:
        data, absmax, shape = before[id(m)]
        state = m.weight.quant_state
        assert torch.equal(m.weight.data, data), "packed 4-bit codes differ after the restore"
        assert state.absmax.shape == absmax.shape and state.absmax.dtype == absmax.dtype
        torch.testing.assert_close(state.absmax, absmax, rtol=2**-8, atol=0)
        assert tuple(state.shape) == tuple(shape) and not state.nested


def test_offloading_stays_around_liger_s_own_loss(monkeypatch: pytest.MonkeyPatch, tiny_model: Path) -> None:
    """liger's fused loss installs its own instance ``forward``; the offloading wrapper is put on
    after it, so it still runs (before, the offload hooks were silently dropped)."""
    import types

    from transformers import AutoModelForCausalLM

    from xpukit.loading.lora import apply_lora
    from xpukit.planning.training.lora_request import resolve_lora

    def apply(*, model: Any, **kwargs: Any) -> None:  # liger with its fused loss: a new forward
        if kwargs.get("fused_linear_cross_entropy", True):
            model.forward = types.MethodType(type(model).forward, model)

    _fake_liger(monkeypatch, apply)  # no functional entry point: liger's own loss stays
    request = resolve_lora({"gradient_checkpointing": "offload", "liger": True}, quantized=False)
    assert request is not None
    model, notes = apply_lora(
        AutoModelForCausalLM.from_pretrained(tiny_model),
        request,
        compute_dtype="float32",
        quantized=False,
        device=device_profile("h100"),
    )
    assert any("liger's fused loss in its own chunks" in n for n in notes)
    assert getattr(model.get_base_model().forward, "_xpukit_offload", False)
