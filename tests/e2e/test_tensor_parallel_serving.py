"""A tensor-parallel engine (--tensor-parallel-size 2, its step loop in a process of its
own, the production default) behind the router: what it serves equals a one-device
engine's token for token (plain, with a LoRA adapter, with a JSON schema), a rank killed
mid-stream ends the engine and its streams continue on the other engine token for token,
no rank is left running, and a size that does not split is refused at startup naming it.

The one-device engine's outputs equal transformers' and PEFT's elsewhere (tests/oracle);
tests/oracle/test_tensor_parallel.py holds the ranks to transformers directly."""

from __future__ import annotations

import json
import os
import re
import signal

import grpc
import pytest
from omnibus.v1 import inference_pb2 as pb
from omnibus.v1 import inference_pb2_grpc

from tests.grpc_helpers import engine_process, engine_stats, router_process, wait_until

FLAGS = ("--num-kv-blocks", "512", "--block-size", "8", "--max-num-seqs", "8", "--max-loras", "2")
SCHEMA = {"type": "object", "properties": {"name": {"enum": ["fox", "dog", "cat"]}, "n": {"enum": [1, 2, 3]}},
          "required": ["name", "n"]}  # short whatever the random model prefers


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model, one_adapter):
    model = tiny_model
    logs = tmp_path_factory.mktemp("logs")
    flags = (*FLAGS, "--adapter-dir", str(one_adapter))
    tp = engine_process(model, logs, "engine-tp", *flags, "--tensor-parallel-size", "2", "--step-loop", "process",
                        "--kv-transfer", "mooncake")
    one = engine_process(model, logs, "engine-one", *flags)
    procs = [tp, one]
    try:
        for proc in procs:
            proc.wait_serving()
        routers = {}
        for name, engines in (("tp", [tp]), ("one", [one]), ("both", [tp, one])):
            routers[name] = router_process(model, [e.address for e in engines], logs, f"router-{name}",
                                           "--engine-stale-seconds=1.5")
            procs.append(routers[name])
        for router in routers.values():
            router.wait_serving()
        yield {"model": model, "logs": logs, "tp": tp, "one": one,
               **{f"via_{name}": inference_pb2_grpc.InferenceStub(grpc.insecure_channel(r.address))
                  for name, r in routers.items()}}
    finally:
        for proc in reversed(procs):
            proc.stop()


def request(text: str, max_tokens: int, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                    ignore_eos=True, **sampling))


def tokens(stub, req, adapter: str | None = None) -> list[int]:
    metadata = (("x-adapter-id", adapter),) if adapter else ()
    return [t for r in stub.Generate(req, metadata=metadata) for t in r.token_ids]


def test_two_ranks_serve_what_one_device_serves_through_the_router(fleet):
    plain = request("Once upon a time", 24)
    assert tokens(fleet["via_tp"], plain) == tokens(fleet["via_one"], plain)
    adapted = tokens(fleet["via_tp"], plain, "b-r8")
    assert adapted == tokens(fleet["via_one"], plain, "b-r8") and adapted != tokens(fleet["via_one"], plain)
    structured = request("A record:", 48, structured_output=pb.StructuredOutput(json_schema=json.dumps(SCHEMA)))
    structured.sampling.ignore_eos = False
    text = "".join(r.text for r in fleet["via_tp"].Generate(structured))
    assert text == "".join(r.text for r in fleet["via_one"].Generate(structured))
    assert set(json.loads(text)) == {"name", "n"}


