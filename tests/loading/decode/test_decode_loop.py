"""xpukit's decode loop on the CPU: token-identical to transformers' generate, sampling, EOS, fallback.

The reference is transformers' own ``generate`` with the same static cache, uncompiled, on the tiny
qwen3 in float32. Its greedy logits are checked to be far from ties (``MIN_MARGIN``), so an equal
result means the loops agree, and deliberately wrong loops (a first new position or a mask that
ignore the left padding) are shown to be caught; shifting every prompt position by the same amount
is not a mistake (rotary embeddings see only relative positions), so it is not among them. The
compiled step is traced by dynamo with a counting backend (``fullgraph=True``): one graph for every
prompt length, one more per batch size.
"""

from __future__ import annotations

import pytest

from xpukit.errors import InvalidRequestError
from xpukit.loading.decode import compile_cache
from xpukit.loading.decode import loop as decode_loop
from xpukit.loading.decode import runner as decode_runner
from xpukit.loading.decode import step as decode_step
from xpukit.loading.decode.install import install_decode_loop

PROMPTS = [
    "the quick brown fox",
    "a",
    "when the bell rings in the morning",
    "bread",
    "x y",
    "fox",
    "the",
    "ok",
]
NEW = 12
# The smallest gap between the best and the second-best logit along the reference's greedy path:
# measured 6.6e-3 on the tiny qwen3 (logits' std 1.6), three orders above float32's differences
# between two ways of computing the same forward (~1e-6).
MIN_MARGIN = 1e-3


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
def reference(tiny_model):
    return _model(tiny_model)


@pytest.fixture
def fast(tiny_model):
    model = _model(tiny_model)
    install_decode_loop(model, max_cache_len=256, compile_options=None)
    return model


def _inputs(tokenizer, batch):
    return dict(tokenizer(PROMPTS[:batch], return_tensors="pt", padding=True))


def _transformers(model, inputs, **kwargs):
    import torch

    with torch.no_grad():
        return model.generate(**inputs, cache_implementation="static", disable_compile=True, **kwargs)


