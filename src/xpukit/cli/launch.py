"""``xpukit launch``: run one command with a device selection set for that command alone.

An exported ``ZE_AFFINITY_MASK`` outlives the run it was meant for and silently sends the next one
to the wrong devices; here the variables live only in the child's environment. The launcher itself
never initialises a device runtime (the child must be the first to read ``ZE_*``): with
``--backend`` it does not even import torch.

Multi-process runs (``torchrun``, ``accelerate launch``) inherit the same selection in every rank,
which is what xccl/oneCCL needs: each rank keeps every selected device visible and picks
``xpu:<local_rank>`` itself. A per-rank mask would leave each rank one device and break collectives.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

from xpukit.errors import InvalidRequestError
from xpukit.select.devices import DeviceSelection, select_devices

__all__ = ["add_parser", "run", "run_command"]

logger = logging.getLogger(__name__)

# Signals passed on to the child. The launcher itself waits for the child to finish either way.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_EPILOG = """\
examples:
  xpukit launch --devices 0,2 -- torchrun --nproc-per-node 2 train.py
  xpukit launch --devices all --backend xpu --dry-run -- python train.py
  xpukit launch --devices 0.0,0.1 --hierarchy composite -- python infer.py

The variables are set for COMMAND alone; the shell that runs xpukit keeps its own.
Exit status: COMMAND's; 128+N when it is killed by signal N; 127 when it cannot be found.
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``launch`` on the top-level subparsers."""
    parser = sub.add_parser(
        "launch",
        help="run a command on the chosen devices (the variables are set for that command only)",
        description="Run COMMAND with the device-selection variables (ZE_AFFINITY_MASK, "
        "CUDA_VISIBLE_DEVICES…) set for COMMAND alone. Signals (SIGINT, SIGTERM) are passed on "
        "and COMMAND's exit status is returned.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--devices",
        required=True,
        metavar="SPEC",
        help="'0,2', '0-3', 'all'; tiles '0.1' (xpu, COMPOSITE only); GPU-/MIG- ids (cuda)",
    )
    parser.add_argument("--backend", metavar="B", help="xpu or cuda (default: the detected accelerator)")
    parser.add_argument(
        "--hierarchy",
        metavar="H",
        help="Level Zero hierarchy for xpu: flat, composite or combined (ZE_FLAT_DEVICE_HIERARCHY)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the exact shell line instead of running it"
    )
    parser.add_argument("--json", action="store_true", help="with --dry-run: print the selection as JSON")
    # dest "argv": the top-level parser keeps the subcommand's name in args.command.
    parser.add_argument(
        "argv", nargs=argparse.REMAINDER, metavar="-- COMMAND...", help="the command to run, after --"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Carry out ``xpukit launch``; returns the exit status."""
    command = list(args.argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if args.json and not args.dry_run:
        raise InvalidRequestError("--json describes the selection without running it: add --dry-run.")
    if not command and not args.dry_run:
        raise InvalidRequestError("no command to run. Usage: xpukit launch --devices 0,2 -- python train.py")
    selection = select_devices(args.devices, backend=args.backend, hierarchy=args.hierarchy)
    for note in selection.notes:
        logger.info("%s", note)
    for line in warnings_for(selection, command, os.environ):
        print(f"xpukit launch: warning: {line}", file=sys.stderr)
    if args.dry_run:
        if args.json:
            data = selection.to_dict() | {
                "command": command,
                "shell": selection.command_line(command),
            }
            print(json.dumps(data, indent=2))
        else:
            print(selection.command_line(command))
        return 0
    return run_command(command, selection.environ())


def warnings_for(selection: DeviceSelection, command: Sequence[str], base: Mapping[str, str]) -> list[str]:
    """What may work against the selection: its own warnings, the parent environment, the command.

    Notes (what was assumed or only checked for syntax) are logged at INFO level (``xpukit -v``);
    the selection's warnings (e.g. an index that is an integrated GPU) always reach stderr.
    """
    out = list(selection.warnings)
    for name, (exported, used) in selection.conflicts(base).items():
        now = f"uses {name}={used}" if used is not None else f"removes {name}"
        out.append(
            f"this shell exports {name}={exported}; this run {now} for COMMAND only. Later commands in "
            f"this shell still get {name}={exported} (`unset {name}` unless that is meant)."
        )
    if selection.backend == "xpu" and "ONEAPI_DEVICE_SELECTOR" in base:
        out.append(
            f"ONEAPI_DEVICE_SELECTOR={base['ONEAPI_DEVICE_SELECTOR']} is exported: SYCL applies it on "
            "top of ZE_AFFINITY_MASK, so COMMAND may see fewer devices than selected."
        )
    processes = _processes_per_node(command)
    visible = selection.visible_count
    if processes is not None and visible is not None and processes > visible:
        out.append(
            f"COMMAND starts {processes} processes per node but only {visible} device(s) are "
            f"visible: ranks from {visible} on have no `{selection.backend}:<local_rank>` of their own."
        )
    return out


def _processes_per_node(command: Sequence[str]) -> int | None:
    """The number of processes torchrun / accelerate launch will start per node, when stated."""
    words = list(command)
    program = Path(words[0]).name if words else ""
    if program == "torchrun" or words[1:3] == ["-m", "torch.distributed.run"]:
        flags = ("--nproc-per-node", "--nproc_per_node")
    elif program == "accelerate" and words[1:2] == ["launch"]:
        flags = ("--num-processes", "--num_processes")
    else:
        return None
    for i, word in enumerate(words):
        name, eq, value = word.partition("=")
        if name in flags:
            value = value if eq else (words[i + 1] if i + 1 < len(words) else "")
            return int(value) if value.isdigit() else None  # "auto", "gpu"…: decided at run time
    return None


def run_command(command: Sequence[str], env: Mapping[str, str]) -> int:
    """Run ``command`` with ``env``, passing SIGINT/SIGTERM on; returns its exit status.

    stdin, stdout and stderr are inherited. A child killed by signal N gives 128+N (the shell's
    convention); a command that cannot be found gives 127, one that cannot be run 126.

    SIGINT is not passed on when the launcher runs in the foreground of a terminal: Ctrl-C already
    reached the child (both are in the terminal's foreground process group), and a second SIGINT
    would interrupt the child's own clean-up.
    """
    child: list[subprocess.Popen[bytes]] = []
    early: list[int] = []
    terminal_delivers_sigint = _in_terminal_foreground()

    def forward(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and terminal_delivers_sigint:
            return
        if child:
            _send(child[0], signum)
        else:
            early.append(signum)

    handlers = {}
    if threading.current_thread() is threading.main_thread():  # signal.signal works only there
        handlers = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        try:
            proc = subprocess.Popen(list(command), env=dict(env))
        except FileNotFoundError:
            print(f"xpukit launch: error: command not found: {command[0]}", file=sys.stderr)
            return 127
        except PermissionError as exc:
            print(f"xpukit launch: error: cannot run {command[0]}: {exc.strerror}", file=sys.stderr)
            return 126
        child.append(proc)
        for signum in early:  # a signal that came while the child was being started
            _send(proc, signum)
        code = proc.wait()
    finally:
        for sig, previous in handlers.items():
            signal.signal(sig, previous)
    return 128 - code if code < 0 else code


def _send(proc: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it has just exited: its status is what counts
        proc.send_signal(signum)


def _in_terminal_foreground() -> bool:
    """Whether this process is in the foreground process group of its terminal (POSIX)."""
    getpgrp = getattr(os, "getpgrp", None)
    if getpgrp is None:
        return False
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
            if os.isatty(fd):
                return bool(os.tcgetpgrp(fd) == getpgrp())
        except (AttributeError, OSError, ValueError):
            continue
    return False
