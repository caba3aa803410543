"""``bench_realrun.py``'s data and rows: the real-shaped data sets (token lengths drawn as users'
examples are long: uniform 64-512, chat-like and long-tail log-normal lengths, or fixed; random
token ids), the helpers that hand them to ``Trainer`` and to a child process, and the summary and
versus lines of rows gathered from several processes or devices."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _harness as h
from _peers import against_fastest_peer

DATA = {  # median, sigma of log(length), low, high
    "chat": (256, 0.6, 32, 1024),
    "longtail": (384, 0.9, 32, 2048),
    "uniform": (0, -1.0, 64, 512),  # sigma < 0: uniform in [low, high]
    "fixed": (512, 0.0, 512, 512),
}


def lengths(kind: str, n: int, seed: int, scale: float = 1.0) -> list[int]:
    import random

    median, sigma, low, high = DATA[kind]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if sigma < 0:
            out.append(int(rng.uniform(low * scale, high * scale)))
            continue
        value = median * scale * (rng.lognormvariate(0.0, sigma) if sigma else 1.0)
        out.append(int(min(max(value, low * scale), high * scale)))
    return out


def dataset(kind: str, n: int, vocab: int, seed: int, scale: float) -> list[dict[str, list[int]]]:
    import random

    rng = random.Random(seed + 1)
    return [{"input_ids": [rng.randrange(5, vocab) for _ in range(k)]} for k in lengths(kind, n, seed, scale)]


def with_data(argv: list[str], data: str) -> list[str]:
    """``argv`` with its ``--data`` value replaced by ``data``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            out.append(data)
            skip = False
        elif arg == "--data":
            out.append(arg)
            skip = True
        else:
            out.append(f"--data={data}" if arg.startswith("--data=") else arg)
    return out if any(a == "--data" or a.startswith("--data=") for a in argv) else [*out, f"--data={data}"]


def as_dataset(data: list[dict[str, list[int]]]) -> Any:
    from datasets import Dataset

    return Dataset.from_list(data)


def summarize_files(paths: list[str]) -> int:
    """The summary and versus lines of the rows in ``paths`` (runs split over processes or devices,
    each with its ``--first-round``), grouped by data set and by variant at its budget."""
    groups: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line) if line.startswith("{") else {}
            if row.get("bench") != "realrun" or "variant" not in row or "error" in row or "skipped" in row:
                continue
            budget = row.get("max_memory")
            name = (
                f"{row['variant']}@{budget}"
                if budget and not row["variant"].startswith("unsloth")
                else row["variant"]
            )
            groups.setdefault(row.get("data", "?"), {}).setdefault(name, []).append(row)
    for rows in groups.values():
        for variant, done in rows.items():
            print(json.dumps(summary(variant, done)), flush=True)
        for line in against_fastest_peer(rows, "realrun"):
            print(json.dumps(line), flush=True)
    return 0


def summary(variant: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    summed = (
        "tokens_per_s",
        "tokens_per_s_steady",
        "tokens_per_s_first20",
        "peak_mem_gb",
        "step_ms_median",
        "loss_last",
    )
    kept = ("data", "micro_batch", "graphs", "packing", "plan", "max_memory", "budget_kept")
    return h.summary(variant, rows, bench="realrun", summed=summed, kept=kept)
