"""The fused 4-bit LoRA path against peft's own modules, and the nf4 reference against bitsandbytes.

Everything runs on the CPU in float32 (bitsandbytes 4-bit with fp32 compute), so the results do not
depend on the CPU's features: the fused path must give peft's loss and every LoRA gradient to fp32
rounding, on the same weights (the same model, before and after fusing).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from xpukit.errors import InvalidRequestError

RTOL, ATOL = 1e-5, 1e-6


# ---------------------------------------------------------------------------------------------
# nf4 dequantisation: the PyTorch reference is bitsandbytes, bit for bit
# ---------------------------------------------------------------------------------------------


def _quantized(shape: tuple[int, ...], dtype: Any, blocksize: int, nested: bool) -> tuple[Any, Any]:
    import bitsandbytes.functional as bnb_functional
    import torch

    generator = torch.Generator().manual_seed(sum(shape) + blocksize)
    weight = (torch.randn(shape, generator=generator) * 0.05).to(dtype)
    return bnb_functional.quantize_4bit(
        weight, blocksize=blocksize, quant_type="nf4", compress_statistics=nested
    )


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "double-quant"])
@pytest.mark.parametrize(
    ("shape", "blocksize"),
    [((64, 64), 64), ((33, 70), 64), ((17, 5), 64), ((96, 130), 128), ((300, 257), 256)],
)
def test_nf4_reference_is_bitsandbytes(
    dtype_name: str, nested: bool, shape: tuple[int, int], blocksize: int
) -> None:
    import bitsandbytes.functional as bnb_functional
    import torch

    from xpukit.kernels.nf4 import dequantize_nf4, dequantize_nf4_reference

    dtype = getattr(torch, dtype_name)
    packed, state = _quantized(shape, dtype, blocksize, nested)
    assert state.nested is nested and state.dtype == dtype
    # An odd last dimension takes bitsandbytes' generic dequantisation, a torch.compile'd function:
    # run eagerly, it is the same arithmetic without inductor's 30-60 s first compile per process
    # (what is checked here is the nf4 layout, not inductor's code generation).
    with torch.compiler.set_stance("force_eager"):
        expected = bnb_functional.dequantize_4bit(packed, state)
        mine = dequantize_nf4_reference(packed, state)
        assert mine.dtype == expected.dtype == dtype and mine.shape == expected.shape == shape
        assert torch.equal(mine, expected), (mine - expected).abs().max()
        assert torch.equal(dequantize_nf4(packed, state), expected)  # on the CPU: bitsandbytes itself


def test_nf4_reference_refuses_fp4() -> None:
    import bitsandbytes.functional as bnb_functional
    import torch

    from xpukit.kernels.nf4 import dequantize_nf4_reference

    packed, state = bnb_functional.quantize_4bit(torch.randn(8, 64), quant_type="fp4")
    with pytest.raises(ValueError, match="fp4"):
        dequantize_nf4_reference(packed, state)


def test_triton_kernel_under_the_interpreter(triton_interpreter: Any) -> None:
    """The Triton kernel's indexing, under triton's CPU interpreter (fp32 outputs: the interpreter
    computes with numpy, which has no bfloat16; the bf16/fp16 check is in
    tests/kernels/test_kernels_gpu.py)."""
    code = (
        "import torch, bitsandbytes.functional as F\n"
        "from xpukit.kernels._nf4_triton import dequantize_nf4_triton\n"
        "torch.compiler.set_stance('force_eager')  # bitsandbytes' compiled path for odd shapes, eagerly\n"
        "for shape in [(64, 64), (33, 70), (17, 5), (40, 256)]:\n"
        "    for nested in (False, True):\n"
        "        w = torch.randn(shape, generator=torch.Generator().manual_seed(1))\n"
        "        q, s = F.quantize_4bit(w, blocksize=64, quant_type='nf4', compress_statistics=nested)\n"
        "        assert torch.equal(dequantize_nf4_triton(q, s), F.dequantize_4bit(q, s)), (shape, nested)\n"
        "print('ok')\n"
    )
    triton_interpreter(code)


# ---------------------------------------------------------------------------------------------
# The fused path against peft's modules on tiny 4-bit models (float32)
# ---------------------------------------------------------------------------------------------


def _load_4bit(path: Path, *, double_quant: bool = True, dtype: str = "float32") -> Any:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=getattr(torch, dtype),
        bnb_4bit_use_double_quant=double_quant,
    )
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=bnb, dtype=getattr(torch, dtype), device_map="cpu"
    )
    for module in model.modules():  # no CPU repacking in eval (avx512_bf16 CPUs): one kernel for all
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def _peft(model: Any, **config: Any) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model

    settings = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear"}
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **{**settings, **config}))
    with torch.no_grad():  # a trained adapter: B away from its zero start, so every gradient is live
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    return peft_model


def _ids() -> Any:
    import torch

    return torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))


def _loss_and_grads(model: Any) -> tuple[Any, dict[str, Any]]:
    ids = _ids()
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def _assert_same_training(before: tuple[Any, dict[str, Any]], after: tuple[Any, dict[str, Any]]) -> None:
    import torch

    torch.testing.assert_close(after[0], before[0], rtol=RTOL, atol=ATOL)
    assert after[1].keys() == before[1].keys() and before[1]
    for name, grad in before[1].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(after[1][name], grad, rtol=RTOL, atol=ATOL, msg=name)


def _logits(model: Any) -> Any:
    import torch

    model.eval()
    with torch.no_grad():
        return model(input_ids=_ids()).logits


@pytest.mark.parametrize("arch", ["qwen3", "llama", "mistral"])
@pytest.mark.parametrize("double_quant", [True, False], ids=["double-quant", "plain"])
def test_fused_equals_peft(tiny_models: Mapping[str, Path], arch: str, double_quant: bool) -> None:
    from xpukit.loading.training.fused_lora import apply_fused_lora

    model = _peft(_load_4bit(tiny_models[arch], double_quant=double_quant))
    reference = _loss_and_grads(model)
    logits = _logits(model)
    notes = apply_fused_lora(model, insist=True)
    assert notes[0] == "fused LoRA: 2 decoder blocks (q/k/v, o, gate/up/down)"
    assert notes[1].startswith("fused LoRA check: ") and "agrees with peft's block in float32" in notes[1]
    assert apply_fused_lora(model, insist=True) == notes[:1]  # a second call changes nothing
    _assert_same_training(reference, _loss_and_grads(model))
    import torch

    torch.testing.assert_close(_logits(model), logits, rtol=RTOL, atol=ATOL)  # eval, no_grad


# Tiny random-weight models of each family the fused path covers, built from transformers' config
# classes (sizes as xpukit.demo.tiny's, plus what makes the family itself: multipliers, norms, NoPE
# layers, sliding windows, fused projections, biases, experts).
_SMALL = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma1": ("GemmaConfig", {"head_dim": 16, "hidden_act": "gelu_pytorch_tanh"}),
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "attn_implementation": "eager",
        },
    ),  # soft-capped attention logits: eager attention only
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "granite": (
        "GraniteConfig",
        {
            "head_dim": 16,
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.015625,
            "logits_scaling": 8.0,
        },
    ),
    "olmo2": ("Olmo2Config", {}),  # q/k norms over the whole projection, post-norms
    "qwen3": ("Qwen3Config", {"head_dim": 16}),  # per-head q/k norms
    "smollm3": ("SmolLM3Config", {"num_hidden_layers": 4, "no_rope_layer_interval": 2}),  # NoPE layers
    "mistral-swa": ("MistralConfig", {"head_dim": 16, "sliding_window": 8}),
    "phi3": ("Phi3Config", {"original_max_position_embeddings": 512}),  # qkv_proj, gate_up_proj
    "glm4": ("Glm4Config", {"head_dim": 16}),  # gate_up_proj, q/k/v with biases, post-norms
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 16,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "mixtral": ("MixtralConfig", {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2}),
}
MOE = ("qwen3-moe", "mixtral")


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    built: dict[str, Path] = {}

    def build(family: str) -> Path:
        if family not in built:
            import torch
            import transformers

            config_class, extra = FAMILIES[family]
            extra = dict(extra)
            attn = extra.pop("attn_implementation", "sdpa")
            config = getattr(transformers, config_class)(**{**_SMALL, **extra})
            config._attn_implementation = attn
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                model = transformers.AutoModelForCausalLM.from_config(config)
            built[family] = tmp_path_factory.mktemp(family)
            model.save_pretrained(built[family])
        return built[family]

    return build


def _relative(got: Any, want: Any) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_fused_equals_peft(family_dir: Any, family: str) -> None:
    """Every family: the loss within 1e-4 relative and every LoRA gradient within 1e-3 (relative L2)
    of peft's, float32, the PyTorch path; the load-time check agrees."""
    from xpukit.loading.training.fused_lora import apply_fused_lora, fused_everywhere

    model = _peft(_load_4bit(family_dir(family)))
    loss, grads = _loss_and_grads(model)
    notes = apply_fused_lora(model, insist=True)
    assert notes[1].startswith("fused LoRA check: ") and "DIFFERS" not in notes[1], notes
    if family in MOE:
        assert notes[0].startswith("fused LoRA: attention (q/k/v, o) in 2 and MLP (gate/up/down) in 0 of 2")
        assert "mixture of experts" in notes[0] and not fused_everywhere(model)
    else:
        assert notes[0].startswith("fused LoRA: ") and "kept" not in notes[0] and fused_everywhere(model)
    fused_loss, fused_grads = _loss_and_grads(model)
    assert abs(float(fused_loss) / float(loss) - 1) < 1e-4
    assert fused_grads.keys() == grads.keys() and grads
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        assert _relative(fused_grads[name], grad) < 1e-3, name


