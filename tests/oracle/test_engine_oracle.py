"""Token-exact greedy outputs against Hugging Face transformers on small random checkpoints,
with chunked prefill, preemption and prefix-cache hits (float32 on CPU)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import Engine
from omnibus.engine.worker.sampling import SamplingParams
from tests.checkpoints import hf_greedy, load_hf, make_checkpoint

VOCAB = 384


def workload(seed: int = 0, n: int = 16, shared_prefix: int = 0):
    """Mixed prompt lengths from 1 to 500 tokens and mixed max_tokens."""
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 33, 64, 100, 127, 200, 255, 300, 381, 450, 499, 500][:n]
    lengths += [rng.randint(1, 500) for _ in range(n - len(lengths))]
    prefix = [rng.randrange(3, VOCAB) for _ in range(shared_prefix)]
    prompts = [(prefix + [rng.randrange(3, VOCAB) for _ in range(n_tok)])[: max(n_tok, 1)] for n_tok in lengths]
    max_tokens = [rng.randint(1, 20) for _ in prompts]
    return prompts, max_tokens


class Oracle:
    """A checkpoint plus transformers' greedy outputs, computed once per prompt."""

    def __init__(self, path):
        self.path = path
        self.hf = load_hf(path)
        self._memo: dict[tuple, list[int]] = {}

    def expected(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self._memo:
            self._memo[key] = hf_greedy(self.hf, prompt, max_tokens)
        return self._memo[key]

    def check(self, prompts, max_tokens, **engine_kw) -> Engine:
        engine = Engine(EngineConfig(model=str(self.path), dtype="float32", **engine_kw))
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
        outputs = engine.generate(prompts, params)
        for i, (prompt, m, got) in enumerate(zip(prompts, max_tokens, outputs)):
            assert got == self.expected(prompt, m), f"request {i} (prompt {len(prompt)} tokens) diverged"
        counts = engine.check_integrity()
        assert counts.referenced == 0
        return engine


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return Oracle(make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", vocab_size=VOCAB))


@pytest.mark.parametrize("arch,kw", [
    ("llama", {}),
    ("mistral", {}),
    ("qwen2", {}),  # q/k/v bias
    ("llama", {"max_shard_size": "100KB"}),  # sharded with an index file
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),  # tied, no GQA
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}}),  # Llama 3.1 scaling
    ("llama", {"attention_bias": True, "mlp_bias": True}),  # q/k/v/o and gate/up/down biases
    ("llama", {"head_dim": 32, "num_key_value_heads": 1}),  # head_dim != hidden / heads, MQA
])
def test_architectures_match_transformers(tmp_path, arch, kw):
    path = make_checkpoint(tmp_path / "ckpt", arch, vocab_size=VOCAB, **kw)
    if "max_shard_size" in kw:
        assert (path / "model.safetensors.index.json").is_file()
    prompts, max_tokens = workload(seed=1, n=16)
    Oracle(path).check(prompts, max_tokens)


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill_matches(llama, overlap):
    prompts, max_tokens = workload(seed=2, n=20)
    engine = llama.check(prompts, max_tokens, max_num_batched_tokens=48, max_num_seqs=8,
                         overlap_scheduling=overlap)
    assert engine.num_steps > sum(len(p) for p in prompts) // 48  # prompts really were chunked


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_matches(llama, overlap):
    prompts, max_tokens = workload(seed=3, n=16)
    # 40 blocks of 16 tokens: far less than the ~3,600 tokens in flight, so sequences
    # are preempted and recomputed many times.
    engine = llama.check(prompts, max_tokens, num_kv_blocks=40, max_num_batched_tokens=256,
                         overlap_scheduling=overlap)
    assert engine.stats().num_preemptions > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_padded_decode_buckets_match(llama, overlap):
    """The CUDA-graph path's padding (to bucket sizes, through the null block), run
    eagerly on the CPU, leaves every output token-exact."""
    prompts, max_tokens = workload(seed=5, n=19)
    engine = llama.check(prompts, max_tokens, decode_graphs=True, overlap_scheduling=overlap)
    assert engine.runner.graphs.num_runs > 10


@pytest.mark.parametrize("overlap", [False, True])
def test_prefix_cache_hits_match(llama, overlap):
    prompts, max_tokens = workload(seed=4, n=16, shared_prefix=100)
    engine = llama.check(prompts, max_tokens, overlap_scheduling=overlap)
    # Second round: every prompt's full blocks are cached now.
    before = engine.stats().num_prefix_cache_hit_blocks
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    assert engine.generate(prompts, params) == [llama.expected(p, m) for p, m in zip(prompts, max_tokens)]
    assert engine.stats().num_prefix_cache_hit_blocks - before >= sum((len(p) - 1) // 16 for p in prompts)
    engine.check_integrity()


def test_cached_prompt_tokens_reported(llama):
    engine = Engine(EngineConfig(model=str(llama.path), dtype="float32"))
    prompt = list(range(3, 3 + 40))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.generate([prompt], params)
    engine.add_request("again", prompt + [5, 6], params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].num_cached_tokens == 32 and outs[-1].num_prompt_tokens == 42


@pytest.mark.parametrize("overlap", [False, True])
def test_eos_and_stop_tokens_end_requests(llama, overlap):
    engine = Engine(EngineConfig(model=str(llama.path), dtype="float32", overlap_scheduling=overlap))
    prompt = [5, 9, 13, 200]
    ref = llama.expected(prompt, 8)
    stop = ref[3]
    engine.add_request("s", prompt, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(stop,)))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == ref[: ref.index(stop) + 1]
    assert outs[-1].finish_reason == "stop"


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_frees_blocks_and_reports(llama, overlap):
    engine = Engine(EngineConfig(model=str(llama.path), dtype="float32", max_num_batched_tokens=32,
                                 overlap_scheduling=overlap))
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add_request("decoding", [5] * 10, params)
    engine.step()
    engine.add_request("prefilling", [6] * 200, params)
    engine.step()
    engine.add_request("waiting", [7] * 5, params)
    for rid in ("decoding", "prefilling", "waiting"):
        assert engine.abort(rid)
    assert engine.check_integrity().referenced == 0
    outs = engine.step()
    assert sorted((o.request_id, o.finish_reason, o.finished) for o in outs) == [
        ("decoding", "abort", True), ("prefilling", "abort", True), ("waiting", "abort", True)]
    assert not engine.has_unfinished()


