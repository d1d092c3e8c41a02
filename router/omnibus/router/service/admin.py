"""The router's admin API (`omnibus.v1.Admin`): LoRA adapter load / unload fanned out
to the engines, and each engine's adapter listing.

Every call needs an admin key (router/omnibus/router/admission/auth.py). Load and unload succeed only when
every targeted engine did; otherwise the call fails with the first failing engine's
status and a message naming each engine's outcome, so an operator knows where to
retry. Each engine gets a bounded share of the call's time, so one that hangs (a
stopped process) is reported as such rather than taking the whole call's deadline.
"""

from __future__ import annotations

import asyncio
from typing import NoReturn

import grpc
import structlog
from omnibus.v1 import admin_pb2, admin_pb2_grpc, engine_pb2

from omnibus.router.dispatch.adapters import check_adapter_name
from omnibus.router.admission.auth import KeyStore
from omnibus.router.dispatch.engines import EngineClient
from omnibus.router.dispatch.fleet import Fleet
from omnibus.router.dispatch.session import rpc_error
from omnibus.router.service.errors import RequestError

log = structlog.get_logger("router.admin")

ENGINE_CALL_TIMEOUT_S = 30.0  # one engine's load or unload (a load reads the weights from disk)
LIST_TIMEOUT_S = 10.0  # one engine's listing

