"""The step loop's watchdog: a step that runs far longer than any normal step (a hung
kernel, a deadlocked collective, a driver fault) takes the engine out of service, and
the process exits if it does not come back, so the orchestrator restarts it.

The step loop beats a `Heartbeat` around each step; an asyncio task (`Watchdog`) on
the server's loop reads it. Past `stall_seconds` the server turns health NOT_SERVING and
ends load reports UNAVAILABLE (routers stop sending); a step that ends puts it back;
`exit_seconds` more of the same stall and the process exits with one clear log line.
The first step after start gets `first_step_seconds`: it may compile kernels or capture
CUDA graphs. At each stall the watchdog flags it on the heartbeat, and `StallStacks`, a
thread in the step loop's own process, logs where the step is (`step_loop_stack`).
Torch-free: it only reads clocks and frames.
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, MutableSequence
from dataclasses import dataclass

import structlog

from omnibus.common.fatal import EXIT_CODE, exit_process

log = structlog.get_logger("engine.watchdog")



@dataclass(frozen=True)
class WatchdogConfig:
    """Step-time limits. stall_seconds = 0 turns the watchdog off."""

    stall_seconds: float = 120.0  # a step this long: NOT_SERVING (normal steps: milliseconds)
    first_step_seconds: float = 900.0  # the limit of the first step (compiles, graph capture)
    exit_seconds: float = 60.0  # still stalled this long after the limit: the process exits

    def __post_init__(self) -> None:
        # named as the flags that set them
        for name, flag in (("stall_seconds", "watchdog_step_seconds"),
                           ("first_step_seconds", "watchdog_first_step_seconds"),
                           ("exit_seconds", "watchdog_exit_seconds")):
            value = getattr(self, name)
            if not value >= 0:  # NaN too
                raise ValueError(f"{flag} must be >= 0, got {value}")

    @property
    def enabled(self) -> bool:
        return self.stall_seconds > 0

    def limit(self, steps_done: int) -> float:
        return max(self.first_step_seconds, self.stall_seconds) if steps_done == 0 else self.stall_seconds


class Heartbeat:
    """Written by the step loop only: when the running step began (NaN between steps) and
    how many steps have ended; and, written by the watchdog only, how many stalls it has
    seen. The doubles live in `shared` when the step loop runs in another process (a
    `multiprocessing.RawArray("d", Heartbeat.SLOTS)`); a sequence number, odd while a
    write is under way, gives readers a consistent pair."""

    SLOTS = 4  # seq, began, done, stalls

    def __init__(self, shared: MutableSequence[float] | None = None) -> None:
        self._s = shared if shared is not None else [0.0, math.nan, 0.0, 0.0]
        self._s[1] = math.nan

    def _write(self, began: float, done: float) -> None:
        s = self._s
        s[0] += 1
        s[1], s[2] = began, done
        s[0] += 1

    def begin(self) -> None:
        self._write(time.monotonic(), self._s[2])

    def end(self) -> None:
        self._write(math.nan, self._s[2] + 1)

    def running_for(self, now: float) -> tuple[float, int]:
        """(seconds the current step has run, 0 between steps; steps ended so far)."""
        s = self._s
        while True:
            seq, began, done = s[0], s[1], s[2]
            if seq % 2 == 0 and s[0] == seq:
                return (0.0 if math.isnan(began) else now - began), int(done)

    def flag_stall(self) -> None:
        """The watchdog saw the running step pass its limit (StallStacks logs where it is)."""
        self._s[3] += 1

    @property
    def stalls(self) -> int:
        """How many stalls the watchdog has flagged."""
        return int(self._s[3])


STACK_POLL_S = 0.1  # how often StallStacks looks for a new stall


class StallStacks:
    """A daemon thread in the step loop's process (the watchdog may be in another) that,
    once per stall the watchdog flags on `heartbeat`, logs `step_loop_stack`: every frame
    of the thread running the step (`thread_id`, default the caller's), outermost first,
    as "file:line in function". It reads the frames while the stuck step has let go of
    the GIL (a wait on the device, a lock, a sleep); a step spinning in C code that holds
    the GIL holds this thread up too, and the watchdog's own line still says it stalled."""

    def __init__(self, heartbeat: Heartbeat, thread_id: int | None = None,
                 poll: float = STACK_POLL_S) -> None:
        self._heartbeat = heartbeat
        self._thread_id = threading.get_ident() if thread_id is None else thread_id
        self._poll = poll
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-stall-stacks", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1.0)

    def _run(self) -> None:
        seen = self._heartbeat.stalls
        while not self._stop.wait(self._poll):
            stalls = self._heartbeat.stalls
            if stalls != seen:
                seen = stalls
                self.log_stack()

    def log_stack(self) -> None:
        """Logs the step thread's stack now, if a step is running."""
        age, done = self._heartbeat.running_for(time.monotonic())
        frame = sys._current_frames().get(self._thread_id)
        if not age or frame is None:  # the step ended meanwhile, or the loop did
            return
        frames = [f"{f.filename}:{f.lineno} in {f.name}" for f in traceback.extract_stack(frame)]
        log.error("step_loop_stack", step_seconds=round(age, 3), steps_done=done, frames=frames)


class Watchdog:
    """Watches `heartbeat` every `poll` seconds; `on_change(stalled)` is awaited when the
    step loop stalls or recovers; `exit` is called (with the log line's message) when the
    stall outlasts the exit limit."""

    def __init__(
        self,
        heartbeat: Heartbeat,
        config: WatchdogConfig,
        on_change: Callable[[bool], Awaitable[None]],
        exit: Callable[[str], None] = exit_process,
    ) -> None:
        self._heartbeat = heartbeat
        self._config = config
        self._on_change = on_change
        self._exit = exit
        self.stalled = False
        self.poll = min(1.0, config.stall_seconds / 4) if config.enabled else 1.0

    async def run(self) -> None:
        if not self._config.enabled:
            return
        exited = False
        while True:
            await asyncio.sleep(self.poll)
            age, done = self._heartbeat.running_for(time.monotonic())
            limit = self._config.limit(done)
            stalled = age > limit
            if stalled != self.stalled:
                self.stalled = stalled
                if stalled:
                    log.error("engine_step_stalled", step_seconds=round(age, 3), limit_seconds=limit,
                              steps_done=done)
                    self._heartbeat.flag_stall()  # the step loop's process logs its stack
                else:
                    log.warning("engine_step_recovered", steps_done=done)
                    exited = False
                await self._on_change(stalled)
            if stalled and not exited and age > limit + self._config.exit_seconds:
                message = (f"engine step loop stalled for {age:.1f} s (limit {limit:.1f} s + "
                           f"{self._config.exit_seconds:.1f} s); exiting so the worker is restarted")
                log.critical("engine_watchdog_exit", step_seconds=round(age, 3), limit_seconds=limit,
                             exit_code=EXIT_CODE, message=message)
                exited = True
                self._exit(message)
