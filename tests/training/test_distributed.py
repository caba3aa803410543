"""Real two-process runs (gloo): `xpukit launch --nproc 2` and `accelerate launch` → load_for_xpu +
training_args(strategy="ddp") + Trainer."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TRAIN = r"""
import atexit, json, os, sys
import torch.distributed as dist
from transformers import AutoTokenizer, DataCollatorForLanguageModeling, Trainer
from xpukit import load_for_xpu, training_args
from xpukit.demo.tiny import corpus_lines

path, out = sys.argv[1], sys.argv[2]
# Registered before training_args, so it runs after xpukit's exit hook (atexit is last-in, first-out).
atexit.register(lambda: open(os.path.join(out, f"exit{os.environ['RANK']}"), "w").write(
    str(dist.is_initialized())))
model = load_for_xpu(path, lora=True)
tok = AutoTokenizer.from_pretrained(path)
data = [tok(t, truncation=True, max_length=32) for t in corpus_lines()[:8]]  # one step per epoch
args = training_args(model, output_dir=out, strategy="ddp", per_device_train_batch_size=4, max_steps=4,
                     learning_rate=5e-2, logging_steps=1, save_strategy="no", seed=0)
trainer = Trainer(model=model, args=args, train_dataset=data,
                  data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
trainer.train()
rank = int(os.environ["RANK"])
trained = sorted((n, round(p.detach().float().sum().item(), 6)) for n, p in model.named_parameters()
                 if p.requires_grad)
result = {
    "rank": rank,
    "world_size": args.world_size,
    "ddp_backend": args.ddp_backend,
    "process_group_backend": dist.get_backend() if dist.is_initialized() else None,
    "use_cpu": args.use_cpu,
    "find_unused": args.ddp_find_unused_parameters,
    "device_map": model.xpukit_plan.device_map,
    "launch": model.xpukit_plan.machine.launch.launcher,
    "trained": trained,
    "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "order": os.environ.get("CUDA_DEVICE_ORDER"),
}
with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
    json.dump(result, fh)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_torchrun_two_ranks_train_in_sync_with_gloo(tiny_model: Path, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="3")  # a stale export
    cmd = [
        sys.executable,
        "-m",
        "xpukit.cli.main",
        "launch",
        "--backend",
        "cuda",
        "--devices",
        "all",
        "--nproc",
        "2",
        "--",
        "python",
        str(script),
        str(tiny_model),
        str(out),
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["world_size"] == 2
        # training_args set the backend only because the run is distributed, and to gloo on CPU.
        assert r["ddp_backend"] == "gloo" and r["process_group_backend"] == "gloo"
        assert r["use_cpu"] is True
        assert len(r["losses"]) == 4
        # `launch --devices all` removed the stale export for the whole job and fixed the order.
        assert r["visible"] is None and r["order"] == "PCI_BUS_ID"
    # DDP kept the trained LoRA weights identical on both ranks, and they did train.
    _check_ddp(ranks, "torchrun")
    lora_b = [value for name, value in ranks[0]["trained"] if "lora_B" in name]
    assert lora_b and any(value != 0 for value in lora_b)  # lora_B starts at zero
    assert "CUDA_VISIBLE_DEVICES" in run.stderr  # the launcher warned about the export it removed
    # training_args destroyed the process group at exit on both ranks (docs/distributed.md "The
    # process group at exit"): Trainer leaves it up, and gloo can abort the exiting rank.
    assert [(out / f"exit{r}").read_text() for r in (0, 1)] == ["False", "False"]


def test_exit_hook_destroys_a_live_gloo_group_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from xpukit.training import arguments

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.is_initialized()
        with monkeypatch.context() as m:  # an NCCL/XCCL group is the user's to shut down
            m.setattr(dist, "get_backend", lambda *a, **k: "nccl")
            arguments._destroy_process_group()
            assert dist.is_initialized()
        arguments._destroy_process_group()
        assert not dist.is_initialized()
        arguments._destroy_process_group()  # a no-op once the group is gone (or the user destroyed it)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _check_ddp(ranks: list[dict[str, Any]], launcher: str) -> None:
    for r in ranks:
        assert r["world_size"] == 2 and r["launch"] == launcher
        assert r["ddp_backend"] == "gloo" and r["process_group_backend"] == "gloo"
        assert r["find_unused"] is False  # strategy="ddp" with LoRA
        assert r["device_map"] == {"": "cpu"}  # every CPU rank on the one CPU
        assert r["losses"][-1] < r["losses"][0]  # the loss falls
    assert ranks[0]["trained"] == ranks[1]["trained"]


@pytest.mark.slow
def test_accelerate_launch_two_cpu_ranks(tiny_model: Path, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [
        # accelerate 1.15: `--cpu` with several processes needs mpirun (--mpirun_hostfile), else it
        # starts one process; --multi_gpu starts them through torch elastic, and they train on the
        # CPU with gloo (docs/distributed.md "accelerate launch on the CPU").
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        "2",
        "--multi_gpu",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(_free_port()),
        str(script),
        str(tiny_model),
        str(out),
    ]
    run = subprocess.run(
        cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=400
    )
    assert run.returncode == 0, run.stderr[-3000:]
    _check_ddp([json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)], "accelerate")
    assert [(out / f"exit{r}").read_text() for r in (0, 1)] == ["False", "False"]
