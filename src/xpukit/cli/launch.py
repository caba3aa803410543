"""``xpukit launch``: run one command with a device selection set for that command alone.

An exported ``ZE_AFFINITY_MASK`` outlives the run it was meant for and silently sends the next one
to the wrong devices; here the variables live only in the child's environment. The launcher itself
never initialises a device runtime (the child must be the first to read ``ZE_*``): with
``--backend`` it does not even import torch.

Multi-process runs (``torchrun``, ``accelerate launch``) inherit the same selection in every rank,
which is what xccl/oneCCL needs: each rank keeps every selected device visible and picks
``xpu:<local_rank>`` itself. A per-rank mask would leave each rank one device and break collectives.

``--nproc auto|N`` starts torchrun itself (``python -m torch.distributed.run``), one process per
selected device; on XPU the job gets ``CCL_PROCESS_LAUNCHER=none`` and ``CCL_LOCAL_SIZE``, and each
rank ``CCL_LOCAL_RANK`` from its ``LOCAL_RANK``, which torchrun sets only inside the rank: the rank
runs ``python -m xpukit.cli.launch SCRIPT ARGS`` (:func:`~xpukit.cli.torchrun.rank_main`), which
sets it before the script starts (docs/distributed.md "What xpukit launch sets"); the command line
and the rank's side are :mod:`xpukit.cli.torchrun`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

from xpukit import _platform
from xpukit.cli.output import emit_json
from xpukit.cli.torchrun import nproc_per_node, rank_main, torchrun_command
from xpukit.doctor.checks import environment_findings
from xpukit.errors import InvalidRequestError
from xpukit.select.devices import DeviceSelection, select_devices

__all__ = ["add_parser", "rank_main", "run", "run_command", "torchrun_command"]

logger = logging.getLogger(__name__)

# Signals passed on to the child: _platform.forwarded_signals() (SIGINT/SIGTERM on POSIX, Ctrl-C and
# Ctrl-Break as CTRL_BREAK_EVENT on Windows). The launcher waits for the child to finish either way.

_EPILOG = """\
examples:
  xpukit launch --devices 0,2 -- torchrun --nproc-per-node 2 train.py
  xpukit launch --devices all --backend xpu --dry-run -- python train.py
  xpukit launch --devices 0.0,0.1 --hierarchy composite -- python infer.py
  xpukit launch --devices 0,1 --nproc auto -- train.py --epochs 1     # torchrun, one rank per device
  xpukit launch --nproc 2 --backend cpu -- train.py                   # 2 CPU ranks (gloo)
  xpukit launch --devices all --nproc 4 --nnodes 2 --rdzv-endpoint host:29400 -- train.py

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
        metavar="SPEC",
        help="'0,2', '0-3', 'all'; tiles '0.1' (xpu, COMPOSITE only); GPU-/MIG- ids (cuda); "
        "required unless --nproc N is given",
    )
    parser.add_argument(
        "--backend", metavar="B", help="xpu, cuda, or cpu with --nproc (default: the detected accelerator)"
    )
    parser.add_argument(
        "--nproc",
        metavar="auto|N",
        help="start torchrun with N processes per node (auto: one per selected device); COMMAND is then "
        "the script and its arguments (a leading `python` is dropped; `python -m mod` runs a module, "
        "`python -c CODE` the code)",
    )
    parser.add_argument("--nnodes", metavar="N", help="with --nproc: torchrun --nnodes (e.g. 2 or 1:4)")
    parser.add_argument(
        "--rdzv-endpoint", metavar="HOST:PORT", help="with --nproc: torchrun rendezvous (c10d) endpoint"
    )
    parser.add_argument(
        "--hierarchy",
        metavar="H",
        help="Level Zero hierarchy for xpu: flat, composite or combined (ZE_FLAT_DEVICE_HIERARCHY)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the exact shell line instead of running it"
    )
    parser.add_argument("--json", action="store_true", help="with --dry-run: print the selection as JSON")
    parser.add_argument(
        "--shell",
        choices=_platform.SHELLS,
        help="with --dry-run: write the line for this shell (default: powershell on Windows, else posix)",
    )
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
    if args.nproc is None and (args.nnodes or args.rdzv_endpoint):
        raise InvalidRequestError("--nnodes / --rdzv-endpoint go to torchrun: add --nproc auto|N.")
    if args.nproc is not None:
        return _run_torchrun(args, command)
    if args.devices is None:
        raise InvalidRequestError("--devices is required (or --nproc N to start torchrun).")
    selection = select_devices(args.devices, backend=args.backend, hierarchy=args.hierarchy)
    _check_inherited(selection)
    for note in selection.notes:
        logger.info("%s", note)
    for line in warnings_for(selection, command, os.environ):
        print(f"xpukit launch: warning: {line}", file=sys.stderr)
    if args.dry_run:
        if args.json:
            data = selection.to_dict() | {
                "command": command,
                "shell": selection.command_line(command, args.shell),
            }
            emit_json(data)
        else:
            print(selection.command_line(command, args.shell))
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
    would interrupt the child's own clean-up. On Windows the child runs in its own process group
    and gets Ctrl-C and Ctrl-Break as CTRL_BREAK_EVENT; there is no SIGTERM to pass on
    (docs/windows.md "Stopping a launched command").
    """
    child: list[subprocess.Popen[bytes]] = []
    early: list[int] = []
    terminal_delivers_sigint = _platform.terminal_delivers_sigint()

    def forward(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and terminal_delivers_sigint:
            return
        if child:
            _send(child[0], signum)
        else:
            early.append(signum)

    handlers = {}
    if threading.current_thread() is threading.main_thread():  # signal.signal works only there
        handlers = {sig: signal.signal(sig, forward) for sig in _platform.forwarded_signals()}
    try:
        try:
            proc = subprocess.Popen(list(command), env=dict(env), **_platform.child_process_options())
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
        proc.send_signal(_platform.signal_for_child(signum))  # CTRL_BREAK_EVENT on Windows


# ---------------------------------------------------------------------------------------------
# --nproc: torchrun started by xpukit (docs/distributed.md "What xpukit launch sets")
# ---------------------------------------------------------------------------------------------

_LAUNCHERS = ("torchrun", "accelerate", "mpirun", "mpiexec", "deepspeed")


def _check_inherited(selection: DeviceSelection | None) -> None:
    """What the ranks would inherit from this environment, checked as ``xpukit doctor`` checks it:
    an unreadable device mask or a hierarchy the driver ignores is refused before anything starts
    (the selection's own variables replace the inherited ones and are not checked here); a variable
    the runtime never reads is a warning."""
    replaced = set(selection.env) | set(selection.unset) if selection is not None else set()
    inherited = {k: v for k, v in os.environ.items() if k not in replaced}
    for finding in environment_findings(inherited):
        if finding.code in ("mask-unreadable", "hierarchy-ignored"):
            raise InvalidRequestError(
                f"xpukit launch: the ranks would inherit {finding.message} Fix: {finding.fix} "
                "(or give --devices, whose selection replaces the mask)."
            )
        print(f"xpukit launch: warning: {finding.message} Fix: {finding.fix}", file=sys.stderr)


def _run_torchrun(args: argparse.Namespace, command: list[str]) -> int:
    backend = (args.backend or "").lower() or None
    selection = None
    if args.devices is not None and backend != "cpu":
        selection = select_devices(args.devices, backend=backend, hierarchy=args.hierarchy)
        backend = selection.backend
    _check_inherited(selection)
    nproc = nproc_per_node(args.nproc, selection)
    program = Path(command[0]).name if command else ""
    if program in _LAUNCHERS or command[1:3] == ["-m", "torch.distributed.run"]:
        raise InvalidRequestError(
            f"--nproc starts torchrun itself, and COMMAND is already a launcher ({program}). Fix: drop "
            f"--nproc (`xpukit launch --devices SPEC -- {program} ...` keeps working), or pass the script."
        )
    extra = {"CCL_PROCESS_LAUNCHER": "none", "CCL_LOCAL_SIZE": str(nproc)} if backend == "xpu" else {}
    full = torchrun_command(
        command, nproc=nproc, nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint, rank_env=backend == "xpu"
    )
    if selection is not None:
        selection = dataclasses.replace(selection, env={**selection.env, **extra})
        for line in warnings_for(selection, full, os.environ):
            print(f"xpukit launch: warning: {line}", file=sys.stderr)
        env, shell = selection.environ(), selection.command_line(full, args.shell)
    else:
        env = dict(os.environ) | extra
        shell = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in extra.items()), shlex.join(full)])
    if args.dry_run:
        if args.json:
            data = (selection.to_dict() if selection is not None else {"backend": backend or "cpu"}) | {
                "command": full,
                "env": extra | (selection.env if selection is not None else {}),
                "unset": list(selection.unset) if selection is not None else [],
                "per_rank_env": {"CCL_LOCAL_RANK": "LOCAL_RANK"} if backend == "xpu" else {},
                "nproc_per_node": nproc,
                "shell": shell,
            }
            emit_json(data)
        else:
            print(shell)
        return 0
    return run_command(full, env)


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1:]))
