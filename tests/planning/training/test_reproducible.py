"""The same seed gives the same run, and a run killed with SIGKILL resumes exactly (docs/training.md
"Reproducible runs").

4-bit + LoRA on the tiny model with ``load_for_xpu(..., seed=7)`` and ``training_args(..., seed=7)``,
each run a child process on one CPU thread: two uninterrupted runs, and one killed right after its
first checkpoint and resumed with ``resume_from_checkpoint``, end with bit-identical adapters.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from xpukit.errors import InvalidRequestError
from xpukit.planning.model.reference_models import reference_config
from xpukit.planning.plan import plan_load

SEED = 7

TESTS = Path(__file__).resolve().parent


def train(model_dir: Path, out: Path, mode: str, seed: int = SEED) -> None:
    """One training run on one CPU thread; the adapter goes to ``out/adapter.safetensors``.

    ``mode``: ``run``; ``kill`` (pause in ``on_save`` so the parent can kill the process right after
    the first checkpoint); ``resume`` (``resume_from_checkpoint=True``).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling, Trainer, TrainerCallback

    from xpukit import load_for_xpu, training_args
    from xpukit.demo.tiny import corpus_lines

    class PauseAfterSave(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # Written whole, then renamed: the parent polls for the name and reads it at once.
            (out / "saved.tmp").write_text(str(state.global_step))
            (out / "saved.tmp").replace(out / "saved")
            time.sleep(600)  # the parent kills this process now

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reductions in one fixed order
    try:
        model = load_for_xpu(model_dir, quantize="4bit", lora=True, seed=seed)
        tok = AutoTokenizer.from_pretrained(model_dir)
        data = [tok(line, truncation=True, max_length=24) for line in corpus_lines()[:24]]
        args = training_args(
            model,
            output_dir=str(out / "run"),
            per_device_train_batch_size=4,
            max_steps=4,
            save_strategy="steps",
            save_steps=2,
            learning_rate=5e-3,
            logging_steps=1,
            seed=seed,
            dataloader_num_workers=0,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=data,
            data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
            callbacks=[PauseAfterSave()] if mode == "kill" else [],
        )
        trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
        adapter = {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}
        save_file(adapter, str(out / "adapter.safetensors"))
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    """The child process: ``python -c ... MODEL_DIR OUT MODE``."""
    model_dir, out, mode = sys.argv[1:4]
    train(Path(model_dir), Path(out), mode)


def _start(model_dir: Path, out: Path, mode: str) -> subprocess.Popen[bytes]:
    out.mkdir(parents=True, exist_ok=True)
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_reproducible as t; t.main()"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", code, str(model_dir), str(out), mode],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _finish(proc: subprocess.Popen[bytes]) -> None:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-3000:]


def _adapter(out: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    return dict(load_file(str(out / "adapter.safetensors")))


def _max_diff(a: dict[str, object], b: dict[str, object]) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)  # type: ignore[operator]


@pytest.mark.slow
def test_same_seed_same_adapter_and_a_killed_run_resumes_exactly(tiny_model: Path, tmp_path: Path) -> None:
    # The killed and the resumed run are child processes; the two uninterrupted ones run here,
    # while the first child trains.
    killed = _start(tiny_model, tmp_path / "c", "kill")
    train(tiny_model, tmp_path / "a", "run")
    marker = tmp_path / "c" / "saved"
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert killed.poll() is None, killed.communicate()[1].decode()[-3000:]
        assert time.monotonic() < deadline, "the killed run never saved a checkpoint"
        time.sleep(0.1)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=30)
    assert killed.returncode == -signal.SIGKILL
    assert marker.read_text() == "2"
    assert (tmp_path / "c" / "run" / "checkpoint-2").is_dir()
    assert not (tmp_path / "c" / "run" / "checkpoint-4").exists()  # it really stopped half-way
    resumed = _start(tiny_model, tmp_path / "c", "resume")
    train(tiny_model, tmp_path / "b", "run")
    _finish(resumed)
    a, b, c = (_adapter(tmp_path / x) for x in "abc")
    assert _max_diff(a, b) == 0.0
    assert _max_diff(a, c) == 0.0
    assert (tmp_path / "c" / "run" / "checkpoint-4").is_dir()


def test_the_plan_records_the_seed() -> None:
    config = reference_config("qwen3-8b")
    seeded = plan_load(config, facts="h100", quantize="4bit", lora=True, seed=SEED)
    assert seeded.seed == SEED
    decision = seeded.decision("seed")
    assert (decision.value, decision.source) == (SEED, "user") and "set_seed(7)" in decision.reason
    assert seeded.to_dict()["seed"] == SEED
    unseeded = plan_load(config, facts="h100", quantize="4bit", lora=True)
    assert unseeded.seed is None and "unseeded" in unseeded.decision("seed").reason
    assert "seed" not in {d.name for d in plan_load(config, facts="h100").decisions}
    no_adapters = plan_load(config, facts="h100", seed=3).decision("seed")
    assert no_adapters.value == 3 and "not applied" in no_adapters.reason


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, "7", True])
def test_a_bad_seed_is_refused(seed: object) -> None:
    with pytest.raises(InvalidRequestError, match="is not a seed"):
        plan_load(reference_config("qwen3-8b"), facts="h100", lora=True, seed=seed)
