"""test_continuation's lost engines, the stalled half: an engine stopped (SIGSTOP) or
drained past its grace period (SIGTERM). A file of its own so that a second test worker
runs it beside the killed half (each case starts two engines and a router and streams
2 x 3,000 tokens)."""

from __future__ import annotations

import pytest

from tests.e2e.test_continuation import lose_an_engine, processes  # noqa: F401 (processes: a fixture)


@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGTERM"])
def test_a_stalled_or_drained_engines_streams_continue_elsewhere_token_exact(processes, fault):  # noqa: F811
    lose_an_engine(processes, fault)
