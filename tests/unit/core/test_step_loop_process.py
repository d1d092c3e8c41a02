"""The step loop in a process of its own (`--step-loop process`): the same outputs as on
a thread, refusals and call errors cross the pipe with their types, aborts free the KV,
the shared heartbeat counts the child's steps, and a dead step-loop process fails its
requests."""

import asyncio
import os
import signal

import pytest

from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import Engine
from omnibus.engine.lora import AdapterStateError
from omnibus.engine.request import as_request
from omnibus.engine.serving.async_engine import AsyncEngine
from omnibus.engine.serving.loading import EngineLoadError
from omnibus.engine.serving.step_loop_runners import StepLoopProcess, resolve_step_loop
from omnibus.engine.worker.sampling import SamplingParams
from tests.checkpoints import make_checkpoint

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = {"a": [5, 6, 7], "b": [9, 10, 11, 12, 13], "c": [3] * 20}


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    model = make_checkpoint(tmp_path_factory.mktemp("step-loop") / "m")
    return EngineConfig(model=str(model), dtype="float32", num_kv_blocks=32)


@pytest.fixture(scope="module")
def process(config):
    """One spawned step-loop process for the module's tests (a spawn costs seconds on this
    machine), behind its AsyncEngine."""
    aengine = AsyncEngine(StepLoopProcess(config))
    aengine.start()
    yield aengine
    aengine.shutdown()


async def _run_all(aengine: AsyncEngine) -> dict[str, list[int]]:
    async def one(rid: str, prompt: list[int]) -> list[int]:
        return [t async for out in aengine.generate(rid, prompt, GREEDY) for t in out.new_token_ids]

    ids = await asyncio.gather(*(one(f"{rid}-{id(aengine)}", p) for rid, p in PROMPTS.items()))
    return dict(zip(PROMPTS, ids))


async def _settled(aengine: AsyncEngine) -> None:
    for _ in range(500):
        s = aengine.stats()
        if s.num_running == 0 and s.num_waiting == 0:
            return
        await asyncio.sleep(0.01)


async def test_the_step_loop_process_streams_what_the_step_loop_thread_does(config, process):
    on_thread = AsyncEngine(Engine(config))
    on_thread.start()
    try:
        expected = await _run_all(on_thread)
    finally:
        on_thread.shutdown()
    assert await _run_all(process) == expected
    assert all(len(ids) == GREEDY.max_tokens for ids in expected.values())
    assert process.max_model_len == Engine(config).model_config.max_model_len
    await _settled(process)
    s = process.stats()
    assert (s.num_running, s.num_free_blocks) == (0, s.num_total_blocks)


async def test_refusals_and_call_errors_keep_their_types(process):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        async for _ in process.generate("oov", [10**6], GREEDY):
            pass
    with pytest.raises(AdapterStateError, match="serves no adapters"):
        await process.load_adapter("x")
    assert await process.list_adapters() == (await process.list_adapters())  # a reply per call
    vectors = await process.embed([[5, 6, 7], [8, 9]])
    assert len(vectors) == 2 and len(vectors[0]) == len(vectors[1]) > 0
    with pytest.raises(ValueError):
        await process.embed([[10**6]])


async def test_an_abort_frees_the_kv_and_ends_the_stream(process):
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    stream = process.generate("long", [5] * 8, params)
    first = await anext(stream)
    assert first.new_token_ids
    await stream.aclose()  # leaving early aborts it in the step-loop process
    await _settled(process)
    s = process.stats()
    assert (s.num_running, s.num_free_blocks) == (0, s.num_total_blocks)


async def test_the_shared_heartbeat_counts_the_step_loop_process_s_steps(process):
    _, before = process.heartbeat.running_for(0.0)
    await _run_all(process)
    _, after = process.heartbeat.running_for(0.0)
    assert after - before >= GREEDY.max_tokens  # at least one step per token


def test_a_step_loop_process_that_cannot_load_says_why(tmp_path):
    with pytest.raises(EngineLoadError, match="cannot load"):
        StepLoopProcess(EngineConfig(model=str(tmp_path / "missing")))


async def test_a_killed_step_loop_process_fails_its_requests_and_refuses_new_ones(config):
    aengine = AsyncEngine(StepLoopProcess(config))
    aengine.start()
    try:
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        stream = aengine.generate("doomed", [5, 6], params)
        await anext(stream)
        os.kill(aengine.runner.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="step-loop process exited"):
            async for _ in stream:
                pass
        assert isinstance(aengine.error, RuntimeError) and not aengine.is_alive
        with pytest.raises(RuntimeError, match="not running"):
            aengine.add(as_request("late", [5], params), None)  # type: ignore[arg-type]
    finally:
        aengine.shutdown()


