"""Where a stalled step is (issue 31): when the watchdog flags a step past its limit, the
step loop's own process logs `step_loop_stack`, every frame of the thread running the
step, once per stall, whether the step loop runs on a thread of the server's process or
in a process of its own."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import queue
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from structlog.testing import capture_logs

from omnibus.engine.serving.step_loop import StepLoop
from omnibus.engine.serving.watchdog import Heartbeat, Watchdog, WatchdogConfig

LIMITS = WatchdogConfig(stall_seconds=0.2, first_step_seconds=0.2, exit_seconds=600.0)


def _a_hung_kernel(let_go: queue.Queue) -> None:
    let_go.get(timeout=60)  # a kernel that never returns, until the test lets one step go


class _HangingEngine:
    """Always has work; each step hangs in _a_hung_kernel until `let_go` gets an item."""

    runner = SimpleNamespace(device=SimpleNamespace(type="cpu"))

    def __init__(self) -> None:
        self.let_go: queue.Queue = queue.Queue()
        self.num_steps = 0

    def has_unfinished(self) -> bool:
        return True

    def step(self) -> list:
        _a_hung_kernel(self.let_go)
        self.num_steps += 1
        return []

    def stats(self) -> None:
        return None

    def close(self) -> None:
        pass

    def check_integrity(self) -> None:
        pass


class _Outlet:
    def step(self, outputs, stats, settled) -> None:  # type: ignore[no-untyped-def]
        pass

    def reply(self, call_id, result, error) -> None:  # type: ignore[no-untyped-def]
        pass

    def crashed(self, error) -> None:  # type: ignore[no-untyped-def]
        raise AssertionError(f"the step loop crashed: {error!r}")


async def _nothing(stalled: bool) -> None:
    pass


async def _until(predicate, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


def _names_the_hung_kernel(stack: list[str]) -> bool:
    """The stack, outermost first, goes through StepLoop.run and ends in the hung kernel
    (then the queue's wait inside it)."""
    ours = [frame for frame in stack if frame.startswith(__file__ + ":")]
    return (isinstance(stack, list) and any(f.endswith(" in run") and "step_loop.py:" in f for f in stack)
            and [f.rsplit(" in ", 1)[1] for f in ours][-2:] == ["step", "_a_hung_kernel"])


async def test_a_stalled_step_on_a_thread_logs_its_stack_once_per_stall() -> None:
    engine, heartbeat = _HangingEngine(), Heartbeat()
    inbox, commands = multiprocessing.Pipe(duplex=False)  # the loop's end, the test's
    loop = StepLoop(engine, inbox, _Outlet(), heartbeat)  # type: ignore[arg-type]
    thread = threading.Thread(target=loop.run, daemon=True)
    watchdog = asyncio.create_task(Watchdog(heartbeat, LIMITS, _nothing, print).run())
    with capture_logs() as logs:
        def stacks() -> list[dict]:
            return [e for e in logs if e["event"] == "step_loop_stack"]

        try:
            thread.start()
            await _until(lambda: len(stacks()) == 1, "the first step's stack")
            await asyncio.sleep(0.5)  # the same stall: no second line
            assert len(stacks()) == 1
            engine.let_go.put(None)  # the step ends; the next one hangs too: a second stall
            await _until(lambda: len(stacks()) == 2, "the second step's stack")
        finally:
            commands.send(None)
            engine.let_go.put(None)
            thread.join(10)
            watchdog.cancel()
    first, second = stacks()
    assert first["log_level"] == "error" and first["step_seconds"] >= LIMITS.stall_seconds
    assert (first["steps_done"], second["steps_done"]) == (0, 1)
    assert _names_the_hung_kernel(first["frames"]), first["frames"]
    assert _names_the_hung_kernel(second["frames"]), second["frames"]
    stalled = [e for e in logs if e["event"] == "engine_step_stalled"]
    assert len(stalled) == 2
    assert not thread.is_alive()
    assert "engine-stall-stacks" not in {t.name for t in threading.enumerate()}  # stopped with the loop


def _hung_step_loop_process(shared, log_path: str) -> None:  # type: ignore[no-untyped-def]
    """The step loop's process (as engine/omnibus/engine/serving/step_loop_runners.py's), logging JSON
    lines to a file."""
    from omnibus.common.logs import configure_logging

    os.dup2(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
    configure_logging("info")
    inbox, commands = multiprocessing.Pipe(duplex=False)  # no command comes; `commands` stays open
    StepLoop(_HangingEngine(), inbox, _Outlet(), Heartbeat(shared)).run()  # type: ignore[arg-type]
    commands.close()


async def test_a_stalled_step_in_its_own_process_logs_its_stack(tmp_path: Path) -> None:
    """The watchdog (here) flags the stall in the shared heartbeat; the step loop's process
    logs the stack of its step thread (its main thread)."""
    ctx = multiprocessing.get_context("spawn")
    shared = ctx.RawArray("d", Heartbeat.SLOTS)
    heartbeat = Heartbeat(shared)
    log_path = tmp_path / "step-loop.log"
    process = ctx.Process(target=_hung_step_loop_process, args=(shared, str(log_path)), daemon=True)
    process.start()
    watchdog = asyncio.create_task(Watchdog(heartbeat, LIMITS, _nothing, print).run())

    def stacks() -> list[dict]:
        if not log_path.exists():
            return []
        lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
        return [e for e in lines if e["event"] == "step_loop_stack"]

    try:
        await _until(lambda: stacks(), "the stalled step's stack from the step loop's process", 60)
    finally:
        watchdog.cancel()
        process.kill()
        process.join(10)
    (line,) = stacks()
    assert line["level"] == "error" and line["step_seconds"] >= LIMITS.stall_seconds
    assert _names_the_hung_kernel(line["frames"]), line["frames"]
