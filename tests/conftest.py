"""Shared test set-up: an offline Hub, throw-away caches, tiny models, and GPU tests skipped without a GPU.

At import (before any test module imports huggingface_hub, which reads ``HF_HUB_OFFLINE`` once) this
file makes the Hub unreachable on purpose and points every cache at a scratch directory that is
removed when the session ends, so tests never read or write the user's real caches. It imports
neither torch nor transformers: the fixtures do, when a test asks for them.

Fixtures (session-scoped, built on first use and shared by every test):

- ``tiny_models``: a read-only mapping ``{arch: Path}`` over :data:`xpukit.demo.tiny.ARCHITECTURES`; each
  model is built the first time its name is looked up, so a test that needs only one pays for one.
- ``tiny_model``: ``tiny_models["qwen3"]``.
- ``tiny_model_factory``: ``factory(arch, *, seed=0, **config_overrides) -> Path`` for variants.
- ``demo_model``: the ``xpukit demo`` default model, built into the scratch cache.
- ``wide_model``: a tiny qwen3 wide enough for torchao's int4 groups (skipped without torchao).
- ``sliding_gemma``: a tiny Gemma 3 with a 4-token sliding-window layer beside a full one.
- ``once_per_run``: ``once_per_run(name, make)``, an expensive set-up run by one pytest worker and
  read by all (the demo run, the example scripts).
- ``triton_interpreter``: ``run(code)`` runs a Python snippet under Triton's CPU interpreter
  (``TRITON_INTERPRET=1``, a process of its own) and asserts it printed ``ok`` (skipped without triton).

Treat the returned directories as read-only (other tests share them); copy one to change it.

The tests mirror ``src/xpukit/`` (``tests/planning/``, ``tests/loading/decode/``, …; ``tests/project/``
holds the checks of the repository itself); a fixture used by one sub-folder only lives in that
folder's ``conftest.py`` (``tests/loading/conftest.py``: ``trained_tiny``, ``export_tiny_factory``,
``bf16_base``; ``tests/loading/decode/conftest.py``: ``rerun_graphs``; ``tests/loading/training/conftest.py``:
``lora_case``).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

_SCRATCH = Path(tempfile.mkdtemp(prefix="xpukit-tests-"))

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HOME"] = str(_SCRATCH / "hf")
os.environ["XPUKIT_CACHE_DIR"] = str(_SCRATCH / "xpukit")
# Variables that would send one cache elsewhere than HF_HOME.
for _name in ("HF_HUB_CACHE", "HF_ASSETS_CACHE", "HF_XET_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE"):
    os.environ.pop(_name, None)
# The CPU's features are an injected fact, never the host's: every test (and every child process it
# starts) sees this CPU unless it asks for another through the ``cpu_kind`` fixture, so a run on an
# AMX Xeon and a run on an AMD EPYC without AVX-512 decide the same (docs/env.md, XPUKIT_CPU_FLAGS).
CPU_KINDS = {
    # Sapphire Rapids: AVX-512 with bf16 and fp16 arithmetic, AMX.
    "native-bf16": "sse4_2 avx avx2 fma f16c avx512f avx512bw avx512_bf16 avx512_fp16 amx_bf16 amx_tile",
    # AMD Zen 3 / Intel before Ice Lake servers: F16C conversions only.
    "no-bf16": "sse4_2 avx avx2 fma f16c",
}
DEFAULT_CPU_KIND = "no-bf16"
os.environ["XPUKIT_CPU_FLAGS"] = CPU_KINDS[DEFAULT_CPU_KIND]
# One compute thread per test process (set before anything imports torch, and inherited by every
# child process a test starts): the tiny models gain nothing from more, and two pytest workers with
# a thread per core each oversubscribe a 2-core machine, where OpenMP's spinning waits stall every
# small op (measured: the same 95 tests of two files took 124 s of CPU with a thread per core and 64 s
# with one; docs/benchmarks.md "Test suite").
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
# tokenizers warns in every child forked after it used threads; that noise would land in the stderr
# of CLI tests that run subprocesses.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_SCRATCH, ignore_errors=True)


@pytest.fixture(params=sorted(CPU_KINDS))
def cpu_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test once as on a CPU with native bf16 and once as on one without (injected facts)."""
    monkeypatch.setenv("XPUKIT_CPU_FLAGS", CPU_KINDS[request.param])
    return str(request.param)


# --- GPU-only tests ------------------------------------------------------------------------------


