"""The tiny offline models: every architecture builds, reloads and generates; the demo model's cache."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from xpukit.demo import tiny
from xpukit.demo.tiny import ARCHITECTURES, DEMO_CONFIG, build_tiny_model, corpus_lines, demo_model_dir
from xpukit.errors import InvalidRequestError

# Longer than the Gemma model's 16-token sliding window, so its windowed mask really cuts something.
PROMPT = "The keeper lights the lamp at dusk and the ships come home safe, and the baker wakes"


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_architecture_reloads_and_generates_offline(tiny_models: Mapping[str, Path], arch: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_models[arch]
    assert (path / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == ARCHITECTURES[arch].model_class
    assert model.config._attn_implementation == "sdpa"
    assert model.num_parameters() < 300_000
    assert len(tokenizer) <= model.config.vocab_size
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    if arch != "gpt2":  # GPT-2 has no grouped-query attention
        assert model.config.num_key_value_heads < model.config.num_attention_heads

    inputs = tokenizer([PROMPT], return_tensors="pt")
    assert inputs.input_ids.shape[1] > 16
    out = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, inputs.input_ids.shape[1] + 4)

    # SDPA and eager attention must agree: the sizes (head_dim, GQA, sliding window) are ones SDPA runs.
    eager = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, eager(**inputs).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "text",
    [
        corpus_lines()[0],
        "  leading spaces,\nnew lines\tand tabs  ",
        "Ünïcödé ✓, 東京, and an emoji 🚀 the model never saw",
    ],
)
def test_tokenizer_round_trips_text(tiny_model: Path, text: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text


def test_tokenizer_has_chat_template_and_special_tokens(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "When does the bell ring?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nWhen does the bell ring?<|im_end|>\n<|im_start|>assistant\n"
    # Corpus words are whole tokens: the tokenizer was trained on that text.
    assert len(tokenizer(" baker", add_special_tokens=False).input_ids) == 1


def test_same_seed_same_weights_and_caller_rng_untouched(tiny_model: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    torch.manual_seed(1234)
    rng_before = torch.get_rng_state()
    again = build_tiny_model("qwen3", tmp_path / "again")
    assert torch.equal(torch.get_rng_state(), rng_before)
    other = build_tiny_model("qwen3", tmp_path / "other", seed=1)

    reference = load_file(tiny_model / "model.safetensors")
    rebuilt = load_file(again / "model.safetensors")
    assert reference.keys() == rebuilt.keys()
    assert all(torch.equal(reference[k], rebuilt[k]) for k in reference)
    reseeded = load_file(other / "model.safetensors")
    assert not all(torch.equal(reference[k], reseeded[k]) for k in reference)


def test_config_overrides_are_applied(tiny_model_factory: Any) -> None:
    path = tiny_model_factory("llama", num_hidden_layers=3, tie_word_embeddings=True)
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 3
    assert config["tie_word_embeddings"] is True
    assert config["hidden_size"] == ARCHITECTURES["llama"].config["hidden_size"]


def test_bad_requests_raise_invalid_request(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match=r"'bert'.*valid choices: qwen3, llama, mistral, gemma"):
        build_tiny_model("bert", tmp_path / "bert")
    with pytest.raises(
        ValueError, match="vocab_size must be at least"
    ):  # InvalidRequestError is a ValueError
        build_tiny_model("qwen3", tmp_path / "small-vocab", vocab_size=100)
    # Gemma lists one layer type per layer: 3 layers against 2 types is refused by the config class.
    with pytest.raises(InvalidRequestError, match="Gemma3TextConfig rejected"):
        build_tiny_model("gemma", tmp_path / "gemma", num_hidden_layers=3)
    assert not (tmp_path / "bert").exists()


def test_corpus_is_bundled_plain_text() -> None:
    lines = corpus_lines()
    assert len(lines) >= 50
    assert all(line == line.strip() and line for line in lines)
    assert sum(len(line) for line in lines) > 3000
    assert sum("baker" in line for line in lines) >= 10  # the pattern the demo's prompts lean on


# --- the demo model's cache ------------------------------------------------------------------------


def _refuse_to_build(*args: Any, **kwargs: Any) -> Path:
    raise AssertionError("the demo model was rebuilt instead of reused")


def test_demo_model_is_built_once_then_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoConfig

    first = demo_model_dir(tmp_path)
    assert first.parent == tmp_path / "models"
    marker = first / "xpukit-build.json"
    built_at = marker.stat().st_mtime_ns
    config = AutoConfig.from_pretrained(first)
    assert config.model_type == tiny.DEMO_ARCHITECTURE
    assert {k: getattr(config, k) for k in DEMO_CONFIG} == dict(DEMO_CONFIG)

    monkeypatch.setattr(tiny, "build_tiny_model", _refuse_to_build)
    assert demo_model_dir(tmp_path) == first
    monkeypatch.setenv("XPUKIT_CACHE_DIR", str(tmp_path))  # the variable finds the same cache
    assert demo_model_dir() == first
    assert marker.stat().st_mtime_ns == built_at
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary leftovers


def test_demo_cache_key_follows_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    key = tiny._demo_key()
    assert key == tiny._demo_key()
    monkeypatch.setattr(tiny, "DEMO_CONFIG", {**DEMO_CONFIG, "num_hidden_layers": 2})
    assert tiny._demo_key() != key


def test_partial_builds_are_not_taken_for_finished_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, partial_folder: Callable[..., Path]
) -> None:
    models = tmp_path / "models"
    name = f"tiny-{tiny.DEMO_ARCHITECTURE}-demo-{tiny._demo_key()}"

    # A build interrupted after the weights were written but before it was marked complete ...
    def interrupt(directory: Path, key: str) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(tiny, "_write_marker", interrupt)
        with pytest.raises(KeyboardInterrupt):
            demo_model_dir(tmp_path)
    assert list(models.iterdir()) == []  # ... leaves nothing behind, under any name.

    # A directory of the right name without the completion marker (e.g. copied by hand, half-way),
    # next to the temporary directory of a build that was killed outright.
    (models / name).mkdir()
    (models / name / "config.json").write_text("{}")
    killed = partial_folder(models / name)  # the partial folder of a build killed outright: swept
    running = partial_folder(models / name, os.getppid())  # a build in progress elsewhere: left alone

    path = demo_model_dir(tmp_path)
    assert path == models / name
    assert (path / "xpukit-build.json").is_file() and (path / "model.safetensors").is_file()
    assert sorted(p.name for p in models.iterdir()) == sorted([name, running.name])
    assert not killed.exists()


def test_concurrent_builds_publish_one_complete_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both runs finish building before either publishes, so one of them must lose the rename.
    both_built = threading.Barrier(2, timeout=60)
    real_build = tiny.build_tiny_model

    def build_then_wait(*args: Any, **kwargs: Any) -> Path:
        out = real_build(*args, **kwargs)
        both_built.wait()
        return out

    monkeypatch.setattr(tiny, "build_tiny_model", build_then_wait)
    results: list[Path] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(demo_model_dir(tmp_path))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(results) == 2 and results[0] == results[1]
    assert tiny._is_complete(results[0], tiny._demo_key())
    assert [p.name for p in (tmp_path / "models").iterdir()] == [results[0].name]
