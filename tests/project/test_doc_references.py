"""Every document the code or the docs point at is in this repository, down to the section.

A maintainer must be able to follow each reference from a clone: ``docs/planning.md``,
``docs/platform-notes.md §1.1``, ``docs/known-issues.md "bitsandbytes: CPU repacking of 4-bit
weights"`` and ``[text](file.md#anchor)`` links must name a file that exists and, when they name a
section, a heading that exists in it.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A path ending in .md, optionally followed by a section: §1.2 / "Heading" / #anchor.
_REF = re.compile(
    r"(?P<path>(?<![\w/.-])[\w./-]*[\w-]\.md)"
    r"(?:(?:#(?P<anchor>[\w-]+))|(?:[`)]?,?\s*§\s?(?P<section>\d+(?:\.\d+)*))"
    r"|(?:[`)]?,?\s*\"(?P<title>[^\"\n]{3,80})\"))?"
)
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def _tracked() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    keep = ("src/", "tests/", "docs/", "bench/", "examples/", "scripts/")
    names = {"README.md", "CONTRIBUTING.md", "CHANGELOG.md"}
    return [
        ROOT / f
        for f in out
        if (f.startswith(keep) or f in names)
        and (ROOT / f).is_file()
        and f.endswith((".py", ".md", ".ipynb", ".toml", ""))
    ]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache  # read once per document: the docs cite the same few pages thousands of times
def _headings(doc: Path) -> list[str]:
    return [m.group(2) for m in _HEADING.finditer(doc.read_text(encoding="utf-8"))]


def _resolve(path: str, citing: Path) -> Path | None:
    for base in (citing.parent, ROOT, ROOT / "docs"):
        candidate = (base / path).resolve()
        if candidate.is_file() and ROOT in candidate.parents:
            return candidate
    return None


def references(text: str) -> list[re.Match[str]]:
    return [m for m in _REF.finditer(text) if not m.group("path").startswith(("http", "//"))]


def problems_in(citing: Path, text: str) -> list[str]:
    found = []

    def where(m: re.Match[str]) -> str:  # counted only for a problem: some files are megabytes
        return f"{citing.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"

    for m in references(text):
        path = m.group("path")
        doc = _resolve(path, citing)
        if doc is None:
            found.append(f"{where(m)}: {path} is not in this repository")
            continue
        heads = _headings(doc)
        if m.group("section"):
            number = m.group("section")
            if not any(re.match(rf"{re.escape(number)}(?:[.\s]|$)", h) for h in heads):
                found.append(f"{where(m)}: {path} has no section {number}")
        elif m.group("anchor"):
            if m.group("anchor") not in {_slug(h) for h in heads}:
                found.append(f"{where(m)}: {path} has no heading with anchor #{m.group('anchor')}")
        elif m.group("title"):
            title = m.group("title").strip()
            exact = any(h.strip() == title or h.strip().endswith(" " + title) for h in heads)
            # A quoted phrase after a path names a section only when some heading starts alike.
            if not exact and any(h.lower().startswith(title.lower()[:12]) for h in heads):
                found.append(f"{where(m)}: {path} has no heading {title!r}")
    return found


def test_every_referenced_document_and_section_exists() -> None:
    problems = []
    for f in _tracked():
        if f == Path(__file__).resolve():
            continue  # its own examples name missing files on purpose
        problems += problems_in(f, f.read_text(encoding="utf-8", errors="replace"))
    assert problems == [], "references to documents or sections this repo lacks:\n" + "\n".join(problems)


def test_no_reference_points_outside_the_repository() -> None:
    # The names of background documents that live outside the repository, spelled in pieces so that
    # this line itself is not one of the pointers the test looks for.
    names = ("cpu-" + "findings", "peers", "style", "design", "reference/" + "platform", r"\.\./" + "shared")
    outside = re.compile("|".join(n if "/" in n or "-" in n else n + r"\.md" for n in names))
    hits = []
    for f in _tracked():
        if f == Path(__file__).resolve():
            continue
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if outside.search(line):
                hits.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert hits == [], "pointers to documents a clone does not have:\n" + "\n".join(hits)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("see docs/planning.md", []),
        ("see docs/nowhere.md", ["nowhere.md is not in this repository"]),
        ("(docs/platform-notes.md §99.9)", ["has no section 99.9"]),
        ("[x](docs/index.md#no-such-heading)", ["has no heading with anchor #no-such-heading"]),
        ("[x](docs/index.md#pages)", []),
    ],
)
def test_the_checker_catches_missing_targets(text: str, expected: list[str]) -> None:
    got = problems_in(ROOT / "tests" / "x.py", text)
    assert len(got) == len(expected)
    for problem, part in zip(got, expected, strict=True):
        assert part in problem


# A user page says what to call, what it decides and the measured table; the history of measurement
# rounds goes to docs/benchmarks.md (which may stay long) and CHANGELOG.md.
PAGE_LINE_LIMIT = 500
LONG_BY_DESIGN = {"benchmarks.md"}
# Pages still over the limit while they are being split: remove each name once its page fits.
KNOWN_LONG: set[str] = set()


def test_user_pages_stay_under_the_line_limit() -> None:
    lengths = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in (ROOT / "docs").glob("*.md")}
    long = {name: n for name, n in lengths.items() if n > PAGE_LINE_LIMIT and name not in LONG_BY_DESIGN}
    over = {name: n for name, n in long.items() if name not in KNOWN_LONG}
    assert over == {}, (
        f"docs pages over {PAGE_LINE_LIMIT} lines: {over}. Split the page by topic (a new page in "
        "mkdocs.yml's nav, each moved heading unchanged) or move the history of measurement rounds to "
        "docs/benchmarks.md"
    )
    fitting = sorted(KNOWN_LONG - set(long))
    assert fitting == [], f"{fitting} now fit(s) in {PAGE_LINE_LIMIT} lines: remove from KNOWN_LONG"
