"""bench-kv-tier's code path at a tiny shape: the second turn reads its evicted history
from the host tier and only from it (the full run is `make bench-kv-tier`)."""

from __future__ import annotations

from omnibus.bench import kv_tier
from omnibus.bench.shapes import TINY


def test_turn_two_reads_its_history_from_the_tier_and_recomputes_it_without():
    results = kv_tier.run(TINY, 64, rounds=1, offload_bytes=1 << 20)
    (recompute,), (tier,) = results["recompute"], results["host tier"]
    assert recompute.cached_tokens == 0 and tier.cached_tokens == 64
    assert results["loads"][0].cached_tokens == 4 and recompute.ttft_ms > 0 and tier.ttft_ms > 0
    text = kv_tier.markdown(results, TINY, 64)
    assert "| host tier |" in text and "Host tier loads over the run: 4 blocks." in text
