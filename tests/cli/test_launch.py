"""``xpukit launch``: real child processes, exit codes, signals, dry runs and warnings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from xpukit.cli.launch import _processes_per_node
from xpukit.cli.main import main

SELECTION_VARS = (
    "ZE_AFFINITY_MASK",
    "ZE_FLAT_DEVICE_HIERARCHY",
    "ZE_ENABLE_PCI_ID_DEVICE_ORDER",
    "ONEAPI_DEVICE_SELECTOR",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
)
LAUNCH_XPU_0 = [sys.executable, "-m", "xpukit.cli.main", "launch", "--devices", "0", "--backend", "xpu", "--"]
# A child that reports the selection variables it sees.
PRINT_ENV = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {SELECTION_VARS!r}}}))"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SELECTION_VARS}
    return env | extra


def _xpukit(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "xpukit.cli.main", "launch", *args],
        env=_clean_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_child_sees_the_selection() -> None:
    out = _xpukit("--devices", "0,2", "--backend", "xpu", "--", sys.executable, "-c", PRINT_ENV)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["ZE_AFFINITY_MASK"] == "0,2"
    assert seen["ZE_ENABLE_PCI_ID_DEVICE_ORDER"] == "1"
    assert seen["CUDA_VISIBLE_DEVICES"] is None
    assert out.stderr == ""  # nothing exported, nothing to warn about


def test_cuda_selection_and_all_removes_an_exported_mask() -> None:
    env = _clean_env(CUDA_VISIBLE_DEVICES="3", ZE_AFFINITY_MASK="1")
    out = _xpukit("--devices", "all", "--backend", "cuda", "--", sys.executable, "-c", PRINT_ENV, env=env)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["CUDA_VISIBLE_DEVICES"] is None
    assert seen["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert seen["ZE_AFFINITY_MASK"] == "1"  # another backend's variable is left alone
    assert "exports CUDA_VISIBLE_DEVICES=3; this run removes CUDA_VISIBLE_DEVICES" in out.stderr


def test_parent_environment_is_untouched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # In-process: this test process is the launcher.
    for name in SELECTION_VARS:
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    report = tmp_path / "env.json"
    child = f"import json, os; open({str(report)!r}, 'w').write(json.dumps(dict(os.environ)))"
    code = main(["launch", "--devices", "1", "--backend", "cuda", "--", sys.executable, "-c", child])
    assert code == 0
    assert json.loads(report.read_text())["CUDA_VISIBLE_DEVICES"] == "1"
    assert dict(os.environ) == before


@pytest.mark.parametrize("status", [0, 1, 7, 255])
def test_exit_codes_pass_through(status: int) -> None:
    out = _xpukit(
        "--devices", "0", "--backend", "xpu", "--", sys.executable, "-c", f"raise SystemExit({status})"
    )
    assert out.returncode == status


def test_child_killed_by_a_signal_gives_128_plus_n() -> None:
    kill_self = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    out = _xpukit("--devices", "0", "--backend", "xpu", "--", sys.executable, "-c", kill_self)
    assert out.returncode == 128 + signal.SIGKILL


def test_missing_command_gives_127() -> None:
    out = _xpukit("--devices", "0", "--backend", "xpu", "--", "no-such-command-xpukit")
    assert out.returncode == 127
    assert "command not found: no-such-command-xpukit" in out.stderr


def test_stdin_passes_through() -> None:
    proc = subprocess.run(
        [*LAUNCH_XPU_0, sys.executable, "-c", "import sys; print(sys.stdin.read().upper())"],
        input="hello",
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip() == "HELLO"


# A child that reports a signal in a file, then exits with a status of its own.
_WAITER = """
import signal, sys, time
from pathlib import Path
done = Path(sys.argv[1])
def handler(signum, frame):
    done.write_text(signal.Signals(signum).name)
    sys.exit(42)
