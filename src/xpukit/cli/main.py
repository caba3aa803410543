"""``xpukit`` entry point: argparse subcommands, errors as one line on stderr with exit code 1.

Each subcommand module exposes ``add_parser(subparsers)`` and ``run(args) -> int`` and imports
torch/transformers only inside ``run``, so ``xpukit --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import nullcontext

from xpukit import __version__
from xpukit._quiet import quiet_imports, verbose
from xpukit.cli.logs import command_logging
from xpukit.cli.output import emit_json, reserved_stdout
from xpukit.errors import XpukitError

_STARTED = time.perf_counter()  # the command's start, as near the process's as xpukit can see it

# Subcommand modules, in the order `--help` lists them.
SUBCOMMANDS = ("doctor", "plan", "launch", "demo", "merge", "export")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, every subcommand included."""
    parser = argparse.ArgumentParser(
        prog="xpukit",
        description="Load, fine-tune and launch Hugging Face Transformers correctly on Intel GPUs "
        "(xpu), CUDA, MPS and CPU.",
        epilog="Examples:\n  xpukit doctor\n  xpukit plan Qwen/Qwen3-8B --assume arc-b580\n"
        "  xpukit launch --devices 0,1 -- torchrun --nproc-per-node 2 train.py\n  xpukit demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"xpukit {__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log xpukit's decisions (INFO) and show other libraries' warnings under their own names",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"xpukit.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"xpukit.cli.{name}":
                raise
            continue  # a subcommand not built yet in this tree
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code.

    A command whose work is complete (``args.completed``, set by the command: a merge once OUT is
    written) exits 0 on a Ctrl-C that comes after it; run as the program (``argv`` from the command
    line), a finished command ignores Ctrl-C while the interpreter shuts down (a second or more after
    a merge, freeing torch).
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the subcommand's own usage, not the top-level one (`xpukit doctor --jsn`)
        _subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    args.started = _STARTED if argv is None else time.perf_counter()  # a summary's wall time
    if args.command is None:
        parser.print_help()
        return 0
    try:
        code = _run(args)
    except KeyboardInterrupt:
        code = 0 if getattr(args, "completed", False) else 130
    if argv is None and code != 130 and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


def _run(args: argparse.Namespace) -> int:
    """The command, its errors as one line (and, with ``--json``, a JSON error object on stdout)."""
    json_out = bool(getattr(args, "json", False))
    # Only xpukit's records print under xpukit's name; other libraries' only with --verbose, under
    # their own names (cli/logs.py).
    # With --json, standard output is the JSON alone: other libraries' prints go to stderr.
    with (
        reserved_stdout(json_out),
        command_logging(bool(args.verbose)) as collected,
        verbose(bool(args.verbose)) if args.verbose else nullcontext(),
        quiet_imports(),  # other libraries' import-time messages: only with --verbose (_quiet.py)
    ):
        args.log_records = collected.records
        try:
            return int(args.run(args))
        except XpukitError as exc:
            print(f"xpukit {args.command}: error: {exc}", file=sys.stderr)
            if json_out:
                emit_json({"error": {"type": type(exc).__name__, "message": str(exc)}})
            return 1


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The parser of ``command`` (the top-level parser when there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]  # type: ignore[no-any-return]
    return parser


if __name__ == "__main__":
    sys.exit(main())
