"""The null model (`--load-format null`): the real engine and server with a near-free
forward. Tokens follow its fixed pattern and every KV block comes back."""

import json
import time

import grpc
import pytest
import torch
from omnibus.v1 import engine_pb2, engine_pb2_grpc

from omnibus.engine.config import EngineConfig, ModelConfig
from omnibus.engine.engine import Engine
from omnibus.engine.model.null import NullModel
from omnibus.engine.worker.sampling import SamplingParams
from tests.grpc_helpers import engine_process, engine_request, engine_stats, wait_until

VOCAB = 384
CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """A model directory with config.json and nothing else: the null model reads no weights."""
    path = tmp_path_factory.mktemp("null-model")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return path


def expected(prompt_len: int, n: int) -> list[int]:
    null = NullModel(ModelConfig.from_dict(CONFIG), torch.device("cpu"))
    return null.next_tokens(torch.arange(prompt_len - 1, prompt_len - 1 + n)).tolist()


def test_pattern_avoids_eos_and_bos():
    null = NullModel(ModelConfig.from_dict(CONFIG), torch.device("cpu"))
    tokens = set(null.next_tokens(torch.arange(10_000)).tolist())
    assert tokens == set(range(VOCAB)) - {CONFIG["bos_token_id"], CONFIG["eos_token_id"]}


def test_in_process_engine_generates_the_pattern_and_frees_every_block(config_only):
    engine = Engine(EngineConfig(model=str(config_only), load_format="null", num_kv_blocks=64,
                                 max_num_seqs=8))
    prompts = [[5, 6, 7], [9] * 20, [3, 4, 5, 6, 7, 8]]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    assert outputs == [expected(len(p), 40) for p in prompts]
    counts = engine.check_integrity()
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks == 63, counts


def test_null_step_ms_paces_each_step_without_changing_the_tokens(config_only):
    engine = Engine(EngineConfig(model=str(config_only), load_format="null", num_kv_blocks=64,
                                 max_num_seqs=8, null_step_ms=25))
    engine.warmup()
    steps, start = engine.num_steps, time.monotonic()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert engine.generate([[5, 6, 7], [9] * 20], params) == [expected(3, 6), expected(20, 6)]
    steps = engine.num_steps - steps
    assert steps >= 6  # a prefill, then a decode step per token after the first
    assert time.monotonic() - start >= steps * 0.025


def test_null_step_ms_is_a_device_that_overlapped_scheduling_plans_ahead_of(config_only):
    engine = Engine(EngineConfig(model=str(config_only), load_format="null", num_kv_blocks=64,
                                 max_num_seqs=8, null_step_ms=25, overlap_scheduling=True))
    engine.warmup()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("r", [5, 6, 7], params)
    assert engine.step() == []  # the prefill is launched, not reported
    launched = engine._in_flight
    assert launched is not None and launched.ready_at > time.monotonic()  # still on the device
    outputs = engine.step()  # launches the next step, then reports the prefill's token
    assert [out.new_token_ids for out in outputs] == [expected(3, 1)]
    assert engine._in_flight.ready_at >= launched.ready_at + 0.025  # one step after another
    tokens = outputs[0].new_token_ids
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == expected(3, 6)
    assert engine.check_integrity().free == 63


@pytest.mark.parametrize("fields, message", [
    (dict(load_format="null", null_step_ms=-1), "null_step_ms must be >= 0"),
    (dict(load_format="dummy", null_step_ms=5), "null_step_ms must be 0 unless load_format is null"),
])
def test_null_step_ms_is_refused_where_it_means_nothing(config_only, fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(config_only), **fields)


