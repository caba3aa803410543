"""The command line's errors: one line on stderr with the fix, a JSON error object with --json, the
subcommand's own usage for an unknown option, and bad model folders named for what they are."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from xpukit.cli.main import main


@pytest.fixture(scope="module")
def adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter saved from the tiny model."""
    from xpukit import load_for_xpu

    out = tmp_path_factory.mktemp("cli-errors") / "adapter"
    load_for_xpu(tiny_model, device="cpu", lora=True).save_pretrained(out)
    return out


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's usage errors
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def _one_line(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"xpukit {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_json_errors_are_a_json_object_on_stdout_with_a_nonzero_exit(tmp_path: Path) -> None:
    code, out, err = _cli("plan", str(tmp_path / "missing"), "--json")
    assert code == 1
    error = json.loads(out)["error"]
    assert error["type"] == "InvalidRequestError" and "does not exist" in error["message"]
    assert _one_line(err, "plan").endswith(error["message"])


def test_an_unknown_option_shows_the_subcommands_usage() -> None:
    code, _, err = _cli("doctor", "--jsn")
    assert code == 2
    assert err.startswith("usage: xpukit doctor") and "unrecognized arguments: --jsn" in err


def test_a_regular_file_as_merge_out_is_named_a_file(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    out.write_text("keep me")
    code, _, err = _cli("merge", str(tiny_model), str(tmp_path / "no-adapter"), str(out))
    assert code == 1 and "is a file, not a directory" in _one_line(err, "merge")
    assert out.read_text() == "keep me"


def test_an_adapter_passed_as_the_model_gives_the_call_that_loads_it(
    tiny_model: Path, adapter: Path, tmp_path: Path
) -> None:
    for argv in (
        ["plan", str(adapter)],
        ["merge", str(adapter), str(adapter), str(tmp_path / "o")],
        ["demo", "--model", str(adapter)],
    ):
        code, _, err = _cli(*argv)
        line = _one_line(err, argv[0])
        assert code == 1 and "is a LoRA adapter (adapter_config.json found)" in line
        assert f"load_for_xpu('{tiny_model}', lora='{adapter}')" in line


@pytest.mark.parametrize("command", ["merge", "demo"])
def test_a_model_folder_without_weights_is_one_line(
    command: str, tiny_model: Path, adapter: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "no-weights"
    shutil.copytree(tiny_model, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    argv = (
        ["merge", str(folder), str(adapter), str(tmp_path / "o")]
        if command == "merge"
        else ["demo", "--model", str(folder)]
    )
    code, out, err = _cli(*argv)
    assert code == 1 and "has a config.json but no weights" in _one_line(err, command)
    assert "Plan for" not in out  # the demo refuses before it prints its plan


def test_demo_refuses_a_non_empty_or_file_output_dir_before_it_runs(tmp_path: Path) -> None:
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    a_file = tmp_path / "file"
    a_file.write_text("mine")
    for target, says in ((full, "is not empty"), (a_file, "is a file")):
        code, out, err = _cli("demo", "--output-dir", str(target), "--steps", "1")
        assert code == 1 and says in _one_line(err, "demo") and "Plan for" not in out
    assert [p.name for p in full.iterdir()] == ["notes.txt"] and a_file.read_text() == "mine"