def test_family_words_in_the_notes(family_dir: Any) -> None:
    from xpukit.loading.training.fused_lora import apply_fused_lora

    expected = {
        "gemma3": "fused LoRA: 2 decoder blocks (q/k/v, o, gate/up/down with GELU (tanh))",
        "phi3": "fused LoRA: 2 decoder blocks (qkv, o, gate_up/down)",
    }
    for family, head in expected.items():
        notes = apply_fused_lora(_peft(_load_4bit(family_dir(family))), insist=True)
        assert notes[0] == head
        if family == "gemma3":  # a sliding-window layer and a global one: two block types checked
            assert notes[1].count("agrees with peft's block") == 2, notes[1]


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"lora_dropout": 0.1}, "lora_dropout > 0"),
        ({"use_dora": True}, "DoRA"),
        ({"lora_bias": True}, "bias adapters (lora_bias)"),
        ({"target_modules": ["q_proj", "v_proj", "o_proj"]}, "not adapted (not in target_modules)"),
    ],
    ids=["dropout", "dora", "lora_bias", "partial-targets"],
)
def test_each_fallback_is_recorded(tiny_model: Path, config: dict[str, Any], reason: str) -> None:
    from xpukit.loading.training.fused_lora import apply_fused_lora

    model = _peft(_load_4bit(tiny_model), **config)
    note = apply_fused_lora(model, insist=False)[0]
    assert "kept peft's path for" in note and reason in note, note
    forwards = {n for n, m in model.named_modules() if "forward" in vars(m)}
    with pytest.raises(InvalidRequestError, match=r"cannot fuse .*" + reason.split(" (")[0]) as err:
        apply_fused_lora(_peft(_load_4bit(tiny_model), **config), insist=True)
    assert 'lora={"fused": False}' in str(err.value)
    if config.get("lora_dropout") or config.get("use_dora") or config.get("lora_bias"):
        assert note.startswith("fused LoRA: nothing fused") and not forwards


