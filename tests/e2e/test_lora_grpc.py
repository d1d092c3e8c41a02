"""Multi-tenant LoRA over real gRPC: a router (keys file with adapter lists, admin key)
in front of two engine processes serving PEFT adapters of the session's tiny
checkpoint, checked token for token against PEFT; plus one engine served in this
process, whose disk loads a test can hold, behind a second router.

Covers: the x-adapter-id header, its errors (INVALID_ARGUMENT, PERMISSION_DENIED,
NOT_FOUND, FAILED_PRECONDITION), ListModels per tenant, the admin API and its
authentication, the engine's adapter RPCs and load reports, adapter affinity,
adapter metrics, and that a slow adapter load stalls no other tenant's stream.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from omnibus.v1 import admin_pb2, admin_pb2_grpc, engine_pb2, engine_pb2_grpc
from omnibus.v1 import inference_pb2 as pb
from omnibus.v1 import inference_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file
from tokenizers import Tokenizer

from omnibus.engine.serving.async_engine import AdapterStateError, AsyncEngine
from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import Engine
from omnibus.engine.serving.loading import preload
from omnibus.engine.serving.server import RunningServer, ServerConfig, start
from omnibus.router.admission.auth import KeyStore
from omnibus.router.config import TenantLimits
from omnibus.router.service.errors import RequestError
from tests.checkpoints import hf_greedy, load_hf
from tests.grpc_helpers import (
    ROOT,
    ServerProcess,
    engine_process,
    engine_request,
    engine_stats,
    free_port,
    metric,
    router_process,
    scrape,
    tiny_checkpoint,
    wait_until,
)
from tests.oracle.test_lora import ADAPTERS, make_adapter

NAMES = ("a-r2", "b-r8", "c-r4")  # PEFT adapters of tests/test_lora.py, made here
ENGINE_FLAGS = (
    "--max-loras", "2", "--max-cpu-loras", "3", "--block-size", "8", "--num-kv-blocks", "128",
    "--max-num-seqs", "4",
)  # fmt: skip
TENANTS = {
    "acme": {"keys": ["key-acme"], "adapters": ["a-r2", "c-r4", "retired"]},
    "globex": {"keys": ["key-globex"], "adapters": []},  # the base model only
    "initech": {"keys": ["key-initech"]},  # no list: any adapter
    "ops": {"keys": ["key-ops"], "adapters": ["*"], "admin": True},
}
ADMIN_KEY = "admin-secret-1"
PROMPT = [5, 6, 7, 8, 9, 10]


def bearer(key: str, adapter: str | None = None) -> list[tuple[str, str]]:
    metadata = [("authorization", f"Bearer {key}")]
    return metadata + [("x-adapter-id", adapter)] if adapter is not None else metadata


def greedy_request(prompt: list[int] = PROMPT, max_tokens: int = 6) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)


def token_ids(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def write_broken_adapter(path: Path) -> None:
    """A PEFT directory whose config is fine but whose tensors fit another base model:
    refused only once its weights are read, in the background."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 2, "target_modules": ["q_proj"]}))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {f"{prefix}.lora_A.weight": torch.zeros(2, 32), f"{prefix}.lora_B.weight": torch.zeros(64, 2)},
        str(path / "adapter_model.safetensors"),
    )


def write_pickled_adapter(path: Path) -> None:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 2, "target_modules": ["q_proj"]}))
    (path / "adapter_model.bin").write_bytes(b"\x80\x04not really a pickle")


@dataclass
class Setup:
    model: Path
    adapters: Path
    oracles: dict[str | None, object]  # adapter (None: base) -> transformers / PEFT model
    logs: Path
    keys: Path
    admin_key: Path

    def expected(self, adapter: str | None, prompt: list[int] = PROMPT, n: int = 6) -> list[int]:
        return hf_greedy(self.oracles[adapter], prompt, n)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    model = tiny_checkpoint(tmp_path_factory)
    root = tmp_path_factory.mktemp("lora-grpc")
    adapters = root / "adapters"
    oracles: dict[str | None, object] = {None: load_hf(model)}
    for seed, name in enumerate(NAMES):
        oracles[name] = make_adapter(model, adapters / name, *ADAPTERS[name], seed=seed)
    write_broken_adapter(adapters / "broken")
    write_pickled_adapter(adapters / "pickled")
    keys = root / "keys.json"
    keys.write_text(json.dumps({"tenants": TENANTS}))
    admin_key = root / "admin.key"
    admin_key.write_text(ADMIN_KEY + "\n")
    return Setup(model, adapters, oracles, tmp_path_factory.mktemp("logs"), keys, admin_key)


# ---- a router in front of two engine processes -----------------------------------


