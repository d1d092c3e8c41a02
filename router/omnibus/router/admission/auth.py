"""API keys → tenants, and admin keys.

The keys file is JSON:

    {"tenants": {"acme": {"keys": ["sk-acme-1"], "max_concurrent": 8,
                          "tokens_per_minute": 60000, "adapters": ["support-bot"],
                          "weight": 2.0, "cache_group": "acme-corp"},
                 "ops":  {"keys": ["sk-ops-1"], "admin": true}}}

Only `keys` is required; missing limits take the router's --tenant-* defaults.
`adapters` lists the LoRA adapters the tenant may select with x-adapter-id: absent
or ["*"] means any adapter the engines have, [] the base model only. `admin: true`
makes the tenant's keys admin keys too (the omnibus.v1.Admin service), as is the
key in the router's --admin-key-file. `weight` (> 0, default 1) is the tenant's share
under fair queueing (--queue-policy vtc): a weight-2 tenant is served twice the tokens
of a weight-1 tenant when both are backlogged. Keys are kept only as SHA-256 digests in memory.

Prefix cache: with a keys file, each tenant's requests carry a cache salt that the
engines chain into every KV block's hash, so tenants share cached prefixes only within
a cache group: a tenant's `cache_group` (a non-empty string) if set, else the tenant
alone (its name). A shared cache lets one tenant learn from its time to first token
whether another sent a prompt (vLLM's CVE-2025-46570); tenants that trust each other
(one customer's keys) can name the same group to keep their hits. The salt is a SHA-256
digest of the group (or name), the same on every router, and only the router sets it:
no client field does. Without a keys file the one tenant "default" is unsalted.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from omnibus.common.adapters import is_adapter_name
from omnibus.router.config import TenantLimits
from omnibus.router.service.errors import RequestError

DEFAULT_TENANT = "default"
ANY_ADAPTER = "*"
_TENANT_FIELDS = {
    "keys", "max_concurrent", "tokens_per_minute", "adapters", "admin", "weight", "cache_group"}
_MAX_LIMIT = 2**53  # limits stay exact as floats (token buckets, Redis's Lua numbers)


@dataclass(frozen=True)
class Tenant:
    """Who is calling, and what they may use."""

    name: str
    limits: TenantLimits = field(default_factory=TenantLimits)
    adapters: tuple[str, ...] | None = None  # the adapters it may use; None: any
    admin: bool = False  # its keys may call the admin API
    weight: float = 1.0  # its share under fair queueing (virtual token counters grow by tokens / weight)
    cache_salt: str = ""  # salts its requests' prefix-cache blocks (cache_salt()); "": unsalted

    def may_use(self, adapter: str) -> bool:
        return self.adapters is None or adapter in self.adapters


def cache_salt(tenant: str, cache_group: str | None) -> str:
    """The prefix-cache salt of a keys-file tenant: a digest of its cache group, or of its
    name when it has none (a group and a tenant of the same name stay apart). 32 hex
    characters (omnibus.common.prefix.check_cache_salt allows 64)."""
    what = b"group\x00" + cache_group.encode() if cache_group is not None else b"tenant\x00" + tenant.encode()
    return hashlib.sha256(b"omnibus-cache-salt\x00" + what).hexdigest()[:32]


def _digest(key: str) -> bytes:
    # surrogateescape: an HTTP header's bytes that are not UTF-8 come as lone surrogates
    # (aiohttp's decoding); they digest as those bytes, so such a key is just a wrong key.
    return hashlib.sha256(key.encode(errors="surrogateescape")).digest()


class KeyStore:
    """Authenticates a call's `authorization: Bearer <key>` metadata."""

    def __init__(
        self,
        tenants_by_digest: Mapping[bytes, Tenant] | None,
        default: Tenant,
        admin_digests: frozenset[bytes] = frozenset(),
    ) -> None:
        """`tenants_by_digest` None: no keys configured, every caller is `default`.
        `admin_digests`: admin keys besides those of tenants marked admin."""
        self._by_digest = dict(tenants_by_digest) if tenants_by_digest is not None else None
        self._default = default
        self._admin_digests = admin_digests

    @classmethod
    def open(
        cls, path: str | None, default_limits: TenantLimits, admin_key_file: str | None = None
    ) -> KeyStore:
        """The store for a keys file, or an open one (tenant "default") when path is None;
        `admin_key_file` holds one more admin key."""
        default = Tenant(DEFAULT_TENANT, default_limits)
        admin = frozenset()
        if admin_key_file is not None:
            admin = frozenset({_digest(_read_admin_key(Path(admin_key_file)))})
        if path is None:
            return cls(None, default, admin)
        return cls(_load_keys(Path(path), default_limits), default, admin)

    @property
    def admin_enabled(self) -> bool:
        """Some key may call the admin API."""
        return bool(self._admin_digests) or any(t.admin for t in self.tenants)

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        if self._by_digest is None:
            return (self._default,)
        return tuple({t.name: t for t in self._by_digest.values()}.values())

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]]) -> Tenant:
        """The caller's tenant. Raises RequestError(UNAUTHENTICATED) for a missing or bad key."""
        if self._by_digest is None:
            return self._default
        tenant = self._by_digest.get(_digest(_bearer_key(metadata)))
        if tenant is None:
            raise _unauthenticated("invalid API key")
        return tenant

    def authenticate_admin(self, metadata: Iterable[tuple[str, str | bytes]]) -> str:
        """Who is calling the admin API ("admin-key" or an admin tenant's name). Raises
        RequestError: PERMISSION_DENIED when no admin key is configured or the key is a
        tenant's that is not an admin, UNAUTHENTICATED for a missing or unknown key."""
        if not self.admin_enabled:
            raise RequestError(
                grpc.StatusCode.PERMISSION_DENIED,
                "the admin API is disabled on this router: start it with --admin-key-file FILE, "
                'or mark a tenant "admin": true in its keys file',
                "admin_disabled",
            )
        digest = _digest(_bearer_key(metadata))
        if digest in self._admin_digests:
            return "admin-key"
        tenant = self._by_digest.get(digest) if self._by_digest is not None else None
        if tenant is None:
            raise _unauthenticated("invalid API key")
        if not tenant.admin:
            raise RequestError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"tenant {tenant.name!r} may not use the admin API; call it with an admin key",
                "not_admin",
            )
        return tenant.name


