"""Fixtures of the decode loop's CPU tests."""

from __future__ import annotations

import contextlib
import types

import pytest


class ReRunGraphs:
    """A stand-in for a device's graph API: a capture keeps the step without running it, and a
    replay runs it again, so the loop is right only if it replays each captured step exactly once."""

    def __init__(self):
        self.captured = 0

    def new_graph(self):
        return types.SimpleNamespace(replay=None)

    def pool(self):
        return object()

    def capture(self, graph, body, pool):
        self.captured += 1
        graph.replay = body

    def synchronize(self):
        pass

    def side_stream(self):
        return contextlib.nullcontext()


@pytest.fixture
def rerun_graphs() -> type[ReRunGraphs]:
    """The stand-in graph API for the decode loop's CPU tests (:class:`ReRunGraphs`)."""
    return ReRunGraphs
