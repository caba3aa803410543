"""GGUF export: a loaded model, or a checkpoint (with an adapter merged first), to a file for
llama.cpp and Ollama.

:func:`export_gguf` writes a loaded transformers model; :func:`export_gguf_from_source` (``xpukit
export``) plans from the checkpoint's config and its tensors' shapes (a model built on the ``meta``
device: no weight is read), refuses what the plan refuses, then loads it (merging ``adapter`` as
``xpukit merge`` does, by the adapter's training record) and writes. OUT is a new folder that
receives ``<name>-<type>.gguf`` and, with ``ollama=True``, a ``Modelfile`` beside it. Everything is
written into a temporary sibling of OUT renamed into place when complete (:mod:`xpukit._partial`):
an error, SIGTERM or Ctrl-C leaves nothing behind, and what a killed export left is removed by the
next write into the same folder. docs/export.md says what is written and how it was checked.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from xpukit._compat import installed_version
from xpukit._partial import into_place, writing
from xpukit.errors import InvalidRequestError, MissingExtraError
from xpukit.planning.model.gguf_export import ExportFacts, GgufExportPlan, gguf_type, plan_gguf_export

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from xpukit.planning.loadplan import LoadPlan
    from xpukit.planning.request import DeviceArg, MergeArg

# A tokenizer, or the folder or Hub id of one.
TokenizerArg: TypeAlias = "PreTrainedTokenizerBase | str | os.PathLike[str]"

__all__ = ["GgufExport", "export_facts", "export_gguf", "export_gguf_from_source", "modelfile"]


@dataclass(frozen=True, kw_only=True)
class GgufExport:
    """What an export wrote.

    Attributes:
        out: the folder; ``file`` the ``.gguf`` in it; ``modelfile`` the Ollama Modelfile or ``None``.
        plan: the export plan (architecture, tensor types, tokenizer, estimated size).
        bytes: the file's size on disk; ``seconds`` the time the export took (loading included).
    """

    out: Path
    file: Path
    plan: GgufExportPlan = field(repr=False)
    bytes: int
    seconds: float
    modelfile: Path | None = None
    merge: LoadPlan | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, object]:
        """A JSON-able dict (``xpukit export --json``)."""
        return {
            "out": str(self.out),
            "file": str(self.file),
            "modelfile": str(self.modelfile) if self.modelfile else None,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 2),
            "plan": self.plan.to_dict(),
        }


def _require_gguf() -> None:
    if installed_version("gguf") is None:
        raise MissingExtraError("GGUF export", "gguf", "export")


def export_facts(model: PreTrainedModel, out: Path, tokenizer_dir: Path | None) -> ExportFacts:
    """The facts of a loaded (or ``meta``-device) model: config, tensor shapes, tokenizer, free disk."""
    config = model.config.to_dict()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors = {
        name: tuple(tensor.shape)
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    tokenizer_json = None
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").is_file():
        tokenizer_json = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    return ExportFacts(
        config=config,
        tensors=tensors,
        tokenizer_json=tokenizer_json,
        free_bytes=_free_bytes(out),
        out_exists=out.exists() and (not out.is_dir() or any(out.iterdir())),
        out=str(out),
    )


def export_gguf(
    model: PreTrainedModel,
    out: str | os.PathLike[str],
    *,
    type: str = "bf16",
    tokenizer: TokenizerArg | None = None,
    ollama: bool = False,
    name: str | None = None,
) -> GgufExport:
    """Write a loaded causal LM to ``out/<name>-<type>.gguf`` for llama.cpp and Ollama.

    Args:
        model: a transformers model of a family docs/export.md lists (a ``PeftModel``: merge it first).
        out: a new (or empty) folder.
        type: ``bf16``, ``f16``, ``q8_0`` or ``q4_0`` (k-quants: export bf16, then ``llama-quantize``).
        tokenizer: a tokenizer, or the folder or Hub id of one; default: the model's own
            (``model.name_or_path``).
        ollama: also write an Ollama ``Modelfile`` beside the file.
        name: the model's name in the file (default: OUT's folder name).

    Returns:
        A :class:`GgufExport` saying what was written.

    Raises:
        InvalidRequestError: a family, type or tokenizer the export cannot write, or OUT exists
            (docs/export.md); nothing is written.
        PlanError: too little free disk for the file; nothing is written.
        MissingExtraError: the ``gguf`` package is missing (``pip install "xpukit[export]"``).

    Example::

        from xpukit import export_gguf, load_for_xpu

        model = load_for_xpu("out/merged")
        export_gguf(model, "out/gguf", type="q8_0", ollama=True)
    """
    start = time.perf_counter()
    _require_gguf()
    if hasattr(model, "merge_and_unload"):
        raise InvalidRequestError(
            "export_gguf(model): the model carries LoRA adapters (a PeftModel). Fix: "
            "model = model.merge_and_unload() first, or `xpukit export BASE OUT --gguf --adapter ADAPTER`."
        )
    target = Path(out)
    with _tokenizer_folder(tokenizer if tokenizer is not None else model.name_or_path) as tokenizer_dir:
        plan = plan_gguf_export(export_facts(model, target, tokenizer_dir), type)
        assert tokenizer_dir is not None  # the plan refuses a model without a tokenizer
        return _write(model, plan, target, tokenizer_dir, name=name, ollama=ollama, start=start)


def export_gguf_from_source(
    source: str,
    out: str | os.PathLike[str],
    *,
    type: str = "bf16",
    adapter: str | None = None,
    ollama: bool = False,
    name: str | None = None,
    device: DeviceArg = None,
    merge: MergeArg = True,
    force: bool = False,
) -> GgufExport:
    """``xpukit export``: plan from SOURCE's config (no weight read), then load, merge and write.

    ``adapter`` is merged in the dtype its training record names, into the weights it records (as
    :func:`xpukit.loading.save_merged.save_merged` does); SOURCE alone loads in its own dtype.
    Raises what :func:`export_gguf` raises, and what ``load_for_xpu(..., lora=, merge=)`` refuses
    (an adapter that does not fit SOURCE) before any weight is read.
    """
    start = time.perf_counter()
    gguf_type(type)  # a bad type is refused before anything is read
    _require_gguf()
    target = Path(out)
    with _tokenizer_folder(adapter if _has_tokenizer(adapter) else source) as tokenizer_dir:
        plan = plan_gguf_export(export_facts(_meta_model(source), target, tokenizer_dir), type)
        assert tokenizer_dir is not None  # the plan refuses a model without a tokenizer
        from xpukit.loading.load import load_for_xpu
        from xpukit.loading.save_merged import checkpoint_dtype, merge_dtype

        if adapter is None:
            dtype, _ = checkpoint_dtype(source)
            model = load_for_xpu(source, dtype=dtype, device=device)
        else:
            dtype, _, _ = merge_dtype(None, source, adapter)
            model = load_for_xpu(source, lora=adapter, merge=merge, force=force, dtype=dtype, device=device)
        default = Path(source).name if Path(source).is_dir() else source.split("/")[-1]
        result = _write(model, plan, target, tokenizer_dir, name=name or default, ollama=ollama, start=start)
    return GgufExport(
        out=result.out,
        file=result.file,
        plan=plan,
        bytes=result.bytes,
        seconds=time.perf_counter() - start,
        modelfile=result.modelfile,
        merge=getattr(model, "xpukit_plan", None),
    )


def modelfile(gguf_name: str, eos_tokens: list[str]) -> str:
    """An Ollama Modelfile for the file beside it (docs/export.md "To Ollama")."""
    lines = [
        "# Written by xpukit export. Create the model with: ollama create NAME -f Modelfile",
        "# Ollama reads the chat template and the tokenizer from the GGUF file's metadata.",
        f"FROM ./{gguf_name}",
    ]
    lines += [f"PARAMETER stop {json.dumps(token)}" for token in eos_tokens]
    return "\n".join(lines) + "\n"


def _write(
    model: PreTrainedModel,
    plan: GgufExportPlan,
    target: Path,
    tokenizer_dir: Path,
    *,
    name: str | None,
    ollama: bool,
    start: float,
) -> GgufExport:
    from xpukit.loading.gguf_file import write_gguf

    title = name or target.name
    file_name = f"{_slug(title)}-{plan.type}.gguf"
    config = model.config.to_dict()
    with writing(target) as partial:  # removed on an error, SIGTERM or Ctrl-C; swept if killed
        write_gguf(partial / file_name, plan, config, _tensors(model, plan), tokenizer_dir, name=title)
        if ollama:
            (partial / "Modelfile").write_text(
                modelfile(file_name, _stop_tokens(tokenizer_dir)), encoding="utf-8"
            )
        into_place(partial, target)  # an empty target: the plan refused anything else
    file = target / file_name
    return GgufExport(
        out=target,
        file=file,
        plan=plan,
        bytes=file.stat().st_size,
        seconds=time.perf_counter() - start,
        modelfile=target / "Modelfile" if ollama else None,
    )


def _tensors(model: PreTrainedModel, plan: GgufExportPlan) -> Iterator[tuple[str, torch.Tensor]]:
    for tensor_name, tensor in model.state_dict().items():
        if tensor_name in plan.tensor_types:
            yield tensor_name, tensor


def _meta_model(source: str) -> PreTrainedModel:
    """SOURCE's model built on the ``meta`` device from its config: names and shapes, no weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from xpukit.planning.model.reference_models import BUILTIN_SHAPES
    from xpukit.sources.model_config import read_config

    config = read_config(source, {}, shapes=BUILTIN_SHAPES).config
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _has_tokenizer(folder: str | None) -> bool:
    return folder is not None and (Path(folder) / "tokenizer.json").is_file()


