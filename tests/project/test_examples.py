"""Every example runs on CPU, offline: the scripts as subprocesses (the distributed ones as two CPU
ranks through `xpukit launch --nproc 2`), the notebook with nbclient.

The two scripts start together (each spends most of its time importing, which uses one core), so
the pair costs about as much as the slower one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TIMEOUT = 280


def _env() -> dict[str, str]:
    """Offline, conftest's scratch caches (where demo_model is built), and one torch thread: the tiny
    model gains nothing from more, and on a shared 2-core runner two threads stall each other."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


@dataclass
class Script:
    """What an example script did: its exit status and output."""

    returncode: int
    stdout: str
    stderr: str

    def finish(self, name: str) -> str:
        assert self.returncode == 0, f"{name}: exit {self.returncode}\n{self.stderr[-4000:]}"
        return self.stdout


def _run_both(work: Path) -> dict[str, Any]:
    """Start both example scripts at once and wait for both; output goes to files (no pipe to fill)."""
    commands = {
        "inference": [str(EXAMPLES / "inference.py")],
        "qlora": [str(EXAMPLES / "qlora_finetune.py"), "--steps", "10", "--output-dir", "out"],
    }
    started = {}
    try:
        for name, args in commands.items():
            out, err = work / f"{name}.out", work / f"{name}.err"
            with out.open("wb") as stdout, err.open("wb") as stderr:
                started[name] = subprocess.Popen(
                    [sys.executable, *args], cwd=work, env=_env(), stdout=stdout, stderr=stderr
                )
        for proc in started.values():
            proc.wait(timeout=TIMEOUT)
    finally:
        for proc in started.values():  # a timeout must not leave a process behind
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {
        "work": str(work),
        **{
            name: {
                "returncode": proc.returncode,
                "stdout": (work / f"{name}.out").read_text(errors="replace"),
                "stderr": (work / f"{name}.err").read_text(errors="replace"),
            }
            for name, proc in started.items()
        },
    }


@pytest.fixture(scope="module")
def scripts(once_per_run: Callable[..., Any], demo_model: Path) -> dict[str, Any]:
    """Both example scripts' results, run once for the whole test run (by whichever pytest worker
    asks first), in a shared working directory (``scripts["work"]``)."""
    ran = once_per_run("example-scripts", _run_both)
    return {"work": Path(ran.pop("work")), **{name: Script(**r) for name, r in ran.items()}}


@pytest.mark.slow
def test_inference_example_runs(scripts: dict[str, Any]) -> None:
    out = scripts["inference"].finish("inference")
    assert "Plan for" in out and "loaded on cpu" in out
    generated = re.search(r"^generate\(\): (.+)$", out, re.M)
    piped = re.search(r"^pipeline\(\): +(.+)$", out, re.M)
    assert generated and piped
    # Greedy decoding of the same prompt: the pipeline must produce what generate() did.
    assert generated.group(1).startswith("The baker") and piped.group(1) == generated.group(1)


@pytest.mark.slow
def test_qlora_example_trains_and_saves_the_adapter(scripts: dict[str, Any]) -> None:
    pytest.importorskip("peft")  # extras lora + quant
    pytest.importorskip("bitsandbytes")
    out = scripts["qlora"].finish("qlora")
    match = re.search(r"^loss ([\d.]+) -> ([\d.]+)$", out, re.M)
    assert match, out
    assert float(match.group(2)) < float(match.group(1))
    adapter = scripts["work"] / "out"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] > 0
    assert (adapter / "adapter_model.safetensors").stat().st_size > 0


# --- the notebook --------------------------------------------------------------------------------


def _notebook() -> Any:
    import nbformat

    return nbformat.read(EXAMPLES / "quickstart.ipynb", as_version=4)


def test_notebook_is_committed_without_outputs() -> None:
    import nbformat

    nb = _notebook()
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


@pytest.mark.slow
def test_notebook_runs(tmp_path: Path, demo_model: Path) -> None:
    """Executed with a kernel on this interpreter (not whatever `python3` kernel the user has)."""
    pytest.importorskip("peft")  # the notebook fine-tunes in 4-bit: extras lora + quant
    pytest.importorskip("bitsandbytes")
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    spec = tmp_path / "kernels" / "xpukit-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "xpukit test",
                "language": "python",
            }
        )
    )
    specs = KernelSpecManager(kernel_dirs=[str(spec.parent)], ensure_native_kernel=False)
    km = KernelManager(kernel_name="xpukit-test", kernel_spec_manager=specs)
    nb = _notebook()
    client = NotebookClient(nb, km=km, timeout=TIMEOUT, resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=_env())
    # "".join: the kernel flushes stdout on a timer, so one print can arrive as several stream
    # outputs ("before:" and the text after it); a newline between them broke the line apart.
    text = "".join(
        out.get("text", "")
        for cell in nb.cells
        for out in cell.get("outputs", [])
        if out.get("output_type") == "stream"
    )
    assert "Plan for" in text
    logged = re.search(r"^loss: (.+)$", text, re.M)
    assert logged, text
    losses = [float(x) for x in logged.group(1).split(" -> ")]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    before = re.search(r"^before: (.+)$", text, re.M)
    after = re.search(r"^after: +(.+)$", text, re.M)
    assert before and after and before.group(1) != after.group(1)


# --- the distributed examples --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "args", "expected"),
    [
        ("ddp_finetune.py", ["--steps", "10"], r"2 ranks on cpu: loss [\d.]+ -> [\d.]+$"),
        ("fsdp_qlora.py", ["--steps", "3"], r"step 2: loss [\d.]+$"),
    ],
)
def test_distributed_example_runs_on_two_cpu_ranks(
    script: str, args: list[str], expected: str, tmp_path: Path, demo_model: Path
) -> None:
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    cmd = [sys.executable, "-m", "xpukit", "launch", "--nproc", "2", "--", str(EXAMPLES / script), *args]
    run = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr[-4000:]
    assert re.search(expected, run.stdout, re.M), run.stdout[-2000:]