@functools.cache
def _has_accelerator() -> bool:
    """Whether torch sees a CUDA or XPU device, asked in a child process.

    Asking here would initialise the CUDA / Level Zero runtime in the test process, which then keeps
    the device view it read (CUDA_VISIBLE_DEVICES, ZE_AFFINITY_MASK) for good, under every later test.
    """
    code = (
        "import sys, torch\n"
        "xpu = getattr(torch, 'xpu', None)\n"
        "sys.exit(0 if torch.cuda.is_available() or (xpu is not None and xpu.is_available()) else 1)\n"
    )
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Decided per test about to run, so a session without gpu tests never asks at all.
    if item.get_closest_marker("gpu") is not None and not _has_accelerator():
        pytest.skip("needs a CUDA or XPU device; none is visible to torch")


# --- tiny models ---------------------------------------------------------------------------------


class _TinyModelFactory:
    """Builds tiny models into one directory, once per distinct (arch, seed, overrides)."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._built: dict[str, Path] = {}

    def __call__(self, arch: str, *, seed: int = 0, **config_overrides: Any) -> Path:
        from xpukit.demo.tiny import build_tiny_model

        key = json.dumps([arch, seed, config_overrides], sort_keys=True, default=str)
        if key not in self._built:
            name = arch if seed == 0 and not config_overrides else f"{arch}-{len(self._built)}"
            self._built[key] = build_tiny_model(arch, self._root / name, seed=seed, **config_overrides)
        return self._built[key]


class _TinyModels(Mapping[str, Path]):
    """Every tiny architecture by name; each model is built on first lookup, then reused."""

    def __init__(self, factory: _TinyModelFactory) -> None:
        self._factory = factory

    @staticmethod
    def _names() -> tuple[str, ...]:
        from xpukit.demo.tiny import ARCHITECTURES

        return tuple(ARCHITECTURES)

    def __getitem__(self, arch: str) -> Path:
        if arch not in self._names():
            raise KeyError(f"{arch!r} is not a tiny architecture; choose from {', '.join(self._names())}")
        return self._factory(arch)

    def __contains__(self, arch: object) -> bool:  # membership must not build anything
        return arch in self._names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``factory(arch, *, seed=0, **config_overrides) -> Path``: a tiny model, built once per arguments."""
    return _TinyModelFactory(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def tiny_models(tiny_model_factory: _TinyModelFactory) -> Mapping[str, Path]:
    """``{arch: Path}`` over every tiny architecture; each is built the first time it is looked up."""
    return _TinyModels(tiny_model_factory)


# The tiny qwen3 widened so torchao's int4 groups (128) divide every projection (8 heads of 16): the
# model of the torchao tests on the CPU (test_serve_quant.py) and the GPU (test_serve_quant_gpu.py).
WIDE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "initializer_range": 0.02,
}


@pytest.fixture(scope="session")
def wide_model(tiny_model_factory: _TinyModelFactory) -> Path:
    """The wide tiny qwen3 (skipped without torchao)."""
    pytest.importorskip("torchao")
    return Path(tiny_model_factory("qwen3", **WIDE))