@contextmanager
def _tokenizer_folder(tokenizer: TokenizerArg | None) -> Iterator[Path | None]:
    """A folder holding the tokenizer's files: the one given, or one it is saved to for the export."""
    if isinstance(tokenizer, str | os.PathLike) and (Path(tokenizer) / "tokenizer.json").is_file():
        yield Path(tokenizer)
        return
    with tempfile.TemporaryDirectory(prefix="xpukit-tokenizer-") as scratch:
        if isinstance(tokenizer, str | os.PathLike):
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(os.fspath(tokenizer))
            except (OSError, ValueError):
                yield None  # the plan refuses: no tokenizer
                return
        if tokenizer is None or not hasattr(tokenizer, "save_pretrained"):
            yield None
            return
        tokenizer.save_pretrained(scratch)
        yield Path(scratch)


def _stop_tokens(tokenizer_dir: Path) -> list[str]:
    """The tokens that end a turn: the tokenizer's eos, and ``<|im_end|>`` / ``<end_of_turn>`` /
    ``<|eot_id|>`` where the vocabulary has them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = tokenizer.get_vocab()
    found = [tokenizer.eos_token] if tokenizer.eos_token else []
    found += [t for t in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>") if t in vocab and t not in found]
    return found


def _free_bytes(out: Path) -> int | None:
    here = out.resolve()
    while not here.exists() and here != here.parent:
        here = here.parent
    try:
        return int(shutil.disk_usage(here).free)
    except OSError:
        return None


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"
