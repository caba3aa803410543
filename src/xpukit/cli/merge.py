"""``xpukit merge``: a LoRA adapter merged into its base, written as a full safetensors checkpoint."""

from __future__ import annotations

import argparse
import textwrap
import time
from typing import TYPE_CHECKING

from xpukit.cli.output import emit_json

if TYPE_CHECKING:
    from xpukit.loading.save_merged import MergeResult


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the ``merge`` subcommand."""
    parser = sub.add_parser(
        "merge",
        help="merge a trained LoRA adapter into its base and write the merged model",
        description="Merge the LoRA adapter in ADAPTER (written by PeftModel.save_pretrained) into the "
        "full-precision weights of BASE and write a plain transformers checkpoint to OUT: safetensors "
        "weights in the dtype the adapter was trained in, as its xpukit_base.json records (without one, "
        "the base checkpoint's own dtype; --dtype overrides both), config.json, generation_config.json, "
        "and the tokenizer (ADAPTER's when it has one, else BASE's). The adapter is merged into the base "
        "as it trained against it: an adapter xpukit trained carries a record of how its base was held "
        "(xpukit_base.json), and the merge follows it; without one, into the base as 4-bit training "
        "saw it (quantised to nf4 and dequantised), which reproduces a QLoRA-trained model, with a "
        "warning naming --into original, which merges into the checkpoint's own weights (for an adapter "
        "trained on the full-precision base). Never into 4-bit weights. The merge runs on the device when "
        "the model fits there, else on the CPU; --explain prints the plan that says which and why. "
        "Prints a short summary; other libraries' messages and progress bars only with --verbose.",
        epilog="Examples:\n"
        "  xpukit merge Qwen/Qwen3-8B out/adapter out/merged\n"
        "  xpukit merge ./base ./adapter ./merged --dtype bfloat16 --device cpu\n"
        "  xpukit merge ./base ./lora-adapter ./merged --into original --json\n"
        "  xpukit merge Qwen/Qwen3-8B out/adapter out/merged-int4 --quantize int4 --for xpu\n"
        "  xpukit merge ./base ./adapter ./merged --explain --verbose",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("base", metavar="BASE", help="the base model's directory or Hub id")
    parser.add_argument("adapter", metavar="ADAPTER", help="the trained adapter's directory")
    parser.add_argument("out", metavar="OUT", help="a new (or empty) directory for the merged model")
    parser.add_argument(
        "--dtype",
        help="bfloat16, float16 or float32 (default: the dtype the adapter was trained in, as its "
        "xpukit_base.json records, so OUT is the trained model; without one, the base checkpoint's own)",
    )
    parser.add_argument("--device", help="xpu, xpu:1, cuda, mps or cpu (default: by fit, else the CPU)")
    parser.add_argument(
        "--into",
        choices=("dequantized", "original"),
        help="the weights to merge into: the dequantised 4-bit base (for QLoRA adapters) or the "
        "original weights (for adapters trained on the full-precision base); default: as the adapter's "
        "xpukit_base.json records, else dequantized, with a warning",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="merge even when the adapter's tensors do not all fit BASE (it was trained on another "
        "base); the plan lists what does not fit",
    )
    parser.add_argument(
        "--quantize",
        choices=("int4", "int8", "4bit", "8bit"),
        help="write OUT quantized: torchao's int4/int8 weights in safetensors, in the format the device "
        "family of --for runs, which load_for_xpu(OUT) and from_pretrained load without quantizing again "
        "(int4 for the CPU has no on-disk format: full precision, quantized at each load)",
    )
    parser.add_argument(
        "--for",
        dest="for_family",
        choices=("cuda", "xpu", "cpu"),
        help="the device family the quantized checkpoint is for (int4: tile-packed for cuda, plain_int32 "
        "for xpu, each written on such a device; int8 loads on every family); default: this machine's",
    )
    parser.add_argument("--json", action="store_true", help="print what was done as JSON")
    parser.add_argument(
        "--explain", action="store_true", help="print the whole plan (every decision and its reasons) first"
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,  # `xpukit --verbose merge …` stays on
        help="also show other libraries' messages and progress bars (as `xpukit --verbose merge`)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Merge, write OUT, print a summary (the plan with --explain; JSON with --json); bad input exits 1."""
    from xpukit.cli.logs import library_output, plan_warnings_printed
    from xpukit.loading.save_merged import save_merged

    verbose = bool(getattr(args, "verbose", False))
    with plan_warnings_printed(verbose), library_output(verbose):
        result = save_merged(
            args.base,
            args.adapter,
            args.out,
            dtype=args.dtype,
            device=args.device,
            merge=args.into or True,
            force=args.force,
            quantize=args.quantize,
            for_family=args.for_family,
        )
    args.completed = True  # OUT is complete: a Ctrl-C from here on does not make the exit code 130
    if args.json:
        emit_json(result.to_dict())
        return 0
    if args.explain:
        print(result.plan.explain(), end="\n\n")
    wall = time.perf_counter() - args.started if hasattr(args, "started") else None
    print("\n".join(summary(result, args.base, wall=wall)))
    return 0


def summary(result: MergeResult, base: str, *, wall: float | None = None) -> list[str]:
    """What ``xpukit merge`` prints without ``--explain``: warnings first, then what was merged into
    what, where it was written, the dtype and the time."""
    from xpukit.planning.training.base_record import RECORD_FILE

    lines = []
    for warning in result.plan.warnings:
        lines += textwrap.wrap(
            warning, 100, initial_indent="warning: ", subsequent_indent="  ", break_on_hyphens=False
        )
    merge = result.plan.merge
    assert merge is not None  # a merge's plan has its merge
    into = "the dequantised 4-bit base" if merge.base == "dequantized" else "the original weights"
    why = {"record": f"as its {RECORD_FILE} says", "asked": f"--into {merge.base}", "default": "the default"}
    tokenizer = (
        f"the tokenizer from {result.tokenizer_from}" if result.tokenizer_from else "no tokenizer found"
    )
    said = [
        f"merged {merge.adapter} into {into} of {base} ({why.get(merge.base_from, merge.base_from)}), on "
        f"{merge.device}",
        f"dtype {result.dtype}: {result.dtype_reason}",
        f"wrote {result.out}: {', '.join(result.files)}; {tokenizer}",
        f"took {wall if wall is not None else result.seconds:.1f} s; --explain prints the plan",
    ]
    quantized = result.quantized
    if quantized is not None and quantized["on_disk"]:
        said.insert(
            3,
            f"quantized on disk: {quantized['format']} for {quantized['for']} (loads on "
            f"{', '.join(quantized['runs_on'])}), loaded as it is by load_for_xpu and from_pretrained",
        )
    elif quantized is not None:
        said.insert(
            3,
            f"loads quantized: load_for_xpu({str(result.out)!r}) takes quantize={result.quantize!r}; "
            f"{quantized['reason']}",
        )
    for line in said:
        lines += textwrap.wrap(
            line, 100, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False
        )
    return lines
