"""Fused q/k/v and gate/up products (docs/decode-kernels.md "Fused projections"), on the CPU.

float32 and torchao int8 weights fuse and give the unfused model's logits and greedy tokens (on a
model whose top two logits are checked to be apart); a layout that does not slice by rows, a
non-Linear layer and an MLP that is not ``down(act(gate) * up)`` are kept apart with the reason.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from xpukit.loading.decode.fused_proj import GATE_UP_BUFFER, QKV_BUFFER, fuse_projections

WIDE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4}


@pytest.fixture(scope="module")
def wide_f32(tiny_model_factory: Any) -> Path:
    return Path(tiny_model_factory("qwen3", initializer_range=0.2, **WIDE))


def _ids() -> Any:
    import torch

    return torch.arange(3, 3 + 7 * 12, 7).remainder(500).unsqueeze(0)


def _greedy(model: Any, new: int = 10) -> Any:
    import torch

    with torch.no_grad():
        return model.generate(
            _ids(), max_new_tokens=new, do_sample=False, output_scores=True, return_dict_in_generate=True
        )


def test_fused_float_model_gives_the_same_logits_tokens_and_checkpoint(
    wide_f32: Path, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(wide_f32, dtype=torch.float32)
    fused = AutoModelForCausalLM.from_pretrained(wide_f32, dtype=torch.float32)
    assert fuse_projections(fused) == {"attention": 2, "mlp": 2, "blocks": 2}
    attn = fused.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == getattr(attn, QKV_BUFFER).data_ptr()  # a view, no copy
    assert getattr(fused.model.layers[0].mlp, GATE_UP_BUFFER).shape == (2 * 256, 128)
    with torch.no_grad():
        torch.testing.assert_close(fused(_ids()).logits, plain(_ids()).logits, rtol=1e-5, atol=1e-5)
    want = _greedy(plain)
    top = torch.stack(want.scores, 1).topk(2, -1).values
    assert (top[..., 0] - top[..., 1]).min().item() > 1e-3  # clear margins: equal tokens mean equal paths
    assert _greedy(fused).sequences.tolist() == want.sequences.tolist()
    # The fused buffers are not written; the parts' names and values are, and load back unfused.
    assert not any("xpukit" in k for k in fused.state_dict())
    fused.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert _greedy(again).sequences.tolist() == want.sequences.tolist()


def test_the_fused_step_traces_as_one_graph(wide_f32: Path) -> None:
    import torch
    from torch._dynamo.testing import CompileCounter
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(wide_f32, dtype=torch.float32)
    fuse_projections(model)
    counter = CompileCounter()
    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend=counter, fullgraph=True)
    with torch.no_grad():
        forward(input_ids=_ids())
    assert counter.frame_count == 1


def test_k_and_v_called_apart_compute_their_own_slice(wide_f32: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(wide_f32, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(wide_f32, dtype=torch.float32)
    fuse_projections(model)
    x = torch.randn(1, 3, 128)
    ours, theirs = model.model.layers[1].self_attn, plain.model.layers[1].self_attn
    with torch.no_grad():  # v before q, then k with another tensor: no pending result is taken
        torch.testing.assert_close(ours.v_proj(x), theirs.v_proj(x))
        ours.q_proj(x)
        torch.testing.assert_close(ours.k_proj(x.clone()), theirs.k_proj(x))


def test_a_wrong_mlp_or_layer_is_kept_apart() -> None:
    import torch

    class Swapped(torch.nn.Module):  # gate and up the other way round: not what the fusion computes
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj = torch.nn.Linear(16, 32), torch.nn.Linear(16, 32)
            self.down_proj, self.act_fn = torch.nn.Linear(32, 16), torch.nn.SiLU()

        def forward(self, x: Any) -> Any:
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(16, 16)
            self.k_proj = type("Lin4", (torch.nn.Linear,), {})(16, 8)  # a subclass, as bitsandbytes' layers
            self.v_proj = torch.nn.Linear(16, 8)

    block = torch.nn.Module()
    block.self_attn, block.mlp = Attention(), Swapped()
    done = fuse_projections(block)
    assert done["attention"] == done["mlp"] == 0
    kept = " ".join(done["kept"])
    assert "plain Linear layers only" in kept and "not down_proj(act_fn(gate) * up)" in kept


def test_torchao_int8_fuses_and_keeps_tokens(wide_model: Path) -> None:
    import torch

    from xpukit import load_for_xpu

    plain = load_for_xpu(str(wide_model), device="cpu", dtype="float32", quantize="8bit")
    model = load_for_xpu(str(wide_model), device="cpu", dtype="float32", quantize="8bit")
    assert fuse_projections(model) == {"attention": 2, "mlp": 2, "blocks": 2}
    assert type(getattr(model.model.layers[0].self_attn, QKV_BUFFER)).__name__ == "Int8Tensor"
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()).logits, plain(_ids()).logits, rtol=1e-5, atol=1e-5)


def test_the_default_quantized_path_gives_plain_greedy_tokens(wide_model: Path) -> None:
    """What fast_decode="auto" carries out on a GPU (fused projections, xpukit's loop), eager here."""
    import torch

    from xpukit import load_for_xpu
    from xpukit.loading.load import carry_out
    from xpukit.planning.device.decode import DecodePlan

    plain = load_for_xpu(str(wide_model), device="cpu", dtype="float32", quantize="8bit")
    want = _greedy(plain)
    top = torch.stack(want.scores, 1).topk(2, -1).values
    assert (top[..., 0] - top[..., 1]).min().item() > 1e-3
    decode = DecodePlan(
        static_cache=True,
        max_cache_len=256,
        compile=False,
        compile_mode=None,
        fused_projections=True,
        weights="torchao Int8WeightOnlyConfig",
    )
    model = carry_out(replace(plain.xpukit_plan, decode=decode))
    fused = next(e for e in model.xpukit_plan.events if e.what == "fused_projections")
    assert fused.kind == "applied" and fused.actual["attention"] == 2
    fields = {"weights": "torchao Int8WeightOnlyConfig", "fused": True, "weight_kernel": ""}
    assert model.xpukit_decode_loop.cache_fields == fields
    with torch.no_grad():
        got = model.generate(_ids(), max_new_tokens=10, do_sample=False)
    assert model.xpukit_last_decode["loop"] == "xpukit"
    assert got.tolist() == want.sequences.tolist()


def test_the_doctor_int4_line_runs_eager_on_the_cpu() -> None:
    """``decode-int4`` on the CPU: the CPU's int4 format (no row slicing, so nothing fused), eager."""
    pytest.importorskip("torchao")
    import torch

    from xpukit.doctor.selftest import decode_int4_check
    from xpukit.machine.profiles import device_profile

    line = decode_int4_check(torch, device_profile("cpu-bf16"), compiled=False)
    assert line.startswith("torchao int4 (cpu), eager, fused 0+0 of 4 groups: tokens equal plain generate()")
    mps = decode_int4_check(torch, device_profile("apple-m2"), compiled=False)
    assert mps.startswith("skipped: no torchao int4 here") and "MPS" in mps


def test_a_long_compile_shows_progress(caplog: pytest.LogCaptureFixture) -> None:
    from xpukit.loading.decode.progress import compile_progress

    seen = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno == logging.WARNING:
                seen.set()

    logger = logging.getLogger("xpukit.loading.decode")
    watch = Watch()
    logger.addHandler(watch)
    try:
        with caplog.at_level(logging.INFO, logger="xpukit.loading.decode"):
            with compile_progress("compiling the decode step for batch 1", first_s=0.01, every_s=0.01):
                assert seen.wait(10)  # the ticker speaks while the work goes on
            with compile_progress("a short one", first_s=60):
                pass
    finally:
        logger.removeHandler(watch)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and all("batch 1" in w and "fast_decode=False skips it" in w for w in warnings)
    assert any("a short one: done in" in r.getMessage() for r in caplog.records)
    assert not any(t.name == "xpukit-compile-progress" for t in threading.enumerate())
