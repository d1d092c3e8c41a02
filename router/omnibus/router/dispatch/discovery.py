"""Which engines exist: fixed addresses, and DNS names that resolve to every engine.

A `dns:///NAME:PORT` target (a Kubernetes headless Service, a compose service scaled
to N) is re-resolved every `engine_resolve_seconds`, and soon after one of its
engines stops answering. Every address it resolves to is its own engine with its own
load stream. An address that appears joins once its gRPC health says SERVING (a pod
still loading its model gets no requests); an address that disappears takes no new
requests and leaves once its in-flight requests have ended. A failed lookup keeps the
engines last seen: a DNS hiccup is no reason to drop engines that are serving.

The engines live in the router's Fleet (fleet.py), which the dispatcher, the health
tracker and the metrics read; only this module adds to it or removes from it, on the
event loop.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
from collections.abc import Awaitable, Callable

import dns.asyncresolver
import dns.exception
import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnibus.common.fatal import exit_if_it_fails
from omnibus.common.security import ClientSecurity
from omnibus.router.config import EngineTarget, RouterConfig
from omnibus.router.dispatch.engines import EngineClient
from omnibus.router.dispatch.fleet import Fleet

log = structlog.get_logger("router.discovery")

Resolve = Callable[[EngineTarget], Awaitable[list[str]]]  # target -> "host:port" addresses
Probe = Callable[[str], Awaitable[bool]]  # address -> its gRPC health is SERVING
PROBE_TIMEOUT_S = 2.0
CLOSE_GRACE_S = 5.0  # calls still open on a departed engine (Embed) get this long


async def resolve(target: EngineTarget) -> list[str]:
    """The target's addresses, sorted. IPv4 when the name has any (so `localhost`, which
    also has ::1, is one engine), IPv6 otherwise. Raises OSError or DNSException."""
    if target.dns_server is None:
        infos = await asyncio.get_running_loop().getaddrinfo(
            target.host, target.port, type=socket.SOCK_STREAM
        )
        hosts = {str(info[4][0]) for info in infos}
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [target.dns_server[0]]
        resolver.port = target.dns_server[1]
        answer = await resolver.resolve(target.host, "A", lifetime=PROBE_TIMEOUT_S)
        hosts = {rr.address for rr in answer}
    ips = [ipaddress.ip_address(h) for h in hosts]
    v4 = [ip for ip in ips if ip.version == 4]
    return [_join(ip, target.port) for ip in sorted(v4 or ips)]


def _join(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    return f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}"


async def probe(address: str, security: ClientSecurity = ClientSecurity()) -> bool:
    """True when the engine's overall gRPC health is SERVING (model loaded, not draining)."""
    async with security.aio_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S
            )
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


class EngineDiscovery:
    """Keeps the fleet equal to what config.engines name (fixed ones from the start)."""

    def __init__(
        self,
        config: RouterConfig,
        fleet: Fleet,
        resolver: Resolve = resolve,
        prober: Probe | None = None,
    ) -> None:
        self._config = config
        self._engines = fleet
        self._resolve = resolver
        self._probe = prober or functools.partial(probe, security=config.engine_security())
        targets = [EngineTarget.parse(t) for t in config.engines]
        self._dns = [t for t in targets if t.dns]
        self._wake = {t: asyncio.Event() for t in self._dns}
        self._members: dict[EngineTarget, set[str]] = {t: set() for t in self._dns}
        self._joining: set[str] = set()
        self._leaving: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        for target in targets:
            if not target.dns:  # as before discovery: retried with backoff while down
                fleet.add(EngineClient(str(target), config, fleet.changed))

    def start(self) -> None:
        for engine in self._engines:
            engine.start()
        for target in self._dns:
            self._spawn(self._follow(target), f"resolve-{target}")

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(e.close() for e in self._engines))

    def _spawn(self, coro: Awaitable[None], name: str) -> None:
        task = exit_if_it_fails(asyncio.ensure_future(coro))
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- one DNS target --------------------------------------------------------

    async def _follow(self, target: EngineTarget) -> None:
        wake = self._wake[target]
        while True:
            members = self._members[target]  # the addresses last resolved
            try:
                found = set(await self._resolve(target))
            except (OSError, dns.exception.DNSException) as exc:
                log.warning("engine_resolve_failed", target=str(target), error=str(exc))
            else:
                if found != members:
                    log.info("engines_resolved", target=str(target), addresses=sorted(found))
                self._members[target] = found
                for address in found - self._joining:
                    if self._engines.get(address) is None:
                        self._joining.add(address)
                        self._spawn(self._join(address, target), f"join-{address}")
                for address in members - found:
                    self._spawn(self._leave(address), f"leave-{address}")
            try:
                async with asyncio.timeout(self._config.engine_resolve_seconds):
                    await wake.wait()
                # An engine failed: look again soon, but not in a tight loop.
                await asyncio.sleep(self._config.engine_retry_initial_seconds)
            except TimeoutError:
                pass
            wake.clear()

    async def _join(self, address: str, target: EngineTarget) -> None:
        """Adds the engine once it is SERVING; gives up if it leaves DNS first. (An
        address that comes back while its engine is still leaving joins at the lookup
        after it has left.)"""
        try:
            delay = self._config.engine_retry_initial_seconds
            while not await self._probe(address):
                await asyncio.sleep(delay)
                delay = min(2 * delay, self._config.engine_retry_max_seconds)
                if address not in self._members[target]:
                    return
            if address not in self._members[target]:
                return
            engine = EngineClient(address, self._config, self._engines.changed,
                                  self._wake[target].set)
            self._engines.add(engine)
            engine.start()
            log.info("engine_added", engine=address, target=str(target))
        finally:
            self._joining.discard(address)

    async def _leave(self, address: str) -> None:
        """No new requests for the engine; it leaves when its in-flight ones have ended."""
        engine = self._engines.get(address)
        if engine is None or address in self._leaving:
            return
        self._leaving.add(address)
        try:
            log.info("engine_retiring", engine=address, inflight=engine.seats.inflight)
            await engine.seats.retire()
            self._engines.remove(engine)
            await engine.close(CLOSE_GRACE_S)
            log.info("engine_removed", engine=address)
        finally:
            self._leaving.discard(address)