def test_served_engine_streams_the_pattern_and_frees_every_block(config_only, tmp_path):
    proc = engine_process(config_only, tmp_path, "null-engine", "--load-format", "null",
                          "--num-kv-blocks", "64", "--max-num-seqs", "4").wait_serving()
    try:
        with grpc.insecure_channel(proc.address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            calls = [stub.Generate(engine_request(f"r{i}", prompt=[5 + i] * (3 + i), max_tokens=30),
                                   timeout=60) for i in range(6)]  # 6 > 4 seats: some wait
            for i, call in enumerate(calls):
                tokens = [t for reply in call for t in reply.token_ids]
                assert tokens == expected(3 + i, 30)
        load = engine_stats(proc.address).load
        assert load.num_running == load.num_waiting == 0
        assert load.num_free_blocks == load.num_total_blocks == 63
    finally:
        proc.stop()


def _add(request_id: str, handle: int, **kwargs) -> engine_pb2.EngineGenerateRequest:
    request = engine_request(request_id, **kwargs)
    request.handle = handle
    return request


async def _read_until(call, done) -> tuple[dict[int, list], int]:
    """Reads updates until `done(outputs by handle)`; returns them and the update count."""
    outputs: dict[int, list] = {}
    updates = 0
    while not done(outputs):
        update = await call.read()
        assert update is not grpc.aio.EOF
        updates += 1
        for out in update.outputs:
            outputs.setdefault(out.handle, []).append(out)
    return outputs, updates


def _ended(out) -> bool:
    return bool(out.finish_reason or out.status_code)


async def test_session_carries_every_request_per_step_and_its_end_frees_every_block(config_only, tmp_path):
    proc = engine_process(config_only, tmp_path, "null-session", "--load-format", "null",
                          "--num-kv-blocks", "64", "--max-num-seqs", "4").wait_serving()
    try:
        async with grpc.aio.insecure_channel(proc.address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            steps = (await stub.Stats(engine_pb2.StatsRequest())).num_steps
            call = stub.Session()
            adds = [_add(f"r{i}", i, prompt=[5 + i] * (3 + i), max_tokens=30) for i in range(6)]
            await call.write(engine_pb2.SessionRequest(add=adds))  # 6 > 4 seats: some wait
            outputs, updates = await _read_until(
                call, lambda o: sum(_ended(x[-1]) for x in o.values()) == 6)
            assert {h: [t for out in outs for t in out.token_ids] for h, outs in outputs.items()} == {
                i: expected(3 + i, 30) for i in range(6)}
            assert all(out.status_code == 0 for outs in outputs.values() for out in outs)
            assert [outs[-1].finish_reason for outs in outputs.values()] == [2] * 6  # LENGTH
            steps = (await stub.Stats(engine_pb2.StatsRequest())).num_steps - steps
            assert updates <= steps < 180  # one message per step at most, not one per token

            # A request's error is its own: the session and its other requests live on.
            await call.write(engine_pb2.SessionRequest(add=[
                _add("long", 20, max_tokens=500), _add("oov", 21, prompt=[VOCAB + 5]),
                _add("long", 22), _add("", 23), _add("late", 24, max_tokens=200)]))
            errors, _ = await _read_until(call, lambda o: all(h in o for h in (21, 22, 23)))
            codes = {h: errors[h][-1].status_code for h in (21, 22, 23)}
            assert codes == {21: grpc.StatusCode.INVALID_ARGUMENT.value[0],
                             22: grpc.StatusCode.ALREADY_EXISTS.value[0],
                             23: grpc.StatusCode.INVALID_ARGUMENT.value[0]}
            await call.write(engine_pb2.SessionRequest(abort=["late"]))
            running = lambda: engine_stats(proc.address).load.num_running  # noqa: E731
            wait_until(lambda: running() == 1, 30, "the aborted request to leave")
            call.cancel()  # the router is gone: "long" ends with its session
        wait_until(lambda: running() == 0, 30, "the session's sequences to be aborted")
        load = engine_stats(proc.address).load
        assert load.num_waiting == 0 and load.num_free_blocks == load.num_total_blocks == 63
    finally:
        proc.stop()


async def test_session_requests_past_their_deadline_end_deadline_exceeded(config_only, tmp_path):
    proc = engine_process(config_only, tmp_path, "null-deadline", "--load-format", "null",
                          "--num-kv-blocks", "64", "--max-num-seqs", "4").wait_serving()
    try:
        async with grpc.aio.insecure_channel(proc.address) as channel:
            call = engine_pb2_grpc.EngineStub(channel).Session()
            endless = _add("endless", 7, max_tokens=900)
            endless.deadline_ms = 30  # far less than 900 steps take
            await call.write(engine_pb2.SessionRequest(add=[endless]))
            outputs, _ = await _read_until(call, lambda o: 7 in o and _ended(o[7][-1]))
            last = outputs[7][-1]
            assert last.status_code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            assert sum(len(out.token_ids) for out in outputs[7]) < 900
            wait_until(lambda: engine_stats(proc.address).load.num_running == 0, 30, "the abort")
            call.cancel()
        load = engine_stats(proc.address).load
        assert load.num_free_blocks == load.num_total_blocks == 63
    finally:
        proc.stop()


async def test_generate_is_served_by_a_one_request_session_of_its_own(config_only, tmp_path):
    """Generate: one message per step, no handle; its refusals, failures and deadline are
    the call's status; a cancelled call's sequence is aborted and its blocks come back."""
    proc = engine_process(config_only, tmp_path, "null-generate", "--load-format", "null",
                          "--num-kv-blocks", "64", "--max-num-seqs", "4").wait_serving()
    try:
        async with grpc.aio.insecure_channel(proc.address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            replies = [r async for r in stub.Generate(_add("one", 5, max_tokens=12), timeout=60)]
            assert [t for r in replies for t in r.token_ids] == expected(3, 12)
            assert [len(r.token_ids) for r in replies] == [1] * 12  # one message per step
            assert {r.handle for r in replies} == {0} and replies[-1].finish_reason == 2  # LENGTH
            assert (replies[-1].num_prompt_tokens, replies[-1].num_output_tokens) == (3, 12)

            async def status(request: engine_pb2.EngineGenerateRequest, timeout: float = 60) -> tuple:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    [r async for r in stub.Generate(request, timeout=timeout)]
                return err.value.code(), err.value.details()

            endless = engine_request("endless", max_tokens=900)
            endless.deadline_ms = 30  # far less than 900 steps take
            assert (await status(endless))[0] == grpc.StatusCode.DEADLINE_EXCEEDED
            assert (await status(engine_request("short", max_tokens=1000), 0.1))[0] == (
                grpc.StatusCode.DEADLINE_EXCEEDED)  # the call's own deadline
            assert await status(engine_request("")) == (
                grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
            code, details = await status(engine_request("oov", prompt=[VOCAB + 5]))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in details

            long = stub.Generate(engine_request("long", max_tokens=900), timeout=60)
            assert (await long.read()).token_ids
            assert await status(engine_request("long")) == (
                grpc.StatusCode.ALREADY_EXISTS, "request id 'long' is already streaming")
            long.cancel()  # the client leaves: its sequence is aborted
        wait_until(lambda: engine_stats(proc.address).load.num_running == 0, 30, "the abort")
        load = engine_stats(proc.address).load
        assert load.num_waiting == 0 and load.num_free_blocks == load.num_total_blocks == 63
    finally:
        proc.stop()
