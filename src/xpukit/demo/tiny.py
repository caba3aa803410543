"""Tiny, randomly initialised causal language models, built offline in about a second.

They stand in for real checkpoints wherever no network (or no time) is available: the test suite
loads, quantises and fine-tunes them, and ``xpukit demo`` runs the whole job on one. Each is built
from the architecture's real config and model classes, so ``from_pretrained``, the planner and peft
see exactly the structure (GQA, tied embeddings, fused projections, sliding windows) that the full
size model has, only a few hundred thousand parameters of it.

The tokenizer is a byte-level BPE trained on the bundled corpus (``xpukit/demo/data/corpus.txt``) with
`tokenizers`; it is trained once per process and saved next to every model, so
``AutoTokenizer.from_pretrained(path)`` works without the Hub.

Example::

    from xpukit.demo.tiny import build_tiny_model, demo_model_dir

    path = build_tiny_model("llama", "/tmp/tiny-llama")   # any of ARCHITECTURES
    demo = demo_model_dir()                                 # built once, then reused from the cache
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from xpukit import _environ, _platform, _quiet
from xpukit._partial import partial_path, writing
from xpukit.errors import InvalidRequestError
from xpukit.planning.model.families import FAMILIES, TinyShape

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "ARCHITECTURES",
    "DEMO_ARCHITECTURE",
    "DEMO_CONFIG",
    "DEMO_PROMPTS",
    "TinyArchitecture",
    "build_tiny_model",
    "corpus_lines",
    "demo_model_dir",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyArchitecture:
    """How to build one tiny model: the transformers classes and the config's tiny sizes.

    Token ids (bos/eos/pad) are not listed: they come from the shared tokenizer.
    """

    config_class: str  # name in the `transformers` namespace
    model_class: str
    config: Mapping[str, Any]


# Ten times the usual initializer_range (0.02). With 0.02 the (tied) embeddings are so short that no
# logit can rise much above the rest, and LoRA, which cannot touch embeddings or norms, barely moves the
# loss of a random model (6.98 -> 6.65 in 20 steps); with 0.2 it falls to ~5.5, and the demo model's
# to ~1.3 in 60 steps.
_INIT_RANGE = 0.2

# Sizes shared by the decoder-only families: 4 query heads over 2 KV heads (GQA), head_dim 16 so SDPA
# takes its fast path, and a vocabulary that holds the 1000-token tokenizer with room to spare.
_DECODER = {
    "initializer_range": _INIT_RANGE,
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def _tiny_architecture(shape: TinyShape) -> TinyArchitecture:
    base = _DECODER if shape.decoder else {"initializer_range": _INIT_RANGE}
    return TinyArchitecture(
        config_class=shape.config_class, model_class=shape.model_class, config={**base, **shape.config}
    )


# The family of the embedded demo model.
DEMO_ARCHITECTURE = "qwen3"
# One per family of xpukit.planning.model.families that has a tiny shape, the demo's family first.
_TINY_SHAPES = sorted(
    (f.tiny for f in FAMILIES.values() if f.tiny is not None), key=lambda t: t.name != DEMO_ARCHITECTURE
)
ARCHITECTURES: Mapping[str, TinyArchitecture] = MappingProxyType(
    {t.name: _tiny_architecture(t) for t in _TINY_SHAPES}
)

# The embedded default for `xpukit demo` (DEMO_ARCHITECTURE, above): Qwen3-style, larger than the test
# models so that a short fine-tune visibly changes what it generates, still under a million parameters.
DEMO_CONFIG: Mapping[str, Any] = MappingProxyType(
    {
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    }
)
_DEMO_SEED = 0
# Prompts whose continuations in the corpus are easy to recognise after fine-tuning.
DEMO_PROMPTS = ("The baker", "In the morning", "When the bell rings")

_TOKENIZER_VOCAB = 1000
_EOS = "<|endoftext|>"
_SPECIAL_TOKENS = (_EOS, "<|im_start|>", "<|im_end|>")
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Bump when the build code changes what it writes, so cached demo models are rebuilt.
_BUILD_FORMAT = 1
_MARKER = "xpukit-build.json"  # written last, before the directory is published: its presence = complete

# Model construction draws from torch's global RNG; the lock keeps concurrent builds in one process
# from interleaving their seeded draws.
_BUILD_LOCK = threading.Lock()


def corpus_lines() -> list[str]:
    """The bundled training text, one sentence per line (blank lines dropped).

    Returns:
        About seventy short English sentences about a harbour town, with patterns a tiny model picks
        up within a few dozen training steps.
    """
    text = resources.files("xpukit.demo").joinpath("data", "corpus.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def build_tiny_model(
    arch: str,
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    **config_overrides: Any,  # a transformers config's fields, of the types that config takes
) -> Path:
    """Build a tiny randomly initialised model with its tokenizer and save both to ``out_dir``.

    Args:
        arch: one of :data:`ARCHITECTURES` (``"qwen3"``, ``"llama"``, ``"mistral"``, ``"gemma"``,
            ``"phi3"``, ``"gpt2"``, ``"granite"``).
        out_dir: directory to write (created if missing); gets ``config.json``,
            ``generation_config.json``, ``model.safetensors`` and the tokenizer files.
        seed: seed of the random weights; the same seed gives the same weights.
        **config_overrides: config fields that replace the tiny defaults, e.g. ``num_hidden_layers=4``.

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`, loadable with ``AutoModelForCausalLM.from_pretrained``
        and ``AutoTokenizer.from_pretrained`` offline.

    Raises:
        InvalidRequestError: ``arch`` is unknown, or the overrides make an invalid config.
    """
    spec = _architecture(arch)
    import torch
    import transformers
    from huggingface_hub.errors import StrictDataclassError

    tokenizer = _hf_tokenizer()
    token_ids = {
        "bos_token_id": tokenizer.eos_token_id,  # byte-level BPE has no separate BOS; Qwen does the same
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    kwargs = {**spec.config, **token_ids, **config_overrides}
    if kwargs["vocab_size"] < len(tokenizer):
        raise InvalidRequestError(
            f"build_tiny_model({arch!r}, vocab_size={kwargs['vocab_size']}): the tokenizer has "
            f"{len(tokenizer)} tokens, so vocab_size must be at least {len(tokenizer)}."
        )
    try:
        config = getattr(transformers, spec.config_class)(**kwargs)
    except (TypeError, ValueError, StrictDataclassError) as exc:
        raise InvalidRequestError(
            f"build_tiny_model({arch!r}) with overrides {config_overrides}: {spec.config_class} "
            f"rejected them: {exc}"
        ) from exc
    model_class = getattr(transformers, spec.model_class)
    # fork_rng restores the caller's RNG state afterwards: building a model must not reseed the caller.
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model.generation_config = transformers.GenerationConfig(**token_ids)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _quiet.quiet_load():  # no "Writing model shards" bar for a model of a few MB
        model.save_pretrained(out)  # safetensors by default
    tokenizer.save_pretrained(out)
    return out


def demo_model_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The embedded demo model (tiny Qwen3-style), built on first use and then reused from the cache.

    The directory name carries a hash of everything that shapes the model (config, seed, tokenizer
    settings, corpus, build format), so a changed recipe gets a fresh directory. A build is written to
    a temporary sibling and renamed into place only when complete, so an interrupted build or two
    concurrent runs never leave a half-written model where a finished one is expected.

    Args:
        cache_dir: xpukit's cache root; default ``$XPUKIT_CACHE_DIR``, else the user cache directory
            (``platformdirs.user_cache_dir("xpukit")``). The model lives under ``<root>/models/``.

    Returns:
        The model directory (config, safetensors weights, tokenizer).
    """
    root = _cache_root(cache_dir) / "models"
    key = _demo_key()
    final = root / f"tiny-{DEMO_ARCHITECTURE}-demo-{key}"
    if _is_complete(final, key):
        return final

    started = time.perf_counter()
    # The partial folder is removed unless published (another run may have published first); the
    # libraries' import messages are collected, as in every xpukit call.
    with _quiet.quiet_imports(), writing(final) as partial:
        build_tiny_model(DEMO_ARCHITECTURE, partial, seed=_DEMO_SEED, **DEMO_CONFIG)
        _write_marker(partial, key)
        _publish(partial, final, key)
    logger.info("built the demo model in %s (%.2f s)", final, time.perf_counter() - started)
    return final


# --- helpers -------------------------------------------------------------------------------------


def _architecture(arch: str) -> TinyArchitecture:
    try:
        return ARCHITECTURES[arch]
    except (KeyError, TypeError):
        raise InvalidRequestError(
            f"Unknown tiny-model architecture {arch!r}; valid choices: {', '.join(ARCHITECTURES)}."
        ) from None


@functools.cache
def _tokenizer_json() -> str:
    """Train the byte-level BPE tokenizer on the corpus (once per process) and serialise it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=_TOKENIZER_VOCAB,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    serialized: str = tokenizer.to_str()
    return serialized


def _hf_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        eos_token=_EOS,
        pad_token=_EOS,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=list(_SPECIAL_TOKENS[1:]),
        model_max_length=512,
        chat_template=_CHAT_TEMPLATE,
    )


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    from_env = _environ.get("XPUKIT_CACHE_DIR")
    if from_env:
        return Path(from_env).expanduser()
    return _platform.cache_dir()


def _demo_key() -> str:
    """A short hash of everything that shapes the demo model."""
    corpus = resources.files("xpukit.demo").joinpath("data", "corpus.txt").read_bytes()
    recipe = {
        "format": _BUILD_FORMAT,
        "architecture": DEMO_ARCHITECTURE,
        "config": {**ARCHITECTURES[DEMO_ARCHITECTURE].config, **DEMO_CONFIG},
        "seed": _DEMO_SEED,
        "tokenizer": [_TOKENIZER_VOCAB, _SPECIAL_TOKENS, _CHAT_TEMPLATE],
        "corpus": hashlib.sha256(corpus).hexdigest(),
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _write_marker(directory: Path, key: str) -> None:
    from xpukit._compat import installed_version

    marker = {
        "key": key,
        "architecture": DEMO_ARCHITECTURE,
        "config": dict(DEMO_CONFIG),
        "seed": _DEMO_SEED,
        "transformers": installed_version("transformers"),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (directory / _MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")


def _is_complete(directory: Path, key: str) -> bool:
    """A published build: its marker names this key and the files the marker vouches for are there."""
    try:
        marker = json.loads((directory / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    files = ("config.json", "model.safetensors", "tokenizer.json")
    return (
        isinstance(marker, dict)
        and marker.get("key") == key
        and all((directory / name).is_file() for name in files)
    )


def _publish(partial: Path, final: Path, key: str) -> None:
    """Rename the finished build into place; a complete build already there wins, a broken one goes."""
    for _ in range(3):
        try:
            os.rename(partial, final)  # atomic; fails when `final` is a non-empty directory
            return
        except OSError:
            if _is_complete(final, key):
                return  # another run finished first; the caller removes our copy
        # An incomplete directory blocks the name (copied by hand, or written by a non-atomic tool):
        # move it aside rather than delete in place, so a reader never sees it half-removed.
        aside = partial_path(final)  # swept by a later build if this process is killed meanwhile
        with contextlib.suppress(FileNotFoundError):
            os.rename(final, aside)
        shutil.rmtree(aside, ignore_errors=True)
    raise OSError(f"could not publish the demo model at {final}; remove that directory and retry")
