"""Distributed planning from injected facts: rank placement per launcher, strategies, launch commands."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from xpukit import plan_load
from xpukit.cli.main import main
from xpukit.errors import DeviceSelectionError, InvalidRequestError, MissingExtraError
from xpukit.machine.facts import MachineFacts
from xpukit.machine.launch import LaunchFacts, parse_launch
from xpukit.machine.precision import TrainingPrecision
from xpukit.machine.profiles import device_profile, machine_profile
from xpukit.planning.model.reference_models import reference_config
from xpukit.training.strategy import StrategyFacts, deepspeed_config, strategy_kwargs

# Rank 1 of 2 on one node, as each launcher writes it.
LAUNCHERS: dict[str, dict[str, str]] = {
    "torchrun": {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": "none",
    },
    "accelerate": {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "TORCHELASTIC_RUN_ID": "none",
    },
    "intel-mpi": {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
    "open-mpi": {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    },
}
MACHINES = {"xpu": ("max-1550", 2), "cuda": ("h200", 2), "cpu": ("cpu-bf16", 1)}


def _rank_machine(backend: str, env: dict[str, str]) -> MachineFacts:
    name, count = MACHINES[backend]
    return replace(machine_profile(name, count), launch=parse_launch(env))


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_every_launchers_variables_are_read(launcher: str) -> None:
    facts = parse_launch(LAUNCHERS[launcher])
    assert facts is not None
    assert (facts.launcher, facts.rank, facts.local_rank, facts.world_size) == (launcher, 1, 1, 2)
    assert LaunchFacts.from_dict(json.loads(json.dumps(facts.to_dict()))) == facts


def test_no_launcher_and_bad_variables() -> None:
    assert parse_launch({"PATH": "/bin"}) is None
    assert parse_launch({"LOCAL_RANK": "0"}) is None  # no world size: not a launched job
    with pytest.raises(InvalidRequestError, match="contradict"):
        parse_launch({"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(InvalidRequestError, match="not a number"):
        parse_launch({"RANK": "x", "WORLD_SIZE": "2"})


def test_machine_facts_round_trip_with_launch() -> None:
    machine = _rank_machine("xpu", LAUNCHERS["open-mpi"])
    back = MachineFacts.from_dict(json.loads(json.dumps(machine.to_dict())))
    assert back.launch == machine.launch
    old = machine.to_dict()
    del old["launch"]  # a report from before launch facts existed
    assert MachineFacts.from_dict(old).launch is None


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
@pytest.mark.parametrize("backend", ["xpu", "cuda"])
def test_rank_loads_whole_model_on_its_own_device(launcher: str, backend: str) -> None:
    machine = _rank_machine(backend, LAUNCHERS[launcher])
    for quantize, lora in ((None, None), ("4bit", True)):
        plan = plan_load(reference_config("qwen3-8b"), facts=machine, quantize=quantize, lora=lora)
        assert plan.device.torch_device == f"{backend}:1"
        assert plan.device_map == {"": 1}
        assert plan.max_memory is None  # never split over the other ranks' devices
        assert plan.decision("launch").value == f"rank 1/2 on {backend}:1"
        backend_name = "xccl" if backend == "xpu" else "nccl"
        assert (
            f"Launch: rank 1 of 2 (local rank 1 of 2), {launcher}; backend {backend_name}" in plan.explain()
        )


def test_cpu_ranks_share_the_cpu() -> None:
    plan = plan_load(reference_config("qwen3-0.6b"), facts=_rank_machine("cpu", LAUNCHERS["torchrun"]))
    assert plan.device.backend == "cpu" and plan.device_map == {"": "cpu"}
    assert "backend gloo" in plan.explain()


def test_a_model_too_big_for_one_rank_is_not_split_over_other_ranks() -> None:
    machine = _rank_machine("xpu", LAUNCHERS["torchrun"])
    plan = plan_load(reference_config("qwen3-32b"), facts=machine, device_map="auto")
    assert plan.device.torch_device == "xpu:1"
    assert all(k in (1, "cpu", "disk") for k in (plan.max_memory or {}))  # only its own device (+ offload)


def test_contradicting_device_or_map_is_refused_with_the_fix() -> None:
    machine = _rank_machine("xpu", LAUNCHERS["torchrun"])
    with pytest.raises(InvalidRequestError, match=r"device='xpu'.*device_map=\{'': 1\}"):
        plan_load(reference_config("qwen3-8b"), facts=machine, device="xpu:0")
    with pytest.raises(InvalidRequestError, match="belong to the other ranks"):
        plan_load(reference_config("qwen3-8b"), facts=machine, device_map="balanced")
    with pytest.raises(InvalidRequestError, match="several devices"):
        plan_load(reference_config("qwen3-8b"), facts=machine, device_map={"model": 0, "lm_head": 1})
    assert plan_load(reference_config("qwen3-8b"), facts=machine, device="xpu:1").device_map == {"": 1}
    assert plan_load(reference_config("qwen3-8b"), facts=machine, device="xpu").device.index == 1


def test_more_ranks_than_devices_is_refused() -> None:
    env = {"RANK": "5", "LOCAL_RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}
    with pytest.raises(DeviceSelectionError, match=r"--nproc 4"):
        plan_load(reference_config("qwen3-8b"), facts=_rank_machine("xpu", env))


def test_fsdp_plans_a_load_for_sharding() -> None:
    machine = _rank_machine("cuda", LAUNCHERS["torchrun"])
    plan = plan_load(reference_config("qwen3-8b"), facts=machine, strategy="fsdp")
    assert plan.strategy == "fsdp" and plan.device_map is None and plan.max_memory is None
    assert "no device_map" in plan.decision("device_map").reason
    q = plan_load(reference_config("qwen3-8b"), facts=machine, strategy="fsdp", quantize="4bit", lora=True)
    assert q.quantization_config is not None
    assert q.quantization_config["bnb_4bit_quant_storage"] == q.dtype == "bfloat16"
    assert q.device_map == {"": 1}
    with pytest.raises(InvalidRequestError, match="Int8Params"):
        plan_load(reference_config("qwen3-8b"), facts=machine, strategy="fsdp", quantize="8bit")


def test_fsdp_refuses_a_4bit_config_it_cannot_shard() -> None:
    torch = pytest.importorskip("torch")
    from transformers import BitsAndBytesConfig

    machine = _rank_machine("cuda", LAUNCHERS["torchrun"])
    bad = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
    with pytest.raises(InvalidRequestError, match=r"bnb_4bit_quant_storage=torch\.bfloat16"):
        plan_load(reference_config("qwen3-8b"), facts=machine, strategy="fsdp", quantize=bad)


def test_auto_strategy_is_ddp_when_it_fits_else_fsdp() -> None:
    machine = _rank_machine("xpu", LAUNCHERS["torchrun"])
    small = plan_load(reference_config("qwen3-8b"), facts=machine, strategy="auto", lora=True)
    assert small.strategy == "ddp" and "fits one device" in small.decision("strategy").reason
    big = plan_load(reference_config("qwen3-8b"), facts=machine, strategy="auto")  # full fine-tuning
    assert big.strategy == "fsdp" and big.device_map is None
    with pytest.raises(InvalidRequestError, match="valid: auto, ddp, fsdp, deepspeed"):
        plan_load(reference_config("qwen3-8b"), facts=machine, strategy="tp")


def _kwargs(strategy: str, device: str = "h200", **facts: Any) -> dict[str, Any]:
    precision = TrainingPrecision(bf16=True, fp16=False, reason="")
    out, _ = strategy_kwargs(strategy, device_profile(device), precision, StrategyFacts(**facts), {})
    return out


def test_strategy_keywords() -> None:
    assert _kwargs("ddp", lora=True) == {"ddp_find_unused_parameters": False}
    fsdp = _kwargs("fsdp", wrap_classes=("Qwen3DecoderLayer",), loaded_for_sharding=True)
    assert fsdp["fsdp"] is True
    assert (
        fsdp["fsdp_config"] | {"transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"]} == fsdp["fsdp_config"]
    )
    assert fsdp["fsdp_config"]["version"] == 2 and fsdp["fsdp_config"]["cpu_ram_efficient_loading"] is True
    assert _kwargs("auto", planned="fsdp", wrap_classes=("X",))["fsdp"] is True
    with pytest.raises(InvalidRequestError, match="silently train with DDP"):
        _kwargs("fsdp", device="cpu-bf16")


def test_fsdp_keywords_are_what_transformers_builds_its_fsdp2_plugin_from() -> None:
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    precision = TrainingPrecision(bf16=False, fp16=False, reason="")
    user = {"gradient_checkpointing": True}
    facts = StrategyFacts(wrap_classes=("Qwen3DecoderLayer",))
    out, _ = strategy_kwargs("fsdp", device_profile("h200"), precision, facts, user)
    assert out["gradient_checkpointing"] is False and out["fsdp_config"]["activation_checkpointing"] is True
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to="none", **out)
    plugin = args._process_fsdp_args()
    assert plugin["fsdp_version"] == 2 and plugin["activation_checkpointing"] is True
    assert plugin["transformer_cls_names_to_wrap"] == "Qwen3DecoderLayer"
    assert plugin["reshard_after_forward"] is True


def test_deepspeed_config() -> None:
    precision = TrainingPrecision(bf16=True, fp16=False, reason="")
    two, three = deepspeed_config(2, precision), deepspeed_config(3, precision)
    assert two["zero_optimization"]["stage"] == 2 and three["zero_optimization"]["stage"] == 3
    assert two["bf16"] == {"enabled": True} and two["fp16"]["enabled"] is False
    assert three["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        with pytest.raises(MissingExtraError, match=r"xpukit\[deepspeed\]"):
            _kwargs("deepspeed")
        return
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from transformers import TrainingArguments

    for fits in (True, False):
        config = _kwargs("deepspeed", fits_one_device=fits)["deepspeed"]
        args = TrainingArguments(output_dir="unused", use_cpu=True, report_to="none", deepspeed=config)
        filled = args.hf_deepspeed_config.config  # transformers filled the "auto" values
        assert DeepSpeedZeroConfig(**filled["zero_optimization"]).stage == (2 if fits else 3)


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_launch_dry_run_shows_torchrun_command_and_ccl_env(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--devices", "0,1", "--backend", "xpu", "--nproc", "auto", "--dry-run", "--json"]
    code, out, err = _cli(capsys, "launch", *args, "--", "python", "train.py", "--lr", "1")
    assert code == 0, err
    data = json.loads(out)
    assert data["command"][1:] == [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        "--module",
        "xpukit.cli.launch",
        "train.py",
        "--lr",
        "1",
    ]
    assert data["env"] == {
        "ZE_AFFINITY_MASK": "0,1",
        "ZE_ENABLE_PCI_ID_DEVICE_ORDER": "1",
        "CCL_PROCESS_LAUNCHER": "none",
        "CCL_LOCAL_SIZE": "2",
    }
    assert data["per_rank_env"] == {"CCL_LOCAL_RANK": "LOCAL_RANK"}
    assert data["shell"].endswith("--module xpukit.cli.launch train.py --lr 1")
    multi = ["--nproc", "4", "--nnodes", "2", "--rdzv-endpoint", "h:29400", "--dry-run", "--", "t.py"]
    code, out, _ = _cli(capsys, "launch", *multi)
    assert "--nproc-per-node 4 --nnodes 2 --rdzv-backend c10d --rdzv-endpoint h:29400 t.py" in out
    code, _, err = _cli(capsys, "launch", "--nproc", "2", "--dry-run", "--", "torchrun", "t.py")
    assert code == 1 and "already a launcher" in err
    code, _, err = _cli(capsys, "launch", "--backend", "cuda", "--nproc", "auto", "--dry-run", "--", "t.py")
    assert code == 1 and "--nproc N" in err


def test_launch_nproc_runs_python_c_code(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`xpukit launch --nproc 2 -- python -c CODE`: torchrun takes a script or a module, so the code runs
    through --no-python (or each XPU rank's wrapper); other interpreter options are refused in xpukit's
    words, not with torchrun's usage."""
    import sys

    from xpukit.cli.launch import rank_main

    code, out, err = _cli(
        capsys, "launch", "--nproc", "2", "--dry-run", "--", "python", "-c", "print(1)", "a"
    )
    assert code == 0, err
    assert out.split("torch.distributed.run", 1)[1].split() == [
        "--nproc-per-node",
        "2",
        "--standalone",
        "--no-python",
        sys.executable,
        "-c",
        "'print(1)'",
        "a",
    ]
    args = ["--devices", "0,1", "--backend", "xpu", "--nproc", "2", "--dry-run", "--json"]
    code, out, err = _cli(capsys, "launch", *args, "--", "python", "-c", "print(1)")
    assert code == 0, err
    assert json.loads(out)["command"][-4:] == ["--module", "xpukit.cli.launch", "-c", "print(1)"]
    for bad, says in (
        (["-u", "t.py"], "interpreter option '-u'"),
        (["-c"], "needs its argument"),
        ([], "no script"),
    ):
        code, _, err = _cli(capsys, "launch", "--nproc", "2", "--dry-run", "--", "python", *bad)
        assert code == 1 and says in err and "usage" not in err, err
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # rank_main sets argv and path as `python -c` does
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CCL_LOCAL_RANK", "unset")  # restored after: rank_main sets it in os.environ
    assert rank_main(["-c", "import sys, os; print('ran', sys.argv, os.environ['CCL_LOCAL_RANK'])", "x"]) == 0
    assert "ran ['-c', 'x'] 1" in capsys.readouterr().out