def _bearer_key(metadata: Iterable[tuple[str, str | bytes]]) -> str:
    header = _metadata_value(metadata, "authorization")
    if header is None:
        raise _unauthenticated("missing 'authorization: Bearer <key>' header")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise _unauthenticated("the authorization header must be 'Bearer <key>'")
    return key.strip()


def _read_admin_key(path: Path) -> str:
    try:
        key = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read admin key file {path}: {exc}") from exc
    if not key or any(c.isspace() for c in key):
        raise ValueError(f"admin key file {path} must hold one key: non-empty, no whitespace")
    return key


def _metadata_value(metadata: Iterable[tuple[str, str | bytes]], name: str) -> str | None:
    for key, value in metadata:
        if key.lower() == name:
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return None


def _unauthenticated(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.UNAUTHENTICATED, message, "unauthenticated")


def _unique_fields(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose names are all distinct (json keeps the last of a duplicate:
    a tenant listed twice would silently lose the first entry's keys)."""
    names = [name for name, _ in pairs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{', '.join(map(repr, twice))} appear{'s' if len(twice) == 1 else ''} twice in one object")
    return dict(pairs)


def _load_keys(path: Path, default_limits: TenantLimits) -> dict[bytes, Tenant]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_unique_fields)
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"cannot read keys file {path}: {exc}") from exc
    tenants = raw.get("tenants") if isinstance(raw, dict) else None
    if not isinstance(tenants, dict) or not tenants:
        raise ValueError(f"keys file {path} must be an object with a non-empty 'tenants' object")
    by_digest: dict[bytes, Tenant] = {}
    for name, entry in tenants.items():
        tenant, keys = _parse_tenant(path, name, entry, default_limits)
        for key in keys:
            other = by_digest.get(_digest(key))
            if other is not None:
                whose = (f"tenant {name!r}" if other.name == name
                         else f"tenants {other.name!r} and {name!r}")
                raise ValueError(f"keys file {path}: a key is used twice, by {whose}")
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
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise ValueError(f"{where}: 'admin' must be true or false, got {admin!r}")
    max_concurrent = _limit(where, entry, "max_concurrent", default_limits.max_concurrent)
    tokens_per_minute = _limit(where, entry, "tokens_per_minute", default_limits.tokens_per_minute)
    try:
        limits = TenantLimits(max_concurrent=max_concurrent, tokens_per_minute=tokens_per_minute)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    adapters = _parse_adapters(where, entry.get("adapters"))
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < 1e6:
        raise ValueError(f"{where}: 'weight' must be a number in (0, 1e6), got {weight!r}")
    group = entry.get("cache_group")
    if "cache_group" in entry and (not isinstance(group, str) or not group):
        raise ValueError(f"{where}: 'cache_group' must be a non-empty string, got {group!r}")
    return (Tenant(name, limits, adapters, admin, float(weight), cache_salt(name, group)),
            [k.strip() for k in keys])


def _limit(where: str, entry: dict, name: str, default: int) -> int:
    """The tenant's `name`, a whole number (6e4 is 60000), not 2.7, true or "5", which
    int() would turn into 2, 1 and 5; TenantLimits refuses one below 0."""
    if name not in entry:
        return default
    value = entry[name]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value > _MAX_LIMIT:
        raise ValueError(f"{where}: {name!r} must be a whole number up to 2**53 (0: no limit), "
                         f"got {value!r}")
    return value


def _parse_adapters(where: str, adapters: object) -> tuple[str, ...] | None:
    """A tenant's adapter list: None (any) when absent or containing "*"."""
    if adapters is None:
        return None
    if not isinstance(adapters, list) or not all(isinstance(a, str) for a in adapters):
        raise ValueError(f"{where}: 'adapters' must be a list of adapter names (or [\"*\"])")
    bad = [a for a in adapters if a != ANY_ADAPTER and not is_adapter_name(a)]
    if bad:
        raise ValueError(
            f"{where}: invalid adapter names {bad}: use 1-128 ASCII letters, digits, '.', '_' or "
            "'-', starting with a letter or digit"
        )
    return None if ANY_ADAPTER in adapters else tuple(adapters)
