"""One engine's load as its latest LoadReport says: the figures (running, waiting, free
blocks, its context), the adapters it holds, and the keys of its cached prefix blocks."""

from __future__ import annotations

from omnibus.v1 import engine_pb2

from omnibus.common.sampling import kv_tokens


_NO_REPORT = engine_pb2.LoadReport()  # what the figures read before the first report

class LoadView:
    """The engine's latest load report and what follows from it alone (no report yet:
    the figures are 0 and the sets empty)."""

    def __init__(self) -> None:
        self._report: engine_pb2.LoadReport | None = None  # the latest (None: none yet)
        # From the latest report: adapters in device slots, in host memory, on disk.
        self.adapters_resident: frozenset[str] = frozenset()
        self.adapters_cached: frozenset[str] = frozenset()
        self.adapters_available: frozenset[str] = frozenset()
        # Keys of the engine's cached prefix blocks (omnibus.common.prefix), for
        # prefix-aware routing; reports carry them only when they change.
        self.prefix_keys: frozenset[int] = frozenset()
        self._prefix_generation: int | None = None
        # Adapter -> the salt the engine hashes its requests' prefix blocks with.
        self.adapter_salts: dict[str, str] = {}

    def take(self, report: engine_pb2.LoadReport) -> None:
        """The engine's latest load report: its figures are these."""
        self._report = report
        self.adapters_resident = frozenset(report.resident_adapters)
        self.adapters_cached = frozenset(report.cached_adapters)
        self.adapters_available = frozenset(report.available_adapters)
        if report.prefix_generation != self._prefix_generation:
            self.prefix_keys = frozenset(report.prefix_block_keys)
            self._prefix_generation = report.prefix_generation
        if report.adapter_salts != self.adapter_salts:
            self.adapter_salts = dict(report.adapter_salts)

    def new_stream(self) -> None:
        """A new WatchLoad stream opened: its first report carries the prefix keys."""
        self._prefix_generation = None

    @property
    def report(self) -> engine_pb2.LoadReport | None:
        """The latest report itself (None: none yet)."""
        return self._report

    @property
    def _latest(self) -> engine_pb2.LoadReport:
        """The latest report, or an empty one (every figure 0) before the first."""
        return self._report if self._report is not None else _NO_REPORT

    @property
    def reported(self) -> bool:
        """The engine has reported since this router started (its figures below are known)."""
        return self._report is not None

    @property
    def max_model_len(self) -> int:
        """The context the engine serves (0: not reported)."""
        return self._latest.max_model_len

    @property
    def block_size(self) -> int:
        """Tokens per KV block (0: not reported)."""
        return self._latest.block_size

    @property
    def running(self) -> int:
        """Sequences running, as last reported."""
        return self._latest.num_running

    @property
    def waiting(self) -> int:
        """Sequences waiting inside the engine, as last reported."""
        return self._latest.num_waiting

    @property
    def free_blocks(self) -> int:
        """Free KV blocks, as last reported."""
        return self._latest.num_free_blocks

    @property
    def total_blocks(self) -> int:
        """Usable KV blocks, as last reported."""
        return self._latest.num_total_blocks

    def max_request_tokens(self) -> int | None:
        """The most tokens (prompt + max_tokens) one request may span on the engine, as it
        last reported: its context, and what its KV pool holds (kv_tokens, the engine's own
        rule). None: no report yet."""
        report = self._report
        if report is None:
            return None
        limits = []
        if report.max_model_len > 0:
            limits.append(report.max_model_len)
        if report.block_size > 0:
            limits.append(kv_tokens(report.num_total_blocks, report.block_size))
        return min(limits, default=None)

    def fits(self, tokens: int) -> bool:
        """A request of `tokens` (prompt + max_tokens) fits the engine's context and KV
        pool, as far as the router knows (one that has not reported counts as fitting)."""
        most = self.max_request_tokens()
        return most is None or tokens <= most

    def free_block_share(self) -> float:
        report = self._report
        return (
            report.num_free_blocks / report.num_total_blocks
            if report and report.num_total_blocks
            else 0.0
        )

    @property
    def role(self) -> str:
        """What routers send the engine: "both", "prefill" or "decode" (--role)."""
        return self._latest.role or "both"

    @property
    def kv_transfer(self) -> bool:
        """The engine reads and offers KV (--kv-transfer)."""
        return self._latest.kv_transfer

    @property
    def kv_layout(self) -> str:
        """The KV layout the engine reads ("": it moves none)."""
        return self._latest.kv_layout

    def has_adapter(self, adapter: str) -> bool:
        """The engine can serve `adapter`: it is under the engine's adapter root."""
        return adapter in self.adapters_available
