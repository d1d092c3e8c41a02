"""KV that moves between engines (engine/omnibus/engine/kv_transfer), two engines in one
process over Mooncake's transfer engine (TCP, loopback): a prefill engine's held KV read
by a decode engine, and a drained engine's running requests read by another, go on token
for token as transformers (greedy) and as one engine (seeded sampling), with no prompt
token computed twice (the reader computes only the token whose KV was pending). Faults:
the holder lets go mid-read (the lease word changes), the holder's transfer engine is
gone, the handle does not match the request, the reader has no room; each is recomputed
or waits, token-exact, and both pools' bookkeeping holds after every step and ends with
every block free."""

from __future__ import annotations

import dataclasses
import json
import random
import time

import pytest

from omnibus.common.sampling import StructuredOutput
from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import Engine
from omnibus.engine.request import EngineRequest
from omnibus.engine.worker.sampling import SamplingParams
from tests.checkpoints import hf_greedy, load_hf, make_checkpoint

pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine is in `make setup`'s environment")

VOCAB = 384
BLOCK = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("kv-transfer"), "llama", vocab_size=VOCAB)
    return path, load_hf(path)


def make_engine(path, **kw) -> Engine:
    # handles given with the first token (an early handle, read while the prefill runs:
    # test_kv_overlap.py)
    kw.setdefault("kv_transfer_overlap", False)
    return Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=kw.pop("num_kv_blocks", 64),
                               block_size=BLOCK, kv_transfer="mooncake", **kw))


@pytest.fixture(scope="module")
def pair(model):
    path, _ = model
    engines = [make_engine(path), make_engine(path)]
    yield engines
    for e in engines:
        e.close()


def run(engine: Engine) -> dict[str, list]:
    """Steps `engine` until it has nothing left; each request's outputs, the pool checked
    after every step."""
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        engine.check_integrity()
    return outs


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def prompt(seed: int, n: int = 45) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def prefill(engine: Engine, rid: str, ids: list[int], params: SamplingParams):
    """The prefill engine's part: the first token, and the handle of the KV it holds."""
    engine.add_request(EngineRequest(rid, ids, dataclasses.replace(params, max_tokens=1), kv_hold=True))
    (out,) = run(engine)[rid]
    assert out.finish_reason == "length" and out.kv_handle is not None
    assert out.kv_handle.num_tokens == len(ids)  # every prompt token's KV; the first output's is not computed
    return out.new_token_ids, out.kv_handle


def decode(engine: Engine, rid: str, ids: list[int], sent: list[int], params: SamplingParams, handle):
    """The decode engine's part: the prompt + the tokens sent, reading the handle's KV."""
    rest = dataclasses.replace(params, max_tokens=params.max_tokens - len(sent), output_offset=len(sent))
    engine.add_request(EngineRequest(rid, ids + sent, rest, kv_source=handle))
    return run(engine)[rid]


def all_free(engine: Engine) -> None:
    counts = engine.check_integrity()
    assert counts.referenced == 0 and not engine.kv.held, (counts, engine.kv.stats())


def test_a_prefill_engines_kv_read_by_a_decode_engine_goes_on_token_exact(model, pair):
    path, hf = model
    p, d = pair
    before = d.kv.stats()
    for i, n in enumerate((45, 16, 3)):  # a partial last block, exactly full blocks, less than one
        ids = prompt(i, n)
        first, handle = prefill(p, f"p{i}", ids, greedy(8))
        outs = decode(d, f"d{i}", ids, first, greedy(8), handle)
        assert first + tokens(outs) == hf_greedy(hf, ids, 8)
        assert outs[0].num_cached_tokens == n  # read, not computed: only the first output's KV was
        assert p.abort(f"p{i}")  # the reader's router releases the holder
        all_free(p)
        all_free(d)
    after = d.kv.stats()
    assert after.loaded_tokens - before.loaded_tokens == 45 + 16 + 3
    assert after.load_failures == before.load_failures


