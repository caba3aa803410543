"""Tiered decoding on the CPU: the uncompiled step serves at once, the compiled one takes over.

The tiny qwen3 in float32 (its greedy logits are far from ties: tests/loading/decode/test_decode_loop.py
checks the
margin), against transformers' own ``generate`` with the same static cache. The compiled tier is
built ahead of time with dynamo's ``aot_eager`` backend (torch's ahead-of-time compile with the
graphs run as traced: the same path as inductor's, cheap), the graph tier with a stand-in for the
device's graph API that replays a capture by running it again (``rerun_graphs``), so a token lost or
computed twice at a switch changes the output.
"""

from __future__ import annotations

import threading

import pytest

from xpukit.loading.decode import tiers
from xpukit.loading.decode.install import install_decode_loop

NEW = 12


@pytest.fixture(autouse=True)
def _no_build_left_running():
    """A build a test left on its thread would keep other tests' captures off (device_graph)."""
    from xpukit.loading.device_graph import wait_for_background

    yield
    assert wait_for_background(120), "a compiled step was still being built two minutes after the test"


PROMPTS = ["the quick brown fox", "a", "when the bell rings in the morning"]
OPTIONS = {"backend": "aot_eager", "fullgraph": True, "dynamic": False}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.padding_side = "left"
    return tok


