"""The dynamic batcher's knobs and the Embed path's numerics."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omnibus.engine.serving.async_engine import AsyncEngine
from omnibus.engine.serving.batcher import BatcherConfig, DynamicBatcher, QueueFullError, QueueTimeoutError
from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import Engine
from tests.checkpoints import load_hf, make_checkpoint


def recording_batcher(config: BatcherConfig, delay: float = 0.0):
    seen: list[list[int]] = []

    async def run(items):
        seen.append(list(items))
        await asyncio.sleep(delay)
        return [x * 10 for x in items]

    return DynamicBatcher(config, run), seen


async def test_full_batch_runs_at_once_without_waiting_for_the_window():
    b, seen = recording_batcher(BatcherConfig(max_batch_size=4, max_queue_delay_ms=10_000))
    b.start()
    results = await asyncio.wait_for(asyncio.gather(*(b.submit([i]) for i in range(4))), timeout=2)
    assert results == [[0], [10], [20], [30]] and seen == [[0, 1, 2, 3]]
    await b.stop()


async def test_partial_batch_runs_when_the_window_expires():
    b, seen = recording_batcher(BatcherConfig(max_batch_size=8, max_queue_delay_ms=30))
    b.start()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    results = await asyncio.gather(b.submit([1]), b.submit([2, 3]))
    waited = loop.time() - t0
    assert results == [[10], [20, 30]] and seen == [[1, 2, 3]]
    assert waited >= 0.03  # it did wait for the window (a lower bound, not a timing target)
    await b.stop()


async def test_preferred_size_runs_early_and_priority_goes_first():
    b, seen = recording_batcher(BatcherConfig(max_batch_size=8, max_queue_delay_ms=10_000,
                                              preferred_batch_sizes=(2,)), delay=0.01)
    low = asyncio.ensure_future(b.submit([1], priority=0))
    high = asyncio.ensure_future(b.submit([2], priority=5))
    await asyncio.sleep(0)
    b.start()
    assert await asyncio.wait_for(asyncio.gather(high, low), timeout=2) == [[20], [10]]
    assert seen == [[2, 1]]  # preferred size 2 reached: sent at once, high priority first
    await b.stop()



async def test_a_queue_past_the_max_still_forms_preferred_sizes():
    """Ten waiting with max 8 and preferred 4: batches of 4, 4 (it sent 8 then 2); the two
    left are fewer than any preferred size and go when the window expires."""
    b, seen = recording_batcher(BatcherConfig(max_batch_size=8, max_queue_delay_ms=50,
                                              preferred_batch_sizes=(4,)))
    waiting = [asyncio.ensure_future(b.submit([i])) for i in range(10)]
    await asyncio.sleep(0)
    b.start()
    await asyncio.wait_for(asyncio.gather(*waiting), timeout=5)
    assert [len(batch) for batch in seen] == [4, 4, 2]
    await b.stop()

async def test_queue_cap_and_timeout():
    b, seen = recording_batcher(BatcherConfig(max_batch_size=8, max_queue_delay_ms=10_000, max_queue_size=2))
    b.start()
    first = asyncio.ensure_future(b.submit([1], timeout_ms=20))
    second = asyncio.ensure_future(b.submit([2]))
    await asyncio.sleep(0)
    with pytest.raises(QueueFullError, match="queue full"):
        await b.submit([3])
    with pytest.raises(QueueTimeoutError, match="past its timeout"):
        await first
    second.cancel()
    await b.stop()
    assert seen == []


async def test_queue_timeout_fires_while_a_batch_runs():
    """The timeout was checked between batches only, so it fired when the running batch
    ended, however long after the timeout that was."""
    b, seen = recording_batcher(BatcherConfig(max_batch_size=1, max_queue_delay_ms=0), delay=2.0)
    b.start()
    running = asyncio.ensure_future(b.submit([1]))
    await asyncio.sleep(0.01)
    with pytest.raises(QueueTimeoutError, match="past its timeout"):
        await b.submit([2], timeout_ms=20)
    assert not running.done() and seen == [[1]]
    assert await running == [10]
    await b.stop()


async def test_a_batch_that_started_is_not_timed_out():
    b, seen = recording_batcher(BatcherConfig(max_batch_size=1, max_queue_delay_ms=0), delay=0.1)
    b.start()
    assert await b.submit([1], timeout_ms=30) == [10]  # ran for longer than its queue timeout
    await b.stop()


def test_batcher_config_validated():
    with pytest.raises(ValueError, match="preferred_batch_sizes"):
        BatcherConfig(max_batch_size=4, preferred_batch_sizes=(8,))
    # outside probe: NaN / inf made a partial batch wait forever; 0 or less timed out
    # every request at once, NaN failed each with "cannot convert float NaN to integer"
    for delay in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="max_queue_delay_ms must be finite and >= 0"):
            BatcherConfig(max_queue_delay_ms=delay)
    for timeout in (float("nan"), float("inf"), 0.0, -5.0):
        with pytest.raises(ValueError, match="default_timeout_ms must be finite and > 0"):
            BatcherConfig(default_timeout_ms=timeout)


async def test_one_requests_failure_is_its_own_not_its_batchs():
    """Outside probe: a bad Embed input merged into a batch failed every request in it
    with the bad one's error (and an index into the merged batch)."""
    seen: list[list[int]] = []

    async def run(items):
        seen.append(list(items))
        bad = [i for i, x in enumerate(items) if x < 0]
        if bad:
            raise ValueError(f"input {bad[0]} is negative")
        return [x * 10 for x in items]

    b = DynamicBatcher(BatcherConfig(max_batch_size=8, max_queue_delay_ms=10_000), run)
    b.start()
    results = await asyncio.wait_for(asyncio.gather(
        b.submit([1, 2]), b.submit([3, -4]), b.submit([5]), b.submit([6, 7, 8]),
        return_exceptions=True), timeout=2)
    assert results[0] == [10, 20] and results[2] == [50] and results[3] == [60, 70, 80]
    assert isinstance(results[1], ValueError) and str(results[1]) == "input 1 is negative"
    assert seen[0] == [1, 2, 3, -4, 5, 6, 7, 8]  # merged first, then each alone
    await b.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("embed"), "llama")
    return path, Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64))