def test_seeded_sampling_and_penalties_go_on_as_on_one_engine(model, pair):
    path, _ = model
    p, d = pair
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, repetition_penalty=1.3,
                            ignore_eos=True)
    ids = prompt(11, 37)
    one = make_engine(path)
    try:
        one.add_request(EngineRequest("one", ids, params))
        want = tokens(run(one)["one"])
    finally:
        one.close()
    first, handle = prefill(p, "ps", ids, params)
    assert first + tokens(decode(d, "ds", ids, first, params, handle)) == want
    p.abort("ps")
    all_free(p)


def test_a_drained_engines_running_requests_move_with_their_kv(model, pair):
    """Engine.migrate (a drain): every running request ends with its computed KV held;
    another engine reads it and goes on, computing nothing twice."""
    path, hf = model
    a, b = pair
    ids = [prompt(20 + i, 20 + 9 * i) for i in range(4)]
    for i, p_ in enumerate(ids):
        a.add_request(EngineRequest(f"m{i}", p_, greedy(24)))
    sent: dict[str, list[int]] = {f"m{i}": [] for i in range(4)}
    for _ in range(6):  # some decode steps on `a`
        for out in a.step():
            sent[out.request_id] += out.new_token_ids
    a.migrate()
    ended = run(a)
    before = b.kv.stats().loaded_tokens
    for i, p_ in enumerate(ids):
        rid = f"m{i}"
        last = ended[rid][-1]
        sent[rid] += tokens(ended[rid])
        assert last.finish_reason == "abort" and last.kv_handle is not None
        assert last.kv_handle.num_tokens == len(p_) + len(sent[rid]) - 1  # the last token's KV was pending
        outs = decode(b, rid, p_, sent[rid], greedy(24), last.kv_handle)
        assert sent[rid] + tokens(outs) == hf_greedy(hf, p_, 24), rid
        assert outs[0].num_cached_tokens == last.kv_handle.num_tokens  # no recompute
        assert a.abort(rid)
    assert b.kv.stats().loaded_tokens - before == sum(len(p_) + len(sent[f"m{i}"]) - 1 for i, p_ in enumerate(ids))
    all_free(a)
    all_free(b)


class _LetGoMidRead:
    """The holder gives its blocks back between the reader's block read and its lease
    read: the read's bytes may be another request's by then."""

    def __init__(self, transport, holder: Engine, request_id: str) -> None:
        self._transport, self._holder, self._rid = transport, holder, request_id
        self.address = transport.address

    def read(self, peer, local, remote, lengths):
        ok = self._transport.read(peer, local, remote, lengths)
        if len(local) > 1:  # the blocks; the lease word is read next
            self._holder.abort(self._rid)
        return ok


def test_a_transfer_cut_mid_way_is_recomputed_token_exact(model, pair):
    path, hf = model
    p, d = pair
    ids = prompt(31, 45)
    first, handle = prefill(p, "pc", ids, greedy(6))
    real = d.kv.shard.transport
    d.kv.shard.transport = _LetGoMidRead(real, p, "pc")
    failures = d.kv.stats().load_failures
    try:
        outs = decode(d, "dc", ids, first, greedy(6), handle)
    finally:
        d.kv.shard.transport = real
    assert first + tokens(outs) == hf_greedy(hf, ids, 6)
    assert outs[0].num_cached_tokens == 0  # nothing read: recomputed
    assert d.kv.stats().load_failures == failures + 1
    all_free(p)
    all_free(d)


