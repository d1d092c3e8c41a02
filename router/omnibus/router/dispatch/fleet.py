"""The engines behind one router, and every question asked about them.

One `Fleet` owns the EngineClients: discovery adds and removes them through it, and
the dispatcher, the pipeline, the health tracker, the admin API and the metrics read
them through it, so a rule about which engines count (a retiring one never takes new
work; one that has not reported is unknown, not absent) is written here once.

The engines are kept in a tuple replaced on each change, so iterating the fleet is
safe while discovery changes it (the metrics scrape runs on another thread).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from omnibus.router.dispatch.engines import EngineClient


class Fleet:
    """The engine clients of one router; `changed` tells the subscribers (the dispatcher,
    the health tracker) that room or health may have changed."""

    def __init__(self, engines: Iterable[EngineClient] = ()) -> None:
        self._engines: tuple[EngineClient, ...] = tuple(engines)
        self._listeners: list[Callable[[], None]] = []

    # ---- membership ------------------------------------------------------------

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Calls `listener` on every change of an engine's room, health or membership."""
        self._listeners.append(listener)

    def changed(self) -> None:
        """An engine's room, health or membership changed (its clients' on_change)."""
        for listener in self._listeners:
            listener()

    def add(self, engine: EngineClient) -> None:
        """One more engine (it has no room until it reports: nothing changed yet)."""
        self._engines = (*self._engines, engine)

    def remove(self, engine: EngineClient) -> None:
        self._engines = tuple(e for e in self._engines if e is not engine)
        self.changed()

    def get(self, address: str) -> EngineClient | None:
        return next((e for e in self._engines if e.address == address), None)

    def __iter__(self) -> Iterator[EngineClient]:
        return iter(self._engines)

    def __len__(self) -> int:
        return len(self._engines)

    @property
    def addresses(self) -> list[str]:
        return [e.address for e in self._engines]

    # ---- who can take what -------------------------------------------------------

    def accepting(self) -> list[EngineClient]:
        """The engines taking new requests now."""
        return [e for e in self._engines if e.seats.accepting]

    def serving(self) -> bool:
        """Some engine takes requests now."""
        return any(e.seats.accepting for e in self._engines)

    def taking(self, adapter: str = "", tokens: int = 0, avoid: Iterable[str] = ()) -> bool:
        """Whether some engine taking requests now can serve `adapter` ("": the base
        model) and hold a request of `tokens` (prompt + max_tokens) in its KV pool, other
        than those in `avoid`."""
        return any(e.seats.accepting and (not adapter or e.load.has_adapter(adapter)) and e.load.fits(tokens)
                   and e.address not in avoid for e in self._engines)

    def with_role(self, roles: frozenset[str], adapter: str = "", tokens: int = 0) -> bool:
        """Whether some engine taking requests now has one of `roles` and moves KV, with
        `adapter` and room for `tokens` (as `taking`)."""
        return any(e.seats.accepting and e.load.role in roles and e.load.kv_transfer
                   and (not adapter or e.load.has_adapter(adapter)) and e.load.fits(tokens)
                   for e in self._engines)

    def unheard(self) -> int:
        """Engines that have not reported since this router started (starting or down):
        what they serve is unknown."""
        return sum(not e.load.reported and not e.seats.retiring for e in self._engines)

    def healthy(self) -> int:
        """Engines whose load reports arrive."""
        return sum(e.link.healthy for e in self._engines)

    def served_context(self) -> int:
        """The longest context an engine (not leaving) reports serving; 0: none reported."""
        return max((e.load.max_model_len for e in self._engines if not e.seats.retiring), default=0)

    def most_request_tokens(self, adapter: str = "") -> int:
        """The most tokens (prompt + max_tokens) one request for `adapter` may span on any
        engine that has reported and is not leaving, down or draining or not; 0: none."""
        limits = [e.load.max_request_tokens() for e in self._engines
                  if not e.seats.retiring and (not adapter or e.load.has_adapter(adapter))]
        return max((n for n in limits if n is not None), default=0)

    def fill_tokens(self) -> int | None:
        """The most tokens one request may span on an engine taking requests now (else on
        any engine that has reported and is not leaving); None: no engine has said."""
        for engines in (self.accepting(), [e for e in self._engines if not e.seats.retiring]):
            limits = [n for n in (e.load.max_request_tokens() for e in engines) if n is not None]
            if limits:
                return max(limits)
        return None

    def embed_target(self, longest: int) -> EngineClient | None:
        """The least loaded engine taking requests whose context holds a `longest`-token
        input (engines' contexts may differ; their KV pools play no part); None: none."""
        fit = [e for e in self._engines if e.seats.accepting and not 0 < e.load.max_model_len < longest]
        return min(fit, key=lambda e: e.seats.occupied, default=None)

    # ---- adapters ----------------------------------------------------------------

    def serves_adapter(self, name: str) -> bool:
        """Whether some engine has adapter `name` under its adapter root, as it last
        reported: one taking requests, or one down or draining for now (a restart). An
        engine leaving discovery no longer counts."""
        return any(not e.seats.retiring and e.load.has_adapter(name) for e in self._engines)

    def adapters(self) -> set[str]:
        """The adapters on the disk of any engine, as it last reported (one down or
        draining for now counts, one leaving discovery does not)."""
        names: set[str] = set()
        for engine in self._engines:
            if not engine.seats.retiring:
                names |= engine.load.adapters_available
        return names
