"""``xpukit export``: a model (an adapter merged first) written as a GGUF file for llama.cpp and Ollama,
or its weights quantized once by torchao for a device family (``--quantize``)."""

from __future__ import annotations

import argparse

from xpukit.cli.output import emit_json


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the ``export`` subcommand."""
    parser = sub.add_parser(
        "export",
        help="write a model (an adapter merged first) as a GGUF file for llama.cpp and Ollama, or "
        "quantized once for a device family",
        description="Write SOURCE (a model folder or Hub id) to the new folder OUT as one GGUF file, "
        "OUT/<name>-<type>.gguf, with its tokenizer, special tokens and chat template in the file's "
        "metadata, for llama.cpp (its SYCL backend runs it on Intel GPUs) and Ollama. Families: Llama, "
        "Mistral, Qwen2, Qwen3, Gemma 3. Everything that can be refused is refused before any weight is "
        "read: another family, a type the gguf package cannot write (k-quants: the message gives the "
        "llama-quantize / ollama command), an existing OUT, too little disk, an adapter that does not fit "
        "SOURCE. With --adapter, the adapter is merged first as `xpukit merge` does (by its training "
        "record). With --ollama, a Modelfile beside the file. With --quantize instead of --gguf, SOURCE's "
        "weights are quantized once by torchao, in the format a quantized load on the --for family takes, "
        "and written to OUT with the tokenizer: load_for_xpu(OUT) then loads them without quantizing "
        "(an adapter: xpukit merge --quantize). Nothing is left half-written.",
        epilog="Examples:\n"
        "  xpukit export out/merged out/gguf --gguf\n"
        "  xpukit export Qwen/Qwen3-8B out/gguf --gguf --adapter out/adapter --type q8_0 --ollama\n"
        "  xpukit export ./model ./gguf --gguf --type q4_0 --json\n"
        "  xpukit export Qwen/Qwen3-8B out/int4-xpu --quantize int4 --for xpu\n"
        "Then: llama-cli -m out/gguf/merged-bf16.gguf   or   ollama create mymodel -f out/gguf/Modelfile",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", metavar="SOURCE", help="the model's folder or Hub id")
    parser.add_argument("out", metavar="OUT", help="a new (or empty) folder for the .gguf file")
    written = parser.add_mutually_exclusive_group(required=True)
    written.add_argument("--gguf", action="store_true", help="write one GGUF file")
    written.add_argument(
        "--quantize",
        choices=("int4", "int8", "4bit", "8bit"),
        help="write SOURCE's weights quantized by torchao for the --for family (safetensors), loaded "
        "without quantizing again (int4 for the CPU has no on-disk format: refused)",
    )
    parser.add_argument(
        "--for",
        dest="for_family",
        choices=("cuda", "xpu", "cpu"),
        help="with --quantize: the device family (int4: tile-packed for cuda, plain_int32 for xpu, each "
        "written on such a device; int8 loads on every family); default: this machine's",
    )
    parser.add_argument("--dtype", help="with --quantize: bfloat16 or float16; default: the checkpoint's own")
    parser.add_argument(
        "--type",
        default="bf16",
        help="bf16 (default), f16, q8_0 or q4_0; k-quants (q4_k_m…) are refused with the command that "
        "makes them from a bf16 export",
    )
    parser.add_argument("--adapter", metavar="DIR", help="a LoRA adapter merged into SOURCE first")
    parser.add_argument(
        "--ollama", action="store_true", help="also write an Ollama Modelfile beside the file"
    )
    parser.add_argument("--name", help="the model's name in the file (default: SOURCE's folder name)")
    parser.add_argument("--device", help="where to merge: xpu, cuda, mps or cpu (default: by fit)")
    parser.add_argument(
        "--into",
        choices=("dequantized", "original"),
        help="with --adapter: the weights to merge into (as `xpukit merge --into`); default: by its record",
    )
    parser.add_argument("--force", action="store_true", help="with --adapter: as `xpukit merge --force`")
    parser.add_argument("--json", action="store_true", help="print what was written as JSON")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="also show other libraries' messages and progress bars",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Plan, load (merge), write OUT and print a summary; bad input exits 1 with nothing written."""
    from xpukit.cli.logs import library_output, plan_warnings_printed
    from xpukit.loading.gguf_export import export_gguf_from_source

    verbose = bool(getattr(args, "verbose", False))
    if args.quantize:
        return _quantized(args, verbose)
    with plan_warnings_printed(verbose), library_output(verbose):
        result = export_gguf_from_source(
            args.source,
            args.out,
            type=args.type,
            adapter=args.adapter,
            ollama=args.ollama,
            name=args.name,
            device=args.device,
            merge=args.into or True,
            force=args.force,
        )
    if args.json:
        emit_json(result.to_dict())
        return 0
    plan = result.plan
    merged = f" with {args.adapter} merged" if args.adapter else ""
    arch = f"llama.cpp's {plan.family.arch!r} architecture ({plan.family.label})"
    print(f"exported {args.source}{merged} as {arch}")
    print(f"wrote {result.file} ({result.bytes / 2**20:.1f} MiB, {plan.type}) in {result.seconds:.1f} s")
    if result.modelfile is not None:
        print(f"wrote {result.modelfile}: ollama create NAME -f {result.modelfile}")
    for note in plan.notes:
        print(f"note: {note}")
    return 0


def _quantized(args: argparse.Namespace, verbose: bool) -> int:
    """``--quantize``: SOURCE's weights quantized once and written (no adapter: that is a merge)."""
    from xpukit.cli.logs import library_output, plan_warnings_printed
    from xpukit.errors import InvalidRequestError
    from xpukit.loading.save_quantized import save_quantized

    given = [flag for flag, value in (("--adapter", args.adapter), ("--ollama", args.ollama)) if value]
    if given or args.type != "bf16":
        given += ["--type"] if args.type != "bf16" else []
        raise InvalidRequestError(
            f"export --quantize with {', '.join(given)}: those are GGUF's. Fix: leave them out, or with an "
            f"adapter run xpukit merge {args.source} ADAPTER {args.out} --quantize {args.quantize}."
        )
    with plan_warnings_printed(verbose), library_output(verbose):
        result = save_quantized(
            args.source, args.out, quantize=args.quantize, for_family=args.for_family, dtype=args.dtype
        )
    if args.json:
        emit_json(result.to_dict())
        return 0
    quantized = result.quantized
    assert quantized is not None  # a quantized write
    print(f"quantized {args.source} ({result.dtype}: {result.dtype_reason}) as {quantized['format']}")
    print(
        f"wrote {result.out} for {quantized['for']} (loads on {', '.join(quantized['runs_on'])}) "
        f"in {result.seconds:.1f} s: load_for_xpu({str(result.out)!r}) loads it without quantizing"
    )
    for note in result.notes:
        print(f"note: {note}")
    return 0