async def test_a_server_whose_step_loop_process_was_killed_asks_to_exit(config):
    """An OOM kill of the step-loop process: the server, which can serve nothing more,
    turns NOT_SERVING and asks to exit (code 70) instead of staying up as a zombie."""
    from grpc_health.v1 import health_pb2

    from omnibus.engine.serving.server import ServerConfig, start
    from tests.grpc_helpers import free_port

    import grpc
    from omnibus.v1 import engine_pb2, engine_pb2_grpc, inference_pb2

    process = StepLoopProcess(config)
    exits: list[str] = []
    port = free_port()
    running = await start(process, ServerConfig(port=port), exits.append)
    try:
        os.kill(process.pid, signal.SIGKILL)
        for _ in range(200):
            if exits:
                break
            await asyncio.sleep(0.05)
        assert exits and "step-loop process exited (code -9)" in exits[0], exits
        check = await running.health_servicer.Check(health_pb2.HealthCheckRequest(service=""), None)
        assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
        # Embed as Generate: UNAVAILABLE, not UNKNOWN (outside probe)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await engine_pb2_grpc.EngineStub(channel).Embed(engine_pb2.EngineEmbedRequest(
                    inputs=[inference_pb2.TokenIds(ids=[5, 6])]), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    finally:
        await running.stop(1.0)


def test_the_step_loop_process_dies_with_its_server_process(config):
    """A server killed outright (or exited by its watchdog over a hung step) leaves no
    step-loop process holding the device."""
    import subprocess
    import sys
    import time

    script = (
        "import sys, time\n"
        "from omnibus.engine.config import EngineConfig\n"
        "from omnibus.engine.serving.step_loop_runners import StepLoopProcess\n"
        f"process = StepLoopProcess(EngineConfig(model={config.model!r}, num_kv_blocks=32))\n"
        "print(process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    server = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        step_loop_pid = int(server.stdout.readline())
        os.kill(step_loop_pid, signal.SIGSTOP)  # as if hung in a step: it cannot see the pipe close
    finally:
        server.kill()
        server.wait()
    for _ in range(500):
        try:
            os.kill(step_loop_pid, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{step_loop_pid}/stat") as f:  # a zombie of init's is gone for good
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        time.sleep(0.01)
    raise AssertionError(f"the step-loop process {step_loop_pid} outlived its server")


def test_a_closed_loop_s_destination_does_not_stop_the_others():
    """A caller whose event loop has closed (it left) must not kill the thread that hands
    outputs over: the next destinations still get theirs, in one call each."""
    import types

    from omnibus.engine.core.sequence import RequestOutput

    runner = types.SimpleNamespace(config=None, max_model_len=0, heartbeat=None, first_stats=None)
    aengine = AsyncEngine(runner)  # type: ignore[arg-type]
    gone, alive = asyncio.new_event_loop(), asyncio.new_event_loop()
    gone.close()
    got: list = []

    class Dest:  # hashable, as the server's sessions and sinks are
        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            self.loop, self.deliver = loop, got.append

    aengine._dests.update(old=Dest(gone), new=Dest(alive))
    aengine.step([RequestOutput("old", [1], finished=True), RequestOutput("new", [2])], None, False)
    alive.call_soon(alive.stop)
    alive.run_forever()
    alive.close()
    assert [[o.request_id for o in batch] for batch in got] == [["new"]]
    assert "old" not in aengine._dests and "new" in aengine._dests


def test_auto_puts_the_step_loop_in_a_process_except_the_null_model_s_on_a_cpu(config):
    """`--step-loop auto`: a process of its own (the step loop never waits for the server's
    GIL), except for the null model on a CPU; an explicit choice is kept."""
    import dataclasses

    null = dataclasses.replace(config, load_format="null")
    assert resolve_step_loop("auto", config) == "process"
    assert resolve_step_loop("auto", dataclasses.replace(config, device="cuda")) == "process"
    assert resolve_step_loop("auto", dataclasses.replace(null, device="cuda")) == "process"
    assert resolve_step_loop("auto", null) == "thread"
    assert resolve_step_loop("thread", config) == "thread"
    assert resolve_step_loop("process", null) == "process"


async def test_a_stopping_server_ends_the_routers_session_streams_cleanly(config):
    """Regression probe: on SIGTERM the server's stop cancelled the routers' open Session
    handlers mid-wait, which gRPC logged as an unhandled error with a plain-text traceback
    (1 stop in 3). The streams now end OK first (the router reconnects elsewhere)."""
    import grpc
    from omnibus.v1 import engine_pb2, engine_pb2_grpc

    from omnibus.engine.serving.server import ServerConfig, start
    from tests.grpc_helpers import free_port

    port = free_port()
    running = await start(Engine(config), ServerConfig(port=port))
    stopped = False
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = engine_pb2_grpc.EngineStub(channel).Session()
            await call.write(engine_pb2.SessionRequest(packed_tokens=True))
            await asyncio.sleep(0.2)  # the handler is waiting for something to send
            await running.stop(0.1)
            stopped = True
            assert await asyncio.wait_for(call.read(), 10) is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
    finally:
        if not stopped:
            await running.stop(0.1)
