"""Speculative decoding is token-exact: greedy output equals transformers' in every
batching policy, with chunked prefill, preemption, prefix-cache hits, overlap and LoRA;
seeded sampled output equals the non-speculative output; unseeded sampled output keeps
the target distribution (chi-squared against the non-speculative engine).

Random-weight checkpoints rarely repeat themselves, so besides the n-gram proposer these
tests drive a proposer that knows the right answer and spoils every third guess: kept
and rejected guesses, and both at once, in every step."""

from __future__ import annotations

import random

import pytest
import torch

from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import Engine
from omnibus.engine.worker.sampling import SamplingParams
from tests.checkpoints import hf_greedy, load_hf, make_checkpoint
from tests.oracle.test_lora import make_adapter

VOCAB = 384


class KnowingProposer:
    """Guesses a sequence's next tokens from `answers` (its prompt -> its output), spoiling
    every third guess (by output position), so some guesses are kept and some rejected."""

    name = "knowing"

    def __init__(self, answers: dict[tuple[int, ...], list[int]]) -> None:
        self.answers = answers

    def propose(self, seqs, k):
        out = []
        for seq, n in zip(seqs, k):
            done = seq.num_output_tokens
            right = self.answers.get(tuple(seq.prompt_token_ids), [])[done:done + n]
            out.append([t if (done + j) % 3 != 2 else (t + 1) % VOCAB for j, t in enumerate(right)])
        return out

    def release(self, seq):
        pass

    def check_integrity(self):
        pass


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("spec"), "llama", vocab_size=VOCAB)
    return path, load_hf(path)


def prompts_for(seed: int, n: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(shared)]
    return [prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 60))] for _ in range(n)]


def engine(path, proposer=None, **kw) -> Engine:
    kw.setdefault("speculative", "ngram")
    e = Engine(EngineConfig(model=str(path), dtype="float32", **kw))
    if proposer is not None:
        e.speculator.proposer = proposer
    return e


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("kw", [
    dict(),
    dict(batching="dynamic", max_batch_size=4),
    dict(batching="static", max_batch_size=3),
    dict(batching="none"),
    dict(max_num_batched_tokens=7),  # chunked prefill; guesses cut to the budget
    dict(num_kv_blocks=12, block_size=4, max_num_seqs=3),  # preemption (44 tokens of KV)
    dict(overlap_scheduling=True),  # overlapped steps, lockstep while speculating
    dict(num_speculative_tokens=1),
], ids=["continuous", "dynamic", "static", "none", "chunked", "preempting", "overlap", "k1"])
def test_greedy_speculation_matches_transformers(ckpt, kw):
    path, hf = ckpt
    prompts = prompts_for(1, 6, shared=20)  # a shared prefix: prefix-cache hits
    if kw.get("num_kv_blocks"):
        prompts = [p[-10:] for p in prompts]
    expected = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    e = engine(path, KnowingProposer({tuple(p): x for p, x in zip(prompts, expected)}), **kw)
    assert e.generate(prompts, GREEDY) == expected
    s = e.stats().speculative
    assert 0 < s.accepted < s.proposed and s.emitted > s.steps
    assert e.check_integrity().referenced == 0
    if kw.get("num_kv_blocks"):
        assert e.scheduler.num_preemptions > 0
    if kw.get("max_num_batched_tokens") == 7:
        assert s.accepted_hist[6:] == [0] * 11  # no more than budget - 1 guesses


def test_ngram_speculation_on_repeating_output_matches_transformers(ckpt):
    """A prompt that repeats a span: the model's own continuation tends to repeat too,
    and the n-gram proposer's guesses are checked like any other."""
    path, hf = ckpt
    rng = random.Random(5)
    spans = [[rng.randrange(3, VOCAB) for _ in range(6)] for _ in range(3)]
    prompts = [s * 5 for s in spans]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    e = engine(path)
    assert e.generate(prompts, params) == [hf_greedy(hf, p, 40) for p in prompts]
    assert e.stats().speculative.proposed > 0


def test_speculation_turns_off_per_request_and_above_its_batch_size(ckpt):
    path, hf = ckpt
    prompts = prompts_for(2, 4)
    expected = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    knowing = KnowingProposer({tuple(p): x for p, x in zip(prompts, expected)})
    off = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, speculative_off=True)
    e = engine(path, knowing)
    assert e.generate(prompts, off) == expected and e.stats().speculative.proposed == 0
    e = engine(path, knowing, speculative_max_batch=3)  # 4 running: off until one finishes
    assert e.generate(prompts, [GREEDY] * 4) == expected
    assert e.stats().speculative.steps < 4 * GREEDY.max_tokens // 2


def test_seeded_sampling_is_the_same_with_and_without_speculation(ckpt):
    path, _ = ckpt
    prompts = prompts_for(3, 6)
    params = [SamplingParams(max_tokens=20, temperature=t, top_p=0.9, top_k=k, seed=100 + i, ignore_eos=True,
                             repetition_penalty=r, frequency_penalty=f, logprobs=2)
              for i, (t, k, r, f) in enumerate([(0.7, 0, 1.0, 0.0), (1.0, 50, 1.2, 0.0), (1.3, 0, 1.0, 0.5),
                                                 (0.9, 0, 1.1, 0.3), (0.5, 5, 1.0, 0.0), (1.0, 0, 1.0, 0.0)])]
    plain = engine(path, speculative=None).generate(prompts, params)
    # guesses from the plain run (a third spoiled): most are kept
    e = engine(path, KnowingProposer({tuple(p): x for p, x in zip(prompts, plain)}))
    assert e.generate(prompts, params) == plain
    s = e.stats().speculative
    assert 0 < s.accepted < s.proposed


