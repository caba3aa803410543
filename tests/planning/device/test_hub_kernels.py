"""Hub kernels from the local kernel cache, offline: the success paths of the plan's Hub attention and
``use_kernels`` decisions and of the load's fetch, with a kernel repository built here in the layout
the ``kernels`` library reads (docs/known-issues.md "kernels: the local cache layout"); the
fallbacks when a kernel cannot be had are in tests/loading/test_load.py and tests/planning/test_plan.py."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest

from xpukit import hub
from xpukit.loading.load import load_for_xpu
from xpukit.planning.plan import plan_load

pytestmark = pytest.mark.skipif(
    not hub.kernels_support().accepted, reason="needs a kernels release this transformers accepts"
)

# A Hub flash-attention kernel (the flash-attn API transformers calls), computed with SDPA and
# counting its calls.
ATTENTION = """
import torch

CALLS = []


def _sdpa(q, k, v, scale, causal):
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, heads, tokens, dim)
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return out[0].transpose(0, 1)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **kwargs):
    CALLS.append("dense")
    return torch.stack([_sdpa(q[b], k[b], v[b], softmax_scale, causal) for b in range(q.shape[0])])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, **kwargs):
    CALLS.append("varlen")
    bounds = list(zip(cu_seqlens_q.tolist(), cu_seqlens_q.tolist()[1:]))
    return torch.cat([_sdpa(q[a:b], k[a:b], v[a:b], softmax_scale, causal) for a, b in bounds])
"""


def local_kernel(cache: Path, repo: str, version: int, files: dict[str, str]) -> Path:
    """Lay out ``repo`` at ``refs/v<version>`` in a kernels cache, as the library leaves a fetched kernel:
    ``kernels--org--name/refs/v<N>`` holds a full commit id, ``snapshots/<commit>/build/<variant>``
    the files, with a ``metadata.json`` (name, version, backend, and the files' sha256 digest, which
    the library checks). ``torch-universal`` is the build variant every backend accepts."""
    commit = hashlib.sha1(f"{repo}@v{version}".encode()).hexdigest()
    root = cache / f"kernels--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / f"v{version}").write_text(commit)
    build = root / "snapshots" / commit / "build" / "torch-universal"
    build.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (build / name).write_text(text)
    digest = {n: base64.b64encode(hashlib.sha256(t.encode()).digest()).decode() for n, t in files.items()}
    name = repo.split("/")[-1]
    metadata = {
        "name": name,
        "id": name.replace("-", "_"),
        "version": version,
        "license": "Apache-2.0",
        "python-depends": [],
        "backend": {"type": "cpu"},
        "digest": {"algorithm": "sha256", "files": digest},
    }
    (build / "metadata.json").write_text(json.dumps(metadata))
    return build


def use_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``KERNELS_CACHE`` for this test. kernels < 0.18 also read it once, at import, into ``CACHE_DIR``
    constants of its modules (snapshots are looked up there; versions in the variable): set those too."""
    import importlib

    monkeypatch.setenv("KERNELS_CACHE", str(cache))
    for name in ("hf_hub", "install", "locking", "resolver"):
        try:
            module = importlib.import_module(f"kernels.{name}")
        except ImportError:
            continue
        if hasattr(module, "CACHE_DIR"):
            monkeypatch.setattr(module, "CACHE_DIR", str(cache))


def test_a_hub_attention_kernel_loads_from_the_local_cache(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from transformers import modeling_flash_attention_utils as fa

    use_cache(tmp_path, monkeypatch)
    # transformers keeps the last loaded attention kernel process-wide: put it back afterwards, and a
    # repository name of this test's own (tests/loading/test_load.py's fallback uses acme/attn-kernel).
    monkeypatch.setattr(fa, "_loaded_implementation", getattr(fa, "_loaded_implementation", None))
    local_kernel(tmp_path, "acme/local-flash", 1, {"__init__.py": ATTENTION})
    kernel = "acme/local-flash"
    plan = plan_load(tiny_model, attn=kernel, dtype="bfloat16")
    decision = plan.decision("attn_implementation")
    assert plan.attn_implementation == kernel == plan.attention_kernel
    assert "in the local kernel cache" in decision.reason
    model = load_for_xpu(plan)
    carried = model.xpukit_plan
    assert model.config._attn_implementation == kernel == carried.attn_implementation
    assert not carried.fallbacks and carried.decision("attn_implementation").source != "fallback"
    calls = fa._flash_fn.__globals__["CALLS"]  # the kernel module's own list: it is what transformers runs
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert len(calls) == model.config.num_hidden_layers  # every layer ran the Hub kernel
    reference = load_for_xpu(tiny_model, attn="sdpa", dtype="bfloat16")
    with torch.no_grad():
        torch.testing.assert_close(logits, reference(input_ids=ids).logits, rtol=0.02, atol=0.02)


def test_use_kernels_takes_its_success_path_for_cached_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For an XPU (assumed): the kernels this transformers maps Qwen3's layers to, all cached, turn
    ``use_kernels`` on and reach ``from_pretrained``; one missing keeps it off with the reason."""
    from xpukit.planning.device.layer_kernels import mapping_refs
    from xpukit.planning.model.reference_models import reference_config

    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path))
    offline = plan_load(reference_config("qwen3-0.6b"), facts="arc-b580")
    refs = mapping_refs(offline.model_facts.kernel_layers, "xpu")
    assert refs and offline.use_kernels is False
    for ref in refs:
        local_kernel(tmp_path, ref.repo, ref.version or 1, {"__init__.py": ""})
    cached = plan_load(reference_config("qwen3-0.6b"), facts="arc-b580")
    reason = cached.decision("use_kernels").reason
    assert cached.use_kernels is True and "in the local kernel cache" in reason
    assert cached.from_pretrained_kwargs()["use_kernels"] is True
