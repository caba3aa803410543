"""Regional compilation of xpukit's decode step on the CPU (docs/decode-kernels.md "Regional compilation").

One decoder layer is traced by dynamo (a counting backend stands in for inductor: it records each
graph and runs it as traced) and its code serves every layer: one graph for a 6-layer model, called
6 times a token, and the greedy tokens are those of the whole-step compile and of transformers'
``generate`` on a model whose top two logits stay apart (``MIN_MARGIN``). The plan offers it as
``fast_decode="regional"``, never by default.
"""

from __future__ import annotations

import pytest

from xpukit.loading.decode.install import install_decode_loop
from xpukit.loading.decode.regional import LayerCache, decoder_layers
from xpukit.planning.model.reference_models import reference_config
from xpukit.planning.plan import plan_load

LAYERS = 6
NEW = 10
PROMPTS = ["the quick brown fox", "when the bell rings in the morning", "x y"]
MIN_MARGIN = 1e-3  # as tests/loading/decode/test_decode_loop.py: far above float32's differences (~1e-6)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """dynamo's compiled code of one function is kept per process, up to 8 entries
    (``torch._dynamo.config.recompile_limit``): other tests' entries for ``decode_step`` must not
    count here."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def deep_model(tiny_model_factory):
    return tiny_model_factory("qwen3", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def tokenizer(deep_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(deep_model)
    tok.padding_side = "left"
    return tok


def _model(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _counting(graphs, calls):
    """Compile options whose backend records each graph and counts the calls of its code."""

    def counting(graph_module, example_inputs):
        graphs.append(graph_module)

        def run(*args):
            calls.append(len(graphs) - 1)
            return graph_module.forward(*args)

        return run

    return {"backend": counting, "fullgraph": True, "dynamic": False}


def _inputs(tokenizer, batch):
    return dict(tokenizer(PROMPTS[:batch], return_tensors="pt", padding=True))


def _plain(model, inputs):
    import torch

    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=NEW, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
    top = torch.stack(out.scores, 1).topk(2, -1).values
    return out.sequences.tolist(), (top[..., 0] - top[..., 1]).min().item()


@pytest.mark.slow
def test_one_layer_traced_once_serves_every_layer_with_the_same_tokens(deep_model, tokenizer, tmp_path):
    reference = _model(deep_model)
    whole_graphs: list[object] = []
    whole = _model(deep_model)
    options = _counting(whole_graphs, [])
    install_decode_loop(whole, max_cache_len=64, compile_options=options, cache_dir=tmp_path)
    graphs: list[object] = []
    calls: list[int] = []
    model = _model(deep_model)
    loop = install_decode_loop(
        model, max_cache_len=64, compile_options=_counting(graphs, calls), cache_dir=tmp_path, regional=True
    )
    assert len(decoder_layers(model)) == LAYERS
    for batch in (1, 3):
        inputs = _inputs(tokenizer, batch)
        want, margin = _plain(reference, inputs)
        assert margin > MIN_MARGIN  # the tokens are decided, not ties
        got = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
        assert got.tolist() == want
        assert whole.generate(**inputs, max_new_tokens=NEW, do_sample=False).tolist() == want
        assert model.xpukit_last_decode["regional"] is True and model.xpukit_last_decode["compiled"]
    # Batch 1 traced one layer once; batch 3 (static shapes) once more: never once per layer.
    assert len(graphs) == 2 and len(whole_graphs) == 2
    # The layer's graph holds one layer: a sixth of the whole step's calls or fewer (not 6 layers' worth).
    layer_nodes = len(list(graphs[0].graph.nodes))
    assert layer_nodes * LAYERS <= len(list(whole_graphs[0].graph.nodes)) * 1.5
    # The compiled layer ran for every layer of every decode step (the prefill runs uncompiled).
    assert len(calls) == LAYERS * 2 * (NEW - 1)
    # Calls the loop does not serve run the layers as before, compiling nothing.
    before = len(graphs), len(calls)
    beams = model.generate(**_inputs(tokenizer, 1), max_new_tokens=3, num_beams=2, do_sample=False)
    assert model.xpukit_last_decode["loop"] == "transformers" and beams.shape[0] == 1
    assert (len(graphs), len(calls)) == before
    assert loop.regional and loop.cache_records and all(r["step"] == "greedy" for r in loop.cache_records)


def test_the_layer_cache_ignores_the_layer_index():
    import torch
    from transformers import StaticLayer

    part = StaticLayer(max_cache_len=4)
    key = torch.ones(1, 2, 1, 3)
    keys, values = LayerCache(part).update(key, 2 * key, 17, kwargs={})
    assert keys.shape == (1, 2, 4, 3) and keys[0, 0, 0].tolist() == [1.0] * 3
    assert values[0, 0, 0].tolist() == [2.0] * 3 and int(part.cumulative_length) == 1


def test_models_without_repeated_layers_have_none(deep_model):
    import torch

    assert decoder_layers(torch.nn.Linear(2, 2)) == []
    model = _model(deep_model)
    model.model.layers.append(torch.nn.Linear(2, 2))  # two classes: nothing to share
    assert decoder_layers(model) == []


def test_inside_the_step_graph_the_layer_runs_at_the_warm_up_and_capture_only(
    deep_model, tokenizer, rerun_graphs
):
    """xpukit's step graph captures the regional step whole (docs/decode-kernels.md "Regional compilation"):
    the compiled layer (and its guards) run at the warm run and the capture; a replay runs the
    capture (here: the stand-in runs the captured step again, so the tokens show a wrong replay)."""
    from xpukit.loading.decode.step_graph import StepGraphs

    graphs: list[object] = []
    calls: list[int] = []
    model = _model(deep_model)
    options = _counting(graphs, calls)
    loop = install_decode_loop(model, max_cache_len=64, compile_options=options, regional=True)
    loop.step_graphs = StepGraphs(rerun_graphs())
    inputs = _inputs(tokenizer, 3)
    want, _ = _plain(_model(deep_model), inputs)
    for _ in range(2):
        assert model.generate(**inputs, max_new_tokens=NEW, do_sample=False).tolist() == want
    assert len(graphs) == 1 and model.xpukit_last_decode["regional"] is True
    assert {key[1] for key in loop.step_graphs._graphs} == {"greedy", "prefill-greedy"}
    assert loop.step_graphs.stats["captures"] == 2


def test_the_cache_key_names_regional(deep_model, tmp_path):
    model = _model(deep_model)
    options = {"backend": "eager"}
    loop = install_decode_loop(model, max_cache_len=64, compile_options=options, cache_dir=tmp_path)
    whole = loop._key(1, "greedy")
    loop.set_compile({"backend": "eager"}, regional=True)
    assert loop._key(1, "greedy") != whole
    loop.set_compile(None, regional=True)  # eager: nothing compiles, nothing regional
    assert loop.regional is False


@pytest.mark.parametrize(("facts", "mode"), [("h200", "reduce-overhead"), ("max-1550", "default")])
def test_the_plan_offers_it_when_asked_never_by_default(facts, mode):
    config = reference_config("qwen3-8b")
    plan = plan_load(config, facts=facts, fast_decode="regional")
    decision = plan.decision("fast_decode")
    assert plan.decode is not None and plan.decode.regional and decision.source == "user"
    assert decision.value == {"static_cache": True, "max_cache_len": 4096, "compile": mode, "regional": True}
    assert plan.decode.step_graph == (facts == "h200")  # the regional step captured whole, on CUDA
    assert not plan.decode.tiered  # its compile is the short one: in its first call
    assert plan.decode.loop_compile_options() == {"fullgraph": True, "dynamic": False, "mode": "default"}
    assert "regional compilation: one decoder layer compiled" in decision.reason
    assert "not the default" in decision.reason and "52 tokens/s against 249" in decision.reason
    assert plan.decode.fused_projections  # as fast_decode=True
    for asked in (True, "auto", "unfused"):
        other = plan_load(config, facts=facts, fast_decode=asked, quantize="4bit")
        assert other.decode is None or not other.decode.regional
        assert "regional" not in other.decision("fast_decode").value
    cpu = plan_load(reference_config("qwen3-0.6b"), facts="cpu", fast_decode="regional")
    off = cpu.decision("fast_decode")
    assert off.value == {"static_cache": False, "compile": False}
    assert "nothing changes on the CPU" in off.reason


def test_apply_falls_back_to_the_whole_step_without_decoder_layers():
    import torch

    from xpukit.loading.decode.fast_decode import _regional

    assert _regional(torch.nn.Linear(2, 2), False) == (False, [])
    used, events = _regional(torch.nn.Linear(2, 2), True)
    assert used is False and [(e.kind, e.what) for e in events] == [("fallback", "regional_compile")]
    assert "the whole decode step compiles" in events[0].cause


@pytest.mark.slow
def test_with_grouped_attention_and_windows_one_graph_serves_every_window(deep_model, tokenizer, tmp_path):
    from xpukit.loading.decode.attention import use_grouped_decode_attention

    reference = _model(deep_model)
    graphs: list[object] = []
    model = _model(deep_model)
    assert use_grouped_decode_attention(model) is not None
    loop = install_decode_loop(
        model, max_cache_len=64, compile_options=_counting(graphs, []), cache_dir=tmp_path, regional=True
    )
    loop.window_smallest = 16  # windows of 16, 32, 64 slots over the call's tokens
    inputs = _inputs(tokenizer, 3)
    want, margin = _plain(reference, inputs)
    assert margin > MIN_MARGIN
    assert model.generate(**inputs, max_new_tokens=NEW, do_sample=False).tolist() == want
    windows = {loop._window(state, n).shape[1] for state in loop._states.values() for n in (9, 20)}
    assert windows == {16, 32}  # the call's steps crossed from one window to the next
    assert len(graphs) == 1  # the window's length is a symbol of the layer's one graph


@pytest.mark.slow
def test_a_regional_plan_is_carried_out_and_recorded(deep_model, tokenizer, monkeypatch):
    from dataclasses import replace

    from xpukit.loading.load import carry_out, load_for_xpu
    from xpukit.planning.device import decode
    from xpukit.planning.device.decode import DecodePlan

    # On the CPU, dynamo with the eager backend stands in for inductor (the plan's settings otherwise).
    monkeypatch.setattr(decode, "compile_settings", lambda mode, **_: {"backend": "eager", "fullgraph": True})
    plan = DecodePlan(
        static_cache=True, max_cache_len=64, compile=True, compile_mode="default", regional=True
    )
    # float32, whose greedy tokens have clear margins (the first test checks them)
    model = carry_out(replace(plan_load(deep_model, fast_decode=True, dtype="float32"), decode=plan))
    loop_event = next(e for e in model.xpukit_plan.events if e.what == "decode_loop")
    assert loop_event.actual["regional"] is True and model.xpukit_decode_loop.regional
    inputs = _inputs(tokenizer, 3)
    want = load_for_xpu(deep_model, dtype="float32").generate(**inputs, max_new_tokens=NEW, do_sample=False)
    assert model.generate(**inputs, max_new_tokens=NEW, do_sample=False).tolist() == want.tolist()
    assert model.xpukit_last_decode["regional"] is True