def test_the_reference_logits_are_not_near_ties(reference, tokenizer):
    import torch

    out = _transformers(
        reference,
        _inputs(tokenizer, 8),
        max_new_tokens=NEW,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    top = torch.stack(out.scores, 1).topk(2, -1).values
    assert (top[..., 0] - top[..., 1]).min().item() > MIN_MARGIN


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_is_token_identical_to_transformers(fast, reference, tokenizer, batch):
    inputs = _inputs(tokenizer, batch)
    want = _transformers(reference, inputs, max_new_tokens=NEW, do_sample=False)
    got = fast.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    assert fast.xpukit_last_decode == {
        "loop": "xpukit",
        "reason": "greedy",
        "batch": batch,
        "new_tokens": NEW,
        "compiled": False,
        "cudagraphs": False,
        "step_graphs": False,
    }
    assert got.tolist() == want.tolist()
    # A second call reuses the batch's cache and buffers: the same again.
    assert fast.generate(**inputs, max_new_tokens=NEW, do_sample=False).tolist() == want.tolist()


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_grouped_decode_attention_gives_the_same_tokens(tiny_model, reference, tokenizer, batch):
    """What fast_decode runs on CUDA (the loop with grouped decode attention), eager on the CPU."""
    from xpukit.loading.decode.attention import use_grouped_decode_attention

    model = _model(tiny_model)
    assert use_grouped_decode_attention(model) is not None
    install_decode_loop(model, max_cache_len=256, compile_options=None)
    inputs = _inputs(tokenizer, batch)  # left-padded: the mask matters
    want = _transformers(reference, inputs, max_new_tokens=NEW, do_sample=False)
    assert model.generate(**inputs, max_new_tokens=NEW, do_sample=False).tolist() == want.tolist()
    assert model.xpukit_last_decode["loop"] == "xpukit"


@pytest.mark.parametrize(
    "wrong",
    [
        # the padded length as the first new position (the cache position): wrong for padded rows
        (
            decode_step,
            "first_new_position",
            lambda positions: positions.new_full((positions.shape[0], 1), positions.shape[1]),
        ),
        (decode_loop, "_fill_mask", lambda cache_mask, mask: cache_mask.fill_(1)),
    ],
    ids=["position-ignores-padding", "mask-ignores-padding"],
)
def test_a_wrong_loop_is_caught(fast, reference, tokenizer, monkeypatch, wrong):
    inputs = _inputs(tokenizer, 8)
    want = _transformers(reference, inputs, max_new_tokens=NEW, do_sample=False)
    monkeypatch.setattr(*wrong)
    got = fast.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    assert got.shape == want.shape and got.tolist() != want.tolist()


@pytest.mark.parametrize("check_every", [2, 16])
def test_eos_stops_rows_pads_after_and_trims_like_transformers(fast, reference, tokenizer, check_every):
    inputs = _inputs(tokenizer, 8)
    plain = _transformers(reference, inputs, max_new_tokens=24, do_sample=False)
    prompt_len = inputs["input_ids"].shape[1]
    # Two EOS ids that every row's greedy continuation reaches early: each row's third new token
    # and the first row's first, so rows stop at different steps.
    eos = sorted({int(t) for t in plain[:, prompt_len + 2]} | {int(plain[0, prompt_len])})
    kwargs = {"max_new_tokens": 24, "do_sample": False, "eos_token_id": eos, "pad_token_id": 3}
    want = _transformers(reference, inputs, **kwargs)
    fast.xpukit_decode_loop.check_every = check_every
    got = fast.generate(**inputs, **kwargs)
    assert fast.xpukit_last_decode["loop"] == "xpukit"
    assert want.shape[1] < prompt_len + 24  # all rows stopped early, so the output is shorter
    assert got.tolist() == want.tolist()
    assert (got[:, prompt_len:] == 3).any()  # padded after EOS
    # min_new_tokens suppresses EOS for the first tokens, as transformers does.
    kwargs["min_new_tokens"] = 4
    assert fast.generate(**inputs, **kwargs).tolist() == _transformers(reference, inputs, **kwargs).tolist()


def test_sampling_is_seeded_and_stays_inside_top_k(fast):
    import torch

    ids = torch.tensor([[5, 6], [7, 8], [9, 10], [11, 12]])  # no padding: teacher forcing below is plain
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def sample(seed, **kwargs):
        torch.manual_seed(seed)
        return fast.generate(**inputs, max_new_tokens=16, min_new_tokens=16, do_sample=True, **kwargs)

    first = sample(0, top_k=3, temperature=1.5)
    assert fast.xpukit_last_decode["reason"] == "sampling"
    assert sample(0, top_k=3, temperature=1.5).tolist() == first.tolist()
    assert sample(1, top_k=3, temperature=1.5).tolist() != first.tolist()
    with torch.no_grad():
        logits = fast(input_ids=first).logits[:, :-1]  # teacher forcing over the sampled sequence
    chosen = first[:, 1:].unsqueeze(-1)
    rank = (logits > logits.gather(-1, chosen)).sum(-1)[:, inputs["input_ids"].shape[1] - 1 :]
    assert int(rank.max()) < 3 and int(rank.max()) > 0  # inside the top 3, and not always the best
    nucleus = sample(0, top_p=0.3, top_k=0)
    assert nucleus.shape == first.shape and fast.xpukit_last_decode["loop"] == "xpukit"
    # A nucleus this small keeps only the best token, with or without top-k first: greedy again.
    greedy = fast.generate(**inputs, max_new_tokens=16, min_new_tokens=16, do_sample=False).tolist()
    for top_k in (0, 5):
        assert sample(2, top_p=1e-6, top_k=top_k).tolist() == greedy


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"num_beams": 2}, "num_beams=2"),
        ({"repetition_penalty": 1.3}, "repetition_penalty=1.3"),
        ({"output_scores": True, "return_dict_in_generate": True}, "output_scores=True"),
        ({"logits_processor": "list"}, "argument logits_processor"),
        # a 254-token prompt and 4 new tokens: past the cache as surely as 300 new tokens, for 4 steps
        ({"prompt_tokens": 254}, "prompt + new tokens = 258 exceed the static cache (256)"),
    ],
)
def test_other_calls_go_to_transformers_and_say_so(fast, reference, tokenizer, kwargs, reason):
    from transformers import LogitsProcessorList

    if kwargs.get("logits_processor") == "list":
        kwargs = {"logits_processor": LogitsProcessorList()}
    inputs = _inputs(tokenizer, 2)
    if "prompt_tokens" in kwargs:
        n = kwargs.pop("prompt_tokens")
        inputs = dict(
            tokenizer([" ".join(PROMPTS * 40)] * 2, return_tensors="pt", truncation=True, max_length=n)
        )
        assert inputs["input_ids"].shape == (2, n)
    call = {"max_new_tokens": 4, "do_sample": False} | kwargs
    got = fast.generate(**inputs, **call)
    assert fast.xpukit_last_decode["loop"] == "transformers"
    assert reason in fast.xpukit_last_decode["reason"]
    want = _transformers(reference, inputs, **call)
    assert getattr(got, "sequences", got).tolist() == getattr(want, "sequences", want).tolist()


