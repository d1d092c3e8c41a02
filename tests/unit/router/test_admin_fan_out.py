"""The Admin API's fan-out over engines with different adapter sets, and over an engine
that hangs (outside probe, fleet): unload goes where the adapter is, as load does, and
every call answers with each engine's outcome before the caller's deadline."""

from __future__ import annotations

import grpc
import pytest
from omnibus.v1 import admin_pb2, engine_pb2

from omnibus.router.admission.auth import KeyStore
from omnibus.router.config import RouterConfig, TenantLimits
from omnibus.router.dispatch.fleet import Fleet
from omnibus.router.service.admin import AdminService
from tests.unit.router.inprocess import ScriptedEngine, refusal

E0, E1 = "127.0.0.1:1", "127.0.0.1:2"


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class Context:
    """The caller's side of a call: an admin key, and `remaining` seconds of deadline."""

    def __init__(self, remaining: float | None = None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining

    def invocation_metadata(self):
        return (("authorization", "Bearer k-admin"),)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class Stub:
    """An engine's adapter RPCs as a real engine answers them (`on_disk`, `loaded`); a
    `hung` one (SIGSTOP) lets every call run out its timeout."""

    def __init__(self, on_disk: set[str], loaded: set[str] = frozenset(), hung: bool = False) -> None:
        self.on_disk, self.loaded, self.hung = on_disk, set(loaded), hung
        self.calls: list[tuple[str, float]] = []  # (rpc, timeout)

    def _called(self, rpc: str, adapter: str, timeout: float) -> None:
        self.calls.append((rpc, timeout))
        if self.hung:
            raise refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if adapter and adapter not in self.on_disk | self.loaded:
            raise refusal(grpc.StatusCode.NOT_FOUND, f"adapter {adapter!r} not found")

    async def LoadAdapter(self, request, timeout):
        self._called("load", request.adapter, timeout)
        was_loaded = request.adapter in self.loaded
        self.loaded.add(request.adapter)
        return engine_pb2.LoadAdapterResponse(adapter=request.adapter, resident=True, was_loaded=was_loaded)

    async def UnloadAdapter(self, request, timeout):
        self._called("unload", request.adapter, timeout)
        was_loaded = request.adapter in self.loaded
        self.loaded.discard(request.adapter)
        return engine_pb2.UnloadAdapterResponse(adapter=request.adapter, was_loaded=was_loaded)

    async def ListAdapters(self, request, timeout):
        self._called("list", "", timeout)
        return engine_pb2.ListAdaptersResponse(available=sorted(self.on_disk), cached=sorted(self.loaded))


@pytest.fixture
async def fleet(tmp_path):
    """E0 has {a, b, c} with c loaded; E1 has {a}, and 'gone', deleted from its disk while
    loaded. The router has their load reports."""
    (tmp_path / "admin.key").write_text("k-admin\n")
    config = RouterConfig(model=str(tmp_path), engines=(E0, E1))
    engines = [ScriptedEngine(config, lambda: None, address=E0, stub=Stub({"a", "b", "c"}, {"c"})),
               ScriptedEngine(config, lambda: None, address=E1, stub=Stub({"a"}, {"gone"}))]
    engines[0].report_load(available_adapters=["a", "b", "c"], cached_adapters=["c"])
    engines[1].report_load(available_adapters=["a"], cached_adapters=["gone"])
    keys = KeyStore.open(None, TenantLimits(), str(tmp_path / "admin.key"))
    yield AdminService(keys, Fleet(engines)), engines
    for engine in engines:
        await engine.close()


def results(reply: admin_pb2.AdminAdapterResponse) -> list[tuple[str, bool]]:
    return [(r.engine, r.was_loaded) for r in reply.engines]


async def test_unload_goes_to_the_engines_that_have_the_adapter(fleet):
    admin, (e0, e1) = fleet

    async def unload(name: str) -> admin_pb2.AdminAdapterResponse:
        return await admin.UnloadAdapter(admin_pb2.AdminAdapterRequest(adapter=name), Context())

    assert results(await unload("c")) == [(E0, True)]  # E1 never had it: not asked
    assert results(await unload("b")) == [(E0, False)]  # on disk, not loaded: nothing to do
    assert results(await unload("gone")) == [(E1, True)]  # loaded, no longer on disk
    assert e1.stub.calls == [("unload", pytest.approx(30))]
    with pytest.raises(Aborted) as err:
        await unload("pirate")
    assert (err.value.code, err.value.details) == (
        grpc.StatusCode.NOT_FOUND,
        "adapter 'pirate' not found: no engine has it loaded or under its adapter root (--adapter-dir)")
    # no report lists it: each engine looked for itself (a load a moment ago, see below)
    assert len(e0.stub.calls) == 3 and len(e1.stub.calls) == 2


async def test_unload_right_after_a_load_no_report_lists_yet_reaches_the_engine(fleet):
    """Outside probe: an unload right after the load of a just-copied adapter (before the
    engines' next reports) was NOT_FOUND, and the adapter stayed loaded."""
    admin, (e0, e1) = fleet
    e1.stub.on_disk.add("fresh")
    await admin.LoadAdapter(admin_pb2.AdminAdapterRequest(adapter="fresh"), Context())
    reply = await admin.UnloadAdapter(admin_pb2.AdminAdapterRequest(adapter="fresh"), Context())
    assert results(reply) == [(E1, True)] and "fresh" not in e1.stub.loaded


async def test_load_of_an_adapter_no_report_lists_yet_asks_every_engine(fleet):
    """An adapter copied in a moment ago is on disk before the engine's next report: load
    was NOT_FOUND for a second or two. Now each engine looks on its own disk."""
    admin, (e0, e1) = fleet
    e1.stub.on_disk.add("fresh")
    reply = await admin.LoadAdapter(admin_pb2.AdminAdapterRequest(adapter="fresh"), Context())
    assert [r.engine for r in reply.engines] == [E1]  # E0 answered NOT_FOUND: it does not have it
    with pytest.raises(Aborted) as err:
        await admin.LoadAdapter(admin_pb2.AdminAdapterRequest(adapter="pirate"), Context())
    assert (err.value.code, err.value.details) == (
        grpc.StatusCode.NOT_FOUND,
        "adapter 'pirate' not found: no engine has it under its adapter root (--adapter-dir)")
    # An engine that serves no adapters (it answers FAILED_PRECONDITION) is not asked.
    e1.report_load(available_adapters=[])
    calls = len(e1.stub.calls)
    with pytest.raises(Aborted) as err:
        await admin.LoadAdapter(admin_pb2.AdminAdapterRequest(adapter="pirate"), Context())
    assert err.value.code == grpc.StatusCode.NOT_FOUND and len(e1.stub.calls) == calls


async def test_a_hung_engine_is_reported_before_the_callers_deadline(fleet):
    """E1 stopped (SIGSTOP) but not yet marked unhealthy: its call times out while the
    caller still has time, and the error names each engine's outcome."""
    admin, (e0, e1) = fleet
    e1.stub.hung = True
    with pytest.raises(Aborted) as err:
        await admin.LoadAdapter(admin_pb2.AdminAdapterRequest(adapter="a"), Context(remaining=20))
    assert (err.value.code, err.value.details) == (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        (f"load of adapter 'a' failed on 1 of 2 engines ({E0}: ok; {E1}: DEADLINE_EXCEEDED: "
         "Deadline Exceeded)"))
    timeouts = [t for stub in (e0.stub, e1.stub) for _, t in stub.calls]
    assert len(timeouts) == 2 and all(t < 20 for t in timeouts)  # time left to reply
    with pytest.raises(Aborted):  # without a deadline: bounded all the same
        await admin.LoadAdapter(admin_pb2.AdminAdapterRequest(adapter="a"), Context())
    assert all(t <= 30 for stub in (e0.stub, e1.stub) for _, t in stub.calls)

    listing = await admin.ListAdapters(admin_pb2.AdminListAdaptersRequest(), Context(remaining=5))
    assert [(e.engine, e.reachable, e.error) for e in listing.engines] == [
        (E0, True, ""), (E1, False, "DEADLINE_EXCEEDED: Deadline Exceeded")]
    assert all(t < 5 for t in (e0.stub.calls[-1][1], e1.stub.calls[-1][1]))


async def test_a_named_engine_the_router_sees_down_is_reported_without_waiting_on_it(fleet):
    admin, (_, e1) = fleet
    e1.stub.hung = True
    e1.link.mark_failed("no load report for 5 s")
    request = admin_pb2.AdminAdapterRequest(adapter="a", engines=[E0, E1])
    with pytest.raises(Aborted) as err:
        await admin.LoadAdapter(request, Context())
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.details == (
        f"load of adapter 'a' failed on 1 of 2 engines ({E0}: ok; {E1}: UNAVAILABLE: the router "
        "has marked the engine unhealthy (no current load report); not asked)")
    assert e1.stub.calls == []
    # Without names, load goes to the healthy engines that have the adapter.
    reply = await admin.LoadAdapter(admin_pb2.AdminAdapterRequest(adapter="a"), Context())
    assert results(reply) == [(E0, True)]