def test_plan_cli_rank(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(capsys, "plan", "qwen3-8b", "--assume", "max-1550x2", "--rank", "1/2")
    assert code == 0, err
    assert "Launch: rank 1 of 2 (local rank 1 of 2), assumed; backend xccl" in out
    assert "main device xpu:1" in out.splitlines()[1]
    code, _, err = _cli(
        capsys, "plan", "qwen3-8b", "--assume", "max-1550x2", "--rank", "1/2", "--device", "xpu:0"
    )
    assert code == 1 and "belongs to local rank 0" in err


def test_deepspeed_in_a_process_without_launch_variables_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain `python train.py` with strategy='deepspeed': DeepSpeed would look for its ranks through
    MPI and die in Trainer.train() on mpi4py; refused up front, with the missing variables and fixes."""
    pytest.importorskip("deepspeed")
    import importlib.util

    from xpukit import training_args
    from xpukit.training.strategy import DEEPSPEED_ENV, deepspeed_env_missing

    if importlib.util.find_spec("mpi4py") is not None:
        pytest.skip("mpi4py is installed: DeepSpeed can find its ranks through MPI")
    for name in (*DEEPSPEED_ENV, "AZUREML_EXPERIMENT_ID", "SM_TRAINING_ENV"):
        monkeypatch.delenv(name, raising=False)
    assert deepspeed_env_missing() == DEEPSPEED_ENV
    with pytest.raises(InvalidRequestError, match="not launched") as info:
        training_args(facts="cpu-bf16", strategy="deepspeed", output_dir="unused")
    assert "mpi4py" in str(info.value) and "xpukit launch --nproc" in str(info.value)
    with pytest.raises(InvalidRequestError, match="RANK, WORLD_SIZE"):
        _kwargs("deepspeed", deepspeed_env_missing=DEEPSPEED_ENV)
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "LOCAL_RANK": "0",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert deepspeed_env_missing() == ()  # launched: DeepSpeed reads them, nothing to refuse