def test_partial_targets_fuse_nothing_but_still_train_the_same(tiny_model: Path) -> None:
    from xpukit.loading.training.fused_lora import apply_fused_lora

    model = _peft(_load_4bit(tiny_model), target_modules=["q_proj", "v_proj"])
    reference = _loss_and_grads(model)
    note = apply_fused_lora(model, insist=False)[0]
    assert "attention: k_proj/o_proj: not adapted" in note and "MLP: gate_proj/up_proj/down_proj" in note
    _assert_same_training(reference, _loss_and_grads(model))


def test_other_base_layers_are_refused_with_the_reason(tiny_model: Path) -> None:
    """A model that is not 4-bit (here: plain fp32 Linear layers), and an 8-bit base layer."""
    import bitsandbytes as bnb
    import torch
    from transformers import AutoModelForCausalLM

    from xpukit.loading.training.fused_blocks import _projection_problem
    from xpukit.loading.training.fused_lora import apply_fused_lora

    plain = _peft(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32))
    [note] = apply_fused_lora(plain, insist=False)
    assert (
        note.startswith("fused LoRA: nothing fused")
        and "base layer is Linear, not bitsandbytes 4-bit" in note
    )
    layer = plain.base_model.model.model.layers[0].self_attn.q_proj
    layer.base_layer = bnb.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False)
    assert _projection_problem(layer) == "8-bit bitsandbytes weights (the fused path is 4-bit only)"