@dataclass
class Cluster:
    setup: Setup
    engine_a: ServerProcess
    engine_b: ServerProcess
    engine_a_metrics: int
    router: ServerProcess
    router_metrics: int

    def inference(self) -> inference_pb2_grpc.InferenceStub:
        return inference_pb2_grpc.InferenceStub(grpc.insecure_channel(self.router.address))

    def admin(self) -> admin_pb2_grpc.AdminStub:
        return admin_pb2_grpc.AdminStub(grpc.insecure_channel(self.router.address))

    def generate(self, metadata, request: pb.GenerateRequest | None = None) -> list[int]:
        responses = self.inference().Generate(request or greedy_request(), metadata=metadata)
        return token_ids(list(responses))

    def list_models(self, key: str) -> list[str]:
        """The adapter ids ListModels gives the tenant of `key`."""
        reply = self.inference().ListModels(pb.ListModelsRequest(), metadata=bearer(key))
        assert {a.base_model_id for a in reply.adapters} <= {"tiny-llama"}
        return [a.id for a in reply.adapters]


def engine_stub(proc: ServerProcess) -> engine_pb2_grpc.EngineStub:
    return engine_pb2_grpc.EngineStub(grpc.insecure_channel(proc.address))


@pytest.fixture(scope="module")
def cluster(setup) -> Iterator[Cluster]:
    a_metrics, router_metrics = free_port(), free_port()
    flags = ("--adapter-dir", str(setup.adapters), *ENGINE_FLAGS)
    engine_a = engine_process(setup.model, setup.logs, "engine-a", *flags, f"--metrics-port={a_metrics}")
    engine_b = engine_process(setup.model, setup.logs, "engine-b", *flags)
    router = router_process(
        setup.model, [engine_a.address, engine_b.address], setup.logs, "router",
        f"--keys-file={setup.keys}", f"--admin-key-file={setup.admin_key}",
        f"--metrics-port={router_metrics}",
    )  # fmt: skip
    procs = [engine_a, engine_b, router]
    try:
        for proc in procs:
            proc.wait_serving()
        cluster = Cluster(setup, engine_a, engine_b, a_metrics, router, router_metrics)

        def both_engines_reporting() -> bool:
            text = scrape(router_metrics)
            return all(
                metric(text, "omnibus_router_engine_adapters_available", engine=e.address) == 5
                for e in (engine_a, engine_b)
            )

        # SERVING means one engine reports; the tests need both (and their adapter lists).
        wait_until(both_engines_reporting, 60, "the router to see both engines' adapters")
        yield cluster
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_the_header_selects_the_adapter_token_for_token_with_peft(cluster):
    """Base and three adapters at once through the router; each equals PEFT's output."""

    async def run_all() -> dict[str | None, list[int]]:
        async with grpc.aio.insecure_channel(cluster.router.address) as channel:
            client = inference_pb2_grpc.InferenceStub(channel)

            async def one(adapter: str | None) -> list[int]:
                call = client.Generate(greedy_request(), metadata=bearer("key-initech", adapter))
                return [t async for r in call for t in r.token_ids]

            outs = await asyncio.gather(*(one(a) for a in (None, *NAMES)))
        return dict(zip((None, *NAMES), outs))

    got = asyncio.run(run_all())
    for adapter, tokens in got.items():
        assert tokens == cluster.setup.expected(adapter), f"adapter {adapter} diverged"
    assert all(got[name] != got[None] for name in NAMES)  # the adapters change the output
    # An empty header is the base model.
    assert cluster.generate(bearer("key-initech", "")) == got[None]


