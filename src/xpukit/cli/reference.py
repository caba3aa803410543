"""The CLI reference page (docs/cli.md), written from the parser's own ``--help``.

``python -m xpukit.cli.reference`` rewrites docs/cli.md; ``tests/cli/test_cli_reference.py`` fails when
the page and the parser disagree, so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from xpukit.cli.main import SUBCOMMANDS, build_parser

__all__ = ["WIDTH", "render", "write"]

WIDTH = 100  # help is wrapped at this width whatever the terminal, so the page is the same everywhere

_HEADER = """\
# Command-line reference

Generated from the parser by `python -m xpukit.cli.reference` (do not edit by hand;
`tests/cli/test_cli_reference.py` fails when this page and `xpukit --help` disagree).
`python -m xpukit ...` is the same command line as `xpukit ...`.
"""


def _fixed_width(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = functools.partial(parser.formatter_class, width=WIDTH)  # type: ignore[call-arg]


def render() -> str:
    """The whole page: ``xpukit --help``, then each subcommand's ``--help``.

    Returns:
        Markdown text.
    """
    parser = build_parser()
    _fixed_width(parser)
    subparsers: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            subparsers = dict(action.choices)
    sections = [_HEADER, "## `xpukit`\n", "```text\n" + parser.format_help().rstrip() + "\n```\n"]
    for name in SUBCOMMANDS:
        sub = subparsers.get(name)
        if sub is None:
            continue
        _fixed_width(sub)
        sections += [f"## `xpukit {name}`\n", "```text\n" + sub.format_help().rstrip() + "\n```\n"]
    return "\n".join(sections)


def write(path: str | Path) -> Path:
    """Write :func:`render` to ``path``; returns the path."""
    out = Path(path)
    out.write_text(render(), encoding="utf-8")
    return out


if __name__ == "__main__":
    default = Path(__file__).resolve().parents[3] / "docs" / "cli.md"  # src/xpukit/cli/ -> the repo
    target = sys.argv[1] if len(sys.argv) > 1 else str(default)
    print(f"wrote {write(target)}")
