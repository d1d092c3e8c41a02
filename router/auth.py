"""API keys → tenants.

The keys file is JSON:

    {"tenants": {"acme": {"keys": ["sk-acme-1"], "max_concurrent": 8,
                          "tokens_per_minute": 60000, "adapters": ["support-bot"]}}}

Only `keys` is required; missing limits take the router's --tenant-* defaults.
`adapters` lists the adapters the tenant may select ("*": any); it takes effect once
the router serves adapters. Keys are kept only as SHA-256 digests in memory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from router.config import TenantLimits
from router.errors import RequestError

DEFAULT_TENANT = "default"
_TENANT_FIELDS = {"keys", "max_concurrent", "tokens_per_minute", "adapters"}


@dataclass(frozen=True)
class Tenant:
    """Who is calling, and what they may use."""

    name: str
    limits: TenantLimits = field(default_factory=TenantLimits)
    adapters: tuple[str, ...] = ()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyStore:
    """Authenticates a call's `authorization: Bearer <key>` metadata."""

    def __init__(self, tenants_by_digest: Mapping[bytes, Tenant] | None, default: Tenant) -> None:
        """`tenants_by_digest` None: no keys configured, every caller is `default`."""
        self._by_digest = dict(tenants_by_digest) if tenants_by_digest is not None else None
        self._default = default

    @classmethod
    def open(cls, path: str | None, default_limits: TenantLimits) -> KeyStore:
        """The store for a keys file, or an open one (tenant "default") when path is None."""
        default = Tenant(DEFAULT_TENANT, default_limits)
        if path is None:
            return cls(None, default)
        return cls(_load_keys(Path(path), default_limits), default)

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        if self._by_digest is None:
            return (self._default,)
        return tuple({t.name: t for t in self._by_digest.values()}.values())

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]]) -> Tenant:
        """The caller's tenant. Raises RequestError(UNAUTHENTICATED) for a missing or bad key."""
        if self._by_digest is None:
            return self._default
        header = _metadata_value(metadata, "authorization")
        if header is None:
            raise _unauthenticated("missing 'authorization: Bearer <key>' metadata")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise _unauthenticated("authorization metadata must be 'Bearer <key>'")
        tenant = self._by_digest.get(_digest(key.strip()))
        if tenant is None:
            raise _unauthenticated("invalid API key")
        return tenant


def _metadata_value(metadata: Iterable[tuple[str, str | bytes]], name: str) -> str | None:
    for key, value in metadata:
        if key.lower() == name:
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return None


def _unauthenticated(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.UNAUTHENTICATED, message, "unauthenticated")


def _load_keys(path: Path, default_limits: TenantLimits) -> dict[bytes, Tenant]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read keys file {path}: {exc}") from exc
    tenants = raw.get("tenants") if isinstance(raw, dict) else None
    if not isinstance(tenants, dict) or not tenants:
        raise ValueError(f"keys file {path} must be an object with a non-empty 'tenants' object")
    by_digest: dict[bytes, Tenant] = {}
    for name, entry in tenants.items():
        tenant, keys = _parse_tenant(path, name, entry, default_limits)
        for key in keys:
            if _digest(key) in by_digest:
                raise ValueError(f"keys file {path}: a key of tenant {name!r} is used twice")
            by_digest[_digest(key)] = tenant
    return by_digest


def _parse_tenant(
    path: Path, name: str, entry: object, default_limits: TenantLimits
) -> tuple[Tenant, list[str]]:
    where = f"keys file {path}, tenant {name!r}"
    if not name or not isinstance(entry, dict):
        raise ValueError(f"{where}: each tenant needs a non-empty name and an object")
    unknown = set(entry) - _TENANT_FIELDS
    if unknown:
        raise ValueError(
            f"{where}: unknown fields {sorted(unknown)}; allowed: {sorted(_TENANT_FIELDS)}"
        )
    keys = entry.get("keys")
    if (
        not isinstance(keys, list)
        or not keys
        or not all(isinstance(k, str) and k.strip() for k in keys)
    ):
        raise ValueError(f"{where}: 'keys' must be a non-empty list of non-empty strings")
    adapters = entry.get("adapters", [])
    if not isinstance(adapters, list) or not all(isinstance(a, str) for a in adapters):
        raise ValueError(f"{where}: 'adapters' must be a list of adapter names")
    try:
        limits = TenantLimits(
            max_concurrent=int(entry.get("max_concurrent", default_limits.max_concurrent)),
            tokens_per_minute=int(entry.get("tokens_per_minute", default_limits.tokens_per_minute)),
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from exc
    return Tenant(name, limits, tuple(adapters)), [k.strip() for k in keys]
