"""engine/omnibus/engine/worker/sampling.py: validation, filters, seeded determinism, penalties, logprobs."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from omnibus.engine.config import EngineConfig
from omnibus.engine.worker.sampling import (
    MAX_LOGPROBS,
    Sampler,
    SamplingParams,
    allowed_tokens,
    apply_penalties,
    make_generator,
)


def sample_rows(sampler, logits, params, prompts=None, outputs=None, gens=None):
    b = logits.shape[0]
    return sampler(
        logits,
        params,
        prompts if prompts is not None else [[] for _ in range(b)],
        outputs if outputs is not None else [[] for _ in range(b)],
        gens if gens is not None else [None] * b,
    )


# --- SamplingParams validation -------------------------------------------------------

BAD_FIELDS = [
    ("max_tokens", 0, ">= 1"),
    ("max_tokens", True, ">= 1"),
    ("max_tokens", 2.0, ">= 1"),
    ("temperature", -0.1, ">= 0"),
    ("temperature", float("nan"), ">= 0"),
    ("temperature", float("inf"), ">= 0"),
    ("temperature", "1", ">= 0"),
    ("top_p", 0.0, "in (0, 1]"),
    ("top_p", 1.5, "in (0, 1]"),
    ("top_k", -2, ">= 0 (0 or -1 disables it)"),
    ("top_k", 2.5, ">= 0"),
    ("min_p", -0.01, "in [0, 1]"),
    ("min_p", 1.01, "in [0, 1]"),
    ("seed", -1, "in [0, 2**64 - 1]"),
    ("seed", 2**64, "in [0, 2**64 - 1]"),
    ("seed", 1.0, "in [0, 2**64 - 1]"),
    ("stop_token_ids", 5, "list or tuple of token ids >= 0"),
    ("stop_token_ids", [1, -2], "list or tuple of token ids >= 0"),
    ("stop_token_ids", [1, True], "list or tuple of token ids >= 0"),
    ("ignore_eos", 1, "bool"),
    ("repetition_penalty", 0.0, "> 0"),
    ("repetition_penalty", float("-inf"), "> 0"),
    ("presence_penalty", 2.5, "in [-2, 2]"),
    ("presence_penalty", float("nan"), "in [-2, 2]"),
    ("frequency_penalty", -2.01, "in [-2, 2]"),
    ("logprobs", MAX_LOGPROBS + 1, "in [0, 20]"),
    ("logprobs", -1, "in [0, 20]"),
    ("logprobs", False, "in [0, 20]"),
]


@pytest.mark.parametrize(("field", "value", "allowed"), BAD_FIELDS)
def test_bad_field_raises_value_error_naming_field_and_range(field, value, allowed):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value)
    assert allowed in str(err.value)


def test_params_normalize_types_and_stay_frozen():
    p = SamplingParams(temperature=1, stop_token_ids=[3, 4], seed=2**64 - 1, top_p=1)
    assert p.stop_token_ids == (3, 4) and isinstance(p.stop_token_ids, tuple)
    assert type(p.temperature) is float and type(p.top_p) is float
    assert hash(p) == hash(SamplingParams(temperature=1.0, stop_token_ids=(3, 4), seed=2**64 - 1))
    with pytest.raises(AttributeError):
        p.temperature = 2.0  # type: ignore[misc]


def test_a_float32_value_is_shown_as_sent():
    """The router reads float32 fields: -0.1 arrives as -0.10000000149011612, which the
    message showed."""
    sent = torch.tensor(-0.1, dtype=torch.float32).item()
    with pytest.raises(ValueError, match=r"must be a finite number >= 0, got -0\.1$"):
        SamplingParams(temperature=sent)
    with pytest.raises(ValueError, match=r"got 1\.00000001$"):  # a double stays exact
        SamplingParams(top_p=1.00000001)


def test_top_k_minus_one_is_off_as_in_vllm():
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)


def test_greedy_property():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-7).greedy  # would overflow float32 if divided by
    assert not SamplingParams(temperature=0.01).greedy


def test_make_generator_rejects_bad_seed():
    with pytest.raises(ValueError, match="seed"):
        make_generator(-5)


# --- greedy --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = sample_rows(Sampler(0), logits, [SamplingParams(temperature=0)] * 8)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_rows_in_mixed_batch_take_argmax_of_penalized_logits():
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 4.0, 0.0], [0.0, 0.0, 9.0]])
    params = [
        SamplingParams(temperature=0, repetition_penalty=2.0),  # 5 -> 2.5, so 4 wins
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=1),
    ]
    out = sample_rows(Sampler(0), logits, params, prompts=[[0], [0], []])
    assert out.token_ids == [1, 0, 2]


# --- top-k / top-p / min-p -----------------------------------------------------------

# Distinct probabilities far from every cutoff used below.
PROBS = torch.tensor([0.2, 0.18, 0.16, 0.14, 0.12, 0.1, 0.07, 0.03])
LOGITS = PROBS.log()

FILTER_CASES = [
    # (params, expected support)
    (dict(top_k=2), {0, 1}),
    (dict(top_p=0.5), {0, 1, 2}),  # cumulative 0.2, 0.38, 0.54
    (dict(min_p=0.3), {0, 1, 2, 3, 4, 5, 6}),  # drops prob < 0.06
    (dict(min_p=0.6), {0, 1, 2, 3, 4}),  # drops prob < 0.12
    (dict(top_k=2, top_p=0.5), {0}),  # top-p over top-k survivors: 0.2 / 0.38 > 0.5
    (dict(top_p=0.45), {0, 1, 2}),  # cumulative 0.2, 0.38, 0.54
    (dict(top_p=0.45, temperature=0.5), {0, 1}),  # sharper: cumulative 0.27, 0.49
    (dict(top_k=5, min_p=0.8), {0, 1, 2}),
    (dict(top_k=1), {0}),
    (dict(top_p=0.01), {0}),
    (dict(), set(range(8))),
]


@pytest.mark.parametrize(("kwargs", "support"), FILTER_CASES)
def test_sampled_support_is_exactly_the_allowed_set(kwargs, support):
    n = 400
    params = [SamplingParams(seed=s, **kwargs) for s in range(n)]
    gens = [make_generator(s) for s in range(n)]
    out = sample_rows(Sampler(0), LOGITS.expand(n, -1), params, gens=gens)
    assert set(out.token_ids) == support


@pytest.mark.parametrize(("kwargs", "support"), FILTER_CASES)
def test_allowed_tokens_mask(kwargs, support):
    p = SamplingParams(**kwargs)
    # Two rows: the case under test, and a row with every filter off that must keep all.
    logits = torch.stack([LOGITS / p.temperature, LOGITS])
    keep = allowed_tokens(
        logits,
        top_k=torch.tensor([p.top_k, 0]),
        top_p=torch.tensor([p.top_p, 1.0]),
        min_p=torch.tensor([p.min_p, 0.0]),
    )
    assert set(keep[0].nonzero().flatten().tolist()) == support
    assert keep[1].all()


def test_allowed_tokens_keeps_ties_at_a_cutoff():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0]])
    keep = allowed_tokens(logits, top_k=torch.tensor([2]))
    assert keep.tolist() == [[True, True, True, False]]


def test_top_k_partial_and_sorted_paths_agree():
    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(1))
    k = torch.tensor([0, 1, 7, 100, 1500, 5000])  # max 5000 > _TOPK_MAX: sort path
    by_sort = allowed_tokens(logits, top_k=k)
    for row in range(6):  # single rows with small k take the topk path
        by_topk = allowed_tokens(logits[row : row + 1], top_k=k[row : row + 1])
        assert torch.equal(by_topk[0], by_sort[row])
        assert by_sort[row].sum() == (k[row] if k[row] > 0 else 5000)


# --- seeded determinism --------------------------------------------------------------


def test_seeded_request_is_independent_of_batch_composition():
    vocab, steps = 64, 20
    step_logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(7)) * 2
    target = SamplingParams(seed=1234, temperature=0.9, top_k=40, top_p=0.95, frequency_penalty=0.3)

    def run(batched: bool, sampler_seed: int) -> list[int]:
        rng = random.Random(sampler_seed)
        sampler = Sampler(sampler_seed)
        gen = make_generator(target.seed)
        out: list[int] = []
        for step in range(steps):
            rows = [(step_logits[step], target, out, gen)]
            if batched:
                for _ in range(rng.randint(1, 6)):  # neighbours: seeded, unseeded, greedy
                    seed = rng.choice([None, None, rng.randrange(2**32)])
                    other = SamplingParams(
                        seed=seed,
                        temperature=rng.choice([0.0, 0.7, 1.3]),
                        top_p=rng.choice([1.0, 0.8]),
                        presence_penalty=rng.choice([0.0, 1.0]),
                        logprobs=rng.choice([0, 3]),
                    )
                    other_gen = make_generator(seed) if seed is not None else None
                    other_out = [rng.randrange(vocab) for _ in range(rng.randint(0, 5))]
                    neighbour = (torch.randn(vocab), other, other_out, other_gen)
                    rows.insert(rng.randint(0, len(rows)), neighbour)
            where = next(i for i, r in enumerate(rows) if r[1] is target)
            res = sampler(
                torch.stack([r[0] for r in rows]),
                [r[1] for r in rows],
                [[] for _ in rows],
                [list(r[2]) for r in rows],
                [r[3] for r in rows],
            )
            out.append(res.token_ids[where])
        return out

    alone = run(batched=False, sampler_seed=0)
    assert len(set(alone)) > 3  # really sampling, not collapsing to one token
    for sampler_seed in (1, 2, 3):
        assert run(batched=True, sampler_seed=sampler_seed) == alone


def test_seeded_row_takes_one_draw_per_token_keyed_by_seed_and_position():
    vocab = 50
    gen = make_generator(99)
    sample_rows(Sampler(0), torch.randn(1, vocab), [SamplingParams(seed=99)], gens=[gen])
    assert gen.position == 1
    # The next draw is position 1's, whatever generator object makes it.
    assert torch.equal(gen.draw(vocab), make_generator(99, position=1).draw(vocab))
    assert not torch.equal(make_generator(99, position=2).draw(vocab),
                           make_generator(99, position=1).draw(vocab))
    assert not torch.equal(make_generator(98, position=1).draw(vocab),
                           make_generator(99, position=1).draw(vocab))


def test_seeded_greedy_row_draws_nothing():
    gen = make_generator(5)
    sample_rows(Sampler(0), torch.randn(1, 10), [SamplingParams(seed=5, temperature=0)], gens=[gen])
    assert gen.position == 0


def _history_logits(tokens: list[int], vocab: int) -> torch.Tensor:
    """(1, V) logits that depend on the whole history, as a model's would."""
    g = torch.Generator().manual_seed(hash(tuple(tokens)) & 0xFFFFFFFF)
    return torch.randn(1, vocab, generator=g) * 3


