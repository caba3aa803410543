"""On CUDA: the Triton nf4 kernel bit for bit against bitsandbytes, and the fused LoRA functions in bf16.

Run with ``pytest -m gpu tests/test_kernels_gpu.py`` on a machine with a CUDA device, triton and
bitsandbytes' CUDA library; every test skips cleanly elsewhere.

bf16 tolerance: bf16 keeps 8 significant bits, so one rounding moves a value by up to 2⁻⁹ of it. The
fused functions and peft round at different places (``addmm_`` with ``alpha`` against a separate
scale and add; liger's SwiGLU computes in fp32 and rounds once where PyTorch rounds ``silu`` first),
and the differences accumulate over the layers. Each output and each gradient must agree with peft's
to a relative norm error ``‖fused − peft‖ / ‖peft‖ ≤ 2 %`` (``BF16_REL``) and a cosine similarity
``≥ 0.999``, and the loss to ``1e-2`` relative.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

BF16_REL = 2e-2
BF16_COS = 0.999


def _need_cuda_triton() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    pytest.importorskip("bitsandbytes")


def _close_bf16(got: Any, want: Any, what: str) -> None:
    import torch

    got, want = got.float().flatten(), want.float().flatten()
    rel = float((got - want).norm() / want.norm().clamp_min(1e-12))
    cos = float(torch.nn.functional.cosine_similarity(got, want, dim=0))
    assert rel <= BF16_REL and cos >= BF16_COS, f"{what}: relative error {rel:.2e}, cosine {cos:.5f}"


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "double-quant"])
@pytest.mark.parametrize(
    ("shape", "blocksize"),
    [((4096, 4096), 64), ((12288, 4096), 64), ((4096, 12288), 64), ((33, 70), 64), ((1000, 513), 128)],
)
def test_triton_nf4_is_bitsandbytes(
    dtype_name: str, nested: bool, shape: tuple[int, int], blocksize: int
) -> None:
    _need_cuda_triton()
    import bitsandbytes.functional as bnb_functional
    import torch

    from xpukit.kernels._nf4_triton import dequantize_nf4_triton
    from xpukit.kernels.nf4 import dequantize_nf4, dequantize_nf4_reference

    dtype = getattr(torch, dtype_name)
    generator = torch.Generator(device="cuda").manual_seed(sum(shape))
    weight = (torch.randn(shape, device="cuda", generator=generator) * 0.02).to(dtype)
    packed, state = bnb_functional.quantize_4bit(
        weight, blocksize=blocksize, quant_type="nf4", compress_statistics=nested
    )
    expected = bnb_functional.dequantize_4bit(packed, state)
    got = dequantize_nf4_triton(packed, state)
    assert got.dtype == expected.dtype == dtype and got.shape == expected.shape
    assert torch.equal(got, expected), f"{int((got != expected).sum())} elements differ"
    assert torch.equal(dequantize_nf4(packed, state), expected)  # the dispatch takes the Triton kernel
    assert torch.equal(dequantize_nf4_reference(packed, state), expected)  # the reference, on the GPU
    out = torch.empty_like(expected)
    assert dequantize_nf4_triton(packed, state, out=out) is out and torch.equal(out, expected)


def _projection(out_f: int, in_f: int, seed: int) -> Any:
    import bitsandbytes.functional as bnb_functional
    import torch

    from xpukit.kernels.lora_ops import Projection

    g = torch.Generator(device="cuda").manual_seed(seed)
    packed, state = bnb_functional.quantize_4bit(
        (torch.randn(out_f, in_f, device="cuda", generator=g) * 0.02).bfloat16(),
        quant_type="nf4",
        compress_statistics=True,
    )
    a = (torch.randn(16, in_f, device="cuda", generator=g) * 0.02).requires_grad_()  # fp32, as peft
    b = (torch.randn(out_f, 16, device="cuda", generator=g) * 0.02).requires_grad_()
    return Projection(weight=packed, quant_state=state, lora_A=a, lora_B=b, scale=2.0)


def _plain(x: Any, p: Any) -> Any:
    """peft's arithmetic under bf16 autocast: the base matmul, then the scaled adapter term added."""
    import bitsandbytes.functional as bnb_functional
    import torch

    w = bnb_functional.dequantize_4bit(p.weight, p.quant_state)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return x @ w.t() + (x @ p.lora_A.t()) @ p.lora_B.t() * p.scale