_EngineReply = engine_pb2.LoadAdapterResponse | engine_pb2.UnloadAdapterResponse
# Where an engine would have had the adapter, for a NOT_FOUND
_WHERE = {"load": "under its adapter root (--adapter-dir)",
          "unload": "loaded or under its adapter root (--adapter-dir)"}


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, keys: KeyStore, fleet: Fleet) -> None:
        self._keys = keys
        self._engines = fleet

    async def LoadAdapter(
        self, request: admin_pb2.AdminAdapterRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.AdminAdapterResponse:
        return await self._fan_out("load", request, context)

    async def UnloadAdapter(
        self, request: admin_pb2.AdminAdapterRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.AdminAdapterResponse:
        return await self._fan_out("unload", request, context)

    async def ListAdapters(
        self, request: admin_pb2.AdminListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.AdminListAdaptersResponse:
        await self._authorize(context, "list", "")
        timeout = _engine_timeout(context, LIST_TIMEOUT_S)
        entries = await asyncio.gather(*(_engine_listing(e, timeout) for e in self._engines))
        return admin_pb2.AdminListAdaptersResponse(engines=entries)

    # ---- load / unload -------------------------------------------------------

    async def _fan_out(
        self, action: str, request: admin_pb2.AdminAdapterRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.AdminAdapterResponse:
        who = await self._authorize(context, action, request.adapter)
        try:
            check_adapter_name(request.adapter, "the request's adapter field")
            targets, looking = self._targets(action, request)
        except RequestError as err:
            await _abort(context, err)
        timeout = _engine_timeout(context, ENGINE_CALL_TIMEOUT_S)
        replies = await asyncio.gather(
            *(_engine_call(e, action, request.adapter, timeout) for e in targets)
        )
        outcomes = list(zip(targets, replies))
        if looking:  # an engine without it is not a failure; none with it is NOT_FOUND
            outcomes = [(e, r) for e, r in outcomes if not _missing(r)]
            if not outcomes:
                await _abort(context, _not_found(request.adapter, _WHERE[action]))
        log.info(
            "admin_adapter",
            action=action,
            adapter=request.adapter,
            by=who,
            outcomes={e.address: _outcome(r) for e, r in outcomes},
        )
        failed = [(e, r) for e, r in outcomes if isinstance(r, grpc.aio.AioRpcError)]
        if failed:
            await _abort(context, _fan_out_error(action, request.adapter, outcomes, failed))
        results = [
            admin_pb2.AdminEngineResult(
                engine=e.address,
                resident=isinstance(r, engine_pb2.LoadAdapterResponse) and r.resident,
                was_loaded=r.was_loaded,
            )
            for e, r in outcomes
            if not isinstance(r, grpc.aio.AioRpcError)
        ]
        return admin_pb2.AdminAdapterResponse(adapter=request.adapter, engines=results)

    def _targets(
        self, action: str, request: admin_pb2.AdminAdapterRequest
    ) -> tuple[list[EngineClient], bool]:
        """The engines to act on, in --engine order, and whether they only look for the
        adapter (no report lists it: an engine without it is no failure); RequestError when
        there are none."""
        if request.engines:
            known = self._engines.addresses
            unknown = sorted(set(request.engines) - set(known))
            if unknown:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"engines {unknown} are not behind this router; its engines are {known}",
                    "unknown_engine",
                )
            return [e for e in self._engines if e.address in set(request.engines)], False
        targets = self._engines.accepting()
        if not targets:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                "no engine worker is available; retry later",
                "no_engine",
            )
        # Load: the engines with it on disk. Unload: those with it on disk or in memory (a
        # deleted adapter stays loaded); any other engine would answer NOT_FOUND.
        adapter = request.adapter
        if action == "load":
            listed = [e for e in targets if e.load.has_adapter(adapter)]
        else:
            listed = [e for e in targets if e.load.has_adapter(adapter) or adapter in e.load.adapters_cached
                      or adapter in e.load.adapters_resident]
        if listed:
            return listed, False
        # An adapter copied in (or loaded) a moment ago is there before a report lists it:
        # every engine that serves adapters looks for itself.
        looking = [e for e in targets if e.load.adapters_available]
        if not looking:
            raise _not_found(adapter, _WHERE[action])
        return looking, True

    async def _authorize(self, context: grpc.aio.ServicerContext, action: str, adapter: str) -> str:
        try:
            return self._keys.authenticate_admin(context.invocation_metadata() or ())
        except RequestError as err:
            log.info("admin_refused", action=action, adapter=adapter[:140], code=err.code.name,
                     message=err.message)
            await _abort(context, err)


def _engine_timeout(context: grpc.aio.ServicerContext, cap: float) -> float:
    """One engine call's time: at most `cap`, and a tenth of the caller's remaining time
    short of it, so that the reply naming each engine's outcome still reaches the caller."""
    remaining = context.time_remaining()
    return cap if remaining is None else min(cap, 0.9 * remaining)


async def _engine_call(
    engine: EngineClient, action: str, adapter: str, timeout: float
) -> _EngineReply | grpc.aio.AioRpcError:
    if not engine.link.healthy:  # a named engine the router sees down: do not wait on it
        return rpc_error(
            grpc.StatusCode.UNAVAILABLE,
            "the router has marked the engine unhealthy (no current load report); not asked",
        )
    try:
        if action == "load":
            return await engine.link.load_adapter(adapter, timeout)
        return await engine.link.unload_adapter(adapter, timeout)
    except grpc.aio.AioRpcError as exc:
        return exc


async def _engine_listing(engine: EngineClient, timeout: float) -> admin_pb2.AdminEngineAdapters:
    try:
        reply = await engine.link.list_adapters(timeout)
    except grpc.aio.AioRpcError as exc:
        return admin_pb2.AdminEngineAdapters(
            engine=engine.address, reachable=False, error=f"{exc.code().name}: {exc.details()}"
        )
    return admin_pb2.AdminEngineAdapters(
        engine=engine.address,
        reachable=True,
        resident=reply.resident,
        cached=reply.cached,
        available=reply.available,
        max_loras=reply.max_loras,
        residency=reply.residency,
    )


def _missing(reply: _EngineReply | grpc.aio.AioRpcError) -> bool:
    return isinstance(reply, grpc.aio.AioRpcError) and reply.code() == grpc.StatusCode.NOT_FOUND


def _not_found(adapter: str, where: str) -> RequestError:
    return RequestError(grpc.StatusCode.NOT_FOUND, f"adapter {adapter!r} not found: no engine has it {where}",
                        "unknown_adapter")


def _outcome(reply: _EngineReply | grpc.aio.AioRpcError) -> str:
    if isinstance(reply, grpc.aio.AioRpcError):
        return f"{reply.code().name}: {reply.details()}"
    return "ok"


def _fan_out_error(
    action: str,
    adapter: str,
    outcomes: list[tuple[EngineClient, _EngineReply | grpc.aio.AioRpcError]],
    failed: list[tuple[EngineClient, grpc.aio.AioRpcError]],
) -> RequestError:
    detail = "; ".join(f"{e.address}: {_outcome(r)}" for e, r in outcomes)
    return RequestError(
        failed[0][1].code(),
        f"{action} of adapter {adapter!r} failed on {len(failed)} of {len(outcomes)} engines "
        f"({detail})",
        f"admin_{action}_failed",
    )


async def _abort(context: grpc.aio.ServicerContext, err: RequestError) -> NoReturn:
    await context.abort(err.code, err.message)
    raise AssertionError("unreachable: context.abort raises")
