"""The transfer engine under the KV connector: one-sided reads of registered memory.

The connector (connector.py) needs three verbs from a transport: register (and
unregister) a region of this process's memory, read byte ranges of a peer's registered
regions into this process's, and the address peers reach it at. `MooncakeTransport` is Mooncake's transfer
engine (`mooncake-transfer-engine-non-cuda`: TCP between processes and hosts; its CUDA
build adds RDMA and device memory). NIXL's agent offers the same verbs (register,
prepared reads, a peer's metadata) and would be a second class here.
"""

from __future__ import annotations

import os
import socket
from typing import Protocol

TRANSPORTS = ("mooncake",)  # --kv-transfer's choices besides "none"


class Transport(Protocol):
    address: str  # what peers pass to `read` to reach this process

    def register(self, addr: int, size: int) -> None: ...

    def unregister(self, addr: int) -> None: ...

    def read(self, peer: str, local: list[int], remote: list[int], lengths: list[int]) -> bool:
        """Copies each remote range of `peer`'s registered memory into the local one;
        True when every byte arrived. Blocking (the GIL released); bounded: a peer that
        is gone fails at once, one that stopped answering within the transport's timeout."""
        ...

    def close(self) -> None: ...


class MooncakeTransport:
    """Mooncake's transfer engine over TCP, with peer-to-peer handshakes (no metadata
    server): a peer's address is its host and handshake port."""

    def __init__(self, host: str) -> None:
        os.environ.setdefault("GLOG_minloglevel", "2")  # its glog INFO lines, one per transfer
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:  # also: libibverbs1 missing (its engine links it, even for TCP)
            raise RuntimeError(
                f"--kv-transfer mooncake needs Mooncake's transfer engine: pip install "
                f"mooncake-transfer-engine-non-cuda (and the system's libibverbs1): {exc}") from exc
        self._engine = TransferEngine()
        if self._engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError(f"Mooncake's transfer engine could not start on {host}")
        self.address = f"{host}:{self._engine.get_rpc_port()}"

    def register(self, addr: int, size: int) -> None:
        if self._engine.register_memory(addr, size) != 0:
            raise RuntimeError(f"Mooncake could not register {size} bytes at {addr:#x}")

    def unregister(self, addr: int) -> None:
        self._engine.unregister_memory(addr)

    def read(self, peer: str, local: list[int], remote: list[int], lengths: list[int]) -> bool:
        return self._engine.batch_transfer_sync_read(peer, local, remote, lengths) == 0

    def close(self) -> None:
        self._engine = None


def own_address(host: str) -> str:
    """`host`, or for "auto" the address this machine's name resolves to (a container's or
    a pod's own IP: Docker and Kubernetes write it into /etc/hosts for the hostname)."""
    if host != "auto":
        return host
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError as exc:
        raise RuntimeError(f"--kv-transfer-host auto: this host's name {name!r} does not resolve ({exc}); "
                           "pass the address other engines reach this one at") from exc


def make_transport(kind: str, host: str) -> Transport:
    host = own_address(host)
    if kind == "mooncake":
        return MooncakeTransport(host)
    raise ValueError(f"unknown KV transport {kind!r}; choose from {', '.join(TRANSPORTS)}")
