"""xpukit's weight-only products for decoding (docs/decode-kernels.md "Weight-only products").

The Triton kernel runs under Triton's CPU interpreter in float32 (it mis-computes bf16) against the
PyTorch reference; the dispatch, the install on a model and the plan's decision run on the CPU with
torchao's real int8 weights, the reference standing in for the kernel (``devices=("cpu", ...)``).
The GPU half is tests/kernels/test_woq_gpu.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from xpukit.planning.model.reference_models import reference_config
from xpukit.planning.plan import plan_load

FOUND = "0.18.0"
CPU = ("cpu", "cuda", "xpu")


def test_triton_kernel_matches_the_reference_in_the_interpreter(triton_interpreter: Any) -> None:
    code = (
        "import torch\n"
        "from xpukit.kernels._woq_triton import int8_mm_triton\n"
        "from xpukit.kernels.woq import int8_mm_reference\n"
        "g = torch.Generator().manual_seed(0)\n"
        "cases = [(1, 40, 96, None), (3, 64, 128, None), (16, 24, 80, None), (17, 32, 64, None),\n"
        "         (1, 8, 1000, None), (1, 48, 64, {'BLOCK_M': 1, 'BLOCK_N': 32, 'BLOCK_K': 32}),\n"
        "         (5, 40, 72, {'BLOCK_M': 16, 'BLOCK_N': 16, 'BLOCK_K': 16})]\n"
        "for rows, n, k, blocks in cases:\n"
        "    x = torch.randn(rows, k, generator=g)\n"
        "    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)\n"
        "    s = torch.rand(n, 1, generator=g) / 64\n"
        "    got, want = int8_mm_triton(x, q, s, blocks), int8_mm_reference(x, q, s)\n"
        "    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)\n"
        "    err = float((got - want).abs().max() / want.abs().max())\n"
        "    assert err < 1e-5, (rows, n, k, blocks, err)\n"
        "print('ok')\n"
    )
    triton_interpreter(code)


def test_tile_sizes_give_every_multiprocessor_work() -> None:
    from xpukit.kernels._woq_triton import pick_blocks

    one = pick_blocks(1, 4096, 4096, programs=264)
    assert one == {"BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4}  # 512 programs
    wide = pick_blocks(1, 24576, 4096, programs=264)
    assert wide == {"BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 8}  # 768 programs
    eight = pick_blocks(8, 4096, 4096, programs=264)
    assert eight["BLOCK_M"] == 16 and eight["BLOCK_N"] >= 16  # tl.dot's smallest tile
    assert pick_blocks(1, 64, 40)["BLOCK_K"] == 64  # no wider than the input, rounded up to a power of 2


def test_int4_layout_and_kernel_in_the_interpreter(triton_interpreter: Any) -> None:
    """tinygemm's layout packs and unpacks (against a line-by-line statement of CUDA's packing), and
    the Triton int4 kernel equals the reference on it, every group size, one row and many."""
    code = (
        "import torch\n"
        "from xpukit.kernels.int4_tile import pack_tile_int4, unpack_tile_int4, int4_tile_mm_reference\n"
        "from xpukit.kernels._woq_triton import int4_tile_mm_triton\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for n, k in [(64, 512), (60, 1024), (24, 256)]:\n"
        "    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)\n"
        "    packed = pack_tile_int4(q)\n"
        "    assert packed.shape == (-(-n // 8), k // 128, 32, 4) and packed.dtype == torch.int32\n"
        "    assert torch.equal(unpack_tile_int4(packed, n), q)\n"
        "    for group in (32, 64, 128, 256):\n"
        "        sz = torch.randn(k // group, -(-n // 8) * 8, 2, generator=g).to(torch.bfloat16)\n"
        "        sz[..., 0] = sz[..., 0].abs() / 10\n"
        "        s = sz[..., 0].float().t().repeat_interleave(group, 1)[:n]\n"
        "        z = sz[..., 1].float().t().repeat_interleave(group, 1)[:n]\n"
        "        w = (q.float() - 8) * s + z\n"
        "        for rows, blocks in [(1, None), (3, None), (17, None),\n"
        "                             (1, {'BLOCK_M': 1, 'BLOCK_N': 8, 'TILES': 1, 'num_warps': 4}),\n"
        "                             (2, {'BLOCK_M': 16, 'BLOCK_N': 16, 'TILES': 4, 'num_warps': 4})]:\n"
        "            width = k - 40 if k == 1024 else k  # an input narrower than the padded weight\n"
        "            x = torch.randn(rows, width, generator=g)\n"
        "            want = x @ w[:, :width].t()\n"
        "            for got in (int4_tile_mm_reference(x, packed, sz, group, n),\n"
        "                        int4_tile_mm_triton(x, packed, sz, group, n, blocks)):\n"
        "                err = float((got - want).abs().max() / want.abs().max())\n"
        "                assert got.shape == want.shape and err < 1e-5, (n, k, group, rows, blocks, err)\n"
        "print('ok')\n"
    )
    triton_interpreter(code)


def test_int4_packing_follows_cudas_kernel() -> None:
    """pack_tile_int4 against a line-by-line statement of CUDA's ``matrix_to_m16n8k16_Bint4_layout``
    (PyTorch's aten/src/ATen/native/cuda/int4mm.cu, NVIDIA branch) on torchao's uint8 input, where
    an even k is the high nibble. The GPU test compares with the op itself."""
    import torch

    from xpukit.kernels.int4_tile import pack_tile_int4

    q = torch.randint(0, 16, (16, 256), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    data = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).tolist()
    inner = 8
    out = torch.zeros(2, 2, 32, inner // 2, dtype=torch.int64)
    for k_outer in range(2):
        for n_tile in range(2):
            for lane in range(32):
                for inner_k in range(0, inner, 2):
                    n = n_tile * 8 + lane // 4
                    base0 = (k_outer * inner + inner_k) * 16 // 2
                    ks = [
                        base0 + lane % 4,
                        base0 + lane % 4 + 4,
                        base0 + 8 + lane % 4,
                        base0 + 8 + lane % 4 + 4,
                    ]
                    v = [data[n][kk] for kk in ks]
                    low = (
                        ((v[3] & 0xF) << 28)
                        | ((v[2] & 0xF) << 24)
                        | ((v[1] & 0xF) << 20)
                        | ((v[0] & 0xF) << 16)
                    )
                    high = ((v[3] & 0xF0) << 8) | ((v[2] & 0xF0) << 4) | (v[1] & 0xF0) | ((v[0] & 0xF0) >> 4)
                    out[n_tile, k_outer, lane, inner_k // 2] = low | high
    want = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    assert torch.equal(pack_tile_int4(q), want)


class Int4TilePackedTo4dTensor:  # the name the dispatch reads; torchao builds the real one on CUDA only
    def __init__(self, q: Any, sz: Any, group: int) -> None:
        from xpukit.kernels.int4_tile import pack_tile_int4

        self.qdata, self.scale_and_zero, self.block_size = pack_tile_int4(q), sz, [1, group]
        self.shape = tuple(q.shape)
        self.act_pre_scale = None


def test_int4_dispatch_on_a_stand_in_weight() -> None:
    import torch

    from xpukit.kernels.woq import unsupported, weight_only_linear

    g = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (24, 256), generator=g, dtype=torch.int32)
    sz = torch.randn(2, 24, 2, generator=g).to(torch.bfloat16)
    weight = Int4TilePackedTo4dTensor(q, sz, 128)
    assert unsupported(weight) is None
    w = (q.float() - 8) * sz[..., 0].float().t().repeat_interleave(128, 1) + sz[
        ..., 1
    ].float().t().repeat_interleave(128, 1)
    x = torch.randn(2, 1, 256, generator=g)
    got = weight_only_linear(x, weight, torch.ones(24), devices=("cpu",))
    assert got.shape == (2, 1, 24)
    assert torch.allclose(got, x @ w.t() + 1, rtol=1e-4, atol=1e-3)
    weight.block_size = [1, 100]
    assert "group size 100" in str(unsupported(weight))


def _int8_linear(dtype: Any, *, group: int | None = None) -> Any:
    import torch
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 48, bias=True).to(dtype)
    quantize_(layer, Int8WeightOnlyConfig(granularity=PerGroup(group)) if group else Int8WeightOnlyConfig())
    return layer


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dispatch_matches_torchao_and_leaves_the_rest_to_it(dtype: str) -> None:
    pytest.importorskip("torchao")
    import torch

    from xpukit.kernels.woq import MAX_ROWS, unsupported, weight_only_linear

    dt = getattr(torch, dtype)
    layer = _int8_linear(dt).requires_grad_(False)
    assert unsupported(layer.weight) is None
    for shape in [(1, 1, 128), (2, 3, 128), (MAX_ROWS, 128)]:
        x = torch.randn(shape).to(dt)
        want = torch.nn.functional.linear(x, layer.weight, layer.bias)
        got = weight_only_linear(x, layer.weight, layer.bias, devices=("cpu",))
        assert got.shape == want.shape and got.dtype == want.dtype
        err = float((got.float() - want.float()).norm() / want.float().norm())
        assert err < (1e-6 if dtype == "float32" else 1e-2), (shape, err)
    # Past MAX_ROWS (a prefill), on a device the kernel does not serve, or a weight it has no kernel
    # for: exactly torchao's product.
    big = torch.randn(MAX_ROWS + 1, 128).to(dt)
    assert torch.equal(
        weight_only_linear(big, layer.weight, layer.bias, devices=("cpu",)),
        torch.nn.functional.linear(big, layer.weight, layer.bias),
    )
    x = torch.randn(1, 128).to(dt)
    assert torch.equal(weight_only_linear(x, layer.weight), torch.nn.functional.linear(x, layer.weight))
    plain = torch.nn.Linear(128, 8).to(dt)
    assert "Parameter weights have no xpukit kernel" in str(unsupported(plain.weight))
    assert torch.equal(weight_only_linear(x, plain.weight, plain.bias, devices=("cpu",)), plain(x))


def test_per_group_int8_is_left_to_torchao() -> None:
    pytest.importorskip("torchao")
    from xpukit.kernels.woq import unsupported

    assert "per-group" in str(unsupported(_int8_linear(__import__("torch").float32, group=32).weight))


def _int8_model(path: Path, dtype: str = "float32") -> Any:
    from xpukit import load_for_xpu

    return load_for_xpu(str(path), device="cpu", dtype=dtype, quantize="8bit")


def _ids() -> Any:
    import torch

    return torch.arange(3, 3 + 7 * 12, 7).remainder(1000).unsqueeze(0)


def test_installed_products_give_the_same_greedy_tokens(wide_model: Path) -> None:
    """Fused q/k/v and gate/up, then xpukit's products on every int8 layer and group; xpukit's loop
    (eager) gives plain generate's greedy tokens, on a model whose margins are clear."""
    import torch

    from xpukit.loading.decode.fused_proj import fuse_projections
    from xpukit.loading.decode.install import install_decode_loop
    from xpukit.loading.decode.woq_products import install_weight_only_products, remove_weight_only_products

    new = 10
    model = _int8_model(wide_model)
    with torch.no_grad():
        plain = model.generate(
            _ids(), max_new_tokens=new, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
        logits = model(_ids()).logits
    top = torch.stack(plain.scores, 1).topk(2, -1).values
    assert (top[..., 0] - top[..., 1]).min().item() > 1e-3  # clear margins: equal tokens mean equal paths
    assert fuse_projections(model)["attention"] > 0
    layers = model.config.num_hidden_layers
    assert install_weight_only_products(model) == {"kept": "weights on cpu; xpukit's kernel serves cuda, xpu"}
    assert install_weight_only_products(model, "int4", devices=CPU) == {
        "kept": "no layers whose weights xpukit's int4 kernel reads"
    }
    done = install_weight_only_products(model, devices=CPU)
    assert done == {"layers": 2 * layers, "groups": 2 * layers}  # o/down; q/k/v and gate/up
    install_decode_loop(model, max_cache_len=256, compile_options=None)
    calls: list[int] = []
    from xpukit.kernels import woq

    original = woq.int8_mm
    woq.int8_mm = lambda x, q, s: calls.append(x.shape[0]) or original(x, q, s)  # type: ignore[assignment]
    try:
        got = model.generate(_ids(), max_new_tokens=new, do_sample=False)
    finally:
        woq.int8_mm = original  # type: ignore[assignment]
    assert model.xpukit_last_decode["loop"] == "xpukit"
    assert got.tolist() == plain.sequences.tolist()
    # Four products a layer: the 12-token prefill once (at most MAX_ROWS rows: the kernel), then the
    # loop's one-row steps.
    assert calls.count(12) == 4 * layers and set(calls) == {1, 12}
    assert calls.count(1) % (4 * layers) == 0 and calls.count(1) // (4 * layers) >= new - 1
    with torch.no_grad():
        assert torch.allclose(model(_ids()).logits, logits, atol=1e-4)
    assert remove_weight_only_products(model) == 4 * layers
    assert not any(
        "forward" in m.__dict__
        for m in model.modules()
        if type(m) is torch.nn.Linear and m.__dict__.get("xpukit_weight_only")
    )


def test_dynamo_traces_the_products_as_one_graph(wide_model: Path) -> None:
    import torch

    from xpukit.loading.decode.fused_proj import fuse_projections
    from xpukit.loading.decode.woq_products import install_weight_only_products

    model = _int8_model(wide_model)
    fuse_projections(model)
    install_weight_only_products(model, devices=CPU)
    ids = _ids()[:, :1]
    with torch.no_grad():
        want = model(ids).logits
        explained = torch._dynamo.explain(lambda i: model(i).logits)(ids)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    ops = {str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("int8_weight_only_mm" in op for op in ops), sorted(ops)[:20]
    with torch.no_grad():
        got = torch.compile(lambda i: model(i).logits, backend="eager", fullgraph=True)(ids)
    assert torch.allclose(got, want, atol=1e-5)


def test_a_wrong_product_installs_nothing(wide_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from xpukit.kernels import woq
    from xpukit.loading.decode.woq_products import install_weight_only_products

    model = _int8_model(wide_model)
    monkeypatch.setattr(woq, "int8_mm", lambda x, q, s: woq.int8_mm_reference(x, q, s) * 1.5)
    done = install_weight_only_products(model, devices=CPU)
    assert "differed from torchao's" in done["kept"]
    assert not [m for m in model.modules() if type(m) is torch.nn.Linear and "forward" in m.__dict__]


@pytest.mark.parametrize(
    ("profile", "quantize", "kernel"),
    [
        ("h200", "8bit", "int8"),
        ("arc-b580", "8bit", "int8"),
        ("max-1550", "8bit", "int8"),
        ("h200", "4bit", ""),  # tinygemm's int4: its own product measured faster than xpukit's
        ("arc-b580", "4bit", ""),  # plain_int32: torchao's (oneDNN's) product
        ("h200", None, ""),
        ("cpu-bf16", "8bit", None),  # no fast_decode on the CPU at all
    ],
)
def test_the_plan_names_the_kernel(
    monkeypatch: pytest.MonkeyPatch, profile: str, quantize: str | None, kernel: str | None
) -> None:
    from xpukit.planning.device import layout as layout_module

    monkeypatch.setattr(layout_module, "torchao_version", lambda: FOUND)
    plan = plan_load(reference_config("qwen3-8b"), facts=profile, quantize=quantize)
    if kernel is None:
        assert plan.decode is None or plan.decode.weight_kernel == ""
        return
    if quantize is None:  # bf16: fast_decode only when asked
        plan = plan_load(reference_config("qwen3-8b"), facts=profile, fast_decode=True)
    assert plan.decode is not None and plan.decode.weight_kernel == kernel
    decision = plan.decision("fast_decode")
    assert ("xpukit's Triton kernel" in decision.reason) is bool(kernel)
    assert decision.value.get("weight_kernel", "") == kernel


def test_a_plan_with_the_kernel_on_the_cpu_records_a_fallback(wide_model: Path) -> None:
    """Carrying out a plan that names the kernel where it cannot serve (the CPU) installs nothing,
    records why, keeps the compile cache's key free of it and decodes with torchao's products."""
    from dataclasses import replace

    from xpukit.loading.load import carry_out
    from xpukit.planning.device.decode import DecodePlan

    plain = _int8_model(wide_model)
    decode = DecodePlan(
        static_cache=True,
        max_cache_len=256,
        compile=False,
        compile_mode=None,
        fused_projections=True,
        weights="torchao Int8WeightOnlyConfig",
        weight_kernel="int8",
    )
    model = carry_out(replace(plain.xpukit_plan, decode=decode))
    event = next(e for e in model.xpukit_plan.events if e.what == "weight_only_products")
    assert event.kind == "fallback" and event.planned == "int8"
    assert "weights on cpu; xpukit's kernel serves cuda, xpu" in event.cause
    assert model.xpukit_decode_loop.cache_fields["weight_kernel"] == ""
    assert model.generate(_ids(), max_new_tokens=4, do_sample=False).shape[1] == _ids().shape[1] + 4
