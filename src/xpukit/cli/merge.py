"""``xpukit merge``: a LoRA adapter merged into its base, written as a full safetensors checkpoint."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any


def add_parser(sub: Any) -> None:
    """Register the ``merge`` subcommand."""
    parser = sub.add_parser(
        "merge",
        help="merge a trained LoRA adapter into its base and write the merged model",
        description="Merge the LoRA adapter in ADAPTER (written by PeftModel.save_pretrained) into the "
        "full-precision weights of BASE and write a plain transformers checkpoint to OUT: safetensors "
        "weights in the base checkpoint's own dtype (or --dtype), config.json, generation_config.json, "
        "and the tokenizer (ADAPTER's when it has one, else BASE's). By default the adapter is merged "
        "into the base as 4-bit training saw it (quantised to nf4 and dequantised), which reproduces a "
        "QLoRA-trained model; --into original merges into the checkpoint's own weights, for an adapter "
        "trained on the full-precision base. Never into 4-bit weights. The merge runs on the device "
        "when the model fits there, else on the CPU; the plan says which and why.",
        epilog="Examples:\n"
        "  xpukit merge Qwen/Qwen3-8B out/adapter out/merged\n"
        "  xpukit merge ./base ./adapter ./merged --dtype bfloat16 --device cpu\n"
        "  xpukit merge ./base ./lora-adapter ./merged --into original --json\n"
        "  xpukit merge Qwen/Qwen3-8B out/adapter out/merged-int4 --quantize int4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("base", metavar="BASE", help="the base model's directory or Hub id")
    parser.add_argument("adapter", metavar="ADAPTER", help="the trained adapter's directory")
    parser.add_argument("out", metavar="OUT", help="a new (or empty) directory for the merged model")
    parser.add_argument(
        "--dtype", help="bfloat16, float16 or float32 (default: the base checkpoint's own dtype)"
    )
    parser.add_argument("--device", help="xpu, xpu:1, cuda, mps or cpu (default: by fit, else the CPU)")
    parser.add_argument(
        "--into",
        choices=("dequantized", "original"),
        help="the weights to merge into: the dequantised 4-bit base (default, for QLoRA adapters) or "
        "the original weights (for adapters trained on the full-precision base)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="merge even when the adapter's tensors do not all fit BASE (it was trained on another "
        "base); the plan lists what does not fit",
    )
    parser.add_argument(
        "--quantize",
        choices=("int4", "int8"),
        help="record in OUT that it loads quantized: load_for_xpu(OUT) then quantizes the full-precision "
        "weights to the device's fastest int4/int8 format as they load (quantize='none' opts out)",
    )
    parser.add_argument("--json", action="store_true", help="print what was done as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Merge, write OUT, print the plan and the files (or their JSON); bad input exits 1."""
    from xpukit.loading.save_merged import save_merged

    if not getattr(args, "verbose", False):
        # The plan's warnings are part of what is printed; do not log them a second time.
        logging.getLogger("xpukit.planning.plan").setLevel(logging.ERROR)
    result = save_merged(
        args.base,
        args.adapter,
        args.out,
        dtype=args.dtype,
        device=args.device,
        merge=args.into or True,
        force=args.force,
        quantize=args.quantize,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    print(result.plan.explain())
    print()
    print(f"dtype: {result.dtype} ({result.dtype_reason})")
    tokenizer = (
        f"the tokenizer from {result.tokenizer_from}"
        if result.tokenizer_from
        else "no tokenizer (none found)"
    )
    print(f"wrote {result.out}: {', '.join(result.files)}; {tokenizer}")
    if result.quantize is not None:
        print(f"loads quantized: load_for_xpu({str(result.out)!r}) takes quantize={result.quantize!r}")
    return 0