@pytest.mark.parametrize("penalties", [{}, {"repetition_penalty": 1.3, "presence_penalty": 0.5,
                                            "frequency_penalty": 0.7}])
def test_seeded_request_resumed_at_position_k_continues_the_same_tokens(penalties):
    """A continuation: prompt + the first k tokens, output_offset=k, max_tokens - k left,
    draws from position k: the same tokens as the run that was never interrupted."""
    vocab, steps, prompt = 40, 24, [3, 1, 4, 1, 5]
    params = SamplingParams(seed=2024, temperature=1.1, top_k=30, max_tokens=steps, **penalties)

    def run(prompt_ids: list[int], p: SamplingParams, n: int) -> list[int]:
        gen, out = make_generator(p.seed, position=p.output_offset), []
        for _ in range(n):
            logits = _history_logits(prompt_ids + out, vocab)
            out += sample_rows(Sampler(7), logits, [p], [prompt_ids], [out], [gen]).token_ids
        return out

    whole = run(prompt, params, steps)
    assert len(set(whole)) > 3  # really sampling
    for k in (1, 9, steps - 1):
        resumed = dataclasses.replace(params, output_offset=k, max_tokens=steps - k)
        assert whole[:k] + run(prompt + whole[:k], resumed, steps - k) == whole


def test_output_offset_counts_the_resumed_tokens_as_output_for_penalties():
    logits = torch.zeros(1, 6)
    fresh = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5)
    resumed = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, output_offset=2)
    a = apply_penalties(logits, [fresh], [[0, 1]], [[4, 4, 5]])
    b = apply_penalties(logits, [resumed], [[0, 1, 4, 4]], [[5]])
    assert torch.equal(a, b)
    assert b[0, 4].item() == -2.0 and b[0, 0].item() == 0.0