def test_client_cli_adapter_flag(cluster):
    env = {"PATH": "/usr/bin:/bin"}
    text = "Once upon a time"
    args = ["--target", cluster.router.address, "--adapter", "c-r4", "--key", "key-acme",
            "--max-tokens", "6", "--temperature", "0"]  # fmt: skip
    out = subprocess.run(
        [str(Path(sys.executable).parent / "omnibus-client"), text, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    tokenizer = Tokenizer.from_file(str(cluster.setup.model / "tokenizer.json"))
    prompt = tokenizer.encode(text).ids
    expected = cluster.setup.expected("c-r4", prompt, 6)
    assert out.stdout == tokenizer.decode(expected) + "\n"


@pytest.mark.parametrize(
    "key, adapter, code, message",
    [
        ("key-initech", "../base", grpc.StatusCode.INVALID_ARGUMENT,
         "invalid adapter name '../base' in x-adapter-id: use 1-128 ASCII letters, digits, '.', "
         "'_' or '-', starting with a letter or digit"),
        ("key-initech", "a" * 200, grpc.StatusCode.INVALID_ARGUMENT,
         f"invalid adapter name '{'a' * 40}...' in x-adapter-id"),
        ("key-initech", "pirate", grpc.StatusCode.NOT_FOUND,
         "adapter 'pirate' not found on any engine; ListModels lists the adapters you may use"),
        ("key-acme", "b-r8", grpc.StatusCode.PERMISSION_DENIED,
         "tenant 'acme' may not use adapter 'b-r8'; ListModels lists the adapters it may use"),
        # Outside the list is PERMISSION_DENIED whether or not the adapter exists.
        ("key-acme", "pirate", grpc.StatusCode.PERMISSION_DENIED,
         "tenant 'acme' may not use adapter 'pirate'"),
        ("key-globex", "a-r2", grpc.StatusCode.PERMISSION_DENIED,
         "tenant 'globex' may not use adapter 'a-r2'"),
        # In the tenant's list but on no engine.
        ("key-acme", "retired", grpc.StatusCode.NOT_FOUND, "adapter 'retired' not found"),
        ("key-initech", "pickled", grpc.StatusCode.INVALID_ARGUMENT,
         "adapter 'pickled' is a pickle file (adapter_model.bin), which is refused"),
        ("key-initech", "broken", grpc.StatusCode.FAILED_PRECONDITION,
         "adapter 'broken' failed to load: adapter 'broken' does not fit this base model: "
         "layer 0 q_proj has A(2, 32) B(64, 2), expected A(2, 64) B(64, 2)"),
    ],
    ids=["traversal", "long-name", "unknown", "outside-list", "outside-list-unknown",
         "base-only-tenant", "listed-but-missing", "pickle", "weights-do-not-fit"],
)  # fmt: skip
def test_adapter_errors_have_precise_statuses(cluster, key, adapter, code, message):
    err = rpc_error(lambda: cluster.generate(bearer(key, adapter)))
    assert err.code() == code
    assert err.details().startswith(message), err.details()


def test_list_models_shows_exactly_the_adapters_each_tenant_may_use(cluster):
    everything = ["a-r2", "b-r8", "broken", "c-r4", "pickled"]
    assert cluster.list_models("key-initech") == everything
    assert cluster.list_models("key-ops") == everything
    assert cluster.list_models("key-acme") == ["a-r2", "c-r4"]  # "retired": no engine has it
    assert cluster.list_models("key-globex") == []


# ---- the engines' own adapter API -------------------------------------------------


def test_load_reports_carry_the_adapters_on_disk(cluster):
    call = engine_stub(cluster.engine_b).WatchLoad(engine_pb2.WatchLoadRequest())
    report = next(call)
    call.cancel()
    assert list(report.available_adapters) == ["a-r2", "b-r8", "broken", "c-r4", "pickled"]
    assert set(report.resident_adapters) <= set(report.cached_adapters) <= set(NAMES)


@pytest.mark.parametrize(
    "rpc, adapter, code, message",
    [
        ("LoadAdapter", "../x", grpc.StatusCode.INVALID_ARGUMENT, "invalid adapter name '../x'"),
        ("LoadAdapter", "pirate", grpc.StatusCode.NOT_FOUND,
         "adapter 'pirate' not found under the adapter root"),
        ("LoadAdapter", "pickled", grpc.StatusCode.INVALID_ARGUMENT, "adapter 'pickled' is a pickle"),
        ("LoadAdapter", "broken", grpc.StatusCode.FAILED_PRECONDITION,
         "adapter 'broken' failed to load: adapter 'broken' does not fit this base model"),
        ("UnloadAdapter", "../x", grpc.StatusCode.INVALID_ARGUMENT, "invalid adapter name '../x'"),
        ("UnloadAdapter", "pirate", grpc.StatusCode.NOT_FOUND,
         "adapter 'pirate' not found: it is neither loaded nor under the adapter root"),
    ],
)  # fmt: skip
def test_engine_adapter_rpcs_refuse_with_precise_statuses(cluster, rpc, adapter, code, message):
    stub = engine_stub(cluster.engine_b)
    request = {
        "LoadAdapter": engine_pb2.LoadAdapterRequest,
        "UnloadAdapter": engine_pb2.UnloadAdapterRequest,
    }[rpc]
    err = rpc_error(lambda: getattr(stub, rpc)(request(adapter=adapter), timeout=30))
    assert err.code() == code
    assert err.details().startswith(message), err.details()


def test_engine_generate_with_an_adapter_that_fails_to_load(cluster):
    request = engine_request("broken-direct", prompt=PROMPT, adapter="broken")
    err = rpc_error(lambda: list(engine_stub(cluster.engine_a).Generate(request, timeout=30)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details().startswith("adapter 'broken' failed to load: ")


def test_engine_metrics_count_loads_evictions_and_requests(cluster):
    """Engine A, direct: after unloading everything, three adapters through its two slots."""
    stub, metrics = engine_stub(cluster.engine_a), cluster.engine_a_metrics
    for name in NAMES:
        stub.UnloadAdapter(engine_pb2.UnloadAdapterRequest(adapter=name), timeout=30)
    assert list(stub.ListAdapters(engine_pb2.ListAdaptersRequest()).cached) == []
    def counters(text: str) -> dict[str, float]:
        return {
            "loads": total(text, "omnibus_engine_adapter_loads_total"),
            "device_evictions": total(text, "omnibus_engine_adapter_evictions_total", tier="device"),
            "load_seconds_count": metric(text, "omnibus_engine_adapter_load_seconds_count"),
            **{f"{a} loads": metric(text, "omnibus_engine_adapter_loads_total", adapter=a) for a in NAMES},
            **{f"{a} evictions": metric(text, "omnibus_engine_adapter_evictions_total", adapter=a,
                                        tier="device") for a in NAMES},
        }

    text = scrape(metrics)
    before = counters(text)
    requests = {a: metric(text, "omnibus_engine_adapter_requests_total", adapter=a) for a in NAMES}
    for i, name in enumerate(NAMES):
        request = engine_request(f"metrics-{i}", prompt=PROMPT, adapter=name, max_tokens=6)
        responses = list(stub.Generate(request, timeout=60))
        assert token_ids(responses) == cluster.setup.expected(name)
    text = scrape(metrics)
    # Two empty slots take a-r2 and b-r8; c-r4 evicts a-r2, the least recently used.
    after = counters(text)
    assert {k: after[k] - before[k] for k in after} == {
        "loads": 3, "device_evictions": 1, "load_seconds_count": 3,
        "a-r2 loads": 1, "b-r8 loads": 1, "c-r4 loads": 1,
        "a-r2 evictions": 1, "b-r8 evictions": 0, "c-r4 evictions": 0,
    }
    for name in NAMES:
        assert metric(text, "omnibus_engine_adapter_requests_total", adapter=name) == requests[name] + 1
    listing = stub.ListAdapters(engine_pb2.ListAdaptersRequest())
    assert (list(listing.resident), list(listing.cached)) == (["b-r8", "c-r4"], list(NAMES))
    limits = (listing.max_loras, listing.max_cpu_loras, listing.max_lora_rank, listing.enabled)
    assert limits == (2, 3, 16, True)
    assert metric(text, "omnibus_engine_adapters_resident") == 2
    assert metric(text, "omnibus_engine_adapters_cached") == 3
    assert metric(text, "omnibus_engine_adapter_slots") == 2
    assert residency(text) == {"a-r2": "host", "b-r8": "device", "c-r4": "device"}
    # ListAdapters says the same per adapter as the metrics (tier, loads, evictions by tier)
    rows = {r.adapter: (r.tier, r.loads, r.device_evictions, r.host_evictions) for r in listing.residency}
    assert rows == {name: (residency(text)[name],
                           total(text, "omnibus_engine_adapter_loads_total", adapter=name),
                           total(text, "omnibus_engine_adapter_evictions_total", adapter=name, tier="device"),
                           total(text, "omnibus_engine_adapter_evictions_total", adapter=name, tier="host"))
                    for name in NAMES}
    assert all(r.pins == 0 for r in listing.residency)  # nothing runs now


def total(text: str, name: str, **labels: str) -> float:
    """The sum of every sample of `name` whose labels include `labels`."""
    found = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{(?P<labels>[^}}]*)\}})? (?P<value>\S+)$", text, re.M):
        pairs = set((m.group("labels") or "").split(","))
        if {f'{k}="{v}"' for k, v in labels.items()} <= pairs:
            found += float(m.group("value"))
    return found


