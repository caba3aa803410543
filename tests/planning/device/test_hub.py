"""Hub reachability in bounded time, kernels support, and the local kernel cache (loopback only)."""

from __future__ import annotations

import contextlib
import http.server
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from xpukit import hub
from xpukit.errors import InvalidRequestError


@pytest.fixture
def answering_server() -> Iterator[str]:
    """A loopback endpoint that answers HEAD / with 200."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.timeout(30)
def test_silent_endpoint_is_unreachable_within_the_bound(silent_endpoint):
    status = hub._probe(silent_endpoint, 0.5)
    assert not status.reachable and not status.offline
    assert "no answer" in status.reason and "0.5" in status.reason


def test_answering_endpoint_is_reachable(answering_server):
    status = hub._probe(answering_server, 5.0)
    assert status.reachable and status.usable and "HTTP 200" in status.reason


def test_refused_connection_is_unreachable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    status = hub._probe(f"http://127.0.0.1:{port}", 5.0)
    assert not status.reachable and "not reachable" in status.reason


def test_offline_never_probes(monkeypatch):
    monkeypatch.setattr(hub, "_probe", lambda *a: pytest.fail("probed while offline"))
    status = hub.hub_status()  # conftest sets HF_HUB_OFFLINE=1
    assert status.offline and not status.usable and "HF_HUB_OFFLINE" in status.reason


def test_status_is_cached_per_endpoint(monkeypatch, answering_server):
    calls: list[str] = []

    def probe(endpoint: str, timeout: float) -> hub.HubStatus:
        calls.append(endpoint)
        return hub.HubStatus(endpoint=endpoint, offline=False, reachable=True, reason="stub")

    monkeypatch.setattr(hub, "hub_offline", lambda: False)
    monkeypatch.setattr(hub, "hub_endpoint", lambda: answering_server)
    monkeypatch.setattr(hub, "_probe", probe)
    monkeypatch.setattr(hub, "_STATUS_CACHE", {})
    assert hub.hub_status().usable and hub.hub_status().usable
    assert calls == [answering_server]
    hub.hub_status(refresh=True)
    assert len(calls) == 2


def test_a_failure_is_kept_a_minute_a_success_longer(monkeypatch):
    now = [1000.0]
    answers = [False, True, False]
    calls: list[bool] = []

    def probe(endpoint: str, timeout: float) -> hub.HubStatus:
        calls.append(answers[len(calls)])
        return hub.HubStatus(endpoint=endpoint, offline=False, reachable=calls[-1], reason="stub")

    monkeypatch.setattr(hub, "hub_offline", lambda: False)
    monkeypatch.setattr(hub, "_probe", probe)
    monkeypatch.setattr(hub, "_STATUS_CACHE", {})
    monkeypatch.setattr(hub.time, "monotonic", lambda: now[0])
    assert not hub.hub_status().usable  # a slow first check fails...
    now[0] += hub.FAILURE_TTL_S - 1
    assert not hub.hub_status().usable and len(calls) == 1  # ...and is believed for a while...
    now[0] += 2
    assert hub.hub_status().usable and len(calls) == 2  # ...but not for good
    now[0] += hub.FAILURE_TTL_S * 10
    assert hub.hub_status().usable and len(calls) == 2  # a success is kept longer
    now[0] += hub.SUCCESS_TTL_S
    assert not hub.hub_status().usable and len(calls) == 3


def test_unusable_hub_messages_say_how_to_check_again():
    from xpukit.planning.device.attention import KernelRef, obtainable

    class Unreachable:  # the Hub's facts, hand-made: kernels accepted, nothing cached, no answer
        def kernels(self) -> hub.KernelsSupport:
            return hub.KernelsSupport(
                installed="1", required=None, transformers="5", accepted=True, reason="ok"
            )

        def cached(self, repo: str, *, version: int | None, revision: str | None) -> bool:
            return False

        def status(self) -> hub.HubStatus:
            return hub.HubStatus(endpoint="x", offline=False, reachable=False, reason="no answer")

        def import_offline(self, module: str) -> contextlib.nullcontext[None]:
            return contextlib.nullcontext()

    ok, why = obtainable([KernelRef(repo="acme/none", version=1)], Unreachable())
    assert not ok and "hub_status(refresh=True)" in why and "HF_HUB_OFFLINE" in why


def test_timeouts_are_validated(monkeypatch):
    for raw in ("inf", "nan", "-1", "0"):
        monkeypatch.setenv("XPUKIT_HUB_TIMEOUT", raw)
        with pytest.raises(InvalidRequestError, match="XPUKIT_HUB_TIMEOUT"):
            hub.hub_timeout()
    monkeypatch.setenv("XPUKIT_HUB_TIMEOUT", "1e12")
    assert hub.hub_timeout() == hub.MAX_HUB_TIMEOUT
    monkeypatch.setenv("XPUKIT_HUB_FETCH_TIMEOUT", "1e300")
    assert hub.fetch_timeout() == hub.MAX_FETCH_TIMEOUT
    monkeypatch.delenv("XPUKIT_HUB_FETCH_TIMEOUT")
    monkeypatch.setenv("XPUKIT_HUB_TIMEOUT", "0.25")
    assert hub.hub_timeout() == 0.25
    monkeypatch.setenv("XPUKIT_HUB_TIMEOUT", "soon")
    with pytest.raises(InvalidRequestError, match="XPUKIT_HUB_TIMEOUT"):
        hub.hub_timeout()
    monkeypatch.delenv("XPUKIT_HUB_FETCH_TIMEOUT", raising=False)
    assert hub.fetch_timeout() == hub.DEFAULT_FETCH_TIMEOUT


@pytest.mark.timeout(30)
def test_run_bounded():
    assert hub.run_bounded(lambda: 41 + 1, 5, "add") == 42
    with pytest.raises(KeyError):
        hub.run_bounded(lambda: {}["x"], 5, "lookup")
    release = threading.Event()
    with pytest.raises(TimeoutError, match=r"did not finish within 0\.2 s"):
        hub.run_bounded(release.wait, 0.2, "wait")
    release.set()


def test_offline_guard_sets_and_restores():
    from huggingface_hub import constants

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = False
    try:
        with hub.offline_guard(True):
            assert constants.HF_HUB_OFFLINE is True
        assert constants.HF_HUB_OFFLINE is False
        with hub.offline_guard(False):
            assert constants.HF_HUB_OFFLINE is False
    finally:
        constants.HF_HUB_OFFLINE = before


def test_kernels_support_reads_transformers_window(monkeypatch):
    hub.kernels_support.cache_clear()
    try:
        support = hub.kernels_support()
        assert support.installed is not None and support.required  # the dev set has kernels installed
        monkeypatch.setattr(hub, "_transformers_kernels_requirement", lambda: ">=99.0,<100")
        hub.kernels_support.cache_clear()
        rejected = hub.kernels_support()
        assert not rejected.accepted
        assert f"kernels {support.installed} is installed, but transformers" in rejected.reason
        assert 'pip install "kernels>=99.0,<100"' in rejected.reason
        monkeypatch.setattr(hub, "is_installed", lambda module: False)
        hub.kernels_support.cache_clear()
        assert "xpukit[kernels]" in hub.kernels_support().reason
    finally:
        hub.kernels_support.cache_clear()


def test_kernel_cache_lookup(monkeypatch, tmp_path):
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path))
    repo = tmp_path / "kernels--kernels-community--flash-attn2"
    assert not hub.kernel_cached("kernels-community/flash-attn2", version=4)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "v4").write_text("abc\n")
    assert not hub.kernel_cached("kernels-community/flash-attn2", version=4)  # ref without snapshot
    (repo / "snapshots" / "abc").mkdir(parents=True)
    assert hub.kernel_cached("kernels-community/flash-attn2", version=4)
    assert not hub.kernel_cached("kernels-community/flash-attn2", version=3)
    assert hub.kernel_cached("kernels-community/flash-attn2", revision="abc")
    assert hub.kernel_cached("kernels-community/flash-attn2")  # any version


def test_importing_hub_is_light():
    import subprocess
    import sys

    code = (
        "import sys, xpukit.hub; "
        "print(sorted({'torch', 'transformers', 'huggingface_hub', 'kernels'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_probe_bound_holds_while_dns_or_connect_hang(monkeypatch):
    # Whatever blocks inside the request (here a stubbed urlopen), the caller waits only the bound.
    import urllib.request

    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: time.sleep(30))
    status = hub._probe("https://hub.invalid", 0.3)
    assert not status.reachable and "no answer" in status.reason
