"""The step-loop thread survives whatever one request brings."""

import pytest

from omnibus.engine.serving.async_engine import AsyncEngine
from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import Engine
from omnibus.engine.worker.sampling import SamplingParams
from tests.checkpoints import make_checkpoint


async def test_a_request_that_fails_to_admit_does_not_kill_the_loop(tmp_path, monkeypatch):
    engine = Engine(EngineConfig(model=str(make_checkpoint(tmp_path / "m")), num_kv_blocks=32))
    aengine = AsyncEngine(engine)
    aengine.start()
    try:
        real = engine.add_request

        def flaky(request):
            if request.request_id == "bad":
                raise OSError("adapter file vanished mid-read")
            return real(request)

        monkeypatch.setattr(engine, "add_request", flaky)
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        with pytest.raises(RuntimeError, match="could not admit the request: OSError"):
            async for _ in aengine.generate("bad", [5, 6], params):
                pass
        with pytest.raises(ValueError, match="outside the vocabulary"):
            async for _ in aengine.generate("oov", [10**6], params):
                pass
        tokens = [t async for out in aengine.generate("good", [5, 6], params) for t in out.new_token_ids]
        assert len(tokens) == 3 and aengine.is_alive and aengine.error is None
    finally:
        aengine.shutdown()


async def test_an_idle_engine_proves_its_kv_bookkeeping_once_the_requests_stop(tmp_path, monkeypatch):
    import asyncio

    from omnibus.engine.serving import step_loop

    monkeypatch.setattr(step_loop, "IDLE_CHECK_AFTER_S", 0.0)
    engine = Engine(EngineConfig(model=str(make_checkpoint(tmp_path / "m")), num_kv_blocks=32))
    checks = []
    real = engine.check_integrity
    monkeypatch.setattr(engine, "check_integrity", lambda: checks.append(engine.num_steps) or real())
    aengine = AsyncEngine(engine)
    aengine.start()
    try:
        for _ in range(500):  # the start-up check, before any request (which would defer it)
            if checks:
                break
            await asyncio.sleep(0.01)
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        for rid in ("one", "two"):
            async for _ in aengine.generate(rid, [5, 6], params):
                pass
            for _ in range(500):  # the check runs on the step thread once it sees no command
                if checks and checks[-1] == engine.num_steps:
                    break
                await asyncio.sleep(0.01)
        assert checks == [0, 3, 6]  # at start-up, then once per idle spell, not again while idle
        engine.allocator.ref_counts[31] += 1  # a leak (a block no request touches) the next check must catch
        async for _ in aengine.generate("three", [5, 6], params):
            pass
        for _ in range(500):
            if not aengine.is_alive:
                break
            await asyncio.sleep(0.01)
        assert isinstance(aengine.error, RuntimeError) and "integrity check failed" in str(aengine.error)
    finally:
        aengine.shutdown()


async def test_a_format_compiles_beside_the_loop_holding_only_its_own_request(tmp_path, monkeypatch):
    """A slow compile (held here on an event) delays only its request: a free request
    runs to the end meanwhile; one aborted while compiling ends as an abort, with its
    blocks free; one that does not compile is refused with the compiler's reason."""
    import asyncio
    import json
    import threading

    from omnibus.common.sampling import StructuredOutput

    engine = Engine(EngineConfig(model=str(make_checkpoint(tmp_path / "m")), num_kv_blocks=32))
    release = threading.Event()
    compile_format = engine.runner.compile_format
    threads = []

    def slow(fmt):
        threads.append(threading.current_thread().name)
        release.wait(30)
        return compile_format(fmt)

    monkeypatch.setattr(engine.runner, "compile_format", slow)
    aengine = AsyncEngine(engine)
    aengine.start()
    fmt = StructuredOutput("json_object")
    structured = SamplingParams(max_tokens=24, temperature=0.0, structured_output=fmt)
    free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    try:
        held = asyncio.ensure_future(_collect(aengine, "held", structured))
        gone = asyncio.ensure_future(_collect(aengine, "gone", structured))
        assert len(await _collect(aengine, "free", free)) == 8  # while both compiles are held
        assert not held.done() and not gone.done()
        for _ in range(500):  # the router's load view counts them as waiting
            if (aengine.stats().num_waiting, aengine.stats().num_running) == (2, 0):
                break
            await asyncio.sleep(0.01)
        assert aengine.stats().num_waiting == 2 and aengine.stats().num_running == 0
        gone.cancel()  # the client leaves while its format compiles: an abort
        await asyncio.sleep(0.05)
        release.set()
        tokens = await asyncio.wait_for(held, 30)
        assert threads and all(t.startswith("omnibus-grammar") for t in threads)
        inline = Engine(EngineConfig(model=engine.config.model, num_kv_blocks=32))  # compiles inline
        assert tokens == inline.generate([[5, 6]], structured)[0]
        bad = SamplingParams(max_tokens=4, structured_output=StructuredOutput("json_schema", json.dumps(
            {"type": "string", "pattern": "("})))
        with pytest.raises(ValueError, match="^structured_output: the JSON schema does not compile"):
            await _collect(aengine, "bad", bad)
        for _ in range(500):  # the aborted request ends once added, then every block is free
            if not engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        assert not engine.has_unfinished()
        assert engine.allocator.num_free_blocks == engine.allocator.num_usable_blocks
    finally:
        aengine.shutdown()


async def _collect(aengine: AsyncEngine, request_id: str, params: SamplingParams) -> list[int]:
    return [t async for out in aengine.generate(request_id, [5, 6], params) for t in out.new_token_ids]