signal.signal(signal.SIGTERM, handler)
signal.signal(signal.SIGINT, handler)
Path(sys.argv[2]).write_text("ready")
time.sleep(60)
sys.exit(1)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_reach_the_child(tmp_path: Path, sig: signal.Signals) -> None:
    done, ready = tmp_path / "done", tmp_path / "ready"
    launcher = subprocess.Popen(
        [*LAUNCH_XPU_0, sys.executable, "-c", _WAITER, str(done), str(ready)],
        env=_clean_env(),
        stdin=subprocess.DEVNULL,  # not a terminal: SIGINT must be passed on
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        launcher.send_signal(sig)
        status = launcher.wait(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert done.read_text() == sig.name
    assert status == 42  # the child's own exit status, not the launcher's


def test_dry_run_prints_the_exact_shell_line() -> None:
    out = _xpukit(
        "--devices",
        "0,2",
        "--backend",
        "xpu",
        "--dry-run",
        "--",
        "torchrun",
        "--nproc-per-node",
        "2",
        "my train.py",
    )
    assert out.returncode == 0
    assert out.stdout == (
        "ZE_AFFINITY_MASK=0,2 ZE_ENABLE_PCI_ID_DEVICE_ORDER=1 torchrun --nproc-per-node 2 'my train.py'\n"
    )


def test_dry_run_line_runs_in_a_shell_with_the_same_env() -> None:
    out = _xpukit(
        "--devices",
        "0.0,0.1",
        "--backend",
        "xpu",
        "--hierarchy",
        "composite",
        "--dry-run",
        "--",
        sys.executable,
        "-c",
        PRINT_ENV,
    )
    line = out.stdout.strip()
    assert line.startswith(
        "ZE_AFFINITY_MASK=0.0,0.1 ZE_ENABLE_PCI_ID_DEVICE_ORDER=1 ZE_FLAT_DEVICE_HIERARCHY=COMPOSITE "
    )
    via_shell = subprocess.run(
        ["/bin/sh", "-c", line], env=_clean_env(), capture_output=True, text=True, timeout=60
    )
    launched = _xpukit(
        "--devices",
        "0.0,0.1",
        "--backend",
        "xpu",
        "--hierarchy",
        "composite",
        "--",
        sys.executable,
        "-c",
        PRINT_ENV,
    )
    assert json.loads(via_shell.stdout) == json.loads(launched.stdout)


def test_dry_run_json() -> None:
    out = _xpukit("--devices", "all", "--backend", "xpu", "--dry-run", "--json", "--", "python", "x.py")
    data: dict[str, Any] = json.loads(out.stdout)
    assert data["env"] == {"ZE_ENABLE_PCI_ID_DEVICE_ORDER": "1"}
    assert data["unset"] == ["ZE_AFFINITY_MASK"]
    assert data["shell"] == "env -u ZE_AFFINITY_MASK ZE_ENABLE_PCI_ID_DEVICE_ORDER=1 python x.py"
    assert data["command"] == ["python", "x.py"]


def test_conflicting_exported_variables_are_warned_about_on_stderr() -> None:
    env = _clean_env(ZE_AFFINITY_MASK="1", ONEAPI_DEVICE_SELECTOR="level_zero:0")
    out = _xpukit("--devices", "0,2", "--backend", "xpu", "--", sys.executable, "-c", PRINT_ENV, env=env)
    assert out.returncode == 0
    assert json.loads(out.stdout)["ZE_AFFINITY_MASK"] == "0,2"
    assert "exports ZE_AFFINITY_MASK=1; this run uses ZE_AFFINITY_MASK=0,2 for COMMAND only" in out.stderr
    assert "unset ZE_AFFINITY_MASK" in out.stderr
    assert "ONEAPI_DEVICE_SELECTOR=level_zero:0 is exported" in out.stderr
    same = _xpukit(
        "--devices", "0,2", "--backend", "xpu", "--dry-run", "--", "x", env=_clean_env(ZE_AFFINITY_MASK="0,2")
    )
    assert same.stderr == ""  # the same value is no conflict


def test_an_exported_hierarchy_is_written_into_the_line() -> None:
    # `0,1` was checked as two cards (COMPOSITE); under the default FLAT of a Max node the same mask
    # would be two stacks of card 0, so the line must not depend on the shell it is pasted into.
    env = _clean_env(ZE_FLAT_DEVICE_HIERARCHY="COMPOSITE")
    out = _xpukit("--devices", "0,1", "--backend", "xpu", "--dry-run", "--", "python", "t.py", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == (
        "ZE_AFFINITY_MASK=0,1 ZE_ENABLE_PCI_ID_DEVICE_ORDER=1 ZE_FLAT_DEVICE_HIERARCHY=COMPOSITE "
        "python t.py\n"
    )
    assert out.stderr == ""  # the exported value is kept, so nothing is overridden


def test_integrated_gpu_ordinal_is_warned_about_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from xpukit.machine import probe

    for name in SELECTION_VARS:
        monkeypatch.delenv(name, raising=False)
    sysfs = [("0000:00:02.0", "8086:7d55"), ("0000:03:00.0", "8086:e20b")]
    monkeypatch.setattr(probe, "intel_display_devices", lambda: sysfs, raising=False)
    code = main(["launch", "--devices", "0", "--backend", "xpu", "--dry-run", "--", "python", "t.py"])
    out = capsys.readouterr()
    assert code == 0
    assert out.out == "ZE_AFFINITY_MASK=0 ZE_ENABLE_PCI_ID_DEVICE_ORDER=1 python t.py\n"
    assert "xpukit launch: warning: device 0 is the integrated GPU at 0000:00:02.0" in out.err
    assert "the first discrete card is 1" in out.err
    assert main(["launch", "--devices", "1", "--backend", "xpu", "--dry-run", "--", "python"]) == 0
    assert capsys.readouterr().err == ""


def test_more_ranks_than_devices_is_warned_about() -> None:
    out = _xpukit(
        "--devices", "0,1", "--backend", "xpu", "--dry-run", "--", "torchrun", "--nproc_per_node=4", "t.py"
    )
    assert "starts 4 processes per node but only 2 device(s) are visible" in out.stderr


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["torchrun", "--nproc-per-node", "4", "t.py"], 4),
        (["/usr/bin/torchrun", "--nproc_per_node=2", "t.py"], 2),
        (["python", "-m", "torch.distributed.run", "--nproc-per-node", "8", "t.py"], 8),
        (["accelerate", "launch", "--num_processes", "3", "t.py"], 3),
        (["torchrun", "--nproc-per-node", "gpu", "t.py"], None),
        (["python", "t.py", "--nproc-per-node", "4"], None),
        ([], None),
    ],
)
def test_processes_per_node(command: list[str], expected: int | None) -> None:
    assert _processes_per_node(command) == expected


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--devices", "2,0", "--backend", "xpu", "--", "true"], "cannot reorder devices"),
        (["--devices", "0", "--backend", "xpu"], "no command to run"),
        (["--devices", "0", "--backend", "xpu", "--json", "--", "true"], "add --dry-run"),
        (["--devices", "0.1", "--backend", "xpu", "--", "true"], "COMPOSITE mode"),
        (["--devices", "1" * 5000, "--backend", "xpu", "--", "true"], "an index of 5000 digits"),
    ],
)
def test_bad_requests_exit_1_with_one_line(args: list[str], fragment: str) -> None:
    out = _xpukit(*args)
    assert out.returncode == 1
    assert out.stderr.startswith("xpukit launch: error: ")
    assert fragment in out.stderr
    assert "Traceback" not in out.stderr