@pytest.mark.parametrize("bad,match", [
    (dict(prompt=[]), "the prompt is empty"),
    (dict(prompt=[VOCAB]), "outside the vocabulary"),
    (dict(prompt=[-1]), "outside the vocabulary"),
    (dict(prompt=[1] * 1000, max_tokens=100), "exceeds the model.s context of"),
    (dict(request_id=""), "request_id"),
])
def test_bad_requests_are_refused(llama, bad, match):
    engine = Engine(EngineConfig(model=str(llama.path), dtype="float32", num_kv_blocks=200))
    args = dict(request_id="r", prompt=[5, 6], max_tokens=4) | bad
    with pytest.raises(ValueError, match=match):
        engine.add_request(args["request_id"], args["prompt"], SamplingParams(max_tokens=args["max_tokens"]))
    assert not engine.has_unfinished()


def test_request_larger_than_pool_is_refused(llama):
    engine = Engine(EngineConfig(model=str(llama.path), dtype="float32", num_kv_blocks=4))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("big", [5] * 60, SamplingParams(max_tokens=10))


@pytest.mark.parametrize("overlap", [False, True])
def test_triton_kernels_in_the_engine_match(llama, monkeypatch, overlap):
    """The engine on the Triton kernels (KV store, paged attention; interpreted on the CPU)
    stays token-exact: mixed prefill chunks, cached prefixes and decodes in one launch."""
    monkeypatch.setenv("OMNIBUS_FORCE_TRITON", "1")
    prompts = [[5 + i for i in range(n)] for n in (3, 17, 40)]
    llama.check(prompts, [4, 3, 5], max_num_batched_tokens=24, overlap_scheduling=overlap)


def test_seeded_sampling_is_independent_of_the_batch(llama):
    engine = Engine(EngineConfig(model=str(llama.path), dtype="float32"))
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    (alone,) = engine.generate([[5, 6, 7, 8]], seeded)
    others = [SamplingParams(max_tokens=m, temperature=1.0, ignore_eos=True) for m in (3, 20, 7)]
    batch = engine.generate([[9, 9], [5, 6, 7, 8], [40] * 30, [11]], [others[0], seeded, others[1], others[2]])
    assert batch[1] == alone
    unseeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, ignore_eos=True)
    assert engine.generate([[5, 6, 7, 8]] * 3, unseeded) != [alone] * 3  # the seed is what pins it


def test_overlapped_sampling_equals_lockstep_for_every_knob(llama):
    """Seeded sampling, penalties (which make the next step wait for the pending token)
    and logprobs give the same tokens and logprobs with and without overlap, and stop
    tokens ending a request while its next step is already running waste nothing."""
    prompts = [[5, 6, 7, 8], [9] * 30, [40, 41], [11] * 17, [3] * 5]
    params = [
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                       ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.7, top_k=20, seed=3, frequency_penalty=0.4, logprobs=3,
                       ignore_eos=True),
        SamplingParams(max_tokens=15, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=tuple(range(3, VOCAB, 2))),
    ]
    runs = []
    for overlap in (False, True):
        engine = Engine(EngineConfig(model=str(llama.path), dtype="float32", overlap_scheduling=overlap,
                                     max_num_batched_tokens=16))
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", prompt, p)
        got: dict[str, list] = {}
        ends = {}
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(
                    (t, lp.logprob if lp else None) for t, lp in zip(out.new_token_ids, out.new_logprobs or
                                                                     [None] * len(out.new_token_ids)))
                if out.finished:
                    ends[out.request_id] = out.finish_reason
        assert engine.check_integrity().referenced == 0
        runs.append((got, ends))
    assert runs[0] == runs[1]
    assert runs[1][1]["r4"] == "stop"


def test_overlap_and_graph_flags_reach_the_engine(llama):
    from omnibus.engine.serving.cli import build_parser, configs_from_args

    def config(flags: str):
        return configs_from_args(build_parser().parse_args(["serve", "--model", str(llama.path), *flags.split()]))[0]

    assert (config("").overlap_scheduling, config("").decode_graphs) == (None, None)  # by device
    c = config("--overlap-scheduling --no-decode-graphs")
    assert (c.overlap_scheduling, c.decode_graphs) == (True, False)
    assert Engine(dataclasses.replace(c, dtype="float32")).overlap
    assert not Engine(EngineConfig(model=str(llama.path), dtype="float32")).overlap  # CPU default: lockstep
