"""The adapter names under the engine's adapter root, for load reports and ListAdapters."""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog

from omnibus.engine.lora import list_adapter_names

log = structlog.get_logger("engine.server")

CATALOG_REFRESH_S = 2.0  # how often the adapter root is re-listed for load reports


class AdapterCatalog:
    """The adapter names under the adapter root, for load reports. Listing a directory
    is blocking I/O (the root may be a network mount), so it runs on a worker thread,
    every CATALOG_REFRESH_S and after each load or unload."""

    def __init__(self, root: str | Path | None) -> None:
        self._root = None if root is None else Path(root)
        self.names: tuple[str, ...] = tuple(list_adapter_names(self._root)) if self._root else ()

    async def refresh(self) -> None:
        if self._root is None:
            return
        try:
            self.names = tuple(await asyncio.to_thread(list_adapter_names, self._root))
        except Exception as exc:  # noqa: BLE001 (keep the last listing and the task; say why it is stale)
            log.warning("adapter_root_unreadable", error=repr(exc))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(CATALOG_REFRESH_S)
            await self.refresh()
