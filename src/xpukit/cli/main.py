"""``xpukit`` entry point: argparse subcommands, errors as one line on stderr with exit code 1.

Each subcommand module exposes ``add_parser(subparsers)`` and ``run(args) -> int`` and imports
torch/transformers only inside ``run``, so ``xpukit --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from contextlib import nullcontext

from xpukit import __version__
from xpukit._quiet import quiet_imports, verbose
from xpukit.cli.logs import command_logging
from xpukit.cli.output import reserved_stdout
from xpukit.errors import XpukitError

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
    """Run the CLI; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    # Only xpukit's records print under xpukit's name; other libraries' only with --verbose, under
    # their own names (cli/logs.py).
    # With --json, standard output is the JSON alone: other libraries' prints go to stderr.
    with (
        reserved_stdout(bool(getattr(args, "json", False))),
        command_logging(bool(args.verbose)) as collected,
        verbose(bool(args.verbose)) if args.verbose else nullcontext(),
        quiet_imports(),  # other libraries' import-time messages: only with --verbose (_quiet.py)
    ):
        args.log_records = collected.records
        try:
            return int(args.run(args))
        except XpukitError as exc:
            print(f"xpukit {args.command}: error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130


if __name__ == "__main__":
    sys.exit(main())
