"""Every operating-system-specific piece of xpukit, in one place: Linux, Windows, macOS.

The rest of xpukit asks this module and never looks at ``sys.platform``, ``/proc``, ``/sys``,
``/dev/dri``, groups or signal numbers itself. Everything that differs is answered from
:func:`system`, so a test simulates another platform by replacing that one function (and, for the
Windows calls that need ``ctypes.windll``, the small ``_windows_*`` readers, :mod:`xpukit._win32`'s
calls). What has and has not run on Windows: docs/windows.md.

- Shells: :func:`env_prefix` and :func:`join_command` write a command line for a POSIX shell,
  PowerShell or cmd (docs/windows.md "Shells").
- Signals for ``xpukit launch``: POSIX forwards SIGINT/SIGTERM; Windows has no SIGTERM to forward
  and starts the child in its own process group, sending it CTRL_BREAK_EVENT (docs/windows.md
  "Stopping a launched command").
- Whether a process still runs (:func:`process_alive`, for the partial writes of a killed writer):
  ``kill(pid, 0)`` on POSIX, ``OpenProcess`` on Windows.
- Host facts: the PCI bus, ``/dev/dri`` render nodes and the ``render`` group, ``/proc/cpuinfo`` and
  ``/proc/meminfo`` exist on Linux only; on Windows memory comes from ``GlobalMemoryStatusEx``.
- The cache directory: ``platformdirs`` (``%LOCALAPPDATA%\\xpukit\\Cache`` on Windows).
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, TypedDict

from xpukit._win32 import memory as _windows_memory
from xpukit._win32 import peak_working_set as _windows_peak_working_set
from xpukit._win32 import process_alive as _windows_process_alive
from xpukit.errors import InvalidRequestError

__all__ = [
    "SHELLS",
    "ChildOptions",
    "Shell",
    "System",
    "cache_dir",
    "child_process_options",
    "cpuinfo_text",
    "default_shell",
    "dri_dir",
    "env_prefix",
    "forwarded_signals",
    "in_render_group",
    "is_windows",
    "join_command",
    "pci_device_dirs",
    "peak_rss",
    "physical_memory",
    "process_alive",
    "signal_for_child",
    "system",
    "terminal_delivers_sigint",
]

System = Literal["linux", "windows", "macos", "other"]
Shell = Literal["posix", "powershell", "cmd"]
SHELLS: tuple[Shell, ...] = ("posix", "powershell", "cmd")

# Windows constants, spelled out so the Windows paths also run (simulated) on Linux, where the
# `signal` and `subprocess` modules do not define them. Values from the Windows SDK (wincon.h,
# winbase.h, signal.h), the same ones CPython exposes on Windows.
CTRL_BREAK_EVENT = 1
CREATE_NEW_PROCESS_GROUP = 0x00000200
SIGBREAK = 21


def system() -> System:
    """The operating system xpukit runs on; the one answer every other function here follows."""
    if sys.platform.startswith("linux"):
        return "linux"
    if sys.platform == "win32":
        return "windows"
    if sys.platform == "darwin":
        return "macos"
    return "other"


def is_windows() -> bool:
    """Whether this is Windows (native, not WSL: WSL is Linux to Python and to the GPU driver)."""
    return system() == "windows"


# --- shells --------------------------------------------------------------------------------------


def default_shell() -> Shell:
    """The shell a command line is written for when none is named: PowerShell on Windows (the
    default shell of Windows Terminal), else a POSIX shell."""
    return "powershell" if is_windows() else "posix"


def _shell(shell: str | None) -> Shell:
    if shell is None:
        return default_shell()
    for known in SHELLS:
        if shell == known:
            return known
    raise InvalidRequestError(f"shell={shell!r} is not one of {', '.join(SHELLS)}.")


_POWERSHELL_SAFE = re.compile(r"[A-Za-z0-9_+=:./\\-]+")  # no ',' (an array) and no '@' (a splat)
_CMD_SAFE = re.compile(r"[A-Za-z0-9_+=:,./\\-]+")
_CMD_UNQUOTABLE = re.compile(r'[%!"\r\n]')  # cmd expands %VAR% and !VAR! even inside quotes


def _quote(word: str, shell: Shell) -> str:
    if shell == "posix":
        import shlex

        return shlex.quote(word)
    if shell == "powershell":
        if _POWERSHELL_SAFE.fullmatch(word) and word != "--":
            return word
        return "'" + word.replace("'", "''") + "'"
    if _CMD_UNQUOTABLE.search(word):
        raise InvalidRequestError(
            f"{word!r} cannot be written safely for cmd (it expands % and ! even inside quotes); "
            "use shell='powershell', or run it with `xpukit launch`, which passes it unchanged."
        )
    if _CMD_SAFE.fullmatch(word):
        return word
    # Inside double quotes cmd leaves & | < > ^ alone; backslashes before the closing quote are
    # doubled for the C runtime's argument parser (the rule of subprocess.list2cmdline).
    trailing = len(word) - len(word.rstrip("\\"))
    return '"' + word + "\\" * trailing + '"'


def env_prefix(values: Mapping[str, str], unset: Sequence[str] = (), *, shell: str | None = None) -> str:
    """Shell code that removes ``unset`` and sets ``values``, to put before a command.

    Args:
        values: variables to set, in order.
        unset: variables to remove (an empty value would mean something else, e.g. "no device").
        shell: ``"posix"``, ``"powershell"`` or ``"cmd"``; default :func:`default_shell`.

    Returns:
        POSIX: ``env -u NAME A=1 B=2`` (for the one command). PowerShell: ``Remove-Item Env:NAME
        -ErrorAction SilentlyContinue; $env:A = '1'; $env:B = '2';`` and cmd: ``set "NAME=" &&
        set "A=1" && set "B=2" &&``: these two shells have no per-command form, so the variables
        stay set in that shell window afterwards (``xpukit launch`` sets them for the command alone).

    Raises:
        InvalidRequestError: an unknown shell, or a value cmd cannot hold (``%``, ``!``, ``"``).

    Example:
        >>> env_prefix({"ZE_AFFINITY_MASK": "0,2"}, ["CUDA_VISIBLE_DEVICES"], shell="posix")
        'env -u CUDA_VISIBLE_DEVICES ZE_AFFINITY_MASK=0,2'
        >>> env_prefix({"ZE_AFFINITY_MASK": "0,2"}, shell="powershell")
        "$env:ZE_AFFINITY_MASK = '0,2';"
        >>> env_prefix({"ZE_AFFINITY_MASK": "0,2"}, ["CUDA_VISIBLE_DEVICES"], shell="cmd")
        'set "CUDA_VISIBLE_DEVICES=" && set "ZE_AFFINITY_MASK=0,2" &&'
    """
    kind = _shell(shell)
    if kind == "posix":
        parts = ["env", *(f"-u {name}" for name in unset)] if unset else []
        parts += [f"{name}={_quote(value, kind)}" for name, value in values.items()]
        return " ".join(parts)
    if kind == "powershell":
        parts = [f"Remove-Item Env:{name} -ErrorAction SilentlyContinue;" for name in unset]
        parts += [f"$env:{name} = '{value.replace(chr(39), chr(39) * 2)}';" for name, value in values.items()]
        return " ".join(parts)
    for value in values.values():
        _quote(value, kind)  # refuses what cmd would expand
    parts = [f'set "{name}=" &&' for name in unset]
    parts += [f'set "{name}={value}" &&' for name, value in values.items()]
    return " ".join(parts)


def join_command(command: Sequence[str], *, shell: str | None = None) -> str:
    """``command`` as one line for the shell, each word quoted so it arrives unchanged.

    Example:
        >>> join_command(["python", "my train.py", "--devices", "0,2"], shell="posix")
        "python 'my train.py' --devices 0,2"
        >>> join_command(["python", "my train.py", "--devices", "0,2"], shell="powershell")
        "python 'my train.py' --devices '0,2'"
        >>> join_command(["C:\\\\Program Files\\\\Python\\\\python.exe", "-V"], shell="powershell")
        "& 'C:\\\\Program Files\\\\Python\\\\python.exe' -V"
        >>> join_command(["python", "my train.py", "a&b"], shell="cmd")
        'python "my train.py" "a&b"'
    """
    kind = _shell(shell)
    words = [_quote(word, kind) for word in command]
    if kind == "powershell" and words and words[0] != command[0]:
        words[0] = "& " + words[0]  # a quoted program name is a string to PowerShell until `&` calls it
    return " ".join(words)


# --- signals and processes (`xpukit launch`, writers) ---------------------------------------------


def forwarded_signals() -> tuple[int, ...]:
    """The signals ``xpukit launch`` catches and passes on to its child.

    POSIX: SIGINT and SIGTERM. Windows: SIGINT (Ctrl-C) and SIGBREAK (Ctrl-Break, and what a console
    close sends); SIGTERM exists there only inside one process (``raise``), nothing sends it.
    """
    if is_windows():
        return (int(signal.SIGINT), SIGBREAK)
    return (int(signal.SIGINT), int(signal.SIGTERM))


class ChildOptions(TypedDict, total=False):
    """Extra ``subprocess.Popen`` keywords for the launched child."""

    creationflags: int


def child_process_options() -> ChildOptions:
    """Extra ``subprocess.Popen`` keywords for the launched child.

    On Windows the child gets its own process group (``CREATE_NEW_PROCESS_GROUP``): that is the only
    group a console control event can be sent to, and the one way to reach the child alone.
    """
    if is_windows():
        return {"creationflags": CREATE_NEW_PROCESS_GROUP}
    return {}


def signal_for_child(signum: int) -> int:
    """What to send the child when the launcher receives ``signum``.

    POSIX: the same signal. Windows: ``CTRL_BREAK_EVENT`` for any of them: a process group started
    with ``CREATE_NEW_PROCESS_GROUP`` has Ctrl-C disabled, so Ctrl-Break is the event it can receive
    (Python shows it as SIGBREAK, which ends the process unless a handler is installed).
    """
    return CTRL_BREAK_EVENT if is_windows() else signum


def terminal_delivers_sigint() -> bool:
    """Whether Ctrl-C in the terminal already reaches the child, so the launcher must not repeat it.

    POSIX: when the launcher is in its terminal's foreground process group (the child is in it
    too). Windows: never: the child runs in its own process group with Ctrl-C disabled.
    """
    getpgrp = getattr(os, "getpgrp", None)
    if is_windows() or getpgrp is None:
        return False
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
            if os.isatty(fd):
                return bool(os.tcgetpgrp(fd) == getpgrp())
        except (AttributeError, OSError, ValueError):
            continue
    return False


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine still runs (another user's counts; a zombie too).

    POSIX: ``kill(pid, 0)``, which sends nothing. Windows: ``OpenProcess`` and its exit code
    (``os.kill`` there would end the process).
    """
    if pid <= 0:
        return False
    if is_windows():
        return _windows_process_alive(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, and belongs to another user
        return True
    return True


# --- host facts ----------------------------------------------------------------------------------


def pci_device_dirs() -> list[Path]:
    """The PCI devices' sysfs directories, in address order (Linux); elsewhere none.

    On Windows the PCI bus is not readable without WMI or SetupAPI; the device list then comes
    from the XPU runtime alone (docs/windows.md "What doctor checks").
    """
    if system() != "linux":
        return []
    return sorted(Path("/sys/bus/pci/devices").glob("*"))


def dri_dir() -> Path | None:
    """``/dev/dri`` where it exists (Linux with a GPU driver); ``None`` elsewhere (Windows, macOS)."""
    if system() != "linux":
        return None
    dri = Path("/dev/dri")
    return dri if dri.exists() else None


def in_render_group() -> bool:
    """Whether the user is root or in the ``render`` group; True where there is no such group
    (Windows, macOS, a Linux without it): nothing to be missing from (docs/platform-install.md §6.3)."""
    if system() != "linux":
        return True
    import grp

    if os.geteuid() == 0:
        return True
    try:
        render = grp.getgrnam("render").gr_gid
    except KeyError:
        return True
    return render in os.getgroups()


def cpuinfo_text() -> str | None:
    """``/proc/cpuinfo`` (Linux); ``None`` elsewhere."""
    if system() != "linux":
        return None
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None


def physical_memory() -> tuple[int, int]:
    """``(total, available)`` bytes of RAM: ``/proc/meminfo`` on Linux, ``GlobalMemoryStatusEx`` on
    Windows, ``sysconf`` elsewhere (available is then the total: not known)."""
    kind = system()
    if kind == "windows":
        return _windows_memory()
    if kind == "linux":
        try:
            text = Path("/proc/meminfo").read_text()
        except OSError:
            text = ""
        values = {}
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0]) * 1024
        if "MemTotal" in values:
            total = values["MemTotal"]
            return total, values.get("MemAvailable", total)
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        pages = 0
    return pages, pages


def peak_rss() -> int | None:
    """The process's peak resident memory in bytes (``None`` where it cannot be read)."""
    kind = system()
    if kind == "windows":
        return _windows_peak_working_set()
    try:
        import resource
    except ImportError:
        return None
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if kind == "macos" else peak * 1024  # Linux reports KiB, macOS bytes


def cache_dir(app: str = "xpukit") -> Path:
    """The user's cache directory for ``app``: ``~/.cache/xpukit`` (Linux, or ``$XDG_CACHE_HOME``),
    ``%LOCALAPPDATA%\\xpukit\\Cache`` (Windows), ``~/Library/Caches/xpukit`` (macOS)."""
    import platformdirs

    return Path(platformdirs.user_cache_dir(app, appauthor=False))