def test_two_rank_engines_move_kv_rank_to_rank_both_ways_token_exact(fleet):
    """--kv-transfer under tensor parallelism: each rank reads its heads of the blocks from
    the holder's rank of the same number. The served TP engine (its step loop in its own
    process) holds a prefill's KV in place; a TP engine here reads it through host
    staging (copied in on both ranks); that engine's drain holds its request's KV staged
    (copied out on both ranks) and the served engine reads it in place. Both go on as the
    one-device engine serves them, with nothing recomputed."""
    import random

    from omnibus.v1 import engine_pb2_grpc

    from omnibus.engine.config import EngineConfig
    from omnibus.engine.engine import Engine
    from omnibus.engine.kv_transfer.handle import KvHandle
    from omnibus.engine.request import EngineRequest
    from omnibus.engine.worker.sampling import SamplingParams
    from tests.grpc_helpers import engine_request

    pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine is in `make setup`'s environment")
    rng = random.Random(5)
    ids = [rng.randrange(3, 250) for _ in range(37)]

    def served(address: str, req) -> tuple[list[int], object]:
        with grpc.insecure_channel(address) as channel:
            replies = list(engine_pb2_grpc.EngineStub(channel).Generate(req, timeout=60))
        return [t for r in replies for t in r.token_ids], replies[-1]

    want, _ = served(fleet["one"].address, engine_request("kv-ref", ids, max_tokens=16))
    here = Engine(EngineConfig(model=str(fleet["model"]), num_kv_blocks=512, block_size=8, tensor_parallel_size=2,
                               kv_transfer="mooncake", kv_transfer_staging_bytes=8 << 20))
    try:
        hold = engine_request("kv-p", ids, max_tokens=1)
        hold.kv_hold = True
        first, last = served(fleet["tp"].address, hold)
        handle = KvHandle.from_proto(last.kv_handle)
        assert handle.num_tokens == len(ids) and len(handle.rank_peers) == 1
        rest = SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True, output_offset=1)
        here.add_request(EngineRequest("kv-d", ids + first, rest, kv_source=handle))
        got, outs = list(first), []
        wait_until(lambda: outs.extend(here.step()) or sum(len(o.new_token_ids) for o in outs) >= 3, 30,
                   "the read and three tokens")  # then a drain
        here.migrate()
        while here.has_unfinished():
            outs += here.step()
        got += [t for o in outs for t in o.new_token_ids]
        assert outs[0].num_cached_tokens == len(ids) and outs[-1].finish_reason == "abort"
        moved = outs[-1].kv_handle
        assert moved is not None and moved.num_tokens == len(ids) + len(got) - 1
        back = engine_request("kv-b", ids + got, max_tokens=16 - len(got), output_offset=len(got))
        back.kv_source.CopyFrom(moved.to_proto())
        tail, last = served(fleet["tp"].address, back)
        assert got + tail == want
        stats = engine_stats(fleet["tp"].address).kv_transfer
        # its own prefill of the prompt left 4 full blocks cached: it reads only the rest
        assert stats.loaded_tokens == moved.num_tokens - 32 and stats.load_failures == 0
        assert stats.layout == here.kv.layout and stats.layout.endswith("/tp2")  # routers match readers by it
        assert here.abort("kv-d") and here.check_integrity().referenced == 0 and not here.kv.held
    finally:
        here.close()


