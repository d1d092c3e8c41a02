"""Stop strings over a stream of text deltas.

A stop string can span deltas (and tokens), so text that could be the start of one is
held back until the next delta settles it. The stop string itself is never emitted,
and nothing after it is. The first stop string to complete wins (the one that ends
earliest in the text; of those ending at the same place, the longest), however the
text is split into deltas.

Each delta is searched together with the held text only, never the whole output: the
held text is at most the longest stop string's length - 1 characters (a longer tail
that started a stop string would already have completed it).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Filters one request's text deltas against its stop strings."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        # Longest first: of the stops ending at the same place, the longest starts first.
        self._stops = tuple(sorted(set(stops), key=len, reverse=True))
        self._firsts = frozenset(s[0] for s in self._stops)
        self._max_partial = max((len(s) - 1 for s in self._stops), default=0)
        self._held = ""
        self.stopped = False

    @property
    def active(self) -> bool:
        """Whether there are stop strings to look for."""
        return bool(self._stops)

    def feed(self, text: str) -> str:
        """The part of `text` (plus held text) that is safe to emit. Sets `stopped`
        when a stop string is found; later calls then return ""."""
        if self.stopped or not text:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text
        cut = self._first_completed(buffer)
        if cut is not None:
            self.stopped = True
            self._held = ""
            return buffer[:cut]
        keep = self._longest_partial(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Held text at the end of the stream: no stop string can complete any more."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held

    def _first_completed(self, buffer: str) -> int | None:
        """Start of the stop string that completes first in `buffer`, or None. A stop's
        first occurrence is also the one that ends first."""
        best: tuple[int, int] | None = None  # (end, start)
        for stop in self._stops:
            i = buffer.find(stop)
            if i >= 0 and (best is None or i + len(stop) < best[0]):
                best = (i + len(stop), i)
        return None if best is None else best[1]

    def _longest_partial(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        start = max(0, len(buffer) - self._max_partial)
        for j in range(start, len(buffer)):  # longest first
            if buffer[j] in self._firsts:  # cheap test before the prefix comparisons
                suffix = buffer[j:]
                if any(len(s) > len(suffix) and s.startswith(suffix) for s in self._stops):
                    return len(buffer) - j
        return 0