@pytest.fixture(scope="session")
def sliding_gemma(tiny_model_factory: _TinyModelFactory) -> Path:
    """A tiny Gemma 3 with a sliding-window layer of 4 tokens (shorter than the tests' examples)
    beside a full-attention one, so each kind takes its own mask and position embeddings."""
    return Path(
        tiny_model_factory("gemma", layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    )


@pytest.fixture(scope="session")
def tiny_model(tiny_models: Mapping[str, Path]) -> Path:
    """The tiny Qwen3 model's directory (config, safetensors weights, tokenizer)."""
    return tiny_models["qwen3"]


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The ``xpukit demo`` default model, built once into the session's scratch cache."""
    from xpukit.demo.tiny import demo_model_dir

    return demo_model_dir()


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, Callable[[Path], Any]], Any]:
    """``once_per_run(name, make)``: ``make(directory)`` run by one process of the test run, its
    JSON-able result read by every pytest worker that asks for ``name``.

    For a module fixture whose tests xdist may spread over both workers (each would run it again:
    the demo run, the example scripts). The first worker to ask runs it under a file lock; the other
    waits for the result instead of competing for the same cores. ``directory`` is shared by the
    workers of this run only, so paths written there stay valid for all of them."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's basetemp is pytest-N/popen-gwK: pytest-N is this run's alone.
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def get(name: str, make: Callable[[Path], Any]) -> Any:
        directory = root / f"once-{name}"
        result = root / f"once-{name}.json"
        with FileLock(str(root / f"once-{name}.lock")):
            if not result.exists():
                shutil.rmtree(directory, ignore_errors=True)  # a failed attempt's leftovers
                directory.mkdir()
                value = make(directory)
                result.write_text(json.dumps(value), encoding="utf-8")
        return json.loads(result.read_text(encoding="utf-8"))

    return get


@pytest.fixture
def triton_interpreter() -> Callable[[str], None]:
    """``run(code)``: ``code`` in a fresh Python under Triton's CPU interpreter, which must exit 0 and
    print ``ok`` last (the variable is read when triton is imported, so it needs its own process)."""
    pytest.importorskip("triton")

    def run(code: str) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
        )
        assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]

    return run


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A loopback Hub endpoint that accepts connections and never answers (the no-timeout hang)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])  # keep it open, say nothing
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(2)
    for conn in held:
        conn.close()
    server.close()


# --- training ------------------------------------------------------------------------------------


@pytest.fixture
def liger(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    """Arrange whether the plan finds liger-kernel runnable on CUDA/XPU (``liger(False)``: as where it
    is not installed), whatever this environment has: plans for an assumed GPU read the installed
    packages, and the suite runs both without liger-kernel and with every extra."""
    import xpukit.planning.training.fit as fit

    def arrange(available: bool) -> None:
        why = "liger-kernel can run (arranged)" if available else "liger-kernel is not installed (arranged)"
        monkeypatch.setattr(fit, "liger_availability", lambda backend: (available, why))

    return arrange


def _train_losses(model: Any, args: Any, tok: Any, data: list[Any]) -> list[float]:
    from transformers import DataCollatorForLanguageModeling, Trainer

    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
    )
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.fixture
def train_losses() -> Callable[[Any, Any, Any, list[Any]], list[float]]:
    """``train_losses(model, args, tokenizer, data)``: run a causal-LM ``Trainer``, return its losses."""
    return _train_losses


def _six_steps(model: Any, path: Path, output_dir: Path) -> list[float]:
    from transformers import AutoTokenizer

    from xpukit import training_args

    tok = AutoTokenizer.from_pretrained(path)
    data = [tok("the quick brown fox jumps over the lazy dog", max_length=32, truncation=True)] * 16
    args = training_args(
        model,
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        max_steps=6,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    return _train_losses(model, args, tok, data)


@pytest.fixture
def six_steps() -> Callable[[Any, Path, Path], list[float]]:
    """``six_steps(model, path, output_dir)``: six ``Trainer`` steps of batch 8 on one repeated line of
    ``path``'s tokenizer, through ``training_args`` (lr 1e-2); returns the six losses."""
    return _six_steps


def _perturbed_adapter(base: Path, out: Path, *, quantize: str | None, seed: int = 0) -> Path:
    import torch

    from xpukit import load_for_xpu

    lora = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0}
    model = load_for_xpu(base, device="cpu", dtype="float32", quantize=quantize, lora=lora, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def perturbed_adapter() -> Callable[..., Path]:
    """``perturbed_adapter(base, out, *, quantize, seed=0)``: LoRA r=4 on ``base`` loaded by
    ``load_for_xpu`` (float32, CPU), its ``lora_B`` drawn from ``seed`` (a trained adapter's B is far
    from its zero start), saved to ``out`` by the model's ``save_pretrained``."""
    return _perturbed_adapter


def _partial_folder(final: Path, pid: int | None = None, *, host: str | None = None) -> Path:
    import os
    import subprocess
    import sys

    from xpukit import _partial

    if pid is None:  # a process that has ended (and been waited for)
        code = "import os; print(os.getpid())"
        pid = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)
    name = _partial.partial_path(final).name.replace(f"-{os.getpid()}-", f"-{pid}-")
    if host is not None:
        name = name.replace(f".xpukit-{_partial._host()}-", f".xpukit-{host}-")
    path = final.with_name(name)
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"half")
    return path


@pytest.fixture
def partial_folder() -> Callable[..., Path]:
    """``partial_folder(final, pid=None, *, host=None) -> Path``: a half-written folder of ``final``,
    named as xpukit names it for process ``pid`` (default: one that has ended) of machine ``host``
    (default: this one's tag), with a file in it."""
    return _partial_folder