def test_a_holder_that_is_gone_and_a_handle_that_does_not_match_are_recomputed(model, pair):
    path, hf = model
    _, d = pair
    gone = make_engine(path)
    ids = prompt(41, 30)
    first, handle = prefill(gone, "pg", ids, greedy(6))
    gone.close()  # its transfer engine with it: the read fails at once
    outs = decode(d, "dg", ids, first, greedy(6), handle)
    assert first + tokens(outs) == hf_greedy(hf, ids, 6) and outs[0].num_cached_tokens == 0
    # another request's handle (its tokens differ): not read at all
    refused = d.kv.stats().refused
    other = prompt(42, 30)
    outs = decode(d, "dm", other, first, greedy(6), handle)
    assert tokens(outs) == hf_greedy(hf, other + first, 5)
    assert d.kv.stats().refused == refused + 1
    all_free(d)


def test_a_handle_whose_blocks_do_not_fit_its_rank_count_is_refused_and_recomputed(model, pair):
    """A handle that says two ranks (layout ".../tp2", a peer per rank) but whose blocks
    hold every head, as no two-rank engine's do: a one-rank engine does not read it, and
    computes the request (two-rank handles read by one-rank engines and back:
    tests/e2e/test_tensor_parallel_serving.py)."""
    path, hf = model
    p, d = pair
    ids = prompt(141, 30)
    first, handle = prefill(p, "pt", ids, greedy(6))
    two = dataclasses.replace(handle, layout=handle.layout + "/tp2", rank_peers=(handle.peer,),
                              regions=handle.regions * 2)
    refused = d.kv.stats().refused
    outs = decode(d, "dt", ids, first, greedy(6), two)
    assert first + tokens(outs) == hf_greedy(hf, ids, 6) and outs[0].num_cached_tokens == 0
    assert d.kv.stats().refused == refused + 1 and p.abort("pt")
    all_free(p)
    all_free(d)


class _PretendRank:
    """Rank 1 of a pretend two-rank engine (rank 0 is the engine itself): it offers dummy
    regions, and each read it is asked for reports `ok` at the next poll."""

    def __init__(self, regions: int) -> None:
        self.regions, self.ok, self.reads = regions, True, []

    def setup(self, slots, num_kv_heads):
        return [("127.0.0.1:9", tuple(range(1, self.regions + 1)))]

    def read(self, ticket, src, local, remote, progress):
        assert progress is None  # (a hold, not an early one)
        assert src.rank_peers == ("127.0.0.1:9",) and src.regions[self.regions:] == tuple(range(1, self.regions + 1))
        self.reads.append(ticket)

    def poll(self):
        done, self.reads = {t: self.ok for t in self.reads}, []
        return [done]

    def stage_out(self, blocks, slots):
        pass

    stage_in = stage_out


def test_a_load_counts_only_when_every_rank_read_its_part(model, pair, monkeypatch):
    """Rank 0's connector under tensor parallelism: a read is done when rank 0's and every
    other rank's are, and one rank's failed read fails the load (recomputed, token-exact)."""
    import omnibus.engine.engine as engine_module
    from omnibus.engine.kv_transfer.connector import KvConnector
    from omnibus.engine.kv_transfer.transport import make_transport

    path, hf = model
    regions = len(pair[0].kv.regions)
    ranks: list[_PretendRank] = []

    def two_ranks(config, kv_caches, _ranks=None, _num_kv_heads=0):
        ranks.append(_PretendRank(regions))
        return KvConnector(make_transport("mooncake", "127.0.0.1"), kv_caches, config.block_size,
                           config.kv_hold_seconds, 0, ranks[-1])

    monkeypatch.setattr(engine_module, "make_connector", two_ranks)
    p, d = make_engine(path), make_engine(path)
    try:
        for i, ok in enumerate((True, False)):
            ranks[1].ok = ok
            ids = prompt(150 + i, 37)
            first, handle = prefill(p, f"pr{i}", ids, greedy(6))
            assert handle.layout.endswith("/tp2") and len(handle.regions) == 2 * regions
            failures = d.kv.stats().load_failures
            outs = decode(d, f"dr{i}", ids, first, greedy(6), handle)
            assert first + tokens(outs) == hf_greedy(hf, ids, 6)
            assert outs[0].num_cached_tokens == (37 if ok else 0)
            assert d.kv.stats().load_failures == failures + (not ok) and p.abort(f"pr{i}")
        for e in (p, d):
            all_free(e)
    finally:
        for e in (p, d):
            e.close()


