"""``xpukit plan``: the dry run of ``load_for_xpu`` — every choice and why, no weights read."""

from __future__ import annotations

import argparse
import textwrap
from typing import TYPE_CHECKING, Any

from xpukit.cli.logs import notes_for, plan_warnings_printed
from xpukit.cli.output import emit_json
from xpukit.errors import InvalidRequestError

if TYPE_CHECKING:
    from xpukit.machine.facts import MachineFacts
    from xpukit.planning.loadplan import LoadPlan


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the ``plan`` subcommand."""
    parser = sub.add_parser(
        "plan",
        help="dry run: what load_for_xpu would do with a model, and why",
        description="Plan how a model would be loaded for inference (device, dtype, 4-bit, device_map, "
        "max_memory, attention, Hub kernels) from its config alone; no weights are read. MODEL is a "
        "local model directory, a Hub id (offline: only when its config is in the local cache), or a "
        "built-in shape (qwen3-0.6b, qwen3-8b, qwen3-32b, llama-3.1-8b, llama-3.1-70b).",
        epilog="Examples:\n"
        "  xpukit plan qwen3-8b --assume arc-b580          # does it fit one Arc B580?\n"
        "  xpukit plan qwen3-8b --assume arc-b580 --quantize 4bit\n"
        "  xpukit plan llama-3.1-70b --assume max-1550x2 --json\n"
        "  xpukit plan ./my-model --device cpu",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model", metavar="MODEL", nargs="?", help="model directory, Hub id, or built-in shape name"
    )
    _load_arguments(parser)
    _placement_arguments(parser)
    _use_arguments(parser)
    parser.set_defaults(run=run)


def _load_arguments(parser: argparse.ArgumentParser) -> None:
    """What ``load_for_xpu`` would be given: device, dtype, attention, kernels, quantization."""
    parser.add_argument("--device", help="xpu, xpu:1, cuda, mps or cpu (default: the first available)")
    parser.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32 (default: auto)")
    parser.add_argument(
        "--attn", default="auto", help="auto, sdpa, eager, flash_attention_2 … (default: auto)"
    )
    parser.add_argument(
        "--kernels", default="auto", choices=("auto", "on", "off"), help="Hub kernels (use_kernels)"
    )
    parser.add_argument(
        "--quantize",
        help="4bit, 8bit (the device's fastest format without --lora), nf4 (bitsandbytes) or auto (4-bit "
        "only when needed to fit)",
    )


def _placement_arguments(parser: argparse.ArgumentParser) -> None:
    """Where it would go: the hardware assumed, the budgets, offloading, a rank of a launched job."""
    parser.add_argument(
        "--assume",
        metavar="PROFILE[xN]",
        help="plan for recorded hardware instead of this machine, e.g. arc-b580, max-1550x2 "
        "(`--assume list` lists the profiles)",
    )
    parser.add_argument(
        "--max-memory", metavar="SPEC", help="weights budget per device, e.g. 0=10GiB,1=10GiB,cpu=30GiB"
    )
    parser.add_argument("--headroom", help="memory kept free beside the weights, e.g. 2GiB")
    offload = parser.add_mutually_exclusive_group()
    offload.add_argument("--no-offload", action="store_true", help="fail instead of offloading to CPU")
    offload.add_argument(
        "--offload",
        action="store_true",
        help="allow offloading weights to CPU memory also when training (--train), where it is "
        "refused by default",
    )
    parser.add_argument(
        "--rank",
        metavar="R/W",
        help="plan as rank R of a W-process launched job on one node (e.g. 1/2): its own device",
    )
    parser.add_argument("--strategy", help="auto, ddp, fsdp or deepspeed: plan the load for that strategy")


def _use_arguments(parser: argparse.ArgumentParser) -> None:
    """What it would be used for (decoding, training) and how the plan is shown."""
    parser.add_argument(
        "--fast-decode",
        action="store_const",
        const=True,
        default="auto",
        help="plan fast_decode=True: static KV cache and compiled decoding (docs/decode.md); without "
        "it fast_decode='auto', taken for torchao weights loaded to run on CUDA/XPU",
    )
    parser.add_argument(
        "--no-fast-decode",
        dest="fast_decode",
        action="store_const",
        const=False,
        help="plan fast_decode=False: no static cache or compiled decoding, also where 'auto' takes it",
    )
    parser.add_argument(
        "--train",
        metavar="BATCHxSEQ",
        help="plan LoRA training (lora=True) of BATCH sequences of SEQ tokens, e.g. 4x512: the memory "
        "savers chosen by fit and the activation estimate (docs/training.md)",
    )
    parser.add_argument(
        "--explain",
        action="store_true",
        help="the full plan: every reason, the memory and training estimates, the rejected "
        "alternatives and the from_pretrained keywords (default: each choice with one line of reason)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    """Print the plan (or its JSON); a bad request or a plan that fits nowhere exits 1.

    Every argument is checked before anything heavy is imported (a built-in shape's config imports
    transformers): a typo costs a fraction of a second.
    """
    if (args.assume or "").strip().lower() == "list":
        _print_profiles()
        return 0
    if args.model is None:
        raise InvalidRequestError("MODEL is missing: a model directory, a Hub id or a built-in shape.")
    request = _request(args)
    with plan_warnings_printed(bool(getattr(args, "verbose", False))):
        plan = _plan(args, request)
    notes = notes_for(getattr(args, "log_records", []), plan)
    if args.json:
        emit_json({**plan.to_dict(), "notes": notes})
        return 0
    print(plan.explain(verbose=bool(getattr(args, "explain", False))))
    if notes:
        print("\nNotes (from other libraries' warnings, in xpukit's words; --verbose shows them)")
        for note in notes:
            print("\n".join(textwrap.wrap(note, 100, initial_indent="  ", subsequent_indent="    ")))
    return 0


def _request(args: argparse.Namespace) -> dict[str, Any]:
    """``plan_load``'s keywords from the arguments, every one checked (:class:`LoadRequest`)."""
    from xpukit.planning.request import LoadRequest

    rank = _rank(args.rank) if getattr(args, "rank", None) else None
    kwargs: dict[str, Any] = {
        "device": args.device,
        "dtype": args.dtype,
        "attn": args.attn,
        "kernels": {"on": True, "off": False}.get(args.kernels, "auto"),
        "quantize": args.quantize,
        "max_memory": parse_max_memory(args.max_memory) if args.max_memory else None,
        "headroom": args.headroom,
        "strategy": getattr(args, "strategy", None),
        "fast_decode": getattr(args, "fast_decode", "auto"),
        **_train(getattr(args, "train", None)),
    }
    LoadRequest(**kwargs)
    if args.assume is not None:
        from xpukit.machine.profiles import parse_assume

        parse_assume(args.assume)
    offload = False if args.no_offload else (True if getattr(args, "offload", False) else None)
    return {**kwargs, "offload": offload, "rank": rank}