def test_disable_adapter_and_stash_fallback(tiny_model: Path) -> None:
    import torch

    from xpukit.loading.training.fused_lora import apply_fused_lora

    base_logits = _logits(_load_4bit(tiny_model))
    model = _peft(_load_4bit(tiny_model))
    apply_fused_lora(model, insist=True)
    fused = _logits(model)
    assert (fused - base_logits).abs().max() > 1e-2  # the adapter changes the output
    with model.disable_adapter():
        torch.testing.assert_close(_logits(model), base_logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(_logits(model), fused, rtol=0, atol=0)
    # k_proj called without q_proj first (or with another tensor) runs peft's own path.
    attn = model.base_model.model.model.layers[0].self_attn
    x = torch.randn(3, 64)
    with torch.no_grad():
        expected = type(attn.k_proj).forward(attn.k_proj, x)
        torch.testing.assert_close(attn.k_proj(x), expected, rtol=0, atol=0)
        attn.q_proj(x)
        torch.testing.assert_close(attn.k_proj(x.clone()), expected, rtol=0, atol=0)
        torch.testing.assert_close(attn.k_proj(x), expected, rtol=RTOL, atol=ATOL)  # from q_proj's call


def test_saved_adapter_loads_into_plain_peft(tiny_model: Path, tmp_path: Path) -> None:
    import torch
    from peft import PeftModel

    from xpukit.loading.training.fused_lora import apply_fused_lora

    model = _peft(_load_4bit(tiny_model))
    model.save_pretrained(tmp_path / "unfused")
    apply_fused_lora(model, insist=True)
    _loss_and_grads(model)  # a training step's forward/backward leaves nothing in the saved files
    model.save_pretrained(tmp_path / "fused")
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "fused" / name).read_bytes() == (tmp_path / "unfused" / name).read_bytes()
    fused = _logits(model)
    reloaded = PeftModel.from_pretrained(_load_4bit(tiny_model), tmp_path / "fused")
    torch.testing.assert_close(_logits(reloaded), fused, rtol=RTOL, atol=ATOL)


def test_merge_and_generate_after_fusing(tiny_model: Path) -> None:
    import torch

    from xpukit.loading.training.fused_lora import apply_fused_lora

    model = _peft(_load_4bit(tiny_model))
    prompt = _ids()[:1, :4]
    expected = model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)
    apply_fused_lora(model, insist=True)
    assert torch.equal(model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False), expected)
    fused = _logits(model)
    merged = model.merge_and_unload()  # the patched MLP forward falls back: its LoRA layers are gone
    logits = _logits(merged)
    # Merging re-quantises W + s·BA to nf4, so the logits move by that rounding, not by the adapter.
    assert (logits - fused).abs().max() < 0.5 * (fused - _logits(_load_4bit(tiny_model))).abs().max()