def test_unseeded_rows_reproducible_with_sampler_seed():
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams()] * 16
    a = sample_rows(Sampler(42), logits, params).token_ids
    b = sample_rows(Sampler(42), logits, params).token_ids
    assert a == b


def test_engines_without_a_seed_sample_independently():
    """The engine's --seed defaulted to 0: every replica (and every restart) drew the same
    noise for unseeded requests, so an HTTP request's n choices, spread over replicas, came
    back identical. Unset, each engine's generator is seeded from the OS."""
    assert EngineConfig(model="m").seed is None
    logits = torch.zeros(64, 1000)  # uniform: 64 draws from 1000 tokens
    params = [SamplingParams(temperature=1.0)] * 64
    a = sample_rows(Sampler(EngineConfig(model="m").seed), logits, params).token_ids
    b = sample_rows(Sampler(EngineConfig(model="m").seed), logits, params).token_ids
    assert a != b  # equal with probability 1000**-64


# --- penalties -----------------------------------------------------------------------

BASE = [2.0, -1.0, 0.5, -3.0, 1.0]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # prompt [0, 1], output [1, 2, 2]: seen {0, 1, 2}; output counts {1: 1, 2: 2}
        (dict(repetition_penalty=2.0), [1.0, -2.0, 0.25, -3.0, 1.0]),
        (dict(repetition_penalty=0.5), [4.0, -0.5, 1.0, -3.0, 1.0]),
        (dict(presence_penalty=0.5), [2.0, -1.5, 0.0, -3.0, 1.0]),
        (dict(frequency_penalty=0.25), [2.0, -1.25, 0.0, -3.0, 1.0]),
        (dict(frequency_penalty=-1.0), [2.0, 0.0, 2.5, -3.0, 1.0]),
        (
            dict(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
            [1.0, -2.75, -0.75, -3.0, 1.0],
        ),
    ],
)
def test_penalties_match_hand_computation(kwargs, expected):
    logits = torch.tensor([BASE, BASE])
    before = logits.clone()
    params = [SamplingParams(**kwargs), SamplingParams()]  # second row: no penalties
    got = apply_penalties(logits, params, [[0, 1], [0, 1]], [[1, 2, 2], [1, 2, 2]])
    assert torch.allclose(got[0], torch.tensor(expected))
    assert torch.equal(got[1], before[1])
    assert torch.equal(logits, before)  # caller's tensor untouched


