"""A background task the process cannot work without ends the process when it fails (so
the orchestrator restarts it), never when it is cancelled or returns."""

from __future__ import annotations

import asyncio

from omnibus.common.fatal import exit_if_it_fails


async def test_a_failed_task_asks_to_exit_naming_it_and_the_error():
    exits: list[str] = []

    async def buggy() -> None:
        raise KeyError("a bug")

    task = exit_if_it_fails(asyncio.create_task(buggy(), name="dispatcher"), exits.append)
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)  # done callbacks run on the next loop turn
    assert exits == ["background task 'dispatcher' failed (KeyError('a bug')); exiting so the process is restarted"]


async def test_a_cancelled_or_finished_task_does_not():
    exits: list[str] = []
    forever = exit_if_it_fails(asyncio.create_task(asyncio.sleep(60)), exits.append)
    done = exit_if_it_fails(asyncio.create_task(asyncio.sleep(0)), exits.append)
    forever.cancel()
    await asyncio.gather(forever, done, return_exceptions=True)
    await asyncio.sleep(0)
    assert exits == []


async def test_the_router_s_dispatcher_failing_asks_to_exit(monkeypatch):
    """The router's matching loop hitting a bug: without its dispatcher, queued requests
    would wait forever behind a SERVING health check."""
    from omnibus.common import fatal
    from omnibus.router.dispatch.dispatcher import Dispatcher
    from omnibus.router.dispatch.queue import RequestQueue

    exits: list[str] = []
    monkeypatch.setattr(fatal, "exit_process", exits.append)
    dispatcher = Dispatcher([], RequestQueue(1.0, "fifo"))

    def broken() -> None:
        raise RuntimeError("a bug in matching")

    monkeypatch.setattr(dispatcher, "_match", broken)
    dispatcher.start()
    dispatcher.notify()
    for _ in range(100):
        if exits:
            break
        await asyncio.sleep(0.01)
    assert exits and "'dispatcher' failed (RuntimeError('a bug in matching'))" in exits[0]
    await dispatcher.close()