def samples(text: str, name: str) -> list[dict[str, str]]:
    """The labels (model_name dropped) and "value" of every sample of `name`."""
    out = []
    for family in text_string_to_metric_families(text):
        out += [{**{k: v for k, v in s.labels.items() if k != "model_name"}, "value": s.value}
                for s in family.samples if s.name == name]
    return out


def residency(text: str) -> dict[str, str]:
    """Adapter -> the tier the engine reports it in."""
    return {s["adapter"]: s["tier"] for s in samples(text, "omnibus_engine_adapter_loaded")}


def lora_info(text: str) -> dict[str, str]:
    """The labels of the endpoint picker's LoRA gauge (its newest series)."""
    (info,) = samples(text, "omnibus_engine_lora_requests_info")
    return {k: v for k, v in info.items() if k != "value"}


def test_engine_metrics_speak_the_gateway_protocol_while_requests_run(cluster):
    """Engine A, direct, as the Gateway API Inference Extension's endpoint picker scrapes
    it (docs/deployment.md): a-r2 and b-r8 run and pin both device slots, so a request for
    c-r4 waits (its weights read into host memory). Cancelling a-r2 frees a slot: c-r4
    takes it, evicting a-r2 to the host tier."""
    stub, port = engine_stub(cluster.engine_a), cluster.engine_a_metrics
    calls = []
    try:
        for name in ("a-r2", "b-r8"):  # 486 tokens each: 61 of the 128 blocks, no preemption
            calls.append(stub.Generate(engine_request(f"gw-{name}", prompt=PROMPT, adapter=name,
                                                      max_tokens=480), timeout=120))
            next(calls[-1])  # its first token: running, its slot pinned
        waiting = stub.Generate(engine_request("gw-c-r4", prompt=PROMPT, adapter="c-r4", max_tokens=6),
                                timeout=120)
        state: dict[str, str] = {}

        def c_r4_waits_in_host_memory() -> bool:
            state["text"] = text = scrape(port)
            return (lora_info(text)["waiting_lora_adapters"] == "c-r4"
                    and residency(text).get("c-r4") == "host")

        wait_until(c_r4_waits_in_host_memory, 30, "c-r4 to wait for a slot, read into host memory")
        text = state["text"]
        assert lora_info(text) == {"max_lora": "2", "running_lora_adapters": "a-r2,b-r8",
                                   "waiting_lora_adapters": "c-r4"}
        assert (metric(text, "omnibus_engine_running_sequences"),
                metric(text, "omnibus_engine_waiting_sequences")) == (2, 1)
        assert 0 < metric(text, "omnibus_engine_kv_cache_usage_ratio") <= 1
        assert {s["adapter"]: s["value"] for s in samples(text, "omnibus_engine_adapter_pins")} == {
            "a-r2": 1, "b-r8": 1}
        assert residency(text) == {"a-r2": "device", "b-r8": "device", "c-r4": "host"}
        before = metric(text, "omnibus_engine_adapter_evictions_total", adapter="a-r2", tier="device")

        calls[0].cancel()  # a-r2 ends: its slot is unpinned, c-r4 is filled into it
        assert token_ids(list(waiting)) == cluster.setup.expected("c-r4")
        text = scrape(port)
        assert lora_info(text) == {"max_lora": "2", "running_lora_adapters": "b-r8,c-r4",
                                   "waiting_lora_adapters": ""}
        assert residency(text) == {"a-r2": "host", "b-r8": "device", "c-r4": "device"}
        assert metric(text, "omnibus_engine_adapter_evictions_total", adapter="a-r2",
                      tier="device") == before + 1
        pins = {s["adapter"]: s["value"] for s in samples(text, "omnibus_engine_adapter_pins")}
        assert pins["c-r4"] == 0  # its request has ended: resident, evictable
    finally:
        for call in calls:
            call.cancel()
        # The next tests unload these adapters: their slots must be unpinned by then.
        wait_until(lambda: metric(scrape(port), "omnibus_engine_running_sequences") == 0, 30,
                   "the cancelled sequences to end")