def test_fused_mlp_supersedes_an_instance_forward(tiny_model: Path) -> None:
    """liger-kernel patches the MLP's forward on the instance before peft; the fused MLP replaces it,
    and falls back to it where the adapters are off."""
    from xpukit.loading.training.fused_lora import apply_fused_lora

    model = _load_4bit(tiny_model)
    calls: list[int] = []
    for layer in model.model.layers:
        mlp = layer.mlp

        def liger_like(x: Any, mlp: Any = mlp) -> Any:
            calls.append(1)
            return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

        mlp.forward = liger_like
    model = _peft(model)
    reference = _loss_and_grads(model)
    assert len(calls) == 2
    apply_fused_lora(model, insist=True)
    assert len(calls) == 3  # the load-time check's run of peft's block: the forward it replaced
    _assert_same_training(reference, _loss_and_grads(model))
    assert len(calls) == 3  # the fused MLP ran, not the instance forward
    with model.disable_adapter():
        _logits(model)
    assert len(calls) == 5


def test_the_liger_gate_note_only_where_liger_runs_it(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gated step runs in liger-kernel's kernels only on CUDA/XPU: on this CPU the notes never
    mention liger, installed or not; on an (arranged) XPU with liger's kernels they do, once."""
    from xpukit.loading.training import fused_lora

    monkeypatch.setattr(fused_lora, "liger_gate_available", lambda: True)  # as where liger is installed
    notes = fused_lora.apply_fused_lora(_peft(_load_4bit(tiny_model)), insist=True)
    assert len(notes) == 2 and not any("liger" in n for n in notes)
    monkeypatch.setattr(fused_lora, "_gate_device", lambda new: "xpu" if new else None)
    model = _peft(_load_4bit(tiny_model))
    notes = fused_lora.apply_fused_lora(model, insist=True)
    assert notes[2].startswith("fused MLP: SwiGLU/GeGLU (tanh) in liger-kernel's Triton kernels")
    assert fused_lora.apply_fused_lora(model, insist=True, liger=False) == notes[:1]  # nothing new fused
    notes = fused_lora.apply_fused_lora(_peft(_load_4bit(tiny_model)), insist=True, liger=False)
    assert not any("liger" in n for n in notes)  # lora={"liger": False}


def test_apply_lora_fused_with_checkpointing(tiny_model: Path) -> None:
    """Through apply_lora (xpukit's preparation: gradient checkpointing on, recomputing q/k/v)."""
    from xpukit.loading.lora import apply_lora
    from xpukit.machine.probe import cpu_facts
    from xpukit.planning.training.lora_request import resolve_lora

    def prepared(fused: bool) -> tuple[Any, list[str]]:
        import torch

        request = resolve_lora({"r": 4, "lora_dropout": 0.0}, quantized=True)
        assert request is not None and request.gradient_checkpointing
        torch.manual_seed(0)
        model, notes = apply_lora(
            _load_4bit(tiny_model),
            request,
            compute_dtype="float32",
            quantized=True,
            device=cpu_facts(),
            fused=fused,
            fused_insist=fused,
        )
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
        return model, notes

    plain, plain_notes = prepared(False)
    fused, notes = prepared(True)
    assert not any("fused LoRA" in n for n in plain_notes)
    assert "fused LoRA: 2 decoder blocks (q/k/v, o, gate/up/down)" in notes
    assert any(n.startswith("fused LoRA check: ") and "agrees" in n for n in notes)
    _assert_same_training(_loss_and_grads(plain), _loss_and_grads(fused))


def test_apply_lora_fused_insist_refuses(tiny_models: Mapping[str, Path]) -> None:
    from xpukit.loading.lora import apply_lora
    from xpukit.machine.probe import cpu_facts
    from xpukit.planning.training.lora_request import resolve_lora

    request = resolve_lora(True, quantized=True)
    assert request is not None
    with pytest.raises(InvalidRequestError, match="no decoder block with self_attn and mlp"):
        apply_lora(
            _load_4bit(tiny_models["gpt2"]),
            request,
            compute_dtype="float32",
            quantized=True,
            device=cpu_facts(),
            fused=True,
            fused_insist=True,
        )


# ---------------------------------------------------------------------------------------------
# The autograd functions on their own: against autograd through the dequantised weights
# ---------------------------------------------------------------------------------------------


def _projection(out_f: int, in_f: int, seed: int, nested: bool = True) -> Any:
    import bitsandbytes.functional as bnb_functional
    import torch

    from xpukit.kernels.lora_ops import Projection

    g = torch.Generator().manual_seed(seed)
    packed, state = bnb_functional.quantize_4bit(
        torch.randn(out_f, in_f, generator=g) * 0.1, quant_type="nf4", compress_statistics=nested
    )
    a = (torch.randn(4, in_f, generator=g) * 0.1).requires_grad_()
    b = (torch.randn(out_f, 4, generator=g) * 0.1).requires_grad_()
    return Projection(weight=packed, quant_state=state, lora_A=a, lora_B=b, scale=2.0)


def _plain(x: Any, p: Any) -> Any:
    import bitsandbytes.functional as bnb_functional

    w = bnb_functional.dequantize_4bit(p.weight, p.quant_state)
    out = x @ w.t() + p.scale * (x @ p.lora_A.t()) @ p.lora_B.t()
    return out if p.bias is None else out + p.bias


_ACTS = {
    "silu": "silu",
    "gelu_tanh": "gelu_tanh",
    "gelu": "gelu",
    "gate_up": "silu",
    "gate_up-gelu_tanh-bias": "gelu_tanh",
}


@pytest.mark.parametrize("which", ["shared", "shared-bias", *_ACTS])
def test_functions_match_autograd(which: str) -> None:
    """Each function against autograd through peft's arithmetic on the same dequantised weights."""
    import dataclasses

    import torch

    from xpukit.kernels.lora_ops import lora_gated_mlp, lora_shared_input

    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    bias = "bias" in which

    def biased(p: Any, seed: int) -> Any:
        g = torch.Generator().manual_seed(seed)
        return dataclasses.replace(p, bias=torch.randn(p.lora_B.shape[0], generator=g) * 0.1) if bias else p

    if which.startswith("shared"):
        projs = (_projection(64, 64, 1), _projection(32, 64, 2, nested=False), _projection(32, 64, 3))
        projs = tuple(biased(p, i) for i, p in enumerate(projs))

        def fn() -> Any:
            return sum((o * (i + 1)).sum() for i, o in enumerate(lora_shared_input(x, projs, torch.float32)))

        def ref() -> Any:
            return sum((_plain(x, p) * (i + 1)).sum() for i, p in enumerate(projs))

    else:
        act = _ACTS[which]
        functions = {
            "silu": torch.nn.functional.silu,
            "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
            "gelu": torch.nn.functional.gelu,
        }
        if which.startswith("gate_up"):  # one stored gate_up_proj: gate is the first half
            projs = (biased(_projection(256, 64, 4), 4), biased(_projection(64, 128, 6), 6))
        else:
            projs = (_projection(128, 64, 4), _projection(128, 64, 5), _projection(64, 128, 6))

        def fn() -> Any:
            return (lora_gated_mlp(x, projs[:-1], projs[-1], torch.float32, act=act) ** 2).sum()

        def ref() -> Any:
            if len(projs) == 2:
                gate, up = _plain(x, projs[0]).chunk(2, dim=-1)
            else:
                gate, up = _plain(x, projs[0]), _plain(x, projs[1])
            return (_plain(functions[act](gate) * up, projs[-1]) ** 2).sum()

    leaves = [x] + [t for p in projs for t in (p.lora_A, p.lora_B)]
    got = torch.autograd.grad(fn(), leaves)
    want = torch.autograd.grad(ref(), leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=RTOL, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The load-time check: a block type that disagrees keeps peft's path, and an insisted one is refused
# ---------------------------------------------------------------------------------------------


def _scaled_mlp(model: Any) -> Any:
    """A family the rules do not know: its MLP scales its output (the fused MLP would not)."""
    for layer in model.model.layers:
        mlp = layer.mlp

        def scaled(x: Any, mlp: Any = mlp) -> Any:
            return 1.5 * type(mlp).forward(mlp, x)

        mlp.forward = scaled
    return model


def test_a_block_type_that_disagrees_keeps_peft(tiny_model: Path) -> None:
    import torch

    from xpukit.loading.training.fused_lora import apply_fused_lora, fused_everywhere

    model = _peft(_scaled_mlp(_load_4bit(tiny_model)))
    reference = _loss_and_grads(model)
    lora_b = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    rng = torch.get_rng_state()
    summary, check = apply_fused_lora(model, insist=False)
    assert summary == (
        "fused LoRA: nothing fused; kept peft's path for model.layers.0 and 1 more (the load-time check: "
        "the fused block differs from peft's)"
    )
    assert "DIFFERS from peft's block in float32: output" in check and "kept peft's path for Qwen3" in check
    assert not fused_everywhere(model)
    layers = model.base_model.model.model.layers
    patched = [n for layer in layers for n, m in layer.named_modules() if "forward" in vars(m)]
    assert patched == ["mlp", "mlp"]  # the family's own MLP forward, restored; nothing else
    _assert_same_training(reference, _loss_and_grads(model))
    # The check gave the LoRA B matrices random values for its run and put them back; it drew its
    # random numbers from its own generator.
    assert torch.equal(torch.get_rng_state(), rng)
    for name, param in model.named_parameters():
        if name in lora_b:
            assert torch.equal(param, lora_b[name]), name
    with pytest.raises(InvalidRequestError, match=r"does not compute what peft's modules compute: .*DIFFERS"):
        apply_fused_lora(_peft(_scaled_mlp(_load_4bit(tiny_model))), insist=True)


def test_the_check_reaches_the_plan_and_refuses_an_insisted_fused_path(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through load_for_xpu: the check's measurements are the plan's events; with a tolerance of 0
    (a stand-in for a block that disagrees) the blocks keep peft's path, and lora={"fused": True}
    is refused with the measured difference."""
    from xpukit import load_for_xpu
    from xpukit.loading.training import fused_check

    def load(fused: bool | None) -> Any:
        lora = {} if fused is None else {"fused": fused}
        return load_for_xpu(tiny_model, device="cpu", dtype="float32", quantize="4bit", lora=lora)

    def notes(model: Any) -> list[str]:
        return [str(e.actual) for e in model.xpukit_plan.events if e.what == "lora"]

    [check] = [n for n in notes(load(True)) if n.startswith("fused LoRA check: ")]
    assert "agrees with peft's block in float32" in check
    monkeypatch.setitem(fused_check.TOLERANCES, "float32", (0.0, 0.0))
    with pytest.raises(
        InvalidRequestError, match=r"fused.: True.*DIFFERS from peft's block .*tolerance 0e\+00"
    ):
        load(True)
    assert not any(n.startswith("fused LoRA check: ") for n in notes(load(None)))  # off on the CPU


def test_in_bf16_a_block_beyond_the_tolerance_is_judged_against_float32(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 tolerances are rounding noise: with them at 0, a correct block agrees because it is as
    close to peft's float32 answer as peft's own bf16 block; a wrong one (a scaled MLP) does not."""
    from xpukit.loading.training import fused_check
    from xpukit.loading.training.fused_lora import apply_fused_lora

    def load() -> Any:
        return _load_4bit(tiny_model, dtype="bfloat16")

    monkeypatch.setitem(fused_check.TOLERANCES, "bfloat16", (0.0, 0.0))
    summary, check = apply_fused_lora(_peft(load()), insist=False)
    assert summary.startswith("fused LoRA: 2 decoder blocks")
    assert "agrees with peft's block in bfloat16" in check
    assert "against float32: fused" in check
    summary, check = apply_fused_lora(_peft(_scaled_mlp(load())), insist=False)
    assert "nothing fused" in summary and "DIFFERS" in check and "against float32" in check