def test_penalty_token_ids_out_of_range_raise():
    with pytest.raises(ValueError, match=r"\[0, 4\]"):
        apply_penalties(torch.zeros(1, 5), [SamplingParams(presence_penalty=1.0)], [[]], [[5]])


def test_sampler_never_writes_into_caller_logits():
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(4))
    before = logits.clone()
    params = [
        SamplingParams(seed=1, repetition_penalty=1.5, top_k=5, top_p=0.8, min_p=0.1, logprobs=3),
        SamplingParams(temperature=0, frequency_penalty=1.0),
        SamplingParams(temperature=0.5, presence_penalty=-1.0),
        SamplingParams(),
    ]
    gens = [make_generator(1), None, None, None]
    sample_rows(Sampler(0), logits, params, [[1, 2]] * 4, [[3, 3]] * 4, gens)
    assert torch.equal(logits, before)


# --- logprobs ------------------------------------------------------------------------


def test_logprobs_are_of_penalized_logits_before_temperature_and_filters():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(11))
    params = [
        SamplingParams(logprobs=5, temperature=0.5, top_k=3, repetition_penalty=1.7, seed=8),
        SamplingParams(),
        SamplingParams(logprobs=2, temperature=0),
    ]
    prompts, outputs = [[1, 2, 3], [], [4]], [[5, 5], [], [6]]
    out = Sampler(0)(logits, params, prompts, outputs, [make_generator(8), None, None])
    expected = torch.log_softmax(apply_penalties(logits, params, prompts, outputs), dim=-1)
    assert out.logprobs[1] is None
    for row in (0, 2):
        lp = out.logprobs[row]
        assert lp is not None and lp.token_id == out.token_ids[row]
        top = expected[row].topk(params[row].logprobs)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-6)
        assert lp.logprob == pytest.approx(expected[row, lp.token_id].item(), abs=1e-6)
    assert out.logprobs[2].top[0][0] == out.token_ids[2]  # greedy picks the top logprob