# ---- the admin API ----------------------------------------------------------------


@pytest.mark.parametrize(
    "metadata, code, message",
    [
        ([], grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <key>' header"),
        (bearer("wrong-key"), grpc.StatusCode.UNAUTHENTICATED, "invalid API key"),
        (bearer("key-initech"), grpc.StatusCode.PERMISSION_DENIED,
         "tenant 'initech' may not use the admin API; call it with an admin key"),
    ],
)  # fmt: skip
def test_admin_api_needs_an_admin_key(cluster, metadata, code, message):
    admin = cluster.admin()
    calls = [
        lambda: admin.LoadAdapter(admin_pb2.AdminAdapterRequest(adapter="a-r2"), metadata=metadata),
        lambda: admin.UnloadAdapter(admin_pb2.AdminAdapterRequest(adapter="a-r2"), metadata=metadata),
        lambda: admin.ListAdapters(admin_pb2.AdminListAdaptersRequest(), metadata=metadata),
    ]
    for call in calls:
        err = rpc_error(call)
        assert (err.code(), err.details()) == (code, message)


def listing(cluster: Cluster, key: str = ADMIN_KEY) -> dict[str, admin_pb2.AdminEngineAdapters]:
    reply = cluster.admin().ListAdapters(admin_pb2.AdminListAdaptersRequest(), metadata=bearer(key))
    return {e.engine: e for e in reply.engines}


def test_admin_load_and_unload_fan_out_to_the_engines(cluster):
    admin, a, b = cluster.admin(), cluster.engine_a.address, cluster.engine_b.address
    key = bearer(ADMIN_KEY)
    admin.UnloadAdapter(admin_pb2.AdminAdapterRequest(adapter="c-r4"), metadata=key)
    loaded = admin.LoadAdapter(admin_pb2.AdminAdapterRequest(adapter="c-r4", engines=[b]), metadata=key)
    assert loaded == admin_pb2.AdminAdapterResponse(
        adapter="c-r4", engines=[admin_pb2.AdminEngineResult(engine=b, resident=True, was_loaded=False)]
    )
    engines = listing(cluster, "key-ops")  # an admin tenant's key works too
    assert "c-r4" in engines[b].resident and "c-r4" not in engines[a].cached
    assert {r.adapter: r.tier for r in engines[b].residency}["c-r4"] == "device"
    assert list(engines[a].available) == ["a-r2", "b-r8", "broken", "c-r4", "pickled"]
    assert (engines[a].reachable, engines[a].max_loras) == (True, 2)
    # Without engines: every healthy engine that has it (both have it on disk).
    unloaded = admin.UnloadAdapter(admin_pb2.AdminAdapterRequest(adapter="c-r4"), metadata=key)
    assert list(unloaded.engines) == [
        admin_pb2.AdminEngineResult(engine=a, was_loaded=False),
        admin_pb2.AdminEngineResult(engine=b, was_loaded=True),
    ]
    assert all("c-r4" not in e.cached for e in listing(cluster).values())
    loaded = admin.LoadAdapter(admin_pb2.AdminAdapterRequest(adapter="c-r4"), metadata=key)
    assert [(r.engine, r.resident) for r in loaded.engines] == [(a, True), (b, True)]


@pytest.mark.parametrize(
    "rpc, request_, code, message",
    [
        ("LoadAdapter", admin_pb2.AdminAdapterRequest(adapter="pirate"), grpc.StatusCode.NOT_FOUND,
         "adapter 'pirate' not found: no engine has it under its adapter root (--adapter-dir)"),
        ("LoadAdapter", admin_pb2.AdminAdapterRequest(adapter="../x"),
         grpc.StatusCode.INVALID_ARGUMENT, "invalid adapter name '../x' in the request's adapter field"),
        ("LoadAdapter", admin_pb2.AdminAdapterRequest(adapter="a-r2", engines=["10.0.0.1:1"]),
         grpc.StatusCode.INVALID_ARGUMENT, "engines ['10.0.0.1:1'] are not behind this router"),
        ("UnloadAdapter", admin_pb2.AdminAdapterRequest(adapter="pirate"), grpc.StatusCode.NOT_FOUND,
         "adapter 'pirate' not found: no engine has it loaded or under its adapter root (--adapter-dir)"),
        ("LoadAdapter", admin_pb2.AdminAdapterRequest(adapter="broken"),
         grpc.StatusCode.FAILED_PRECONDITION, "load of adapter 'broken' failed on 2 of 2 engines ("),
    ],
)  # fmt: skip
def test_admin_refusals(cluster, rpc, request_, code, message):
    err = rpc_error(lambda: getattr(cluster.admin(), rpc)(request_, metadata=bearer(ADMIN_KEY)))
    assert err.code() == code
    assert err.details().startswith(message), err.details()


def test_unloading_an_adapter_in_use_is_refused_until_its_sequences_end(cluster):
    admin, key = cluster.admin(), bearer(ADMIN_KEY)
    long = greedy_request(max_tokens=900)
    call = cluster.inference().Generate(long, metadata=bearer("key-acme", "a-r2"))
    next(call)  # running now, on one of the engines
    unload = admin_pb2.AdminAdapterRequest(adapter="a-r2")
    err = rpc_error(lambda: admin.UnloadAdapter(unload, metadata=key))
    call.cancel()
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "FAILED_PRECONDITION: adapter 'a-r2' is in use by 1 running sequence; unload it when they " \
           "have finished" in err.details()

    def unloaded() -> bool:
        try:
            admin.UnloadAdapter(admin_pb2.AdminAdapterRequest(adapter="a-r2"), metadata=key)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
            return False
        return True

    wait_until(unloaded, 30, "the cancelled sequence to release a-r2")
    assert all("a-r2" not in e.cached for e in listing(cluster).values())


def test_adapter_affinity_sends_requests_to_the_engine_that_has_it_resident(cluster):
    """Both engines idle and equal: without affinity the first (A) would win every tie."""
    admin, key = cluster.admin(), bearer(ADMIN_KEY)
    a, b = cluster.engine_a, cluster.engine_b
    admin.UnloadAdapter(admin_pb2.AdminAdapterRequest(adapter="b-r8"), metadata=key)
    admin.LoadAdapter(admin_pb2.AdminAdapterRequest(adapter="b-r8", engines=[b.address]), metadata=key)
    # ... and no longer on A: a report of A from before the unload would tie the two
    # (seen once under make test's load: 2 of 3 requests went to A)
    wait_until(
        lambda: [metric(scrape(cluster.router_metrics), "omnibus_router_engine_adapter_resident",
                        engine=e.address, adapter="b-r8") for e in (a, b)] == [0, 1],
        30, "the router to see b-r8 resident on engine B only",
    )  # fmt: skip
    resident_before = metric(scrape(cluster.router_metrics), "omnibus_router_adapter_dispatches_total",
                             affinity="resident")  # fmt: skip
    before = [engine_stats(e.address).num_requests for e in (a, b)]
    for i in range(3):
        out = cluster.generate(bearer("key-initech", "b-r8"), greedy_request([11 + i, 12, 13]))
        assert out == cluster.setup.expected("b-r8", [11 + i, 12, 13])
    after = [engine_stats(e.address).num_requests for e in (a, b)]
    assert [y - x for x, y in zip(before, after)] == [0, 3]
    text = scrape(cluster.router_metrics)
    resident_after = metric(text, "omnibus_router_adapter_dispatches_total", affinity="resident")
    assert resident_after == resident_before + 3
    assert metric(text, "omnibus_router_adapter_requests_total", adapter="b-r8") >= 3
    assert metric(text, "omnibus_router_engine_adapters_available", engine=a.address) == 5


# ---- a slow adapter load, with the engine in this process -------------------------


class LoadGate:
    """Holds disk loads of the adapters in `names` until `release()`."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.entered = threading.Event()  # a held load has started
        self._open = threading.Event()

    def release(self) -> None:
        self._open.set()

    def wrap(self, real):
        def load(spec, *args, **kwargs):
            if spec.name in self.names:
                self.entered.set()
                self._open.wait(120)
            return real(spec, *args, **kwargs)

        return load


@dataclass
class SlowCluster:
    aengine: AsyncEngine  # the engine, with its step thread
    gate: LoadGate
    router: ServerProcess


@pytest.fixture(scope="module")
def slow(setup) -> Iterator[SlowCluster]:
    import omnibus.engine.lora.manager as lora_manager

    gate = LoadGate({"b-r8"})
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="in-process-engine", daemon=True)
    config = EngineConfig(
        model=str(setup.model), dtype="float32", adapter_dir=str(setup.adapters), max_loras=2,
        max_cpu_loras=3, block_size=8, num_kv_blocks=128, max_num_seqs=4, preload_adapters=("a-r2",),
    )  # fmt: skip
    engine_ = Engine(config)
    preload(engine_)
    running: RunningServer | None = None
    router = None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lora_manager, "load_adapter_weights", gate.wrap(lora_manager.load_adapter_weights))
        thread.start()
        try:
            port = free_port()
            running = asyncio.run_coroutine_threadsafe(
                start(engine_, ServerConfig(port=port)), loop
            ).result(60)
            router = router_process(
                setup.model, [f"127.0.0.1:{port}"], setup.logs, "router-slow",
                f"--keys-file={setup.keys}",
            )  # fmt: skip
            router.wait_serving()
            yield SlowCluster(running.aengine, gate, router)
        finally:
            gate.release()
            if router is not None:
                router.stop()
            if running is not None:
                asyncio.run_coroutine_threadsafe(running.stop(0.0), loop).result(60)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(30)


async def test_a_slow_adapter_load_does_not_block_other_tenants_streams(slow, setup):
    """While b-r8's weights are held on the loader thread, the base model (tenant globex)
    and an adapter already in memory (tenant acme, a-r2) stream to the end."""
    async with grpc.aio.insecure_channel(slow.router.address) as channel:
        client = inference_pb2_grpc.InferenceStub(channel)
        waiting: list[pb.GenerateResponse] = []

        async def collect(call) -> None:
            async for response in call:
                waiting.append(response)

        held = asyncio.create_task(
            collect(client.Generate(greedy_request(), metadata=bearer("key-initech", "b-r8")))
        )
        await asyncio.to_thread(slow.gate.entered.wait, 60)  # the engine is reading b-r8
        request = greedy_request(max_tokens=12)
        base = [r async for r in client.Generate(request, metadata=bearer("key-globex"))]
        other = [r async for r in client.Generate(request, metadata=bearer("key-acme", "a-r2"))]
        assert token_ids(base) == setup.expected(None, n=12)
        assert token_ids(other) == setup.expected("a-r2", n=12)
        assert base[-1].finish_reason == other[-1].finish_reason == pb.LENGTH
        # Meanwhile the b-r8 request has had no token: it waits for its adapter.
        assert (waiting, held.done(), slow.aengine.stats().num_waiting) == ([], False, 1)
        slow.gate.release()
        await held
    assert token_ids(waiting) == setup.expected("b-r8")
    assert waiting[-1].finish_reason == pb.LENGTH


# ---- no processes --------------------------------------------------------------------


async def test_async_engine_without_adapters_refuses_adapter_commands(setup):
    config = EngineConfig(model=str(setup.model), dtype="float32", num_kv_blocks=16)
    aengine = AsyncEngine(Engine(config))
    aengine.start()
    try:
        with pytest.raises(AdapterStateError, match="this engine serves no adapters"):
            await aengine.load_adapter("a-r2")
        inventory = await aengine.list_adapters()
        assert (inventory.resident, inventory.cached) == ((), ())
    finally:
        aengine.shutdown()


def test_admin_keys_from_the_keys_file_and_the_admin_key_file(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": TENANTS}))
    admin_key = tmp_path / "admin.key"
    admin_key.write_text(" k-admin \n")
    store = KeyStore.open(str(keys), TenantLimits(), str(admin_key))
    assert store.authenticate_admin(bearer("k-admin")) == "admin-key"
    assert store.authenticate_admin(bearer("key-ops")) == "ops"
    with pytest.raises(RequestError, match="invalid API key"):  # an admin key is no tenant key
        store.authenticate(bearer("k-admin"))
    off = KeyStore.open(None, TenantLimits())
    with pytest.raises(RequestError) as err:
        off.authenticate_admin(bearer("anything"))
    assert (err.value.code, err.value.message) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "the admin API is disabled on this router: start it with --admin-key-file FILE, or mark a "
        'tenant "admin": true in its keys file',
    )


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"keys": ["k"], "adapters": ["../x"]}, "invalid adapter names \\['../x'\\]"),
        ({"keys": ["k"], "adapters": "a-r2"}, "'adapters' must be a list of adapter names"),
        ({"keys": ["k"], "admin": "yes"}, "'admin' must be true or false, got 'yes'"),
    ],
)
def test_bad_adapter_lists_and_admin_flags_are_refused_at_startup(tmp_path, entry, message):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": {"t": entry}}))
    with pytest.raises(ValueError, match=message):
        KeyStore.open(str(keys), TenantLimits())


def test_tenant_adapter_lists(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": TENANTS}))
    store = KeyStore.open(str(keys), TenantLimits())
    tenants = {t.name: t for t in store.tenants}
    assert [tenants["acme"].may_use(a) for a in ("a-r2", "b-r8")] == [True, False]
    assert tenants["globex"].may_use("a-r2") is False
    assert tenants["initech"].may_use("anything") and tenants["ops"].may_use("anything")
    assert tenants["initech"].adapters is None and tenants["ops"].adapters is None


def test_engine_cli_adapter_flags():
    from omnibus.engine.serving.cli import build_parser, configs_from_args

    args = build_parser().parse_args(
        "serve --model m --adapter-dir /ad --max-loras 3 --max-cpu-loras 9 --max-lora-rank 32 "
        "--preload-adapters a-r2,,b-r8 ".split()
    )
    config, _ = configs_from_args(args)
    assert (config.adapter_dir, config.max_loras, config.max_cpu_loras, config.max_lora_rank) == (
        "/ad", 3, 9, 32,
    )
    assert config.preload_adapters == ("a-r2", "b-r8")
    for flags, message in [
        ("--preload-adapters a", "--preload-adapters needs --adapter-dir"),
        ("--adapter-dir /ad --max-loras 4 --max-cpu-loras 3", "max_cpu_loras must be >= max_loras"),
        ("--adapter-dir /ad --max-cpu-loras 2 --max-loras 1 --preload-adapters a,b,c",
         "lists 3 adapters but host memory holds 2"),
        ("--adapter-dir /ad --preload-adapters a,../x", "invalid adapter name '../x' in --preload-adapters"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            configs_from_args(build_parser().parse_args(["serve", "--model", "m", *flags.split()]))


def test_copying_an_adapter_dir_is_picked_up_by_the_catalog(setup, tmp_path):
    """New adapter directories appear in load reports without a restart."""
    from omnibus.engine.serving.catalog import AdapterCatalog

    root = tmp_path / "adapters"
    shutil.copytree(setup.adapters / "a-r2", root / "a-r2")
    catalog = AdapterCatalog(root)
    assert catalog.names == ("a-r2",)
    shutil.copytree(setup.adapters / "c-r4", root / "c-r4")
    asyncio.run(catalog.refresh())
    assert catalog.names == ("a-r2", "c-r4")


async def test_dispatcher_prefers_adapter_affinity_and_lets_others_pass_a_blocked_adapter():
    from omnibus.router.config import RouterConfig
    from omnibus.router.dispatch.dispatcher import Dispatcher, Ticket
    from omnibus.router.dispatch.engines import EngineClient
    from omnibus.router.dispatch.fleet import Fleet
    from omnibus.router.dispatch.queue import RequestQueue

    config = RouterConfig(model="m", engines=("127.0.0.1:1", "127.0.0.1:2"))
    a, b = (EngineClient(address, config, lambda: None) for address in config.engines)

    def report(engine: EngineClient, running: int, resident=(), available=()) -> None:
        engine.take_report(engine_pb2.LoadReport(
            num_running=running, max_num_seqs=2, num_free_blocks=10, num_total_blocks=10,
            resident_adapters=resident, available_adapters=available,
        ))  # fmt: skip

    queue: RequestQueue[Ticket] = RequestQueue(aging_seconds=0)
    dispatcher = Dispatcher(Fleet([a, b]), queue)

    def dispatch(*tickets: Ticket) -> list[str | None]:
        for ticket in tickets:
            queue.push(ticket, ticket.priority, ticket.cost, ticket.arrival)
        dispatcher._match()
        return [t.future.result().address if t.future.done() else None for t in tickets]

    try:
        # y is resident on A, which has less room than B: affinity wins.
        report(a, 1, resident=["y"], available=["x", "y"])
        report(b, 0, available=["y"])
        first = Ticket(0, 1, 0.0, "y")
        assert dispatch(first) == [a.address] and first.affinity.label == "resident"
        a.seats.release("y")
        # A is full; x is only on A: the base request behind it passes it, and so does a
        # request for y (on B's disk too); x waits in the queue.
        report(a, 2, resident=["y"], available=["x", "y"])
        x, base, y = Ticket(5, 1, 1.0, "x"), Ticket(0, 1, 2.0), Ticket(0, 1, 3.0, "y")
        assert dispatch(x, base, y) == [None, b.address, b.address]
        assert len(queue) == 1 and y.affinity.label == "cold"
        dispatcher.withdraw(x)
        b.seats.release("")
        b.seats.release("y")
        # A burst for an adapter resident nowhere sticks to the engine its first request
        # went to (A wins the tie), although B has more room for the second.
        report(a, 0, available=["z"])
        report(b, 0, available=["z"])
        z1, z2 = Ticket(0, 1, 4.0, "z"), Ticket(0, 1, 5.0, "z")
        assert dispatch(z1, z2) == [a.address, a.address]
        assert (z1.affinity.label, z2.affinity.label) == ("cold", "resident")
    finally:
        await asyncio.gather(a.close(), b.close())
