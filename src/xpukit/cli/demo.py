"""``xpukit demo``: plan, 4-bit + LoRA load, generate, fine-tune, generate again; offline by default."""

from __future__ import annotations

import argparse
import sys

from xpukit.cli.output import emit_json
from xpukit.demo.run import DEFAULT_BATCH_SIZE, DEFAULT_STEPS  # light: xpukit.demo.run imports torch lazily


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the ``demo`` subcommand."""
    parser = sub.add_parser(
        "demo",
        help="the main job end to end on an embedded tiny model (offline; under a minute on a 2-core CPU)",
        description="Build (once, cached) a tiny Qwen3-style model, print the load plan, load it in "
        "4-bit with LoRA adapters (bitsandbytes, where installed), generate, fine-tune on a short "
        "bundled text with the loss falling, and generate again. Uses the GPU where there is one. "
        "Needs no network. With --model it does the same on a real model.",
        epilog="Examples:\n  xpukit demo\n  xpukit demo --steps 30 --plot loss.png\n"
        "  xpukit demo --json > demo.json\n  xpukit demo --model Qwen/Qwen3-0.6B --device xpu",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        metavar="PATH_OR_ID",
        help="a model directory or Hub id instead of the embedded tiny model (its own tokenizer is used)",
    )
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"training steps (default {DEFAULT_STEPS})"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        help=f"sequences per step (default {DEFAULT_BATCH_SIZE})",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="learning rate (default 1e-2 for the embedded model, 2e-4 with --model)",
    )
    parser.add_argument("--device", help="xpu, xpu:1, cuda, mps or cpu (default: the first available)")
    parser.add_argument(
        "--no-quantize", action="store_true", help="LoRA on full-precision weights instead of 4-bit"
    )
    parser.add_argument("--plot", metavar="FILE", help="save the loss curve as an image (extra: plot)")
    parser.add_argument(
        "--output-dir",
        metavar="DIR",
        help="keep the trained adapter and tokenizer here: a new or empty directory, written at the end "
        "(default: a temporary directory, removed)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the LoRA initialisation and the data order (default 0)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the summary as JSON on stdout (the narrative goes to stderr)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit 0 when it finished."""
    from xpukit.demo.run import run_demo

    result = run_demo(
        model=args.model,
        steps=args.steps,
        device=args.device,
        quantize=not args.no_quantize,
        learning_rate=args.lr,
        batch_size=args.batch_size,
        output_dir=args.output_dir,
        plot=args.plot,
        seed=args.seed,
        stream=sys.stderr if args.json else sys.stdout,
    )
    if args.json:
        emit_json(result.to_dict())
    else:
        print("\nSummary")
        print(result.render())
    return 0
