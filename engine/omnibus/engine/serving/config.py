"""The engine worker process's settings around its engine (whose own are EngineConfig,
engine/omnibus/engine/config.py). Light to import: the command line reads its defaults from here."""

from __future__ import annotations

from dataclasses import dataclass, field

from omnibus.common.security import ServerSecurity
from omnibus.engine.serving.batcher import BatcherConfig
from omnibus.engine.serving.watchdog import WatchdogConfig


@dataclass(frozen=True)
class ServerConfig:
    """The worker process around the engine."""

    host: str = "127.0.0.1"
    port: int = 50061
    metrics_port: int = 0  # 0: no /metrics endpoint
    drain_seconds: float = 30.0  # SIGTERM: time in-flight streams get to finish
    embed_batching: BatcherConfig = field(default_factory=BatcherConfig)  # the Embed RPC's batcher
    security: ServerSecurity = field(default_factory=ServerSecurity)  # TLS, client certs, token
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)  # step-time limits

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if not 0 <= value < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {value}")
        if not self.drain_seconds >= 0:  # NaN too
            raise ValueError(f"drain_seconds must be >= 0, got {self.drain_seconds}")