@pytest.mark.parametrize("staging", [0, 8 << 20], ids=["in-place", "staged"])
def test_engines_of_two_ranks_and_of_one_read_each_others_kv_token_exact(fleet, staging):
    """Engines of another rank count read a handle too (kv_transfer/reshard.py): a
    one-device engine here reads the served two-rank engine's held KV (each block's
    heads gathered from both ranks' halves), and the two-rank engine reads this one's
    (each rank its half of the heads). Both go on as the one-device engine serves them,
    with nothing recomputed; the engine here holds and reads in place, or stages as an
    engine on a GPU does (its hold staged; a resharded read lands in scratch, not staging)."""
    import random
    import time

    from omnibus.v1 import engine_pb2_grpc

    from omnibus.engine.config import EngineConfig
    from omnibus.engine.engine import Engine
    from omnibus.engine.request import EngineRequest
    from omnibus.engine.worker.sampling import SamplingParams
    from tests.grpc_helpers import engine_request

    pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine is in `make setup`'s environment")
    rng = random.Random(7 + staging)  # prompts no engine has cached
    to_one, to_two = ([rng.randrange(3, 250) for _ in range(n)] for n in (29, 43))

    def served(address: str, req):
        with grpc.insecure_channel(address) as channel:
            replies = list(engine_pb2_grpc.EngineStub(channel).Generate(req, timeout=60))
        return [t for r in replies for t in r.token_ids], replies[-1]

    def run(engine: Engine) -> list:
        outs, start = [], time.monotonic()
        while engine.has_unfinished():
            outs += engine.step()
            engine.check_integrity()
            assert time.monotonic() - start < 60, "the engine never finished"
        return outs

    want = {name: served(fleet["one"].address, engine_request(f"rs-{name}", ids, max_tokens=12))[0]
            for name, ids in (("one", to_one), ("two", to_two))}
    here = Engine(EngineConfig(model=str(fleet["model"]), num_kv_blocks=256, block_size=8, kv_transfer="mooncake",
                               kv_transfer_staging_bytes=staging))
    try:
        hold = engine_request(f"rs-p2-{staging}", to_one, max_tokens=1)
        hold.kv_hold = True
        first, last = served(fleet["tp"].address, hold)
        assert last.kv_handle.layout.endswith("/tp2") and last.kv_handle.layout != here.kv.layout
        from omnibus.engine.kv_transfer.handle import KvHandle

        rest = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True, output_offset=1)
        handle = KvHandle.from_proto(last.kv_handle)
        here.add_request(EngineRequest(f"rs-d1-{staging}", to_one + first, rest, kv_source=handle))
        outs = run(here)
        assert first + [t for o in outs for t in o.new_token_ids] == want["one"]
        assert outs[0].num_cached_tokens == len(to_one)
        stats = here.kv.stats()
        assert (stats.loaded_tokens, stats.load_failures, stats.refused) == (len(to_one), 0, 0)

        greedy1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        here.add_request(EngineRequest(f"rs-p1-{staging}", to_two, greedy1, kv_hold=True))
        (out,) = run(here)
        assert out.kv_handle is not None and out.kv_handle.num_tokens == len(to_two)
        before = engine_stats(fleet["tp"].address).kv_transfer
        back = engine_request(f"rs-d2-{staging}", to_two + out.new_token_ids, max_tokens=11, output_offset=1)
        back.kv_source.CopyFrom(out.kv_handle.to_proto())
        tail, last = served(fleet["tp"].address, back)
        assert out.new_token_ids + tail == want["two"]
        after = engine_stats(fleet["tp"].address).kv_transfer
        assert after.loaded_tokens - before.loaded_tokens == len(to_two)
        assert after.load_failures == before.load_failures and after.refused == before.refused
        assert here.abort(f"rs-p1-{staging}") and here.check_integrity().referenced == 0 and not here.kv.held
    finally:
        here.close()


def served_tokens(address: str, req) -> list[int]:
    from omnibus.v1 import engine_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return [t for r in engine_pb2_grpc.EngineStub(channel).Generate(req, timeout=60) for t in r.token_ids]


def early_handle(engine, rid: str, ids: list[int]):
    """`engine`'s early handle for a prefill of `ids` (seated, its first chunk computed)."""
    from omnibus.engine.request import EngineRequest
    from omnibus.engine.worker.sampling import SamplingParams

    engine.add_request(EngineRequest(rid, ids, SamplingParams(max_tokens=1, temperature=0.0), kv_hold=True))
    (out,) = engine.step()
    assert out.kv_handle is not None and out.kv_handle.progress_addr and not out.new_token_ids
    assert out.kv_handle.num_tokens == len(ids) - 1
    return out.kv_handle


def served_tp_reads(fleet, holder, rid: str, ids: list[int], handle, want: list[int]) -> None:
    """The served two-rank engine reads `handle` while `holder` is stepped (it reports
    nothing more for the request): it serves `want`, having read the prompt less its last
    token, nothing failed or refused."""
    import threading
    import time

    from tests.grpc_helpers import engine_request

    before = engine_stats(fleet["tp"].address).kv_transfer
    read = engine_request(rid, ids, max_tokens=len(want))
    read.kv_source.CopyFrom(handle.to_proto())
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.extend(served_tokens(fleet["tp"].address, read)))
    reader.start()
    start = time.monotonic()
    while reader.is_alive():
        assert holder.step() == []  # its handle was its last output
        holder.check_integrity()
        time.sleep(0.01)
        assert time.monotonic() - start < 60, "the read never finished"
    reader.join()
    assert got == want
    after = engine_stats(fleet["tp"].address).kv_transfer
    assert after.loaded_tokens - before.loaded_tokens == len(ids) - 1
    assert after.load_failures == before.load_failures and after.refused == before.refused