def _plan(args: argparse.Namespace, request: dict[str, Any]) -> LoadPlan:
    from xpukit.planning.plan import plan_load

    kwargs = dict(request)
    rank = kwargs.pop("rank")
    # plan_load takes a built-in shape's name as it takes a directory or a Hub id, and its error for a
    # Hub id it cannot read names the built-in shape of that model, when there is one.
    return plan_load(args.model, facts=_facts(args.assume, rank) if rank else args.assume, **kwargs)


def _print_profiles() -> None:
    from xpukit.machine.profiles import device_profile, profile_names

    print("Recorded profiles for --assume NAME or NAMExN (N cards):")
    for name in profile_names():
        device = device_profile(name)
        print(f"  {name:<13}{device.backend:<5} {device.name}")


def _train(spec: str | None) -> dict[str, bool | int]:
    """``--train 4x512`` → ``{"lora": True, "batch_size": 4, "seq_len": 512}``."""
    if spec is None:
        return {}
    batch, sep, seq = spec.lower().partition("x")
    if not sep or not batch.strip().isdigit() or not seq.strip().isdigit():
        raise InvalidRequestError(f"--train {spec!r}: use BATCHxSEQ, e.g. 4x512 (4 sequences of 512 tokens).")
    return {"lora": True, "batch_size": int(batch), "seq_len": int(seq)}


def _rank(spec: str) -> tuple[int, int]:
    """``--rank 1/2`` → ``(1, 2)``: rank R of W processes, 0 <= R < W."""
    r, sep, w = spec.partition("/")
    if not sep or not r.strip().isdigit() or not w.strip().isdigit() or not int(r) < int(w):
        raise InvalidRequestError(
            f"--rank {spec!r}: use R/W with W >= 1 processes and R one of 0..W-1, e.g. 1/2 (rank 1 of a "
            "2-process job)."
        )
    return int(r), int(w)


def _facts(assume: str | None, rank: tuple[int, int]) -> MachineFacts:
    """The machine (a profile or this one) as rank R of W (``--rank R/W``)."""
    from dataclasses import replace

    from xpukit.machine.launch import LaunchFacts
    from xpukit.planning.device.choice import machine_for

    machine, _ = machine_for(assume)
    return replace(machine, launch=LaunchFacts.assumed(*rank))


def parse_max_memory(spec: str) -> dict[str, str]:
    """``"0=10GiB,cpu=30GiB"`` → ``{"0": "10GiB", "cpu": "30GiB"}`` (sizes are checked by the planner)."""
    out: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise InvalidRequestError(
                f"--max-memory {spec!r}: use DEVICE=SIZE pairs, e.g. 0=10GiB,cpu=30GiB."
            )
        out[key.strip()] = value.strip()
    return out