def _model(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def want(tiny_model, tokenizer):
    """transformers' greedy tokens for 3 left-padded prompts."""
    import torch

    model = _model(tiny_model)
    with torch.no_grad():
        out = model.generate(
            **_inputs(tokenizer),
            max_new_tokens=NEW,
            do_sample=False,
            cache_implementation="static",
            disable_compile=True,
        )
    return out.tolist()


def _inputs(tokenizer):
    return dict(tokenizer(PROMPTS[:3], return_tensors="pt", padding=True))


def _tiered(path, cache_dir, graphs, *, background=False):
    from xpukit.loading.decode.step_graph import StepGraphs

    model = _model(path)
    loop = install_decode_loop(model, max_cache_len=256, compile_options=None, cache_dir=cache_dir)
    loop.tiers.background = background
    loop.set_compile(OPTIONS, tiered=True)
    if graphs is not None:
        loop.step_graphs = StepGraphs(graphs())
    return model, loop


def _generate(model, tokenizer):
    return model.generate(**_inputs(tokenizer), max_new_tokens=NEW, do_sample=False).tolist()


def test_the_compiled_tier_gives_transformers_tokens_and_is_saved(
    tiny_model, tokenizer, want, tmp_path, rerun_graphs
):
    model, loop = _tiered(tiny_model, tmp_path, rerun_graphs)
    assert _generate(model, tokenizer) == want  # the first call: the first tier (the build starts as it ends)
    assert model.xpukit_last_decode["tiers"] == {"prefill": 1, "graph": NEW - 1}
    assert _generate(model, tokenizer) == want  # built (in the call's thread here): compiled from step 1
    assert model.xpukit_last_decode["tiers"] == {"prefill": 1, "compiled": NEW - 1}
    (record,) = loop.cache_records
    assert record["how"] == "compiled" and record["saved"] is True
    # the compiled step's capture and the prefill's (warmed in the first call, captured in the second);
    # the first tier's step captures were dropped at the switch
    assert {key[1] for key in loop.step_graphs._graphs} == {"greedy", "prefill-greedy"}
    # A second process's loop (a new model, the same cache dir) loads the step: no trace, no compile.
    again, second = _tiered(tiny_model, tmp_path, rerun_graphs)
    assert _generate(again, tokenizer) == want
    assert second.cache_records[0]["how"] == "loaded"


def test_a_switch_in_the_middle_of_a_call_loses_no_token(
    tiny_model, tokenizer, want, tmp_path, monkeypatch, rerun_graphs
):
    model, loop = _tiered(tiny_model, tmp_path, rerun_graphs)
    assert _generate(model, tokenizer) == want  # the first tier's call; the build starts as it ends
    checks = {"n": 0}
    ready = tiers.CompileJob.ready

    def late(job):  # the build is done, but the loop sees it only from its 5th look on
        checks["n"] += 1
        return ready(job) if checks["n"] > 4 else None

    monkeypatch.setattr(tiers.CompileJob, "ready", late)
    assert _generate(model, tokenizer) == want
    assert model.xpukit_last_decode["tiers"] == {"prefill": 1, "graph": 4, "compiled": NEW - 5}
    # The first tier's captures were its own (never replayed as the compiled step), and are dropped
    # once the compiled step serves: 3 captures (the first tier's step, the prefill, the compiled
    # step), the prefill's and the compiled step's kept.
    assert {key[1] for key in loop.step_graphs._graphs} == {"greedy", "prefill-greedy"}
    assert loop.step_graphs.stats["captures"] == 3


def test_a_failed_build_leaves_the_first_tier_serving_and_says_why(
    tiny_model, tokenizer, want, tmp_path, monkeypatch
):
    def broken(*args, **kwargs):
        raise RuntimeError("inductor could not build the graph")

    monkeypatch.setattr(tiers, "build_step", broken)
    model, loop = _tiered(tiny_model, tmp_path, None)
    seen = []
    loop.tiers.on_event = seen.append
    assert _generate(model, tokenizer) == want  # the first call; the build starts (and fails) as it ends
    assert model.xpukit_last_decode["tiers"] == {"prefill": 1, "eager": NEW - 1} and seen == []
    assert _generate(model, tokenizer) == want  # the next call finds the failure and says it
    assert model.xpukit_last_decode["tiers"] == {"prefill": 1, "eager": NEW - 1}
    (event,) = seen
    assert (event.kind, event.what) == ("fallback", "decode_tiers") and "could not build" in event.cause
    assert _generate(model, tokenizer) == want  # the next call too, and the failure is said once
    assert loop.tiers.events == seen and loop.tiers.wait() is False
    assert "could not build" in loop.cache_records[0]["error"]  # what bench rows show


def test_the_background_build_never_blocks_a_call(
    tiny_model, tokenizer, want, tmp_path, monkeypatch, rerun_graphs
):
    release = threading.Event()
    build = tiers.build_step

    def slow(*args, **kwargs):  # a compile that lasts until the first call is over
        assert release.wait(60)
        return build(*args, **kwargs)

    monkeypatch.setattr(tiers, "build_step", slow)
    model, loop = _tiered(tiny_model, tmp_path, rerun_graphs, background=True)
    assert _generate(model, tokenizer) == want
    assert model.xpukit_last_decode["tiers"] == {"prefill": 1, "graph": NEW - 1}
    release.set()
    assert loop.tiers.wait(60) is True
    assert _generate(model, tokenizer) == want
    assert model.xpukit_last_decode["tiers"] == {"prefill": 1, "compiled": NEW - 1}


def test_before_the_build_the_first_tier_is_captured_for_every_window(
    tiny_model, tokenizer, want, tmp_path, monkeypatch, rerun_graphs
):
    """A 1-token first call runs only its prefill; before the build starts, the loop captures the
    first tier's step for every attention window and the call's prompt bucket, so the next call,
    made during the build, replays graphs only (a step run uncaptured beside a build waits for the
    GIL at every operation) and gives transformers' tokens. Python's switch interval is short while
    the build runs, and as it was after."""
    import sys

    from xpukit.loading.decode.attention import use_grouped_decode_attention

    release, building = threading.Event(), threading.Event()
    build = tiers.build_step

    def slow(*args, **kwargs):
        building.set()
        assert release.wait(60)
        return build(*args, **kwargs)

    monkeypatch.setattr(tiers, "build_step", slow)
    found = sys.getswitchinterval()
    model, loop = _tiered(tiny_model, tmp_path, rerun_graphs, background=True)
    use_grouped_decode_attention(model)
    loop.window_smallest = 32
    model.generate(**_inputs(tokenizer), max_new_tokens=1, do_sample=False)
    try:
        assert building.wait(60)
        graphs = loop.step_graphs
        assert sorted(key[2] for key in graphs._graphs if key[1] == "graph-greedy") == [32, 64, 128, 256]
        assert [key[2] for key in graphs._graphs if key[1] == "prefill-greedy"] == [16]
        assert sys.getswitchinterval() == pytest.approx(min(found, tiers.HANDOFF_S), rel=0.05)
        assert _generate(model, tokenizer) == want
        assert model.xpukit_last_decode["tiers"] == {"prefill": 1, "graph": NEW - 1}
        assert graphs.stats["uncaptured_while_building"] == 0
    finally:
        release.set()
    assert loop.tiers.wait(60) is True
    assert sys.getswitchinterval() == found


def test_the_short_switch_interval_is_shared_and_never_undoes_a_change_made_meanwhile():
    import sys

    found = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        with tiers.quick_handoff():
            with tiers.quick_handoff():  # a second build (another batch size) meanwhile
                assert sys.getswitchinterval() == pytest.approx(tiers.HANDOFF_S, rel=0.05)
            assert sys.getswitchinterval() == pytest.approx(tiers.HANDOFF_S, rel=0.05)  # the first still runs
        assert sys.getswitchinterval() == pytest.approx(0.005, rel=0.05)
        with tiers.quick_handoff():
            sys.setswitchinterval(0.002)  # the user's own setting, made during the build
        assert sys.getswitchinterval() == pytest.approx(0.002, rel=0.05)
        sys.setswitchinterval(0.00005)
        with tiers.quick_handoff():  # already shorter: left as it is
            assert sys.getswitchinterval() == pytest.approx(0.00005, rel=0.05)
        assert sys.getswitchinterval() == pytest.approx(0.00005, rel=0.05)
    finally:
        sys.setswitchinterval(found)


def test_tiers_refuse_regional(tiny_model, tmp_path):
    from xpukit.errors import InvalidRequestError

    model = _model(tiny_model)
    loop = install_decode_loop(model, max_cache_len=256, compile_options=None, cache_dir=tmp_path)
    with pytest.raises(InvalidRequestError, match="tiered=True builds the whole compiled step"):
        loop.set_compile(OPTIONS, tiered=True, regional=True)


def test_a_torch_without_aot_compile_compiles_at_the_first_call(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(tiers, "aot_available", lambda torch: "torch 2.0 has no aot_compile")
    from xpukit.loading.decode import loop as decode_loop

    monkeypatch.setattr(decode_loop, "aot_available", tiers.aot_available)
    model = _model(tiny_model)
    loop = install_decode_loop(model, max_cache_len=256, compile_options=None, cache_dir=tmp_path)
    loop.set_compile(OPTIONS, tiered=True)
    assert loop.tiered is False
    assert [(e.kind, e.what) for e in loop.tiers.events] == [("fallback", "decode_tiers")]
    assert "no aot_compile" in loop.tiers.events[0].cause


@pytest.mark.parametrize("fails", [False, True], ids=["built", "failed"])
def test_a_tiered_load_warms_up_both_tiers_and_records_a_failure_on_the_plan(
    tiny_model, tmp_path, monkeypatch, fails
):
    """What fast_decode does on a GPU, carried out here: the plan's tiers installed, the warm-up's
    first call on the first tier, its second on the compiled one; a failed build is a fallback event
    of the warm-up, and one after the load goes onto the model's plan."""
    from dataclasses import replace

    from xpukit.loading.decode.fast_decode import warm_up
    from xpukit.loading.load import carry_out
    from xpukit.planning.device import decode
    from xpukit.planning.plan import plan_load

    monkeypatch.setenv("XPUKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(decode, "compile_settings", lambda mode, patterns=True: dict(OPTIONS))
    if fails:
        monkeypatch.setattr(tiers, "build_step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no")))
    plan = decode.DecodePlan(
        static_cache=True,
        max_cache_len=256,
        compile=True,
        compile_mode="default",
        graph_batch_sizes=(1,),
        tiered=True,
    )
    model = carry_out(replace(plan_load(tiny_model, fast_decode=True), decode=plan))
    loop = model.xpukit_decode_loop
    assert loop.tiered and [
        e.actual.get("tiers") for e in model.xpukit_plan.events if e.what == "decode_loop"
    ] == [["eager", "compiled"]]
    events = warm_up(model, model.xpukit_plan)
    warmup = events[-1].actual
    if not fails:
        assert [e.what for e in events] == ["warmup"] and warmup["compiled"] is True
        assert warmup["tiers"] == {"prefill": 1, "compiled": 7} and warmup["waited_for_compiled_s"] >= 0
        return
    assert [(e.kind, e.what) for e in events] == [("fallback", "decode_tiers"), ("applied", "warmup")]
    assert warmup["compiled"] is False and warmup["tiers"] == {"prefill": 1, "eager": 7}
    # A build that fails after the load is said on the model's plan (here the warm-up ran after the
    # load too: its batch 1, then a new batch size), once per build.
    import torch

    loop.tiers.background = False  # the build fails before the call's first step (no race with a thread)
    model.generate(input_ids=torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=3, do_sample=False)
    model.generate(input_ids=torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=3, do_sample=False)
    causes = [e.cause for e in model.xpukit_plan.fallbacks if e.what == "decode_tiers"]
    assert len(causes) == 2 and "batch 2 (greedy) was not built: RuntimeError: no" in causes[1]


def test_one_compiled_step_serves_every_attention_window(tiny_model, tokenizer, tmp_path):
    """The compiled step is built for the window of the call that started it; with no guards left,
    a later, longer window must still be a symbol of that one graph, not a wrong specialisation."""
    import torch

    from xpukit.loading.decode.attention import use_grouped_decode_attention

    reference = _model(tiny_model)
    inputs = _inputs(tokenizer)
    with torch.no_grad():
        want = reference.generate(
            **inputs, max_new_tokens=40, do_sample=False, cache_implementation="static", disable_compile=True
        )
    model, loop = _tiered(tiny_model, tmp_path, None)
    use_grouped_decode_attention(model)
    loop.window_smallest = 8
    assert model.generate(**inputs, max_new_tokens=40, do_sample=False).tolist() == want.tolist()
    assert model.xpukit_last_decode["tiers"] == {"prefill": 1, "eager": 39}  # built as the call ends
    assert model.generate(**inputs, max_new_tokens=40, do_sample=False).tolist() == want.tolist()
    assert sorted(loop._states[(3, 256)].windows) == [16, 32, 64]  # a 9-token prompt, 40 new tokens
    assert model.xpukit_last_decode["tiers"] == {"prefill": 1, "compiled": 39}


def test_aot_compile_is_asked_for_one_call_and_the_setting_left_as_it_was():
    """Some torch releases hand torch.compile's result an aot_compile only with dynamo's
    enable_aot_compile on: xpukit sets it for the call that makes the wrapper, never for the process.
    (dynamo's own ``config.patch``: pytest's monkeypatch would delete a config entry on undo.)"""
    import torch

    if not hasattr(torch._dynamo.config, "enable_aot_compile"):
        pytest.skip("this torch has no enable_aot_compile")
    with torch._dynamo.config.patch(enable_aot_compile=False):
        assert tiers.aot_available(torch) is None
        assert torch._dynamo.config.enable_aot_compile is False


def test_replay_runs_the_tier_that_serves(tiny_model, tokenizer, tmp_path, rerun_graphs):
    """``loop.replay`` (bench_decode --breakdown's step alone) replays the tier a call would use."""
    model, loop = _tiered(tiny_model, tmp_path, rerun_graphs)
    for _ in range(2):  # the first tier's call, then the compiled tier's (captured by then)
        _generate(model, tokenizer)
    before = dict(loop.step_graphs.stats)
    loop.replay(4)
    assert loop.step_graphs.stats["replays"] == before["replays"] + 4
    assert {key[1] for key in loop.step_graphs._graphs} == {"greedy", "prefill-greedy"}  # compiled tier's


def test_torchao_weights_build_save_and_load_ahead_of_time(wide_model, tmp_path):
    """The default fast path's weights are torchao tensor subclasses: the ahead-of-time step takes
    them as inputs, is saved, and a second loop loads it, with plain generate's greedy tokens."""
    import torch

    from xpukit import load_for_xpu

    ids = torch.arange(3, 3 + 7 * 12, 7).remainder(1000).unsqueeze(0)
    plain = load_for_xpu(str(wide_model), device="cpu", dtype="float32", quantize="8bit")
    with torch.no_grad():
        want = plain.generate(ids, max_new_tokens=8, do_sample=False).tolist()
    for how in ("compiled", "loaded"):
        model = load_for_xpu(str(wide_model), device="cpu", dtype="float32", quantize="8bit")
        assert type(model.model.layers[0].mlp.up_proj.weight).__name__ == "Int8Tensor"
        loop = install_decode_loop(model, max_cache_len=256, compile_options=None, cache_dir=tmp_path)
        loop.tiers.background = False
        loop.set_compile(OPTIONS, tiered=True)
        assert model.generate(ids, max_new_tokens=8, do_sample=False).tolist() == want
        assert model.xpukit_last_decode["tiers"] == {"prefill": 1, "eager": 7}  # built as the call ends
        assert model.generate(ids, max_new_tokens=8, do_sample=False).tolist() == want
        assert model.xpukit_last_decode["tiers"] == {"prefill": 1, "compiled": 7}
        assert loop.cache_records[0]["how"] == how


def test_a_step_that_cannot_be_captured_runs_uncaptured(tiny_model, tokenizer, want, tmp_path, rerun_graphs):
    """A capture runs nothing; one that raises leaves its key uncaptured, and the token comes from the
    step run uncaptured: the output is unchanged."""

    class Refusing(rerun_graphs):
        def capture(self, graph, body, pool):
            raise RuntimeError("operation not permitted when stream is capturing")

    model, loop = _tiered(tiny_model, tmp_path, Refusing)
    for _ in range(2):
        assert _generate(model, tokenizer) == want
    assert loop.step_graphs.stats["captures"] == 0 and loop.step_graphs._graphs == {}
    assert {key[1] for key in loop.step_graphs.uncaptured} == {"greedy", "prefill-greedy"}


def test_fused_projections_build_save_and_load_ahead_of_time(tiny_model, tokenizer, want, tmp_path):
    """The fast path fuses q/k/v and gate/up at load; q_proj hands k and v over through Python state,
    which the ahead-of-time step must carry as the whole-step compile does
    (tests/loading/decode/test_fused_proj.py)."""
    from xpukit.loading.decode.fused_proj import fuse_projections

    for how in ("compiled", "loaded"):
        model, loop = _tiered(tiny_model, tmp_path, None)
        assert fuse_projections(model)["attention"] > 0
        assert _generate(model, tokenizer) == want  # the first tier; the build starts as the call ends
        assert _generate(model, tokenizer) == want
        assert model.xpukit_last_decode["tiers"] == {"prefill": 1, "compiled": NEW - 1}
        assert loop.cache_records[0]["how"] == how