def _chi2_p(a: list[int], b: list[int]) -> float:
    """p-value of the two-sample chi-squared test that token samples `a` and `b` come from
    one distribution (tokens seen fewer than 10 times in all pooled into one category)."""
    both = a + b
    kept = [t for t in set(both) if both.count(t) >= 10]
    cats = [(a.count(t), b.count(t)) for t in kept]
    cats.append((sum(t not in kept for t in a), sum(t not in kept for t in b)))
    na, nb = len(a), len(b)
    stat, df = 0.0, -1
    for x, y in cats:
        if x + y == 0:
            continue
        df += 1
        ea, eb = na * (x + y) / (na + nb), nb * (x + y) / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return float(1 - torch.special.gammainc(torch.tensor(df / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))


def test_unseeded_sampling_keeps_the_target_distribution(ckpt):
    """Output positions 1 and 2 of one prompt sampled 600 times, with and without
    speculation. The guesses are the plain run's most frequent tokens at each position:
    kept about as often as the model draws them, so both the kept and the rejected path
    decide a large share of the samples."""
    path, _ = ckpt
    prompt = prompts_for(4, 1)[0]
    n = 600
    params = SamplingParams(max_tokens=3, temperature=0.3, ignore_eos=True)
    plain = engine(path, speculative=None, seed=1).generate([prompt] * n, params)
    common = [max(range(VOCAB), key=[o[i] for o in plain].count) for i in range(3)]
    guesser = KnowingProposer({})
    guesser.propose = lambda seqs, k: [common[s.num_output_tokens:s.num_output_tokens + m] for s, m in zip(seqs, k)]
    e = engine(path, guesser, seed=2, speculative_max_batch=n)
    spec = e.generate([prompt] * n, params)
    stats = e.stats().speculative
    assert 60 <= stats.accepted <= stats.proposed - 60  # both paths taken often
    for pos in (0, 1, 2):
        assert _chi2_p([o[pos] for o in plain], [o[pos] for o in spec]) > 1e-3, pos


def test_lora_requests_speculate_and_stay_exact(ckpt, tmp_path):
    path, _ = ckpt
    adapters = tmp_path / "adapters"
    make_adapter(path, adapters / "ad", 4, 8, ["q_proj", "v_proj", "down_proj"], False, seed=3)
    prompts = prompts_for(6, 4)
    base_kw = dict(adapter_dir=str(adapters), max_loras=1)

    def run(e: Engine) -> list[list[int]]:
        ids = [f"r{i}" for i in range(len(prompts))]
        for i, (rid, p) in enumerate(zip(ids, prompts)):
            e.add_request(rid, p, GREEDY, adapter="ad" if i % 2 else None)
        out = {rid: [] for rid in ids}
        while e.has_unfinished():
            for o in e.step():
                out[o.request_id] += o.new_token_ids
        return [out[rid] for rid in ids]

    plain = run(engine(path, speculative=None, **base_kw))
    e = engine(path, KnowingProposer({tuple(p): x for p, x in zip(prompts, plain)}), **base_kw)
    assert run(e) == plain
    assert e.stats().speculative.accepted > 0 and e.check_integrity().referenced == 0


@pytest.mark.parametrize("draft, kw", [
    ("itself", dict()),
    ("smaller", dict(max_num_batched_tokens=7)),  # chunked prefill
    ("itself", dict(num_kv_blocks=12, block_size=4)),  # preemption
], ids=["itself", "smaller-chunked", "itself-preempting"])
def test_a_draft_model_proposes_and_the_output_matches_transformers(ckpt, tmp_path, draft, kw):
    """The served model as its own draft (every guess kept but the last), and a smaller
    one-layer model with the same vocabulary (most rejected); the draft's KV pool ends
    with every block free."""
    path, hf = ckpt
    draft_dir = path if draft == "itself" else make_checkpoint(tmp_path / "draft", vocab_size=VOCAB,
                                                               num_hidden_layers=1, seed=7)
    prompts = prompts_for(8, 4)
    if kw.get("num_kv_blocks"):
        prompts = [p[-10:] for p in prompts]
    e = engine(path, speculative="draft", speculative_draft_model=str(draft_dir), **kw)
    assert e.generate(prompts, GREEDY) == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    s = e.stats().speculative
    assert s.proposer == "draft" and s.proposed > 0
    if draft == "itself":
        assert s.accepted >= 0.7 * s.proposed
    e.check_integrity()
    assert e.speculator.proposer.allocator.check_integrity([]).referenced == 0


def test_a_draft_model_with_another_vocabulary_is_refused(ckpt, tmp_path):
    path, _ = ckpt
    other = make_checkpoint(tmp_path / "other", vocab_size=VOCAB + 16)
    with pytest.raises(ValueError, match="a draft model shares the tokenizer"):
        engine(path, speculative="draft", speculative_draft_model=str(other))