def test_a_read_that_raises_fails_its_load_and_is_recomputed(model, pair, monkeypatch):
    """An error above the transport in the read thread (here the shard's read itself)
    reports a failed load: the request is recomputed, never left loading."""
    path, hf = model
    p, d = pair

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the read path")

    monkeypatch.setattr(d.kv.shard, "read", broken)
    ids = prompt(170, 29)
    failures = d.kv.stats().load_failures
    first, handle = prefill(p, "rx", ids, greedy(5))
    outs = decode(d, "rx-d", ids, first, greedy(5), handle)
    assert first + tokens(outs) == hf_greedy(hf, ids, 5) and outs[0].num_cached_tokens == 0
    assert d.kv.stats().load_failures == failures + 1 and p.abort("rx")
    for e in (p, d):
        all_free(e)


def test_a_reader_with_no_room_waits_then_reads(model, pair):
    """A decode engine whose pool is full seats the request once blocks free up; the
    holder keeps the KV meanwhile."""
    path, hf = model
    p, _ = pair
    small = make_engine(path, num_kv_blocks=9)  # 8 usable blocks
    try:
        busy = prompt(51, 40)  # 5 blocks while it decodes 20 tokens: the next request's 6 do not fit
        small.add_request(EngineRequest("busy", busy, greedy(20)))
        early = small.step()
        ids = prompt(52, 45)
        first, handle = prefill(p, "pr", ids, greedy(4))
        rest = greedy(3, output_offset=1)
        small.add_request(EngineRequest("dr", ids + first, rest, kv_source=handle))
        early += small.step()
        assert small.scheduler.num_waiting == 1  # no room: it waits, holding nothing
        outs = run(small)
        assert tokens(early) + tokens(outs["busy"]) == hf_greedy(hf, busy, 20)
        assert first + tokens(outs["dr"]) == hf_greedy(hf, ids, 4)
        assert outs["dr"][0].num_cached_tokens == 45
        p.abort("pr")
        all_free(p)
        all_free(small)
    finally:
        small.close()


def test_a_drafting_decode_engine_and_a_structured_request_go_on_after_the_read(model):
    """A decode engine that speculates with a draft model (the draft computes the moved
    context in its own pool: none of it travels) and a structured request (the grammar is
    replayed over the first token the prefill engine sent) go on as one engine serves them:
    greedy equal to transformers, the structured one equal to one engine's JSON."""
    path, hf = model
    p = make_engine(path, structured_max_whitespace=4)
    d = make_engine(path, speculative="draft", speculative_draft_model=str(path), structured_max_whitespace=4)
    one = Engine(EngineConfig(model=str(path), dtype="float32", block_size=BLOCK, structured_max_whitespace=4))
    try:
        ids = prompt(71, 40)
        first, handle = prefill(p, "ps", ids, greedy(16))
        outs = decode(d, "ds", ids, first, greedy(16), handle)
        assert first + tokens(outs) == hf_greedy(hf, ids, 16)
        spec = d.stats().speculative
        assert outs[0].num_cached_tokens == 40 and spec.accepted >= 0.7 * spec.proposed > 0
        assert p.abort("ps")
        fmt = SamplingParams(max_tokens=24, temperature=0.0,
                             structured_output=StructuredOutput("json_schema", json.dumps(
                                 {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})))
        ids = prompt(72, 30)
        (want,) = one.generate([ids], fmt)
        first, handle = prefill(p, "pj", ids, fmt)
        outs = decode(d, "dj", ids, first, fmt, handle)
        assert first + tokens(outs) == want and outs[0].num_cached_tokens == 30
        assert p.abort("pj")
        all_free(p)
        all_free(d)
        assert d.speculator.proposer.allocator.check_integrity([]).referenced == 0
    finally:
        for e in (p, d, one):
            e.close()


