"""GGUF export, proven by an independent reader: transformers' GGUF loader reads each exported tiny
model back (dequantizing with the gguf package) and must give the merged model's logits, token ids
and chat template. The plan's refusals are tested with hand-made facts; a killed export leaves
nothing half-written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from xpukit.errors import InvalidRequestError, PlanError
from xpukit.planning.model.gguf_export import ExportFacts, plan_gguf_export

pytest.importorskip("gguf")

# Shapes transformers' GGUF reader rebuilds: it takes qwen3's and gemma3's head_dim from its config
# defaults (128, 256; the released models' values), not from the file; llama.cpp's Gemma 3 makes every
# 6th layer global (docs/export.md "Gemma 3").
FAMILIES: Mapping[str, dict[str, Any]] = {
    "qwen3": {"head_dim": 128},
    "qwen2": {},
    "llama": {},
    "mistral": {},
    "gemma": {"num_hidden_layers": 6, "layer_types": None, "head_dim": 256, "query_pre_attn_scalar": 256},
}
TEXT = "The harbour at dawn: Привет, мир! 你好，世界。 Ελληνικά, café naïve, 12345 — ok? <|im_start|>user\n"
MESSAGES = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!"}]


@pytest.fixture(scope="module")
def bf16_sources(
    export_tiny_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Each family's tiny model saved in bfloat16 (as a merged fine-tune is), with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("gguf-sources")
    out = {}
    for family, overrides in FAMILIES.items():
        built = export_tiny_factory(family, **overrides)
        target = root / f"tiny-{family}"
        AutoModelForCausalLM.from_pretrained(built, dtype=torch.bfloat16).save_pretrained(target)
        AutoTokenizer.from_pretrained(built).save_pretrained(target)
        out[family] = target
    return out


def _read_back(result: Any) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = result.file.name
    model = AutoModelForCausalLM.from_pretrained(result.out, gguf_file=name, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(result.out, gguf_file=name)


def _logits(model: Any, ids: list[int]) -> Any:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _corpus_ids(tokenizer: Any) -> list[int]:
    from xpukit.demo.tiny import corpus_lines

    return list(tokenizer(" ".join(corpus_lines()[:12])).input_ids[:400])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_export_reads_back_identical(family: str, bf16_sources: dict[str, Path], tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xpukit.loading.gguf_export import export_gguf_from_source

    source = bf16_sources[family]
    result = export_gguf_from_source(str(source), tmp_path / "gguf", type="bf16")
    model, tokenizer = _read_back(result)
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    original = AutoTokenizer.from_pretrained(source)
    ids = original(TEXT).input_ids
    assert tokenizer(TEXT).input_ids == ids  # the same ids on a multilingual text, special token included
    assert len(ids) > 40
    assert torch.equal(_logits(model, ids), _logits(reference, ids))  # bf16 weights: exact
    assert tokenizer.chat_template == original.chat_template
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False) == original.apply_chat_template(
        MESSAGES, tokenize=False
    )
    assert result.bytes <= result.plan.estimated_bytes


# Argmax agreement over 180 positions of the corpus, measured on these random-weight tiny models
# (docs/export.md "Size and agreement": q8_0 0.939-0.972, q4_0 0.339-0.728), less a margin for another
# CPU's rounding at near-ties: random weights give near-flat logits, so these are floors of the
# tiny models, not of a trained one.
FLOORS = {"f16": 1.0, "q8_0": 0.90, "q4_0": 0.25}


# Every family and type on a model with real margins: the tiny model trained 100 steps on the bundled
# corpus (trained_tiny: windows of 128 tokens at random offsets), compared over 2048 positions: windows
# of 128 tokens (the length trained) every 64 tokens of the corpus, every position counted. Measured on
# the CPU (2026-12-05, docs/export.md "Size and agreement"): q8_0 99.76-100 %, q4_0 97.46-99.12 %,
# f16 identical; every position q8_0 flips is a near-tie (top two logits within 0.2), every one at
# least 0.5 apart agrees. The floors leave room for another CPU's training to land elsewhere
# (q8_0: 20 flips allowed, at most 5 measured; no flip where the top two lead by NEAR_TIE, twice the
# largest logit difference q8_0 measured, 0.53, so that only a real error fails it).
TRAINED_FLOORS = {"f16": 1.0, "q8_0": 0.99, "q4_0": 0.95}
NEAR_TIE = 1.1
TRAINED_WINDOW = 128  # trained_tiny's windows (tests/loading/conftest.py)
# Each family's trained model: its FAMILIES shape, cheaper to train where the exporter writes nothing
# differently: Qwen3 with 2 query heads over 1, Gemma 3 with one head and 2 layers (both sliding, as
# llama.cpp's pattern makes every layer before the 6th; the window as long as the windows compared).
# Mistral from another seed: the same seed would give the Llama's weights again.
TRAINED: Mapping[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"seed": 1},
    "qwen2": {},
    "qwen3": {**FAMILIES["qwen3"], "num_attention_heads": 2, "num_key_value_heads": 1},
    "gemma": {
        **FAMILIES["gemma"],
        "num_hidden_layers": 2,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "sliding_window": TRAINED_WINDOW,
    },
}


@pytest.mark.parametrize("family", sorted(TRAINED))
def test_types_agree_on_a_trained_model(family: str, trained_tiny: Any, tmp_path: Path) -> None:
    """Every type of one family in one test: its model trains once per worker, whichever worker runs it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xpukit.demo.tiny import corpus_lines
    from xpukit.loading.gguf_export import export_gguf_from_source

    source = trained_tiny(family, **TRAINED[family])
    ids = AutoTokenizer.from_pretrained(source)(" ".join(corpus_lines())).input_ids
    step = TRAINED_WINDOW // 2
    windows = [ids[i : i + TRAINED_WINDOW] for i in range(0, len(ids) - TRAINED_WINDOW + 1, step)]

    def logits(model: Any) -> Any:
        return torch.cat([_logits(model, window) for window in windows])

    want = logits(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32))
    top = want.topk(2, -1).values
    gap = top[:, 0] - top[:, 1]
    assert len(want) == 2048 and gap.median() > 2.0  # trained: the top token leads by far
    agreements: dict[str, float] = {}
    for kind in TRAINED_FLOORS:
        model, _ = _read_back(export_gguf_from_source(str(source), tmp_path / kind, type=kind))
        got = logits(model)
        same = want.argmax(-1) == got.argmax(-1)
        agreements[kind] = same.float().mean().item()
        if kind == "f16":  # bf16 values are exact in f16 unless out of its range
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
        elif kind == "q8_0":
            assert (gap[~same] < NEAR_TIE).all(), f"{family} q8_0 flips a position {NEAR_TIE}+ apart"
    low = {k: f"{a:.4f}" for k, a in agreements.items() if a < TRAINED_FLOORS[k]}
    assert not low, f"{family} (trained): argmax agreement {low} below {TRAINED_FLOORS}"