def test_launcher_with_a_named_backend_never_imports_torch() -> None:
    code = (
        "import sys; from xpukit.cli.main import main; "
        "rc = main(['launch', '--devices', '0', '--backend', 'xpu', '--', sys.executable, '-c', 'pass']); "
        "print(rc, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["0", "False"], out.stderr


@pytest.mark.gpu
def test_real_devices_follow_the_selection() -> None:
    import torch

    backend = "xpu" if torch.xpu._is_compiled() else "cuda" if torch.version.cuda else None
    if backend is None:
        pytest.skip("needs a torch build with XPU or CUDA")
    count = f"import torch; print(torch.{backend}.device_count())"
    one = _xpukit("--devices", "0", "--", sys.executable, "-c", count)
    assert one.returncode == 0, one.stderr
    assert one.stdout.strip() == "1"
    every = _xpukit("--devices", "all", "--", sys.executable, "-c", count)
    assert int(every.stdout) >= 1
    if backend == "cuda" and int(every.stdout) >= 2:
        # CUDA enumerates in list order; compare the devices by UUID.
        uuids = "import json, torch; n = torch.cuda.device_count(); "
        uuids += "print(json.dumps([str(torch.cuda.get_device_properties(i).uuid) for i in range(n)]))"

        def seen(spec: str) -> list[str]:
            return list(json.loads(_xpukit("--devices", spec, "--", sys.executable, "-c", uuids).stdout))

        physical = seen("all")
        assert seen("1") == [physical[1]]
        assert seen("1,0") == [physical[1], physical[0]]
        assert seen(f"GPU-{physical[1][:8]}") == [physical[1]]


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("ZE_FLAT_DEVICE_HIERARCHY", "flat", "is not one of"),
        ("ZE_AFFINITY_MASK", "0,a", "entries the runtime cannot read"),
    ],
)
def test_launch_refuses_what_the_ranks_would_inherit_as_doctor_reports_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], variable: str, value: str, said: str
) -> None:
    """`xpukit launch --nproc 2` checks the environment the ranks inherit the way `xpukit doctor` does:
    a hierarchy the driver ignores or an unreadable mask is refused before anything starts, with the
    fix; a selection that replaces the variable is not refused."""
    for name in SELECTION_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, value)
    code = main(["launch", "--backend", "xpu", "--nproc", "2", "--dry-run", "--", "t.py"])
    err = capsys.readouterr().err
    assert code != 0 and said in err and "Fix:" in err and "the ranks would inherit" in err
    if variable == "ZE_AFFINITY_MASK":  # --devices replaces the mask: nothing inherited to refuse
        given = ["launch", "--devices", "0", "--backend", "xpu", "--dry-run", "--", "python", "t.py"]
        assert main(given) == 0
        capsys.readouterr()
    monkeypatch.delenv(variable)  # a variable the runtime never reads: a warning, the launch goes on
    monkeypatch.setenv("UR_L0_USE_RELAXED_ALLOCATION_LIMITS", "1")
    assert main(["launch", "--backend", "xpu", "--nproc", "2", "--dry-run", "--", "t.py"]) == 0
    err = capsys.readouterr().err
    assert "xpukit launch: warning: UR_L0_USE_RELAXED_ALLOCATION_LIMITS is set" in err