def test_a_reader_with_the_prompts_head_cached_reads_only_the_rest(model, pair):
    """Prefix caching still holds on the decode side: the blocks it has cached (a shared
    system prompt) are not read; only the blocks past them travel."""
    path, hf = model
    p, d = pair
    head = prompt(101, 24)  # 3 full blocks
    d.add_request(EngineRequest("warm", head + prompt(102, 5), greedy(2)))
    run(d)
    ids = head + prompt(103, 21)
    first, handle = prefill(p, "ph", ids, greedy(6))
    before = d.kv.stats().loaded_tokens
    outs = decode(d, "dh", ids, first, greedy(6), handle)
    assert first + tokens(outs) == hf_greedy(hf, ids, 6)
    assert outs[0].num_cached_tokens == 45  # 24 cached here + 21 read
    assert d.kv.stats().loaded_tokens - before == 45 - 24
    assert p.abort("ph")
    all_free(p)
    all_free(d)


def test_a_migrated_structured_request_keeps_its_grammar_and_goes_on_as_one_engine(model):
    """A drain mid-stream of a JSON-schema request: the reader replays the sent tokens
    into a fresh matcher (output_offset), reads the KV, and finishes the same JSON as one
    engine that was never drained."""
    path, _ = model
    kw = dict(structured_max_whitespace=4)
    a, b = make_engine(path, **kw), make_engine(path, **kw)
    one = Engine(EngineConfig(model=str(path), dtype="float32", block_size=BLOCK, **kw))
    try:
        fmt = SamplingParams(max_tokens=32, temperature=0.0, structured_output=StructuredOutput("json_schema", json.dumps(
            {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
             "required": ["a", "b"]})))
        ids = prompt(111, 26)
        (want,) = one.generate([ids], fmt)
        assert len(want) > 8  # still writing when the drain comes
        a.add_request(EngineRequest("js", ids, fmt))
        sent: list[int] = []
        for _ in range(5):
            for out in a.step():
                sent += out.new_token_ids
        a.migrate()
        ended = run(a)["js"]
        sent += tokens(ended)
        handle = ended[-1].kv_handle
        assert handle is not None and 0 < len(sent) < len(want)
        outs = decode(b, "js", ids, sent, fmt, handle)
        assert sent + tokens(outs) == want and outs[0].num_cached_tokens == handle.num_tokens
        assert a.abort("js")
        all_free(a)
        all_free(b)
    finally:
        for e in (a, b, one):
            e.close()


def block_bytes(engine: Engine) -> int:
    """One block of the pool over every layer's K and V."""
    return engine.kv.block_bytes * len(engine.kv.regions)