def test_the_switch_sends_every_call_to_transformers(fast, tokenizer):
    fast.xpukit_decode_loop.enabled = False
    fast.generate(**_inputs(tokenizer, 2), max_new_tokens=3, do_sample=False)
    assert fast.xpukit_last_decode["loop"] == "transformers"
    assert "switched off" in fast.xpukit_last_decode["reason"]


def _counting(graphs):
    """Compile options whose backend records each graph dynamo hands it and runs it as traced."""

    def counting(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    return {"backend": counting, "fullgraph": True, "dynamic": False}


@pytest.mark.slow
def test_the_compiled_step_is_one_graph_for_every_prompt_length(tiny_model, reference, tokenizer, tmp_path):
    graphs: list[object] = []
    model = _model(tiny_model)
    options = _counting(graphs)
    loop = install_decode_loop(model, max_cache_len=256, compile_options=options, cache_dir=tmp_path)
    for prompts in (PROMPTS[:2], PROMPTS[2:4]):
        inputs = dict(tokenizer(prompts, return_tensors="pt", padding=True))
        want = _transformers(reference, inputs, max_new_tokens=NEW, do_sample=False)
        assert model.generate(**inputs, max_new_tokens=NEW, do_sample=False).tolist() == want.tolist()
        assert model.xpukit_last_decode["compiled"] is True
    assert len(graphs) == 1  # the second prompt length did not recompile
    model.generate(**_inputs(tokenizer, 3), max_new_tokens=4, do_sample=False)
    assert len(graphs) == 2 and loop.graphs == {(2, "greedy"), (3, "greedy")}
    # Nothing to load in a fresh cache dir; each new graph's save is recorded (saved, or why not:
    # the counting backend leaves torch no artifacts of its own), never raised.
    assert [(r["batch"], r["loaded"]) for r in loop.cache_records] == [(2, False), (3, False)]
    assert all(r.get("saved") or r.get("error") for r in loop.cache_records)


def test_own_step_graphs_capture_once_replay_every_token_and_follow_the_weights(
    tiny_model, reference, tokenizer, monkeypatch, rerun_graphs
):
    import torch

    from xpukit.loading.decode.step_graph import StepGraphs

    model = _model(tiny_model)
    loop = install_decode_loop(model, max_cache_len=256, compile_options=None)
    options = {"backend": "eager", "fullgraph": True, "dynamic": False}
    with pytest.raises(InvalidRequestError, match="reduce-overhead"):
        loop.set_compile(options | {"mode": "reduce-overhead"}, step_graphs=True)
    loop.set_compile(options)
    backend = rerun_graphs()
    loop.step_graphs = StepGraphs(backend)
    monkeypatch.setattr(decode_loop, "_KEEP_BATCH_SIZES", 1)
    inputs = _inputs(tokenizer, 3)
    want = _transformers(reference, inputs, max_new_tokens=NEW, do_sample=False)
    for _ in range(2):  # the first call warms and captures, the second only replays
        assert model.generate(**inputs, max_new_tokens=NEW, do_sample=False).tolist() == want.tolist()
        assert model.xpukit_last_decode["step_graphs"] is True
    # The prompt (padded to its 16-token bucket) is warmed by the first call's prefill and captured by
    # the second's; the step: NEW - 1 a call, one warm run, then replays (the capture's own step is
    # its first replay).
    assert sorted(loop.step_graphs._graphs, key=str) == [
        ((3, 256), "greedy", None),
        ((3, 256), "prefill-greedy", 16),
    ]
    assert loop.step_graphs.stats == {
        "captures": 2,
        "replays": 2 * (NEW - 1) - 1 + 1,
        "dropped": 0,
        "uncaptured_while_building": 0,
    }
    # New weights at a new address: the captures read the old ones, so they are dropped and made again.
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight * 1.0)
    assert model.generate(**inputs, max_new_tokens=NEW, do_sample=False).tolist() == want.tolist()
    assert loop.step_graphs.stats["dropped"] == 2 and loop.step_graphs.stats["captures"] == 3
    # Another batch size evicts the first state (one kept here): its captures go with it.
    model.generate(**_inputs(tokenizer, 2), max_new_tokens=4, do_sample=False)
    assert [key[0] for key in loop.step_graphs._graphs] == [(2, 256)]
    assert backend.captured == 4


