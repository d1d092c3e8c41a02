"""Prompt logprobs (issue 33: lm-evaluation-harness's loglikelihood tasks) against
transformers' logits on a small random checkpoint (float32, CPU), to 1e-4: in every
batching policy, with chunked prefill (prompts over several chunks), overlap,
preemption, speculative decoding beside them and prefix-cache hits. Requests that do
not ask get none and generate what they did before."""

from __future__ import annotations

import pytest
import torch

from omnibus.engine.config import EngineConfig
from omnibus.engine.core.bookkeeping import score_prompts
from omnibus.engine.core.sequence import Sequence, TokenLogprobs
from omnibus.engine.engine import Engine
from omnibus.engine.worker.sampling import SamplingParams
from tests.checkpoints import hf_greedy, load_hf, make_checkpoint
from tests.oracle.test_speculative import KnowingProposer

VOCAB = 384
MAX_TOKENS = 3
# Prompt lengths: one token (nothing to score), two, under a block, over several
# 32-token chunks; each asks for its own number of alternatives (0: none).
LENGTHS = (1, 2, 9, 40, 77, 33)
TOP = (2, 1, 0, 20, 5, 3)


class Reference:
    """transformers' greedy outputs and prompt logprobs, computed once per prompt."""

    def __init__(self, path) -> None:
        self.path = path
        self.hf = load_hf(path)
        self._greedy: dict[tuple[int, ...], list[int]] = {}
        self._logprobs: dict[tuple[int, ...], torch.Tensor] = {}

    def greedy(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self._greedy:
            self._greedy[key] = hf_greedy(self.hf, prompt, MAX_TOKENS)
        return self._greedy[key]

    def check(self, prompt: list[int], k: int, got: list[TokenLogprobs]) -> None:
        """`got` is prompt tokens 1.. scored as transformers scores them, with the top k."""
        key = tuple(prompt)
        if key not in self._logprobs:
            with torch.no_grad():
                self._logprobs[key] = self.hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        lp = self._logprobs[key]  # (P, V): row i scores token i + 1
        assert [g.token_id for g in got] == prompt[1:]
        for i, g in enumerate(got):
            assert g.logprob == pytest.approx(lp[i, prompt[i + 1]].item(), abs=1e-4), i
            top = lp[i].topk(k)
            assert [t for t, _ in g.top] == top.indices.tolist(), i
            assert [v for _, v in g.top] == pytest.approx(top.values.tolist(), abs=1e-4), i


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Reference:
    return Reference(make_checkpoint(tmp_path_factory.mktemp("prompt-logprobs"), "llama", vocab_size=VOCAB))


def prompts(seed: int, lengths=LENGTHS, prefix: list[int] = ()) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def run(engine: Engine, batch: list[list[int]], tops=TOP, first: int = 0) -> dict[str, tuple[list[int], list | None, int]]:
    """Each request's (output tokens, prompt logprobs, cached prompt tokens); prompt
    logprobs come once, with the first token."""
    for i, (prompt, k) in enumerate(zip(batch, tops), first):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                           ignore_eos=True, prompt_logprobs=k))
    engine.scheduler.policy.close_arrivals()  # nothing else is coming: no batch waits for more
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(first, first + len(batch))}
    scored: dict[str, list | None] = dict.fromkeys(tokens)
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert scored[out.request_id] is None and not tokens[out.request_id]
                scored[out.request_id] = out.prompt_logprobs
            tokens[out.request_id] += out.new_token_ids
            cached[out.request_id] = out.num_cached_tokens
    engine.scheduler.policy.close_arrivals(False)
    assert engine.check_integrity().referenced == 0
    return {rid: (tokens[rid], scored[rid], cached[rid]) for rid in tokens}


def check(ref: Reference, batch, results, tops=TOP) -> None:
    for (prompt, k), (tokens, scored, _) in zip(zip(batch, tops), results.values()):
        assert tokens == ref.greedy(prompt)
        if k == 0:
            assert scored is None
        else:
            ref.check(prompt, k, scored)


@pytest.mark.parametrize("kw", [
    dict(),
    dict(overlap_scheduling=True),
    dict(batching="dynamic", max_batch_size=4),
    dict(batching="static", max_batch_size=3),
    dict(batching="none"),
    # preemption (112 tokens of KV): the last prompt is preempted mid-prefill and recomputed
    dict(num_kv_blocks=14, block_size=8, max_num_seqs=4),
    dict(num_kv_blocks=14, block_size=8, max_num_seqs=4, overlap_scheduling=True),
    dict(speculative="ngram"),
], ids=["continuous", "overlap", "dynamic", "static", "none", "preempting", "preempting-overlap",
        "speculative"])
def test_prompt_logprobs_match_transformers_over_chunked_prefill(ref, kw):
    engine = Engine(EngineConfig(model=str(ref.path), dtype="float32", max_num_batched_tokens=32, **kw))
    batch = prompts(1)
    if "speculative" in kw:  # guesses from the answers (some spoiled): decodes really speculate
        engine.speculator.proposer = KnowingProposer({tuple(p): ref.greedy(p) for p in batch})
    check(ref, batch, run(engine, batch))
    if "speculative" in kw:
        assert engine.stats().speculative.accepted > 0
    assert engine.num_steps >= sum(LENGTHS) // 32  # the long prompts ran in several chunks
    if "num_kv_blocks" in kw:
        assert engine.stats().num_preemptions > 0


def test_prompt_logprobs_recompute_a_cached_prefix(ref):
    """A prompt whose leading blocks are cached reads none of them when it asks for prompt
    logprobs (their positions' logits are needed); one that does not ask still hits."""
    engine = Engine(EngineConfig(model=str(ref.path), dtype="float32", block_size=8))
    shared = prompts(2, (48,))[0]
    batch = prompts(3, (5, 20), prefix=shared)
    warm = run(engine, batch[:1], tops=(0,))  # caches the shared blocks
    assert warm["r0"][2] == 0
    hits = engine.stats().num_prefix_cache_hit_blocks
    again = run(engine, batch, tops=(4, 0), first=1)
    check(ref, batch, again, tops=(4, 0))
    assert again["r1"][2] == 0  # it read no cached block...
    assert again["r2"][2] >= 48  # ...while the one that did not ask did
    assert engine.stats().num_prefix_cache_hit_blocks - hits == again["r2"][2] // 8


def test_a_recomputed_chunk_adds_only_what_is_missing():
    """A chunk recomputed after a preemption (its first run still in flight then) overlaps
    what the sequence has; a gap would mean a position was never scored."""
    seq = Sequence("r", list(range(3, 13)), SamplingParams(prompt_logprobs=1))
    scored = [TokenLogprobs(t, -1.0, ((t, -1.0),)) for t in range(4, 13)]  # tokens 1..9
    score_prompts({seq: (0, scored[:5])})
    score_prompts({seq: (2, scored[2:7])})  # positions 2..6: 5 and 6 are new
    assert seq.prompt_logprobs == scored[:7]
    with pytest.raises(RuntimeError, match="position 8 scored before position 7"):
        score_prompts({seq: (8, scored[8:])})


def test_prompt_logprobs_range_is_the_logprobs_range():
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs must be"):
            SamplingParams(prompt_logprobs=bad)
