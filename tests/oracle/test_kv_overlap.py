"""Early handles (--kv-transfer-overlap, kv_transfer/connector.py hold_early): a prefill
for another engine hands its KV on as soon as it is seated, and the reader reads each
layer's blocks as the holder finalizes them (in place: after each layer's forward;
staged: at each step's end), while the prefill still runs (chunked here: several steps). Two engines in one process over Mooncake (TCP, loopback),
stepped in turn: the reader's output is transformers' greedy output, it read the prompt
less its last token (which it computes and samples from itself), and reads happened
before the holder's prefill ended. Faults: the holder's request aborted mid-prefill (its
lease ends first: the reader recomputes, token-exact), a holder whose progress stands
still (the reader gives up after its stall bound and recomputes). Both pools' bookkeeping
holds after every step and ends with every block free."""

from __future__ import annotations

import time

import pytest

from omnibus.engine.request import EngineRequest
from tests.checkpoints import hf_greedy
from tests.oracle.test_kv_transfer import all_free as free_blocks
from tests.oracle.test_kv_transfer import greedy, make_engine, prompt, tokens

pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine is in `make setup`'s environment")

from tests.oracle.test_kv_transfer import model  # noqa: E402,F401 (the module's checkpoint fixture)


STAGING = 1 << 22  # bytes: 64 blocks of the checkpoint's pool


@pytest.fixture(scope="module", params=["in-place", "staged"])
def pair(model, request):  # noqa: F811
    """In place, the holder's forward marks each layer; staged (how a pool on a GPU moves),
    both pools go through host staging and the holder's progress moves at each step's
    end, after its finished blocks are copied out."""
    path, _ = model
    staging = STAGING if request.param == "staged" else 0
    holder = make_engine(path, kv_transfer_overlap=True, max_num_batched_tokens=16, kv_hold_seconds=5.0,
                         kv_transfer_staging_bytes=staging)
    reader = make_engine(path, kv_transfer_overlap=True, kv_hold_seconds=0.5,  # its stall bound
                         kv_transfer_staging_bytes=staging)
    assert holder.kv.marks_layers == (not staging) == (holder.kv.staging is None)
    yield holder, reader
    holder.close()
    reader.close()


@pytest.fixture
def engines(pair):
    """The pair, with whatever a failed test left behind aborted, so one failure stays one."""
    yield pair
    for engine in pair:
        for rid in list(engine.scheduler.lifecycle.requests):
            engine.abort(rid)


def all_free(engine) -> None:
    """No block referenced, nothing held, every staging slot back."""
    free_blocks(engine)
    staging = engine.kv.staging
    assert staging is None or staging.free == len(staging.tensors[0]), staging.free


def early_handle(holder, rid: str, ids: list[int]):
    holder.add_request(EngineRequest(rid, ids, greedy(1), kv_hold=True))
    (out,) = holder.step()  # seated: the handle goes out before any token
    assert out.finished and not out.new_token_ids and out.kv_handle is not None
    assert out.kv_handle.progress_addr and out.kv_handle.num_tokens == len(ids) - 1
    return out.kv_handle


def wait_for(condition, limit_s: float = 10.0) -> None:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < limit_s, "timed out waiting on the read thread"
        time.sleep(0.005)


def start_reading(holder, reader, rid: str, ids: list[int], max_tokens: int, hold_steps_first: int = 0):
    """An early handle for `rid` on the holder (its first chunk computed, `hold_steps_first`
    more steps), and the reader's request for it; the reader's stats before."""
    handle = early_handle(holder, rid, ids)
    for _ in range(hold_steps_first):
        holder.step()
    before = reader.kv.stats()
    reader.add_request(EngineRequest(rid, ids, greedy(max_tokens), kv_source=handle))
    return before


def step_both(holder, reader, rid: str, hold_steps: int | None = None, limit_s: float = 30.0, outputs: bool = False):
    """Steps the holder (at most `hold_steps` times) and the reader in turn until the reader
    is done; the reader's tokens for `rid` (its outputs with `outputs`)."""
    got: list = []
    start, steps = time.monotonic(), 0
    while reader.has_unfinished():
        if holder.has_unfinished() and (hold_steps is None or steps < hold_steps):
            assert [o for o in holder.step() if o.request_id == rid] == []  # it ended with its handle
            steps += 1
            holder.check_integrity()
        got += [o for o in reader.step() if o.request_id == rid]
        reader.check_integrity()
        time.sleep(0.002)  # the read thread polls the holder's progress
        assert time.monotonic() - start < limit_s, "the reader never finished"
    return got if outputs else tokens(got)


def test_an_early_handle_is_read_layer_by_layer_while_the_prefill_runs_token_exact(model, engines):
    path, hf = model
    holder, reader = engines
    ids = prompt(7, 61)  # 4 chunks of 16 on the holder
    seen_running = []
    read = reader.kv.transport.read

    def watched(peer, local, remote, lengths):
        if sum(lengths) > 8 * (1 + reader.kv.layers):  # a read of blocks, not of lease/progress words
            seen_running.append("e1" in holder.scheduler.lifecycle.requests)
        return read(peer, local, remote, lengths)

    reader.kv.shard.transport.read = watched
    try:
        before = start_reading(holder, reader, "e1", ids, 10)
        got = [o for o in reader.step() if o.request_id == "e1"]  # the load starts
        # the first chunk is final on every layer already: the read thread reads it while
        # the holder, not stepped until then, still holds the request mid-prefill
        wait_for(lambda: seen_running)
        got += step_both(holder, reader, "e1", outputs=True)
    finally:
        reader.kv.shard.transport.read = read
    assert tokens(got) == hf_greedy(hf, ids, 10)
    after = reader.kv.stats()
    assert after.loaded_tokens - before.loaded_tokens == len(ids) - 1  # the last prompt token is the reader's
    assert after.load_failures == before.load_failures
    assert seen_running[0], "no block was read while the holder's prefill ran"
    assert holder.kv.stats().sent_early >= 1
    assert holder.abort("e1")  # the router's release: the held blocks go back
    all_free(holder)
    all_free(reader)


def test_an_early_hold_aborted_mid_prefill_is_recomputed_token_exact(model, engines):
    path, hf = model
    holder, reader = engines
    ids = prompt(8, 61)
    before = start_reading(holder, reader, "e2", ids, 6, hold_steps_first=1)  # two chunks of 16 computed
    assert holder.abort("e2")  # the holder's request ends: its lease ends before its blocks are freed
    assert holder.kv.stats().dropped >= 1
    assert step_both(holder, reader, "e2") == hf_greedy(hf, ids, 6)
    assert reader.kv.stats().load_failures == before.load_failures + 1
    all_free(holder)
    all_free(reader)


def test_a_holder_whose_progress_stands_still_is_given_up_on_and_recomputed(model, engines):
    path, hf = model
    holder, reader = engines
    ids = prompt(9, 61)
    before = start_reading(holder, reader, "e3", ids, 6)
    # the holder does not step: the reader waits 0.5 s of no progress, then recomputes
    assert step_both(holder, reader, "e3", hold_steps=0) == hf_greedy(hf, ids, 6)
    assert reader.kv.stats().load_failures == before.load_failures + 1
    assert holder.abort("e3")
    all_free(holder)
    all_free(reader)