def test_an_engine_staging_through_host_memory_and_one_reading_in_place_go_on_token_exact(model, pair):
    """--kv-transfer-staging-bytes (how a pool on a GPU moves: copied out when held, in
    when read) on a CPU pool: a staged holder gives its pool blocks back at once and holds
    the copy; staged and in-place engines read each other's handles, and a staged engine's
    drain moves its requests, all token-exact with nothing recomputed."""
    path, hf = model
    p, d = pair
    staged = make_engine(path, kv_transfer_staging_bytes=64 * block_bytes(p))
    try:
        ids = prompt(81, 45)
        first, handle = prefill(staged, "sp", ids, greedy(8))
        assert staged.check_integrity().referenced == 0 and staged.kv.stats().held_blocks == 0  # the copy is held
        outs = decode(d, "sd", ids, first, greedy(8), handle)
        assert first + tokens(outs) == hf_greedy(hf, ids, 8) and outs[0].num_cached_tokens == 45
        assert staged.abort("sp") and staged.kv.staging.free == 64
        ids = prompt(82, 37)
        first, handle = prefill(p, "ip", ids, greedy(8))
        outs = decode(staged, "is", ids, first, greedy(8), handle)
        assert first + tokens(outs) == hf_greedy(hf, ids, 8) and outs[0].num_cached_tokens == 37
        assert p.abort("ip") and staged.kv.staging.free == 64
        # a drain of the staged engine: its running requests read by the in-place one
        runs = [prompt(83 + i, 20 + 7 * i) for i in range(3)]
        for i, ids in enumerate(runs):
            staged.add_request(EngineRequest(f"sm{i}", ids, greedy(16)))
        sent = {f"sm{i}": [] for i in range(3)}
        for _ in range(4):
            for out in staged.step():
                sent[out.request_id] += out.new_token_ids
        staged.migrate()
        ended = run(staged)
        for i, ids in enumerate(runs):
            rid = f"sm{i}"
            sent[rid] += tokens(ended[rid])
            handle = ended[rid][-1].kv_handle
            outs = decode(d, rid, ids, sent[rid], greedy(16), handle)
            assert sent[rid] + tokens(outs) == hf_greedy(hf, ids, 16), rid
            assert outs[0].num_cached_tokens == handle.num_tokens
            assert staged.abort(rid)
        assert staged.kv.staging.free == 64
        for e in (staged, p, d):
            all_free(e)
    finally:
        staged.close()


@pytest.mark.parametrize("early", [False, True], ids=["hold", "early-hold"])
def test_staging_with_no_room_holds_nothing_and_reads_nothing_and_both_are_recomputed(model, pair, early):
    """(with --kv-transfer-overlap, no early handle either: the prefill ends as a plain one)"""
    path, hf = model
    p, d = pair
    small = make_engine(path, kv_transfer_staging_bytes=2 * block_bytes(p),  # 2 blocks: a 45-token prompt needs 6
                        kv_transfer_overlap=early)
    try:
        ids = prompt(91, 45)
        small.add_request(EngineRequest("nh", ids, greedy(1), kv_hold=True))
        (out,) = run(small)["nh"]
        assert out.finish_reason == "length" and out.kv_handle is None  # ends as a plain request
        assert out.new_token_ids == hf_greedy(hf, ids, 1) and small.kv.stats().sent_early == 0
        all_free(small)
        ids = prompt(92, 45)  # (not the one just computed here: its prefix is cached, 1 block to read)
        first, handle = prefill(p, "nr", ids, greedy(6))
        failures = small.kv.stats().load_failures
        outs = decode(small, "nr", ids, first, greedy(6), handle)
        assert first + tokens(outs) == hf_greedy(hf, ids, 6) and outs[0].num_cached_tokens == 0
        assert small.kv.stats().load_failures == failures + 1 and small.kv.staging.free == 2
        assert p.abort("nr")
        all_free(small)
        all_free(p)
    finally:
        small.close()


def test_a_hold_whose_reader_never_comes_is_given_back_when_its_lease_ends(model):
    path, _ = model
    p = make_engine(path, kv_hold_seconds=0.05)
    try:
        prefill(p, "pl", prompt(61, 20), greedy(4))
        assert p.kv.held and p.holds_kv()
        time.sleep(0.1)
        p.step()  # any step gives back what has expired
        assert not p.kv.held and p.kv.stats().expired == 1
        all_free(p)
    finally:
        p.close()


def test_auto_is_the_address_this_hosts_name_resolves_to_and_an_unresolvable_name_says_so(monkeypatch):
    import socket

    from omnibus.engine.kv_transfer.transport import own_address

    assert own_address("10.1.2.3") == "10.1.2.3"
    assert own_address("auto") == socket.gethostbyname(socket.gethostname())
    monkeypatch.setattr(socket, "gethostname", lambda: "no-such-host.invalid")
    with pytest.raises(RuntimeError, match="'no-such-host.invalid' does not resolve.*pass the address"):
        own_address("auto")
