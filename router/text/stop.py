"""Stop strings over a stream of text deltas.

A stop string can span deltas (and tokens), so text that could be the start of one is
held back until the next delta settles it. The stop string itself is never emitted,
and nothing after it is.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Filters one request's text deltas against its stop strings."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of `text` (plus held text) that is safe to emit. Sets `stopped`
        when a stop string is found; later calls then return ""."""
        if self.stopped or not text:
            return ""
        buffer = self._held + text
        # Only the new text can complete a match: the held part held no whole stop string.
        hits = [i for s in self._stops if (i := buffer.find(s)) >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buffer[: min(hits)]
        keep = self._longest_partial(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Held text at the end of the stream: no stop string can complete any more."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held

    def _longest_partial(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:k]):
                    best = k
                    break
        return best