@pytest.mark.parametrize("batch", [1, 3])
def test_windows_and_prompt_buckets_give_transformers_tokens(
    tiny_model, reference, tokenizer, batch, rerun_graphs
):
    """With grouped decode attention a step reads only its window of the cache; with own graphs the
    prompt is left-padded to its bucket. Windows of 16 and 32 slots here, of a 256-slot cache."""
    from xpukit.loading.decode.attention import use_grouped_decode_attention
    from xpukit.loading.decode.step_graph import StepGraphs

    model = _model(tiny_model)
    assert use_grouped_decode_attention(model) is not None
    loop = install_decode_loop(model, max_cache_len=256, compile_options=None)
    loop.window_smallest = 16
    loop.step_graphs = StepGraphs(rerun_graphs())
    inputs = _inputs(tokenizer, batch)
    new = 16  # a prefill of the prompt's bucket (16 slots), then steps that fill slots 17 to 31
    want = _transformers(reference, inputs, max_new_tokens=new, do_sample=False)
    for _ in range(2):  # warm runs, then captures and replays
        assert model.generate(**inputs, max_new_tokens=new, do_sample=False).tolist() == want.tolist()
    state = loop._states[(batch, 256)]
    assert sorted(state.windows) == [16, 32] and sorted(state.prompts) == [16]
    assert {key[1:] for key in loop.step_graphs._graphs} == {("prefill-greedy", 16), ("greedy", 32)}


def test_a_prompt_past_the_largest_bucket_runs_its_prefill_uncaptured(
    tiny_model, reference, tokenizer, monkeypatch, rerun_graphs
):
    from xpukit.loading.decode import buckets
    from xpukit.loading.decode.step_graph import StepGraphs

    model = _model(tiny_model)
    loop = install_decode_loop(model, max_cache_len=256, compile_options=None)
    loop.step_graphs = StepGraphs(rerun_graphs())
    monkeypatch.setattr(buckets, "PREFILL_LARGEST", 4)  # the 9-token prompt is past it
    inputs = _inputs(tokenizer, 3)
    want = _transformers(reference, inputs, max_new_tokens=NEW, do_sample=False)
    for _ in range(2):
        assert model.generate(**inputs, max_new_tokens=NEW, do_sample=False).tolist() == want.tolist()
    assert [key[1] for key in loop.step_graphs._graphs] == ["greedy"]
    assert sorted(loop._states[(3, 256)].prompts) == [inputs["input_ids"].shape[1]]  # not padded


def test_a_window_too_short_is_caught(tiny_model, reference, tokenizer, monkeypatch):
    from xpukit.loading.decode.attention import use_grouped_decode_attention

    model = _model(tiny_model)
    use_grouped_decode_attention(model)
    loop = install_decode_loop(model, max_cache_len=256, compile_options=None)
    loop.window_smallest = 4
    inputs = _inputs(tokenizer, 3)
    want = _transformers(reference, inputs, max_new_tokens=NEW, do_sample=False)
    monkeypatch.setattr(decode_runner, "window_length", lambda needed, cache_len, smallest: needed - 1)
    got = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    assert got.shape == want.shape and got.tolist() != want.tolist()


@pytest.mark.slow
def test_one_compiled_step_serves_every_window(tiny_model, reference, tokenizer, tmp_path):
    from xpukit.loading.decode.attention import use_grouped_decode_attention

    graphs: list[object] = []
    model = _model(tiny_model)
    use_grouped_decode_attention(model)
    options = _counting(graphs)
    loop = install_decode_loop(model, max_cache_len=256, compile_options=options, cache_dir=tmp_path)
    loop.window_smallest = 8
    inputs = _inputs(tokenizer, 2)
    want = _transformers(reference, inputs, max_new_tokens=40, do_sample=False)
    assert model.generate(**inputs, max_new_tokens=40, do_sample=False).tolist() == want.tolist()
    assert sorted(loop._states[(2, 256)].windows) == [16, 32, 64]  # a 9-token prompt, 40 new tokens
    assert len(graphs) == 1  # the window's length is a symbol in the one graph


# --- the compile cache ------------------------------------------------------------------------------