@pytest.mark.parametrize("staging", [0, 8 << 20], ids=["in-place", "staged"])
def test_a_two_rank_prefills_early_handle_is_read_rank_by_rank_while_it_runs_token_exact(fleet, staging):
    """--kv-transfer-overlap under tensor parallelism: a two-rank engine here hands a
    4-chunk prefill's KV on when it is seated; its progress words (rank 0's) move at each
    step's end, once both ranks computed the chunk (staged: after both copied it out).
    The served two-rank engine reads it, each rank from this one's rank of its number
    following those words, while this engine is stepped; it computes the last prompt
    token itself and goes on as the one-device engine serves the prompt, nothing
    recomputed. In place, engines of another rank count follow early handles too: a
    one-device engine reads this one's, and the served two-rank engine a one-device
    engine's."""
    import random
    import time

    from omnibus.engine.config import EngineConfig
    from omnibus.engine.engine import Engine
    from omnibus.engine.request import EngineRequest
    from omnibus.engine.worker.sampling import SamplingParams
    from tests.grpc_helpers import engine_request

    pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine is in `make setup`'s environment")
    rng = random.Random(11 + staging)
    prompts = [[rng.randrange(3, 250) for _ in range(61)] for _ in range(3)]  # one a read, none cached anywhere
    want = [served_tokens(fleet["one"].address, engine_request(f"ek-ref{i}-{staging}", ids, max_tokens=12))
            for i, ids in enumerate(prompts)]
    here = Engine(EngineConfig(model=str(fleet["model"]), num_kv_blocks=256, block_size=8, tensor_parallel_size=2,
                               kv_transfer="mooncake", kv_transfer_staging_bytes=staging, kv_transfer_overlap=True,
                               max_num_batched_tokens=16))
    try:
        assert not here.kv.marks_layers  # a sharded pool's progress moves at the step's end
        handle = early_handle(here, f"ek-p-{staging}", prompts[0])
        assert len(handle.rank_peers) == 1
        served_tp_reads(fleet, here, f"ek-d-{staging}", prompts[0], handle, want[0])
        assert here.kv.stats().sent_early == 1 and not here.has_unfinished()
        assert here.abort(f"ek-p-{staging}") and here.check_integrity().referenced == 0 and not here.kv.held
        assert here.kv.staging is None or here.kv.staging.free == len(here.kv.staging.tensors[0])
        if staging:
            return
        # A reader of another rank count follows them too (reshard.py): a one-device engine
        # reads each block's heads from both ranks of this engine as its progress allows
        one = Engine(EngineConfig(model=str(fleet["model"]), num_kv_blocks=64, block_size=8, kv_transfer="mooncake",
                                  kv_transfer_overlap=True, max_num_batched_tokens=16))
        try:
            handle = early_handle(here, "ek-p1", prompts[1])
            read, running = one.kv.shard.transport.read, []

            def watched(peer, local, remote, lengths):  # a read of blocks, not of lease/progress words
                if sum(lengths) > 8 * (1 + one.kv.layers):
                    running.append("ek-p1" in here.scheduler.lifecycle.requests)
                return read(peer, local, remote, lengths)

            one.kv.shard.transport.read = watched
            one.add_request(EngineRequest("ek-d1", prompts[1], SamplingParams(max_tokens=12, temperature=0.0,
                                                                              ignore_eos=True), kv_source=handle))
            outs, start = one.step(), time.monotonic()  # the read starts: the first chunk is final on both ranks
            wait_until(lambda: running, 10, "a block read while the holder's prefill runs")
            while one.has_unfinished():
                here.step()
                outs += one.step()
                time.sleep(0.005)
                assert time.monotonic() - start < 60, "the read never finished"
            one.kv.shard.transport.read = read
            assert [t for o in outs for t in o.new_token_ids] == want[1] and running[0]
            stats = one.kv.stats()
            assert (stats.loaded_tokens, stats.load_failures, stats.refused) == (len(prompts[1]) - 1, 0, 0)
            assert here.abort("ek-p1") and here.check_integrity().referenced == 0 and not here.kv.held
            # and the other way: the served two-rank engine reads a one-device engine's
            # early handle, each rank its heads
            handle = early_handle(one, "ek-p2", prompts[2])
            assert not handle.rank_peers
            served_tp_reads(fleet, one, "ek-d2", prompts[2], handle, want[2])
            assert one.abort("ek-p2") and one.check_integrity().referenced == 0 and not one.kv.held
        finally:
            one.close()
    finally:
        here.close()


