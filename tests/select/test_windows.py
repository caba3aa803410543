"""The Windows paths of xpukit._platform, run on Linux by simulating the platform (docs/windows.md)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from xpukit import _platform
from xpukit.cli import launch
from xpukit.errors import InvalidRequestError
from xpukit.select.devices import select_devices


@pytest.fixture
def windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_platform, "system", lambda: "windows")
    monkeypatch.setattr(_platform, "_windows_memory", lambda: (32 << 30, 20 << 30))
    monkeypatch.setattr(_platform, "_windows_peak_working_set", lambda: 123 << 20)


def test_default_shell_follows_the_platform(windows: None) -> None:
    sel = select_devices("0,2", backend="xpu")
    assert sel.shell_prefix() == sel.shell_prefix("powershell")
    assert sel.command_line(["python", "train.py"]) == (
        "$env:ZE_AFFINITY_MASK = '0,2'; $env:ZE_ENABLE_PCI_ID_DEVICE_ORDER = '1'; python train.py"
    )


def test_posix_default_off_windows() -> None:
    assert _platform.default_shell() == ("powershell" if sys.platform == "win32" else "posix")


def test_cmd_line_sets_and_removes() -> None:
    line = _platform.env_prefix({"CUDA_VISIBLE_DEVICES": "0,1"}, ["ZE_AFFINITY_MASK"], shell="cmd")
    assert line == 'set "ZE_AFFINITY_MASK=" && set "CUDA_VISIBLE_DEVICES=0,1" &&'
    # A trailing backslash inside quotes is doubled, or the C runtime would read it as an escaped quote.
    assert _platform.join_command(["py", "a b", "x&y", "C:\\dir\\", "C:\\my dir\\"], shell="cmd") == (
        'py "a b" "x&y" C:\\dir\\ "C:\\my dir\\\\"'
    )


@pytest.mark.parametrize("word", ["50%", "hi!", 'say "x"'])
def test_cmd_refuses_what_it_would_expand(word: str) -> None:
    with pytest.raises(InvalidRequestError, match="powershell"):
        _platform.join_command(["python", word], shell="cmd")


def test_powershell_quotes_and_calls_a_quoted_program() -> None:
    line = _platform.join_command(
        ["C:\\Program Files\\py.exe", "it's", "--", "0,2", "-v"], shell="powershell"
    )
    assert line == "& 'C:\\Program Files\\py.exe' 'it''s' '--' '0,2' -v"
    prefix = _platform.env_prefix({"A": "x'y"}, ["B"], shell="powershell")
    assert prefix == "Remove-Item Env:B -ErrorAction SilentlyContinue; $env:A = 'x''y';"


def test_unknown_shell_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="posix, powershell, cmd"):
        select_devices("0", backend="xpu").shell_prefix("fish")


def test_launch_dry_run_writes_the_named_shell(capsys: pytest.CaptureFixture[str]) -> None:
    from xpukit.cli.main import main

    assert (
        main(["launch", "--devices", "1", "--backend", "cuda", "--dry-run", "--shell", "cmd", "--", "py"])
        == 0
    )
    assert capsys.readouterr().out.strip() == (
        'set "CUDA_VISIBLE_DEVICES=1" && set "CUDA_DEVICE_ORDER=PCI_BUS_ID" && py'
    )


def test_signals_on_windows(windows: None) -> None:
    assert _platform.forwarded_signals() == (int(signal.SIGINT), _platform.SIGBREAK)
    assert int(signal.SIGTERM) not in _platform.forwarded_signals()
    assert _platform.child_process_options() == {"creationflags": _platform.CREATE_NEW_PROCESS_GROUP}
    assert _platform.signal_for_child(int(signal.SIGINT)) == _platform.CTRL_BREAK_EVENT
    assert _platform.terminal_delivers_sigint() is False


def test_signals_on_posix() -> None:
    assert _platform.forwarded_signals() == (int(signal.SIGINT), int(signal.SIGTERM))
    assert _platform.child_process_options() == {}
    assert _platform.signal_for_child(int(signal.SIGTERM)) == int(signal.SIGTERM)


def test_launch_starts_the_child_in_its_own_group_and_sends_ctrl_break(
    windows: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_command on 'Windows': Popen gets CREATE_NEW_PROCESS_GROUP; a signal is sent as CTRL_BREAK."""
    seen: dict[str, Any] = {}
    real_popen = subprocess.Popen

    class Recording(real_popen):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, creationflags: int = 0, **kwargs: Any) -> None:
            seen["creationflags"] = creationflags
            super().__init__(*args, **kwargs)  # Linux cannot take the Windows flag itself

        def send_signal(self, sig: int) -> None:
            seen.setdefault("sent", []).append(sig)
            super().send_signal(signal.SIGTERM)

    monkeypatch.setattr(launch.subprocess, "Popen", Recording)
    monkeypatch.setattr(_platform, "forwarded_signals", lambda: (int(signal.SIGINT), int(signal.SIGUSR1)))
    child = [
        sys.executable,
        "-c",
        "import os, signal, time; os.kill(os.getppid(), signal.SIGUSR1); time.sleep(30)",
    ]
    code = launch.run_command(child, {"PATH": "/usr/bin:/bin"})
    assert seen["creationflags"] == _platform.CREATE_NEW_PROCESS_GROUP
    assert seen["sent"] == [_platform.CTRL_BREAK_EVENT]
    assert code == 128 + int(signal.SIGTERM)


def test_doctor_skips_the_linux_checks_on_windows(windows: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from xpukit.doctor import host

    monkeypatch.setattr(
        "xpukit.hub.hub_status",
        lambda: type("S", (), {"offline": True, "reachable": None, "reason": "offline"})(),
    )
    facts = host.gather_host()
    assert facts.dri_exists is False and facts.in_render_group is True and facts.intel_gpus == ()
    assert _platform.pci_device_dirs() == [] and _platform.cpuinfo_text() is None


def test_memory_and_cache_on_windows(windows: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from xpukit.demo.output import peak_memory
    from xpukit.machine.probe import cpu_facts

    assert _platform.physical_memory() == (32 << 30, 20 << 30)
    cpu = cpu_facts()
    assert (cpu.total_memory, cpu.free_memory) == (32 << 30, 20 << 30)
    assert peak_memory("cpu") == (123 << 20, "peak resident memory of the process")
    import platformdirs

    monkeypatch.setattr(
        platformdirs, "user_cache_dir", lambda app, appauthor=None: str(tmp_path / app / "Cache")
    )
    assert _platform.cache_dir() == tmp_path / "xpukit" / "Cache"


def test_linux_answers_are_real() -> None:
    if _platform.system() != "linux":
        pytest.skip("Linux host facts")
    assert _platform.cpuinfo_text() is not None
    total, free = _platform.physical_memory()
    assert total > 0 and 0 < free <= total
    assert _platform.pci_device_dirs() == sorted(Path("/sys/bus/pci/devices").glob("*"))