def _fields(**changes):
    base = {
        "model_config": {"model_type": "qwen3", "hidden_size": 64, "_name_or_path": "/a"},
        "dtype": "bfloat16",
        "device_name": "NVIDIA H200",
        "batch_size": 1,
        "cache_len": 4096,
        "step": "greedy",
        "compile_options": {"mode": "reduce-overhead", "fullgraph": True},
        "versions": {"torch": "2.11.0", "transformers": "5.17.0"},
    }
    return compile_cache.key_fields(**(base | changes))


def test_the_cache_key_changes_with_what_changes_the_graph():
    key = compile_cache.cache_key(_fields())
    assert key == compile_cache.cache_key(_fields()) and len(key) == 32
    same = _fields(model_config={"hidden_size": 64, "model_type": "qwen3", "_name_or_path": "/b"})
    assert compile_cache.cache_key(same) == key  # the checkpoint's path is not the graph
    for change in (
        {"dtype": "float16"},
        {"model_config": {"model_type": "qwen3", "hidden_size": 128}},
        {"versions": {"torch": "2.12.0", "transformers": "5.17.0"}},
        {"device_name": "Intel(R) Data Center GPU Max 1550"},
        {"batch_size": 8},
        {"cache_len": 256},
        {"step": "sample-k50"},
        {"compile_options": {"mode": "default", "fullgraph": True}},
        {"versions": {"torch": "2.11.0", "transformers": "5.17.0", "torchao": "0.18.0"}},
        {"weights": {"weights": "torchao Int8WeightOnlyConfig", "fused": False}},
        {"weights": {"weights": "bfloat16", "fused": True}},
        {"weights": {"capability": "(9, 0)"}},
    ):
        assert compile_cache.cache_key(_fields(**change)) != key, change


def test_the_cache_dir_follows_xpukit_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XPUKIT_CACHE_DIR", str(tmp_path))
    assert compile_cache.compile_cache_dir() == tmp_path / "compile"


def test_artifacts_round_trip_and_an_unwritable_dir_is_recorded(monkeypatch, tmp_path):
    import torch

    loaded = []
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"graphs", None))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda blob: loaded.append(blob) or object())
    assert compile_cache.load_artifacts("k", tmp_path) == {"loaded": False, "path": str(tmp_path / "k.bin")}
    saved = compile_cache.save_artifacts("k", tmp_path)
    assert saved["saved"] and saved["bytes"] == 6 and (tmp_path / "k.bin").read_bytes() == b"graphs"
    assert compile_cache.load_artifacts("k", tmp_path)["loaded"] and loaded == [b"graphs"]
    assert [p.name for p in tmp_path.iterdir()] == ["k.bin"]  # no temporary file left

    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    record = compile_cache.save_artifacts("k", blocked / "compile")
    assert record["saved"] is False and "Error" in record["error"]
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        record = compile_cache.save_artifacts("k", read_only)
        # root writes anyway; anyone else gets the error recorded
        assert record["saved"] or "PermissionError" in record["error"]
    finally:
        read_only.chmod(0o700)

    def broken(blob):
        raise RuntimeError("artifacts of another torch")

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", broken)
    record = compile_cache.load_artifacts("k", tmp_path)
    assert record["loaded"] is False and "another torch" in record["error"]


def test_the_selftest_decode_line_times_the_first_token_and_compares_compiled_with_eager(
    monkeypatch, tmp_path
):
    import torch

    from xpukit.doctor import selftest
    from xpukit.planning.device import decode

    # On the CPU, dynamo's aot_eager backend stands in for inductor: the same ahead-of-time build, fast.
    monkeypatch.setenv("XPUKIT_CACHE_DIR", str(tmp_path))
    options = {"backend": "aot_eager", "fullgraph": True, "dynamic": False}
    monkeypatch.setattr(decode, "compile_settings", lambda mode: dict(options))
    state = torch.random.get_rng_state()
    detail = selftest._decode_check(torch, "cpu", "cpu")
    assert detail.startswith("first token ") and "(eager tier)" in detail, detail
    assert "compiled step ready" in detail and "its tokens equal eager" in detail
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is untouched

    from xpukit.loading.decode import tiers

    build = tiers.build_step

    def wrong(torch, step, options, args):  # a compiled step that writes token 3 over its output
        built = build(torch, step, options, args)

        def run(*args):
            built(*args)
            args[7].fill_(3)  # decode_step's out

        return run

    monkeypatch.setattr(tiers, "build_step", wrong)
    monkeypatch.setenv("XPUKIT_CACHE_DIR", str(tmp_path / "fresh"))  # not the saved right one
    with pytest.raises(ArithmeticError, match="differ from eager from new token 0"):
        selftest._decode_check(torch, "cpu", "cpu")