def rank_pid(fleet) -> int:
    (pid,) = re.findall(r'"ranks": \[(\d+)\]', fleet["tp"].log_path.read_text())
    return int(pid)


def test_a_killed_rank_ends_the_engine_and_its_streams_continue_token_exact(fleet):
    requests = [request(f"story {i}:", 300) for i in range(4)]
    expected = [tokens(fleet["via_one"], r) for r in requests]
    pid = rank_pid(fleet)
    calls = [fleet["via_both"].Generate(r) for r in requests]
    firsts = [next(c) for c in calls]  # every stream has started
    wait_until(lambda: engine_stats(fleet["tp"].address).num_active_streams > 0, 30, "a stream on the TP engine")
    os.kill(pid, signal.SIGKILL)
    for first, call, want in zip(firsts, calls, expected):
        rest = list(call)
        got = list(first.token_ids) + [t for r in rest for t in r.token_ids]
        assert got == want and rest[-1].finish_reason == pb.LENGTH
        assert rest[-1].usage.completion_tokens == 300
    assert fleet["tp"].wait_exit(30) != 0  # the engine ended itself
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
    assert tokens(fleet["via_both"], request("after", 5)) == tokens(fleet["via_one"], request("after", 5))


def test_a_hung_rank_ends_the_engine_within_the_watchdogs_bound(fleet):
    """SIGSTOP: rank 0 waits in a collective, the watchdog marks the engine unavailable
    after 2 s and ends it 2 s later; the stopped rank dies with it (PR_SET_PDEATHSIG)."""
    tp = engine_process(fleet["model"], fleet["logs"], "engine-tp-hang", *FLAGS, "--tensor-parallel-size", "2",
                        "--watchdog-step-seconds", "2", "--watchdog-exit-seconds", "2")
    router = None
    try:
        tp.wait_serving()
        router = router_process(fleet["model"], [tp.address, fleet["one"].address], fleet["logs"], "router-hang",
                                "--engine-stale-seconds=1.5")
        router.wait_serving()
        stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(router.address))
        requests = [request(f"tale {i}:", 200) for i in range(4)]
        expected = [tokens(fleet["via_one"], r) for r in requests]
        calls = [stub.Generate(r) for r in requests]
        firsts = [next(c) for c in calls]
        wait_until(lambda: engine_stats(tp.address).num_active_streams > 0, 30, "a stream on the TP engine")
        (pid,) = map(int, re.findall(r'"ranks": \[(\d+)\]', tp.log_path.read_text()))
        os.kill(pid, signal.SIGSTOP)
        for first, call, want in zip(firsts, calls, expected):
            assert list(first.token_ids) + [t for r in call for t in r.token_ids] == want
        assert tp.wait_exit(30) == 70
        wait_until(lambda: not os.path.exists(f"/proc/{pid}"), 10, "the stopped rank gone")
    finally:
        if router is not None:
            router.stop()
        tp.stop()


def test_a_size_that_does_not_split_is_refused_at_startup_naming_it(fleet):
    engine = engine_process(fleet["model"], fleet["logs"], "engine-tp3", *FLAGS, "--tensor-parallel-size", "3")
    try:
        with pytest.raises(RuntimeError, match="--tensor-parallel-size 3 does not divide the model's 4 attention heads"):
            engine.wait_serving()
    finally:
        engine.stop()