@pytest.mark.parametrize("which", ["qkv", "mlp-torch", "mlp-liger"])
def test_fused_functions_bf16(which: str) -> None:
    _need_cuda_triton()
    import torch

    from xpukit.kernels.lora_ops import liger_swiglu_available, lora_shared_input, lora_swiglu_mlp

    if which == "mlp-liger" and not liger_swiglu_available():
        pytest.skip("liger-kernel is not installed")
    hidden, inter, tokens = 1024, 3072, 1024
    x = (torch.randn(2, tokens // 2, hidden, device="cuda") * 0.5).bfloat16().requires_grad_()
    fn: Callable[[], Any]
    ref: Callable[[], Any]
    if which == "qkv":
        projs = (_projection(hidden, hidden, 1), _projection(256, hidden, 2), _projection(256, hidden, 3))

        def fn() -> Any:
            return lora_shared_input(x, projs, torch.bfloat16)

        def ref() -> Any:
            return tuple(_plain(x, p) for p in projs)

    else:
        projs = (_projection(inter, hidden, 4), _projection(inter, hidden, 5), _projection(hidden, inter, 6))

        def fn() -> Any:
            return (lora_swiglu_mlp(x, *projs, torch.bfloat16, liger=which == "mlp-liger"),)

        def ref() -> Any:
            gate, up = _plain(x, projs[0]), _plain(x, projs[1])
            return (_plain(torch.nn.functional.silu(gate) * up, projs[2]),)

    leaves = [x] + [t for p in projs for t in (p.lora_A, p.lora_B)]
    got_out, want_out = fn(), ref()
    seeds = [torch.randn_like(o) for o in want_out]
    got = torch.autograd.grad(sum((o * s).sum() for o, s in zip(got_out, seeds, strict=True)), leaves)
    want = torch.autograd.grad(sum((o * s).sum() for o, s in zip(want_out, seeds, strict=True)), leaves)
    for i, (g, w) in enumerate(zip(got_out, want_out, strict=True)):
        assert g.dtype == torch.bfloat16
        _close_bf16(g, w, f"output {i}")
    names = ["x"] + [f"{n}[{i}]" for i in range(len(projs)) for n in ("A", "B")]
    for name, g, w in zip(names, got, want, strict=True):
        assert g.dtype == w.dtype, name  # adapter gradients in the adapters' own dtype (fp32)
        _close_bf16(g, w, f"gradient of {name}")


def _load_4bit_cuda(path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True,
    )
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=bnb, dtype=torch.bfloat16, device_map="cuda"
    )


@pytest.mark.parametrize("liger", [False, True], ids=["torch-swiglu", "liger-swiglu"])
def test_fused_model_vs_peft_bf16(tiny_model_factory: Callable[..., Path], liger: bool) -> None:
    """A small Qwen3 (wider than the CPU tests' so the matmuls are real) in nf4 on CUDA under bf16
    autocast: the loss and every LoRA gradient of the fused path against peft's, same weights."""
    _need_cuda_triton()
    import torch
    from peft import LoraConfig, get_peft_model

    from xpukit.kernels.lora_ops import liger_swiglu_available
    from xpukit.loading.fused_lora import apply_fused_lora

    if liger and not liger_swiglu_available():
        pytest.skip("liger-kernel is not installed")
    path = tiny_model_factory(
        "qwen3",
        hidden_size=256,
        intermediate_size=768,
        num_attention_heads=4,
        head_dim=64,
        num_hidden_layers=3,
    )
    torch.manual_seed(0)
    model = get_peft_model(
        _load_4bit_cuda(path),
        LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    ids = torch.randint(
        0, 1000, (4, 128), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)
    )

    def step() -> tuple[float, dict[str, Any]]:
        model.train()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    loss_peft, grads_peft = step()
    notes = apply_fused_lora(model, insist=True, liger=liger)
    assert notes[0] == "fused LoRA: 3 decoder blocks (q/k/v, o, gate/up/down)"
    loss_fused, grads_fused = step()
    assert abs(loss_fused - loss_peft) <= 1e-2 * abs(loss_peft), (loss_fused, loss_peft)
    assert grads_fused.keys() == grads_peft.keys() and len(grads_peft) == 3 * 7 * 2
    for name, grad in grads_peft.items():
        assert grads_fused[name].dtype == grad.dtype == torch.float32, name
        _close_bf16(grads_fused[name], grad, name)
