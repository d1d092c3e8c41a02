"""Serving metrics on hand-made timings."""

from __future__ import annotations

import math

import pytest

from omnibus.bench.stats import RequestResult, Slo, percentile, stored_token_seconds, summarize


def test_percentile_interpolates_linearly():
    v = [4.0, 1.0, 3.0, 2.0]
    assert percentile(v, 50) == 2.5
    assert percentile(v, 90) == pytest.approx(3.7)
    assert percentile(v, 99) == pytest.approx(3.97)
    assert percentile(v, 0) == 1.0 and percentile(v, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(v, 101)


def _result(i, sent, times, counts, end, code="OK", prompt=10):
    return RequestResult(
        index=i,
        prompt_tokens=prompt,
        max_tokens=sum(counts),
        sent=sent,
        token_times=times,
        token_counts=counts,
        end=end,
        code=code,
    )


def test_per_request_metrics():
    r = _result(0, 1.0, [1.5, 1.6, 1.9], [1, 2, 1], 2.0)
    assert r.ttft == pytest.approx(0.5)
    assert r.output_tokens == 4
    assert r.tpot == pytest.approx(0.4 / 3)  # (1.9 - 1.5) / (4 - 1)
    assert r.itls == pytest.approx([0.1, 0.3])
    assert r.e2e == pytest.approx(1.0)
    one = _result(1, 0.0, [0.2], [1], 0.2)
    assert one.tpot is None and one.itls == []


def test_summary_throughput_latency_and_goodput():
    results = [
        _result(0, 0.0, [0.1, 0.2, 0.3], [1, 1, 1], 0.3),  # ttft 100 ms, tpot 100 ms
        _result(1, 0.0, [0.5, 0.6], [1, 1], 0.6),  # ttft 500 ms, tpot 100 ms
        _result(2, 1.0, [1.1, 1.5], [1, 1], 2.0),  # ttft 100 ms, tpot 400 ms
        _result(3, 1.0, [], [], 1.5, code="RESOURCE_EXHAUSTED"),
    ]
    s = summarize(results, slo=Slo(ttft_s=0.2, tpot_s=0.2))
    assert s["duration_s"] == 2.0
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["failures_by_code"] == {"RESOURCE_EXHAUSTED": 1}
    assert s["output_tokens"] == 7 and s["prompt_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(3.5)
    assert s["total_token_throughput"] == pytest.approx(18.5)
    assert s["ttft_ms"]["p50"] == pytest.approx(100)
    assert s["ttft_ms"]["mean"] == pytest.approx(700 / 3)
    assert s["tpot_ms"]["p90"] == pytest.approx(340)  # [100, 100, 400]: rank 1.8
    assert s["itl_ms"]["p50"] == pytest.approx(100)  # gaps [100, 100, 100, 400]
    assert s["e2e_ms"]["p99"] == pytest.approx(600 + 0.98 * 400)
    assert s["good_requests"] == 1 and s["goodput"] == pytest.approx(0.5)
    assert s["slo"] == "TTFT <= 200 ms, TPOT <= 200 ms"


def test_goodput_without_slos_counts_every_completed_request():
    results = [_result(0, 0.0, [0.1], [1], 0.5), _result(1, 0.0, [], [], 0.5, code="CANCELLED")]
    s = summarize(results, duration=2.0)
    assert s["good_requests"] == 1 and s["goodput"] == 0.5 and s["slo"] == "none"


def test_an_aborted_stream_is_a_failure_not_a_completed_request():
    """A drain that runs out ends a stream OK with finish ABORTED, short of max_tokens: it
    counted as completed, its partial tokens in throughput and its short E2E in latency."""
    cut = _result(1, 0.0, [0.1], [1], 0.2)
    cut.finish_reason = "ABORTED"
    s = summarize([_result(0, 0.0, [0.1, 0.2], [1, 1], 0.4), cut], duration=1.0)
    assert (s["completed"], s["failed"], s["failures_by_code"]) == (1, 1, {"ABORTED": 1})
    assert s["output_tokens"] == 2 and s["good_requests"] == 1


def test_e2e_slo():
    assert Slo(e2e_s=1.0).met(_result(0, 0.0, [0.1], [1], 0.9))
    assert not Slo(e2e_s=1.0).met(_result(0, 0.0, [0.1], [1], 1.1))


def test_stored_token_seconds():
    # prompt 10: holds 11 tokens for 0.5 s, 13 for 0.25 s, then finishes.
    r = _result(0, 0.0, [0.5, 1.0], [1, 2], 1.25)
    assert stored_token_seconds([r]) == pytest.approx(11 * 0.5 + 13 * 0.25)
    assert stored_token_seconds([_result(1, 0.0, [], [], 1.0, code="CANCELLED")]) == 0.0