@pytest.mark.parametrize("penalty", [1e-40, 3e38])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 1e-38])
def test_extreme_penalties_and_temperatures_keep_a_real_distribution(penalty, temperature):
    """Outside probe: repetition_penalty 1e-40 (> 0, so valid) pushed the seen tokens'
    positive logits to inf; every row's softmax was NaN, every draw token 0 and every
    logprob NaN. A tiny temperature can overflow the same way."""
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5, -2.0, 1.0]] * 4)
    params = [SamplingParams(repetition_penalty=penalty, temperature=temperature, logprobs=3,
                             seed=s) for s in range(4)]
    prompts, outputs = [[0, 1]] * 4, [[2, 4]] * 4  # seen: 0, 1, 2, 4
    gens = [make_generator(s) if temperature else None for s in range(4)]
    out = sample_rows(Sampler(0), logits, params, prompts, outputs, gens)
    # tiny penalty: 0 and 2 (the seen positive logits) tie at the top. Huge: those go to
    # ~0 and the seen negative ones to -inf; 5 (1.0) is the top, 3 (0.5) the next.
    if penalty < 1:
        allowed = {0, 2}
    else:
        allowed = {0, 2, 3, 5} if temperature == 1.0 else {5}
    assert set(out.token_ids) <= allowed, out.token_ids
    for lp in out.logprobs:
        values = [lp.logprob, *(v for _, v in lp.top)]
        assert all(math.isfinite(v) for v in values), values


# --- batch validation ----------------------------------------------------------------


def test_batch_mismatches_raise():
    sampler = Sampler(0)
    with pytest.raises(ValueError, match="one entry per logits row"):
        sampler(torch.zeros(2, 4), [SamplingParams()], [[]], [[]], [None])
    with pytest.raises(ValueError, match="make_generator"):
        sample_rows(sampler, torch.zeros(1, 4), [SamplingParams(seed=3)])
    with pytest.raises(ValueError, match="batch, vocab"):
        sample_rows(sampler, torch.zeros(4), [SamplingParams()] * 4)


# --- property: the sampled token always survives every filter --------------------------

MARGIN = 1e-4  # float32 vs float64 disagreement stays far below this


def reference_allowed(logits: list[float], temperature: float, k: int, p: float, min_p: float):
    """Allowed token set in float64, or None when a cutoff is too close to call."""
    z = [v / temperature for v in logits]
    order = sorted(z, reverse=True)
    kth = order[min(k, len(z)) - 1] if k > 0 else -math.inf
    keep = {i for i, v in enumerate(z) if v >= kth}
    if p < 1.0:
        kept = sorted((z[i] for i in keep), reverse=True)
        weights = [math.exp(v - kept[0]) for v in kept]
        total, cum, cutoff = sum(weights), 0.0, kept[-1]
        crossed = False
        for v, w in zip(kept, weights):
            cum += w / total
            if abs(cum - p) < MARGIN:
                return None
            if cum >= p and not crossed:
                cutoff, crossed = v, True
        keep &= {i for i, v in enumerate(z) if v >= cutoff}
    if min_p > 0.0:
        top = order[0]
        for i, v in enumerate(z):
            ratio = math.exp(v - top)
            if v != top and abs(ratio - min_p) < MARGIN:
                return None
        keep &= {i for i, v in enumerate(z) if math.exp(v - top) >= min_p}
    return keep


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    vocab=st.integers(2, 40),
    temperature=st.floats(0.05, 3.0),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    seed=st.integers(0, 2**32),
)
def test_sampled_token_lies_in_allowed_set(data, vocab, temperature, top_p, min_p, seed):
    # Quarter steps make ties common, so the tie rule gets exercised too.
    logits = data.draw(st.lists(st.integers(-40, 40), min_size=vocab, max_size=vocab))
    logits = [v / 4 for v in logits]
    top_k = data.draw(st.integers(0, vocab + 2))
    expected = reference_allowed(logits, temperature, top_k, top_p, min_p)
    assume(expected is not None)

    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed
    )
    row = torch.tensor([logits])
    out = sample_rows(Sampler(0), row, [params], gens=[make_generator(seed)])
    assert out.token_ids[0] in expected

    keep = allowed_tokens(
        row / torch.tensor(params.temperature),
        top_k=torch.tensor([top_k]),
        top_p=torch.tensor([top_p]),
        min_p=torch.tensor([min_p]),
    )
    assert set(keep[0].nonzero().flatten().tolist()) == expected
