"""``xpukit doctor --selftest``: run small real operations on each device and report what worked.

The planner decides from recorded facts; this is how an owner of a device checks those facts on the
real thing (and pastes the JSON into a bug report). Each check is tiny (256×256 tensors) and never
fatal: a failure is recorded with the exception text. On a CUDA or XPU device the ``decode`` check
times the first token of xpukit's decode loop as ``fast_decode=True`` sets it up (tiered: the
uncompiled step first) and says which tier served, then waits for the compiled step and compares its
tokens with eager (tens of seconds, the compile), and
``decode-int4`` decodes a tiny int4 model the way ``quantize="4bit"`` loads it to run there.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from xpukit.machine.facts import DeviceFacts, MachineFacts

if TYPE_CHECKING:
    from transformers import Qwen3Config

__all__ = ["NEAR_TIE", "CheckResult", "decode_int4_check", "run_selftest"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckResult:
    """One check on one device."""

    device: str
    check: str
    ok: bool
    detail: str
    seconds: float
    expected: bool = True  # the device's facts say this check should pass

    @property
    def unexpected_failure(self) -> bool:
        """Failed although the recorded facts say it should work: the facts or the setup are wrong."""
        return self.expected and not self.ok


# Largest relative error accepted for a 256x256 matmul against an fp32 CPU reference: a few
# units of each format's precision after 256-term sums (measured: bf16 4e-3, fp16 5e-4).
TOLERANCE = {"bfloat16": 5e-2, "float16": 1e-2, "float32": 1e-4}
# Top-two logit gap under which bf16 rounding may swap a greedy token
# (as tests/loading/decode/test_serve_quant_gpu.py).
NEAR_TIE = 0.125


def run_selftest(machine: MachineFacts) -> list[CheckResult]:
    """Matmul in bf16/fp16/fp32, fp64 arithmetic, the free-memory query and (CUDA/XPU) the compiled
    decode loop, on every device."""
    import torch

    results: list[CheckResult] = []
    for device in (*machine.devices, machine.cpu):
        results.extend(_device_checks(torch, device))
    return results


def _device_checks(torch: ModuleType, device: DeviceFacts) -> list[CheckResult]:
    name = device.torch_device
    out = []

    def check(label: str, fn: Callable[[], object], expected: bool = True) -> None:
        start = time.perf_counter()
        try:
            detail = fn()
            ok = True
        except Exception as exc:  # a selftest records every failure instead of stopping
            detail, ok = f"{type(exc).__name__}: {exc}", False
        out.append(
            CheckResult(
                device=name,
                check=label,
                ok=ok,
                detail=str(detail),
                seconds=round(time.perf_counter() - start, 4),
                expected=expected,
            )
        )

    def matmul(dtype: object) -> str:  # a torch.dtype
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(256, 256, generator=gen)
        b = torch.randn(256, 256, generator=gen)
        want = a @ b
        got = (a.to(name, dtype) @ b.to(name, dtype)).float().cpu()
        _sync(torch, device)
        if not torch.isfinite(got).all():
            raise ArithmeticError("non-finite result")
        err = ((got - want).abs().max() / want.abs().max()).item()
        limit = TOLERANCE[str(dtype).removeprefix("torch.")]
        if err > limit:
            raise ArithmeticError(f"max relative error {err:.2e} exceeds {limit:.0e}")
        return f"max relative error {err:.2e}"

    for label, dtype, expected in (
        # bf16 works (emulated) everywhere torch has it; only native bf16 is a promise of the facts.
        ("matmul-bf16", torch.bfloat16, device.native_bf16),
        ("matmul-fp16", torch.float16, device.fp16),
        ("matmul-fp32", torch.float32, True),
    ):
        check(label, functools.partial(matmul, dtype), expected)
    if device.backend != "mps":  # MPS has no float64 at all
        check(
            "fp64",
            lambda: str((torch.ones(4, dtype=torch.float64, device=name) * 2).sum().item()),
            device.fp64,
        )
    if device.backend in ("xpu", "cuda"):
        module = getattr(torch, device.backend)
        check(
            "mem_get_info",
            lambda: "free {:.2f} GiB of {:.2f} GiB".format(
                *(v / 2**30 for v in module.mem_get_info(device.index))
            ),
            device.free_memory_known,
        )
        check("decode", lambda: _decode_check(torch, name, device.backend))
        check("decode-int4", lambda: decode_int4_check(torch, device))
        check("layer-graphs", lambda: _graphs_check(torch, name))
        check("layer-graphs-checkpointed", lambda: _graphs_check(torch, name, checkpoint=True))
    return out


def _graphs_check(torch: ModuleType, name: str, *, checkpoint: bool = False) -> str:
    """One LoRA training layer captured as a device graph and replayed (``lora={"graphs": ...}``;
    with ``checkpoint``, checkpointed inside the graph as with ``"gradient_checkpointing": True``),
    against the same layer eager: the losses and LoRA gradients of the third step (the second is
    captured, the third replayed; docs/layer-graphs.md "CUDA graphs of the decoder layers")."""
    from xpukit._compat import is_installed

    if not is_installed("peft"):
        return 'skipped: peft is not installed (pip install "xpukit[lora]")'
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from xpukit.loading.training.layer_graphs import install_layer_graphs

    config = _tiny_config(layers=1)
    runs = []
    for graphed in (False, True):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
            lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
            lora.init_lora_weights = False
            model = get_peft_model(model, lora).to(name).train()
            ids = torch.randint(3, 512, (2, 16)).to(name)
        if graphed:
            install_layer_graphs(model, checkpoint=checkpoint)
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        runs.append((float(loss.detach()), grads.cpu(), model))
    (loss_a, grad_a, _), (loss_b, grad_b, model) = runs
    stats = model.xpukit_layer_graphs.stats
    if stats["graphed"] < 2:
        reasons = dict(model.xpukit_layer_graphs.eager_reasons)
        raise RuntimeError(f"the layer was not replayed: {dict(stats)}, eager because {reasons}")
    err = float((grad_a - grad_b).norm() / grad_a.norm())
    if abs(loss_a - loss_b) > 1e-4 * abs(loss_a) or err > 1e-3:
        raise ArithmeticError(f"graphed loss {loss_b:.6f} vs eager {loss_a:.6f}, gradients {err:.1e} apart")
    return f"captured and replayed: loss and LoRA gradients equal eager ({err:.1e} relative)"


def _decode_check(torch: ModuleType, name: str, backend: str) -> str:
    """xpukit's decode loop as ``fast_decode=True`` sets it up here, against the loop eager: the time
    to the first token and which tier served it, then the compiled tier's tokens.

    A tiny random qwen3 in float32 (seeded without touching the caller's RNG), batch 2, 16 greedy
    tokens. Tiered as the plan tiers it (docs/decode.md "Tiered decoding"): the first call is served
    by the uncompiled step (captured as one device graph on CUDA) while a thread compiles the step;
    the check waits for it and compares the compiled tier's tokens with eager.
    """
    from transformers import AutoModelForCausalLM

    from xpukit.loading.decode.install import install_decode_loop
    from xpukit.planning.device.decode import compile_settings

    config = _tiny_config(layers=2, initializer_range=0.2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        ids = torch.randint(3, 512, (2, 8))
    model = model.to(name).eval()
    graphs = backend == "cuda"
    loop = install_decode_loop(model, max_cache_len=256, compile_options=None)
    args = {"input_ids": ids.to(name), "max_new_tokens": 16, "min_new_tokens": 16, "do_sample": False}
    eager = model.generate(**args)
    loop.set_compile(compile_settings("default"), step_graphs=graphs, tiered=True)
    start = time.perf_counter()
    model.generate(**{**args, "max_new_tokens": 1, "min_new_tokens": 1})
    _sync(torch, backend)
    first_token = time.perf_counter() - start
    model.generate(**args)
    served = dict(model.xpukit_last_decode.get("tiers") or {})
    start = time.perf_counter()
    built = loop.tiers.wait(600) if loop.tiered else True
    waited = time.perf_counter() - start
    compiled = model.generate(**args)
    start = time.perf_counter()
    model.generate(**args)
    _sync(torch, backend)
    per_token = (time.perf_counter() - start) * 1e3 / 16
    if model.xpukit_last_decode.get("loop") != "xpukit":
        raise RuntimeError(f"generate() ran {model.xpukit_last_decode}")
    if not built:
        raise RuntimeError(f"the compiled step was not built: {[e.cause for e in loop.tiers.events]}")
    if not torch.equal(eager.cpu(), compiled.cpu()):
        where = int((eager.cpu() != compiled.cpu()).nonzero()[0, 1]) - ids.shape[1]
        raise ArithmeticError(f"compiled tokens differ from eager from new token {where}")
    tiers = ", ".join(f"{tier} {n}" for tier, n in served.items())
    return (
        f"first token {first_token:.2f} s ({loop.first_tier if loop.tiered else 'compiled'} tier); first "
        f"call's tokens by tier: {tiers or 'untiered'}; compiled step ready {waited:.1f} s later, its tokens "
        f"equal eager, {per_token:.2f} ms/token"
    )


def decode_int4_check(torch: ModuleType, device: DeviceFacts, *, compiled: bool = True) -> str:
    """A tiny int4 model decoded the way ``quantize="4bit"`` loads it to run here: the device's torchao
    int4 format, fused projections, xpukit's loop compiled as ``fast_decode`` compiles it (``compiled``
    False: eager, as on the CPU), against transformers' plain ``generate`` over the same weights.

    Greedy tokens must be equal wherever plain ``generate``'s top two logits are at least
    :data:`NEAR_TIE` apart (bf16 rounding may swap a near tie; docs/decode.md "Fast by default").
    """
    from xpukit._compat import is_installed
    from xpukit.planning.device.quant_configs import torchao_config
    from xpukit.planning.device.serve_quant import serve_format, torchao_version

    fmt = serve_format(device, "4bit", "bfloat16", torchao_version() if is_installed("torchao") else None)
    if fmt.library != "torchao" or fmt.config is None:
        return f"skipped: no torchao int4 here ({fmt.reason})"
    from torchao.quantization import quantize_
    from transformers import AutoModelForCausalLM

    from xpukit.loading.decode.fused_proj import fuse_projections
    from xpukit.loading.decode.install import install_decode_loop
    from xpukit.planning.device.decode import compile_settings

    config = _tiny_config(layers=2, initializer_range=0.2)
    config.hidden_size, config.intermediate_size, config.num_attention_heads = (
        128,
        256,
        8,
    )  # int4 groups of 128
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        ids = torch.randint(3, 512, (1, 8))
    model = model.to(device.torch_device).eval()
    linear = torch.nn.Linear
    quantize_(
        model,
        torchao_config(fmt.config).quant_type,
        filter_fn=lambda m, fqn: isinstance(m, linear) and "lm_head" not in fqn,
    )
    args = {
        "input_ids": ids.to(device.torch_device),
        "max_new_tokens": 8,
        "min_new_tokens": 8,
        "do_sample": False,
    }
    with torch.no_grad():
        plain = model.generate(**args, output_scores=True, return_dict_in_generate=True)
    fused = fuse_projections(model)
    options = compile_settings("default") if compiled else None
    install_decode_loop(
        model, max_cache_len=256, compile_options=options, step_graphs=compiled and device.backend == "cuda"
    )
    start = time.perf_counter()
    fast = model.generate(**args)
    _sync(torch, device)
    first = time.perf_counter() - start
    if model.xpukit_last_decode.get("loop") != "xpukit":
        raise RuntimeError(f"generate() ran {model.xpukit_last_decode}")
    differ = (fast.cpu() != plain.sequences.cpu())[0, ids.shape[1] :].nonzero()
    note = "tokens equal plain generate()"
    if len(differ):
        at = int(differ[0, 0])
        top = plain.scores[at].float().topk(2, -1).values[0]
        margin = float(top[0] - top[1])
        if margin >= NEAR_TIE:
            raise ArithmeticError(
                f"{fmt.label}: new token {at} differs from plain generate() (margin {margin:.3f})"
            )
        note = f"tokens equal plain generate() up to a near tie at new token {at} (margin {margin:.3f})"
    mode = ("compiled" if compiled else "eager") + (
        ", own step graph" if compiled and device.backend == "cuda" else ""
    )
    groups = f"fused {fused['attention']}+{fused['mlp']} of {2 * fused['blocks']} groups"
    return f"{fmt.label}, {mode}, {groups}: {note}; first call {first:.1f} s"


def _tiny_config(*, layers: int, **extra: object) -> Qwen3Config:
    """The selftests' tiny Qwen3 (512 words, hidden 64), random weights built on the spot."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        **extra,
    )


def _sync(torch: ModuleType, device: DeviceFacts | str) -> None:
    backend = device if isinstance(device, str) else device.backend
    if backend in ("xpu", "cuda", "mps"):
        getattr(torch, backend).synchronize()


def results_to_dict(results: list[CheckResult]) -> list[dict[str, Any]]:
    """JSON-able list of the checks."""
    return [asdict(r) for r in results]
