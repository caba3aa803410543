"""``xpukit launch --nproc``: the torchrun command line xpukit starts, and what runs inside each rank.

:func:`torchrun_command` writes ``python -m torch.distributed.run`` for ``--nproc auto|N`` (one process
per selected device); on XPU each rank runs ``python -m xpukit.cli.launch SCRIPT ARGS``, which is
:func:`rank_main`: it sets oneCCL's per-rank variables from torchrun's before the script starts
(docs/distributed.md "What xpukit launch sets").
"""

from __future__ import annotations

import os
import runpy
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from xpukit import _environ
from xpukit.errors import InvalidRequestError
from xpukit.select.devices import DeviceSelection

__all__ = ["nproc_per_node", "rank_main", "torchrun_command"]


def nproc_per_node(value: str, selection: DeviceSelection | None) -> int:
    """``--nproc auto|N``: the processes per node (auto: the selected devices' count)."""
    if value.strip().lower() == "auto":
        count = selection.visible_count if selection is not None else None
        if count is None:
            raise InvalidRequestError(
                "--nproc auto counts the selected devices, but their number is not known here"
                + (" (a named backend is checked for syntax only)" if selection else " (no --devices)")
                + ". Fix: --nproc N, or --devices 0,1 (a list counts itself)."
            )
        return count
    if not value.strip().isdigit() or int(value) < 1:
        raise InvalidRequestError(f"--nproc {value!r}: use auto or a positive number of processes per node.")
    return int(value)


def torchrun_command(
    command: Sequence[str],
    *,
    nproc: int,
    nnodes: str | None = None,
    rdzv_endpoint: str | None = None,
    rank_env: bool = False,
) -> list[str]:
    """The ``python -m torch.distributed.run`` line that runs ``command`` as ``nproc`` ranks per node.

    Args:
        command: ``train.py ARGS``, ``python train.py ARGS`` or ``python -m module ARGS``.
        nproc: processes per node.
        nnodes: torchrun's ``--nnodes`` (``2``, ``1:4``); one node (``--standalone``) when neither it
            nor ``rdzv_endpoint`` is given.
        rdzv_endpoint: the c10d rendezvous ``host:port`` of a multi-node job.
        rank_env: run each rank through :func:`rank_main` (sets oneCCL's per-rank variables).

    Returns:
        The full argument list.
    """
    words = list(command)
    if words and Path(words[0]).name.startswith("python"):
        words = words[1:]
    _check_script(words, command)
    module = words[:1] == ["-m"]
    if module:
        words = words[1:]
    out = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if nnodes is not None:
        out += ["--nnodes", nnodes]
    if rdzv_endpoint is not None:
        out += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint]
    if nnodes is None and rdzv_endpoint is None:
        out.append("--standalone")  # one node, a free port picked by torchrun
    if rank_env:
        return [*out, "--module", "xpukit.cli.launch", *(["-m"] if module else []), *words]
    if words[:1] == ["-c"]:  # torchrun takes a script or a module: the code runs through --no-python
        return [*out, "--no-python", sys.executable, *words]
    return [*out, *(["--module"] if module else []), *words]


def _check_script(words: Sequence[str], command: Sequence[str]) -> None:
    """What torchrun can run after ``python``: a script, ``-m MODULE`` or ``-c CODE`` (each with
    arguments); other interpreter options are refused in xpukit's words (torchrun would print its
    usage)."""
    given = shlex.join(command)
    if not words:
        raise InvalidRequestError(
            f"--nproc with COMMAND {given!r}: there is no script to run. Fix: name it, "
            "e.g. `xpukit launch --nproc 2 -- train.py`, `-- python -m module` or `-- python -c CODE`."
        )
    if words[0] in {"-m", "-c"} and len(words) < 2:
        raise InvalidRequestError(f"--nproc with COMMAND {given!r}: {words[0]} needs its argument.")
    if words[0].startswith("-") and words[0] not in {"-m", "-c"}:
        raise InvalidRequestError(
            f"--nproc with COMMAND {given!r}: the interpreter option {words[0]!r} cannot be passed on: "
            "torchrun starts each rank with its own Python, running a script, `-m MODULE` or `-c CODE`. "
            "Fix: drop the option (PYTHONUNBUFFERED=1 does what -u does, PYTHONWARNINGS what -W does)."
        )


def rank_main(argv: Sequence[str]) -> int:
    """Inside one rank: set ``CCL_LOCAL_RANK`` / ``CCL_LOCAL_SIZE`` from torchrun's variables, run the script.

    ``python -m xpukit.cli.launch SCRIPT ARGS`` (or ``-m MODULE ARGS``); torchrun sets ``LOCAL_RANK``
    only in the rank's own environment, so the launcher cannot set these for each rank itself.
    """
    words = list(argv)
    if not words:
        print(
            "usage: python -m xpukit.cli.launch SCRIPT [ARGS] | -m MODULE [ARGS] | -c CODE [ARGS]",
            file=sys.stderr,
        )
        return 2
    os.environ["CCL_LOCAL_RANK"] = _environ.get("LOCAL_RANK") or "0"
    local_size = _environ.get("LOCAL_WORLD_SIZE")
    if local_size is not None:
        os.environ["CCL_LOCAL_SIZE"] = local_size
    if words[0] == "-m" and len(words) > 1:
        sys.argv = words[1:]
        runpy.run_module(words[1], run_name="__main__", alter_sys=True)
    elif words[0] == "-c" and len(words) > 1:  # as `python -c CODE ARGS`: sys.argv[0] is "-c"
        sys.argv = ["-c", *words[2:]]
        sys.path[0] = ""
        exec(compile(words[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv = words
        sys.path[0] = str(Path(words[0]).resolve().parent)
        runpy.run_path(words[0], run_name="__main__")
    return 0