@pytest.mark.parametrize("kind", sorted(FLOORS))
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_quantized_types_agree_with_the_model(
    family: str, kind: str, bf16_sources: dict[str, Path], tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xpukit.loading.gguf_export import export_gguf_from_source

    source = bf16_sources[family]
    result = export_gguf_from_source(str(source), tmp_path / "gguf", type=kind)
    model, _ = _read_back(result)
    ids = _corpus_ids(AutoTokenizer.from_pretrained(source))
    want = _logits(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), ids)
    got = _logits(model, ids)
    agreement = (want.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agreement >= FLOORS[kind], f"{family} {kind}: argmax agreement {agreement:.3f}"
    if kind == "f16":  # bf16 values are exact in f16 unless out of its range: near-identical logits
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    counts = result.plan.to_dict()["tensor_types"]
    assert counts["F32"] > 0 and counts.get(kind.upper(), 0) > 0


def test_export_of_a_loaded_model_and_ollama_modelfile(bf16_sources: dict[str, Path], tmp_path: Path) -> None:
    import torch

    from xpukit import export_gguf, load_for_xpu

    source = bf16_sources["qwen3"]
    model = load_for_xpu(source, device="cpu", dtype="bfloat16")
    result = export_gguf(model, tmp_path / "gguf", type="q8_0", ollama=True, name="my model")
    assert model.dtype == torch.bfloat16  # the model exported is left as it was
    assert result.file.name == "my-model-q8_0.gguf"
    assert result.modelfile is not None
    text = result.modelfile.read_text()
    assert "FROM ./my-model-q8_0.gguf" in text and 'PARAMETER stop "<|endoftext|>"' in text
    assert 'PARAMETER stop "<|im_end|>"' in text
    read, _ = _read_back(result)
    ids = [5, 17, 230, 9, 400]
    assert torch.allclose(_logits(read, ids), _logits(model, ids), atol=1.0)  # q8_0 of the same model
    assert sorted(p.name for p in result.out.iterdir()) == ["Modelfile", "my-model-q8_0.gguf"]


def test_adapter_is_merged_first(
    bf16_sources: dict[str, Path], tmp_path: Path, perturbed_adapter: Callable[..., Path]
) -> None:
    """--adapter: the file is the merged model (save_merged's merge, by the adapter's record)."""
    import torch
    from transformers import AutoModelForCausalLM

    from xpukit.loading.gguf_export import export_gguf_from_source
    from xpukit.loading.save_merged import save_merged

    source = bf16_sources["llama"]
    adapter = perturbed_adapter(source, tmp_path / "adapter", quantize=None)
    merged = save_merged(source, adapter, tmp_path / "merged", dtype="bfloat16", device="cpu").out
    result = export_gguf_from_source(str(source), tmp_path / "gguf", adapter=str(adapter), device="cpu")
    model, _ = _read_back(result)
    ids = [3, 50, 700, 12, 99, 4]
    reference = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    assert torch.equal(_logits(model, ids), _logits(reference, ids))
    assert not torch.equal(_logits(model, ids), _logits(base, ids))  # the adapter changed the model


def test_cli_export_json_and_refusals(bf16_sources: dict[str, Path], tmp_path: Path, capsys: Any) -> None:
    import json

    from xpukit.cli.main import main

    source = str(bf16_sources["mistral"])
    assert (
        main(["export", source, str(tmp_path / "out"), "--gguf", "--type", "q4_0", "--ollama", "--json"]) == 0
    )
    written = json.loads(capsys.readouterr().out)
    assert written["plan"]["arch"] == "llama" and written["plan"]["type"] == "q4_0"
    assert Path(written["file"]).is_file() and Path(written["modelfile"]).is_file()
    # OUT exists now: refused, nothing changed
    assert main(["export", source, str(tmp_path / "out"), "--gguf"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["export", source, str(tmp_path / "k"), "--gguf", "--type", "q4_k_m"]) == 1
    err = capsys.readouterr().err
    assert "llama-quantize" in err and "ollama create --quantize" in err
    assert not (tmp_path / "k").exists()


def test_adapter_of_another_base_is_refused_before_writing(
    bf16_sources: dict[str, Path], tmp_path: Path, perturbed_adapter: Callable[..., Path]
) -> None:
    from xpukit.errors import XpukitError
    from xpukit.loading.gguf_export import export_gguf_from_source

    adapter = perturbed_adapter(bf16_sources["qwen3"], tmp_path / "adapter", quantize=None)  # other shapes
    with pytest.raises(XpukitError, match="adapter"):
        export_gguf_from_source(
            str(bf16_sources["llama"]), tmp_path / "gguf", adapter=str(adapter), device="cpu"
        )
    assert not (tmp_path / "gguf").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]


# --- the plan, from hand-made facts -------------------------------------------------------------------

_TOKENIZER = {
    "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
    "pre_tokenizer": {"type": "ByteLevel"},
}
_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "hidden_size": 64,
    "max_position_embeddings": 512,
}
_TENSORS = {"model.embed_tokens.weight": (1024, 64), "model.norm.weight": (64,), "lm_head.weight": (1024, 64)}