INPUTS = [[5, 6, 7, 8, 9], [10], list(range(20, 60)), [3, 4, 200, 300]]


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_equal_transformers_and_are_batch_invariant(model, pooling):
    path, engine = model
    hf = load_hf(path)
    batched = torch.tensor(engine.embed(INPUTS, pooling, normalize=True))
    for i, ids in enumerate(INPUTS):
        alone = torch.tensor(engine.embed([ids], pooling, normalize=True)[0])
        torch.testing.assert_close(batched[i], alone, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            h = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]  # (n, hidden)
        ref = h.mean(0) if pooling == "mean" else h[-1]
        torch.testing.assert_close(alone, torch.nn.functional.normalize(ref, dim=-1), rtol=1e-4, atol=1e-5)
    raw = torch.tensor(engine.embed(INPUTS[:1], pooling, normalize=False)[0])
    assert abs(raw.norm().item() - 1.0) > 1e-3  # normalization is optional, not always on


def test_embed_rejects_bad_input(model):
    _, engine = model
    with pytest.raises(ValueError, match="input 1 is empty"):
        engine.embed([[5], []])
    with pytest.raises(ValueError, match="pooling must be"):
        engine.embed([[5]], pooling="max")


async def test_embeds_interleave_with_generation(model):
    from omnibus.engine.worker.sampling import SamplingParams

    path, _ = model
    aengine = AsyncEngine(Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64)),
                          BatcherConfig(max_batch_size=4, max_queue_delay_ms=5))
    aengine.start()
    try:
        async def generate():
            tokens = []
            async for out in aengine.generate("g", [5, 6, 7], SamplingParams(max_tokens=40, temperature=0.0,
                                                                               ignore_eos=True)):
                tokens += out.new_token_ids
            return tokens

        gen = asyncio.ensure_future(generate())
        embeds = await asyncio.gather(*(aengine.embed([ids]) for ids in INPUTS * 3))
        assert len(embeds) == 12 and all(len(e) == 1 and len(e[0]) == 64 for e in embeds)
        assert len(await gen) == 40
        assert max(aengine.embed_batch_sizes) <= 4 and sum(aengine.embed_batch_sizes) == 12
    finally:
        aengine.shutdown()


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--embed-max-queue-delay-ms", "nan", "--embed-max-queue-delay-ms must be finite and >= 0, got nan"),
    ("--embed-queue-timeout-ms", "0", "--embed-queue-timeout-ms must be finite and > 0, got 0.0"),
    ("--embed-queue-timeout-ms", "nan", "--embed-queue-timeout-ms must be finite and > 0, got nan"),
    ("--embed-max-batch-size", "0", "--embed-max-batch-size must be >= 1, got 0"),
    ("--drain-seconds", "nan", "drain_seconds must be >= 0, got nan"),
])
def test_bad_embed_and_drain_flags_are_refused_at_start_naming_the_flag(flag, value, message):
    from omnibus.engine.serving.cli import build_parser, configs_from_args

    with pytest.raises(ValueError) as err:
        configs_from_args(build_parser().parse_args(["serve", "--model", "m", flag, value]))
    assert str(err.value) == message


def test_embed_forwards_stay_within_the_step_token_budget(model, monkeypatch):
    """Outside probe: an Embed batch was one forward of up to 32 inputs x the context,
    past the step size the device memory was sized for."""
    path, _ = model
    engine = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64,
                                 max_num_batched_tokens=16))
    sizes: list[int] = []
    embed = engine.runner.embed
    monkeypatch.setattr(engine.runner, "embed",
                        lambda inputs, *a: sizes.append(sum(map(len, inputs))) or embed(inputs, *a))
    inputs = [[5] * 6, [6] * 6, [7] * 6, [8] * 30, [9] * 3, [10] * 13]
    split = torch.tensor(engine.embed(inputs, "mean", normalize=True))
    assert sizes == [12, 6, 30, 16]  # 6+6 | 6 (+30 > 16) | 30 alone | 3+13
    alone = torch.tensor([engine.embed([x], "mean", normalize=True)[0] for x in inputs])
    torch.testing.assert_close(split, alone, rtol=1e-5, atol=1e-5)
