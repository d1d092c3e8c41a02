"""LoRA adapters as the router sees them: names, which engines have which, and
adapter affinity.

An adapter exists for the router when some healthy engine reports it under its
adapter root (LoadReport.available_adapters). Affinity ranks the engines that have
it: an engine with it in a device slot (or with this router's requests for it in
flight there, so a burst sticks to one engine while the first load runs) beats one
with it in host memory, which beats one that must read it from disk.
"""

from __future__ import annotations

import enum

# The engine's own rule for adapter names: one definition for both processes.
from omnibus.common.adapters import adapter_name_error
from omnibus.router.service.errors import invalid

ADAPTER_HEADER = "x-adapter-id"


class Affinity(enum.IntEnum):
    """How ready an engine is to run a request for an adapter (higher is better)."""

    COLD = 0  # on the engine's disk only: the request waits for a load
    CACHED = 1  # in the engine's host memory: a copy into a device slot
    RESIDENT = 2  # in a device slot (or loading there for this router's requests)

    @property
    def label(self) -> str:
        return self.name.lower()


def check_adapter_name(name: str, where: str = ADAPTER_HEADER) -> None:
    """Raises INVALID_ARGUMENT unless `name` (from `where`: the header, or a field of an
    Admin request) is a well-formed adapter name."""
    error = adapter_name_error(name, f" in {where}")
    if error is not None:
        raise invalid(error)