def _facts(**changes: Any) -> ExportFacts:
    fields: dict[str, Any] = {"config": _CONFIG, "tensors": _TENSORS, "tokenizer_json": _TOKENIZER}
    fields.update(changes)
    return ExportFacts(**fields)


def test_plan_types_sizes_and_refusals() -> None:
    plan = plan_gguf_export(_facts(), "q4_0")
    assert plan.tensor_types == {
        "model.embed_tokens.weight": "Q8_0",
        "model.norm.weight": "F32",
        "lm_head.weight": "Q8_0",
    }
    assert plan.family.permute_qk and plan.tokenizer_model == "gpt2" and plan.tokenizer_pre == "gpt-2"
    bf16 = plan_gguf_export(_facts(), "bf16")
    assert bf16.estimated_bytes > plan.estimated_bytes
    odd = plan_gguf_export(_facts(tensors={"model.layers.0.mlp.down_proj.weight": (64, 40)}), "q8_0")
    assert odd.tensor_types["model.layers.0.mlp.down_proj.weight"] == "F16"  # 40 is not whole 32-blocks
    with pytest.raises(InvalidRequestError, match=r"Llama \(llama\).*Gemma 3"):
        plan_gguf_export(_facts(config={**_CONFIG, "model_type": "phi3"}))
    with pytest.raises(InvalidRequestError, match="llama-quantize"):
        plan_gguf_export(_facts(), "Q5_K_M")
    with pytest.raises(InvalidRequestError, match="Valid: bf16, f16, q8_0, q4_0"):
        plan_gguf_export(_facts(), "int4")
    with pytest.raises(InvalidRequestError, match="already exists"):
        plan_gguf_export(_facts(out_exists=True))
    with pytest.raises(PlanError, match="MiB free"):
        plan_gguf_export(_facts(free_bytes=10 * 2**20))
    with pytest.raises(InvalidRequestError, match="rope_type 'yarn'"):
        plan_gguf_export(_facts(config={**_CONFIG, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(InvalidRequestError, match="pre-tokenizer"):
        plan_gguf_export(_facts(tokenizer_json={**_TOKENIZER, "pre_tokenizer": {"type": "Whitespace"}}))
    with pytest.raises(InvalidRequestError, match=r"tokenizer\.json"):
        plan_gguf_export(_facts(tokenizer_json=None))


def test_plan_refuses_a_gemma3_llama_cpp_would_run_differently() -> None:
    gemma = {**_CONFIG, "model_type": "gemma3_text", "num_hidden_layers": 2, "head_dim": 16}
    with pytest.raises(InvalidRequestError, match="every 6th layer global"):
        plan_gguf_export(_facts(config={**gemma, "layer_types": ["sliding_attention", "full_attention"]}))
    with pytest.raises(InvalidRequestError, match="query_pre_attn_scalar 256"):
        plan_gguf_export(_facts(config={**gemma, "query_pre_attn_scalar": 256}))
    plan = plan_gguf_export(_facts(config={**gemma, "query_pre_attn_scalar": 16}))
    assert plan.family.arch == "gemma3" and plan.family.norm_shift == 1.0


def test_llama3_rope_factors_match_transformers() -> None:
    """The rope_freqs tensor llama.cpp divides its frequencies by, against transformers' own llama3 rope."""
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from xpukit.loading.gguf_file import llama3_rope_factors

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64, rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    factors = torch.tensor(llama3_rope_factors({**config.to_dict(), "rope_parameters": rope}))
    assert torch.allclose(base / factors, scaled, rtol=1e-5)
    assert factors.min() == 1.0 and factors.max() == 32.0


# --- nothing half-written ---------------------------------------------------------------------------

_CHILD = """
import sys
from xpukit.loading.gguf_export import export_gguf_from_source
export_gguf_from_source(sys.argv[1], sys.argv[2], type="q4_0", device="cpu")
"""


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_stopped_export_leaves_nothing_half_written(
    how: signal.Signals, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    if sys.platform == "win32":
        pytest.skip("POSIX signals")
    source = tiny_model_factory("llama", hidden_size=512, intermediate_size=2048, num_hidden_layers=4)
    out = tmp_path / "exports" / "gguf"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(source), str(out)], env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and child.poll() is None:  # the file is being written
        if any(p.is_file() and p.stat().st_size > 0 for p in (tmp_path / "exports").glob(".gguf.*/*.gguf")):
            break
        time.sleep(0.02)
    assert child.poll() is None, "the export ended before it could be stopped"
    child.send_signal(how)
    assert child.wait(timeout=60) == -how
    assert not out.exists()
    left = list((tmp_path / "exports").iterdir())
    if how == signal.SIGTERM:
        assert left == []  # its handler removed the partial folder
        return
    assert len(left) == 1 and left[0].name.startswith(".gguf.")  # SIGKILL: no handler ran
    from xpukit.loading.gguf_export import export_gguf_from_source

    small = tiny_model_factory("llama")
    export_gguf_from_source(str(small), tmp_path / "exports" / "next", device="cpu")
    assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["next"]  # the next write swept it


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_llama_cpp_greedy_decodes_like_transformers(
    family: str, bf16_sources: dict[str, Path], tmp_path: Path
) -> None:
    """llama.cpp itself (through llama-cpp-python) runs the exported file: greedy tokens as transformers'."""
    llama_cpp = pytest.importorskip(
        "llama_cpp",
        reason="llama-cpp-python is not installed; building it from source takes minutes (pip install "
        "llama-cpp-python, with a C++ compiler and cmake)",
    )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xpukit.loading.gguf_export import export_gguf_from_source

    source = bf16_sources[family]
    result = export_gguf_from_source(str(source), tmp_path / "gguf", type="f16")
    prompt = AutoTokenizer.from_pretrained(source)("The baker").input_ids
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[
        0, len(prompt) :
    ].tolist()
    llm = llama_cpp.Llama(model_path=str(result.file), n_ctx=64, verbose=False)
    got = []
    for token in llm.generate(prompt, top_k=1, temp=0.0):
        got.append(token)
        if len(got) == 8:
            break
    assert got == want
