"""The demo's output: one progress display (a bar in a terminal, lines elsewhere), and generated text
that reads back into the exact bytes the model produced (xpukit.demo.text)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from xpukit.demo.text import original_bytes, readable, token_bytes


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _show(stream: io.StringIO) -> str:
    """Drive the demo's callback through four steps as Trainer would, logging every step's loss."""
    from xpukit.demo.training_run import loss_callback

    losses: list[tuple[int, float]] = []
    callback = loss_callback(losses, {"lora_B": True}, 4, 2, stream)
    state = SimpleNamespace(max_steps=4, global_step=0, is_world_process_zero=True)
    callback.on_train_begin(None, state, None)
    for step in range(1, 5):
        state.global_step = step
        callback.on_step_end(None, state, None)
        callback.on_log(None, state, None, logs={"loss": 5.0 - step, "learning_rate": 0.01})
    callback.on_log(None, state, None, logs={"train_runtime": 1.0})  # Trainer's summary: not a step
    callback.on_train_end(None, state, None)
    assert losses == [(1, 4.0), (2, 3.0), (3, 2.0), (4, 1.0)]
    return stream.getvalue()


def test_a_terminal_gets_one_bar_and_no_lines() -> None:
    out = _show(_Terminal())
    assert "4/4" in out and "loss 1.500" in out and "\r" in out  # tqdm redraws one line
    assert "step 2/4" not in out and "{'loss'" not in out


def test_a_pipe_gets_lines_and_no_bar() -> None:
    out = _show(io.StringIO())
    assert out.splitlines() == ["  step 1/4  loss 4.000", "  step 2/4  loss 3.500", "  step 4/4  loss 1.500"]


@pytest.mark.slow  # a one-step Trainer run: about 8 s on two busy cores
def test_trainer_shows_nothing_of_its_own(demo_model: Path, tmp_path: Path) -> None:
    """A real (one-step) run on a pipe: only the demo's line, neither tqdm's bar nor the log dict."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xpukit.demo.tiny import corpus_lines
    from xpukit.demo.training_run import train

    stream = io.StringIO()
    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(demo_model),
        AutoTokenizer.from_pretrained(demo_model),
    )
    with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.redirect_stdout(io.StringIO()) as out:
        train(
            model,
            tokenizer,
            corpus_lines()[:4],
            steps=1,
            batch_size=2,
            learning_rate=1e-3,
            max_tokens=16,
            log_every=1,
            seed=0,
            output_dir=tmp_path,
            stream=stream,
        )
    assert stream.getvalue().startswith("  step 1/1  loss ")
    assert "it/s" not in err.getvalue() + out.getvalue() and "{'loss'" not in out.getvalue()


@given(st.binary(max_size=64))
def test_readable_round_trips_any_bytes(data: bytes) -> None:
    shown = readable(data)
    assert "\ufffd" not in shown or "\ufffd".encode() in data
    assert all(char.isprintable() for char in shown)
    assert original_bytes(shown) == data


def test_stray_bytes_from_the_model_are_escaped_not_replaced(demo_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    text = "sea wind: café ☕"
    ids = tokenizer(text)["input_ids"]
    assert readable(token_bytes(tokenizer, ids)) == text  # the tokenizer is byte-complete
    # "â" is the byte-level token of the lone byte 0xE2 (half of a three-byte character)
    lone = (
        tokenizer("sea")["input_ids"] + [tokenizer.convert_tokens_to_ids("â")] + tokenizer("um")["input_ids"]
    )
    assert tokenizer.decode(lone) == "sea\ufffdum"  # what the demo used to print
    assert readable(token_bytes(tokenizer, lone)) == "sea\\xe2um"
    assert original_bytes("sea\\xe2um") == b"sea\xe2um"
    assert token_bytes(tokenizer, [*lone, len(tokenizer) + 5]) == b"sea\xe2um"  # an id with no token


@pytest.mark.parametrize("word", ["hello", "naïve", "日本語", "🐟"])
def test_every_string_encodes_without_unknown_tokens(demo_model: Path, word: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    assert tokenizer.unk_token_id is None
    assert tokenizer.decode(tokenizer(word)["input_ids"]) == word


def test_the_loss_plot_says_one_step_and_ticks_whole_steps(tmp_path: Path) -> None:
    """A short run: the legend says "mean of 1 step" (not "1 steps") and the step axis has integer ticks."""
    pytest.importorskip("matplotlib")
    from unittest import mock

    from matplotlib.figure import Figure

    from xpukit.demo.output import plot_losses

    saved: list[Figure] = []
    real = Figure.savefig

    def keep(self: Figure, *args: object, **kwargs: object) -> None:
        saved.append(self)
        real(self, *args, **kwargs)

    with mock.patch.object(Figure, "savefig", keep):
        plot_losses(((1, 3.0), (2, 2.5), (3, 2.0)), tmp_path / "loss.png", title="t")
    ax = saved[0].axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["loss per step", "mean of 1 step"]
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks)
