"""Workload distributions of the serving benchmark: seeded, exact lengths and caps."""

from __future__ import annotations

import statistics

import pytest

from omnibus.bench import workloads
from omnibus.bench.workloads import AnyscaleSpec, LogNormal, ShareGptSpec, build_requests


def test_anyscale_defaults_are_the_2023_benchmark():
    spec = AnyscaleSpec()
    assert (spec.input_len, spec.mean_output, spec.cap) == (512, 128.0, 512)
    assert workloads.ANYSCALE_CAPS == (32, 128, 512, 1536)


def test_anyscale_prompts_are_exact_and_outputs_capped():
    reqs = build_requests(AnyscaleSpec(input_len=40, mean_output=20, cap=32), 400, 1000, seed=5)
    assert {len(r.prompt_ids) for r in reqs} == {40}
    outs = [r.max_tokens for r in reqs]
    assert min(outs) >= 1 and max(outs) == 32  # Exp(20) exceeds 32 about 20% of the time
    assert sum(o == 32 for o in outs) > 40
    assert all(3 <= t < 1000 for r in reqs for t in r.prompt_ids)


def test_anyscale_mean_of_uncapped_outputs():
    reqs = build_requests(AnyscaleSpec(input_len=1, mean_output=50, cap=100_000), 4000, 10, seed=0)
    assert statistics.fmean(r.max_tokens for r in reqs) == pytest.approx(50, rel=0.05)


def test_cap_one_makes_every_output_one_token():
    reqs = build_requests(AnyscaleSpec(input_len=3, mean_output=128, cap=1), 50, 10)
    assert {r.max_tokens for r in reqs} == {1}


def test_same_seed_same_requests_other_seed_other():
    spec = AnyscaleSpec(input_len=16, mean_output=8, cap=64)
    a, b = build_requests(spec, 20, 500, seed=1), build_requests(spec, 20, 500, seed=1)
    assert a == b
    assert build_requests(spec, 20, 500, seed=2) != a


def test_mixes_do_not_change_lengths_or_prompts():
    spec = AnyscaleSpec(input_len=16, mean_output=8, cap=64)
    plain = build_requests(spec, 30, 500, seed=4)
    mixed = build_requests(spec, 30, 500, seed=4, adapters="x:1,y:5", priorities="0:1,9:1")
    assert [(r.prompt_ids, r.max_tokens) for r in plain] == [
        (r.prompt_ids, r.max_tokens) for r in mixed
    ]


def test_scale_shrinks_every_length():
    spec = AnyscaleSpec(cap=1536).scaled(0.125)
    assert spec == AnyscaleSpec(input_len=64, mean_output=16.0, cap=192)
    assert [AnyscaleSpec(cap=c).scaled(0.125).cap for c in workloads.ANYSCALE_CAPS] == [
        4,
        16,
        64,
        192,
    ]
    assert AnyscaleSpec(input_len=512, input_len_min=1).scaled(0.5).input_len_min == 1
    assert ShareGptSpec().scaled(0.5).prompt == LogNormal(49.0, 1.0, 2, 512)


def test_uniform_prompt_lengths_cover_the_range():
    reqs = build_requests(AnyscaleSpec(input_len=6, input_len_min=2, mean_output=2, cap=4), 300, 50)
    assert {len(r.prompt_ids) for r in reqs} == {2, 3, 4, 5, 6}


def test_sharegpt_like_lengths_are_clamped_log_normal():
    reqs = build_requests(ShareGptSpec(), 3000, 2048, seed=0)
    prompts = [len(r.prompt_ids) for r in reqs]
    outs = [r.max_tokens for r in reqs]
    assert min(prompts) >= 4 and max(prompts) <= 1024 and min(outs) >= 4 and max(outs) <= 1024
    assert statistics.median(prompts) == pytest.approx(98, rel=0.08)
    assert statistics.median(outs) == pytest.approx(205, rel=0.08)
    assert max(outs) == 1024  # the cap is reached (P(X > 1024) is about 5%)


def test_adapters_round_robin_with_equal_weights():
    reqs = build_requests(
        AnyscaleSpec(input_len=2, mean_output=2, cap=4), 7, 50, adapters="a,b,base"
    )
    assert [r.adapter for r in reqs] == ["a", "b", "", "a", "b", "", "a"]


def test_weighted_priorities_follow_their_weights():
    reqs = build_requests(
        AnyscaleSpec(input_len=2, mean_output=2, cap=4), 2000, 50, priorities="0:3,10:1"
    )
    share = sum(r.priority == 10 for r in reqs) / len(reqs)
    assert {r.priority for r in reqs} == {0, 10}
    assert share == pytest.approx(0.25, abs=0.03)


@pytest.mark.parametrize("text", ["a:0", "a:-1", "a:x"])
def test_bad_mix_entries_are_refused(text):
    with pytest.raises(ValueError, match="bad mix entry"):
        workloads.parse_mix(text)


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="input_len_min"):
        AnyscaleSpec(input_len=4, input_len_min=5)
    with pytest.raises(ValueError, match="mean_output"):
        AnyscaleSpec(mean_output=0)
    with pytest.raises(ValueError, match="min_token_id"):
        build_requests(AnyscaleSpec(), 1, 3)


def test_poisson_arrivals():
    times = workloads.poisson_arrivals(4000, rate=8.0, seed=0)
    assert times[0] == 0.0 and times == sorted(times)
    assert statistics.fmean(b - a for a, b in zip(times, times[1:])) == pytest.approx(
        1 / 8, rel=0.05
    )
    assert workloads.poisson_arrivals(3, float("inf")) == [0.0, 0.0, 0.0]
    assert workloads.poisson_arrivals(5, 2.0, seed=7) == workloads.poisson_arrivals(5, 2.0, seed=7)
