"""Real two-process runs on the CPU (gloo): FSDP2 over a load planned for sharding, 4-bit included,
and the per-rank oneCCL variables `xpukit launch --nproc` gives each rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xpukit.cli.launch import rank_main

# FSDP2 (torch's fully_shard; accelerate applies FSDP only on accelerators, so Trainer cannot run it
# on the CPU: training_args refuses and the script records the refusal) over load_for_xpu(strategy="fsdp").
FSDP = r"""
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import AutoTokenizer
from xpukit import load_for_xpu, training_args
from xpukit.demo.tiny import corpus_lines
from xpukit.errors import InvalidRequestError
from xpukit.training.strategy import strategy_facts

path, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
tok = AutoTokenizer.from_pretrained(path)
lines = corpus_lines()[:8]
result = {"rank": rank}
for quantize in (None, "4bit"):
    model = load_for_xpu(path, lora=True, quantize=quantize, strategy="fsdp", seed=0)
    plan = model.xpukit_plan
    wrap = strategy_facts(model, dist.get_world_size()).wrap_classes
    for module in model.modules():
        if type(module).__name__ in wrap:
            fully_shard(module)
    fully_shard(model)
    sharded = sum(1 for p in model.parameters() if type(p).__name__ == "DTensor")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    texts = lines[rank * 4 : rank * 4 + 4]
    batch = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=24)
    losses = []
    for _ in range(4):
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    lora = {k: round(v.float().sum().item(), 5) for k, v in state.items() if "lora_" in k}
    result[str(quantize)] = {"device_map": plan.device_map, "strategy": plan.strategy,
        "storage": (plan.quantization_config or {}).get("bnb_4bit_quant_storage"), "dtype": plan.dtype,
        "sharded": sharded, "losses": losses, "lora": lora}
try:
    training_args(model, output_dir=out, strategy="fsdp")
except InvalidRequestError as exc:
    result["trainer_refusal"] = str(exc)
with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
    json.dump(result, fh)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_fsdp2_lora_and_qlora_train_to_identical_adapters(tiny_model: Path, tmp_path: Path) -> None:
    script = tmp_path / "fsdp_run.py"
    script.write_text(FSDP)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "xpukit.cli.main",
        "launch",
        "--nproc",
        "2",
        "--",
        str(script),
        str(tiny_model),
        str(out),
    ]
    run = subprocess.run(
        cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for quantize in ("None", "4bit"):
        first, second = (r[quantize] for r in ranks)
        assert first["strategy"] == "fsdp"
        # planned for sharding: no device_map; 4-bit quantized on the rank's device, stored in the
        # compute dtype
        assert first["device_map"] == (None if quantize == "None" else {"": "cpu"})
        if quantize == "4bit":
            assert first["storage"] == first["dtype"]
        assert first["sharded"] > 0  # FSDP2 turned the parameters into DTensor shards
        assert first["losses"][-1] < first["losses"][0] and second["losses"][-1] < second["losses"][0]
        lora_b = [v for k, v in first["lora"].items() if "lora_B" in k]
        assert lora_b and any(v != 0 for v in lora_b)  # lora_B starts at zero: it trained
        assert first["lora"] == second["lora"]  # the gathered full adapter state is the same on both ranks
    assert "silently train with DDP" in ranks[0]["trainer_refusal"]


def test_rank_wrapper_sets_ccl_variables_from_torchruns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = tmp_path / "seen.json"
    script = tmp_path / "rank.py"
    script.write_text(
        "import json, os, sys\n"
        f"open({str(seen)!r}, 'w').write(json.dumps([os.environ.get('CCL_LOCAL_RANK'), "
        "os.environ.get('CCL_LOCAL_SIZE'), sys.argv[1:]]))\n"
    )
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("CCL_LOCAL_RANK", "stale")  # restored after the test
    monkeypatch.setenv("CCL_LOCAL_SIZE", "stale")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert rank_main([str(script), "--lr", "1"]) == 0
    assert json.loads(seen.read_text()) == ["1", "2", ["--lr", "1"]]
