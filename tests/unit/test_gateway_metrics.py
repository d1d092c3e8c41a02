"""The engine's /metrics in the shape the Gateway API Inference Extension's endpoint
picker reads (its model-server protocol, proposal 003): queue and running gauges, KV
use from 0 to 1, the LoRA info gauge (labels max_lora, running_lora_adapters,
waiting_lora_adapters; value a timestamp) and the cache config info; plus where each
adapter is (tier, pins) and its loads and evictions. From one stats snapshot, as the
collector reads it at scrape time; tests/e2e/test_lora_grpc.py scrapes a real engine."""

from __future__ import annotations

import time
from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from omnibus.common.metrics import exposition
from omnibus.engine.engine import EngineStats
from omnibus.engine.serving.metrics import EngineMetrics

STATS = EngineStats(
    num_waiting=3, num_running=2, num_free_blocks=40, num_total_blocks=64, num_cached_blocks=5,
    num_steps=10, num_preemptions=0, num_prefix_cache_hit_blocks=0, num_running_adapters=1,
    resident_adapters=("b", "a"), cached_adapters=("a", "b", "c"), adapter_pins=(("a", 2),),
    waiting_adapters=("d", "e"), adapter_loads=(("a", 1), ("b", 2)),
    adapter_evictions=(("a", "device", 1), ("c", "host", 3)),
)  # fmt: skip


def scrape(stats: EngineStats, adapter_dir: str | None = "/adapters") -> dict[str, list]:
    """Family name -> its samples as (name, labels without model_name, value)."""
    config = SimpleNamespace(adapter_dir=adapter_dir, max_loras=2, block_size=16)
    aengine = SimpleNamespace(stats=lambda: stats, config=config)
    text = generate_latest(exposition(EngineMetrics(aengine).registry, "demo")).decode()
    families = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("omnibus_"):
            continue  # process_*
        assert all(s.labels.get("model_name") == "demo" for s in family.samples), family.name
        families[family.name] = [(s.name, {k: v for k, v in s.labels.items() if k != "model_name"},
                                  s.value) for s in family.samples]
    return families


def test_the_protocol_gauges_carry_the_snapshot():
    before = time.time()
    got = scrape(STATS)
    assert got["omnibus_engine_waiting_sequences"] == [("omnibus_engine_waiting_sequences", {}, 3)]
    assert got["omnibus_engine_running_sequences"] == [("omnibus_engine_running_sequences", {}, 2)]
    assert got["omnibus_engine_kv_cache_usage_ratio"] == [
        ("omnibus_engine_kv_cache_usage_ratio", {}, 24 / 64)]
    assert got["omnibus_engine_cache_config_info"] == [
        ("omnibus_engine_cache_config_info", {"block_size": "16", "num_gpu_blocks": "64"}, 1)]
    ((name, labels, value),) = got["omnibus_engine_lora_requests_info"]
    # Running: in device slots (sorted); waiting: needed by waiting requests, in no slot.
    assert labels == {"max_lora": "2", "running_lora_adapters": "a,b", "waiting_lora_adapters": "d,e"}
    assert before <= value <= time.time()  # a timestamp, as vLLM's: the picker takes the newest


def test_residency_and_per_adapter_counters():
    got = scrape(STATS)
    assert got["omnibus_engine_adapter_loaded"] == [
        ("omnibus_engine_adapter_loaded", {"adapter": "a", "tier": "device"}, 1),
        ("omnibus_engine_adapter_loaded", {"adapter": "b", "tier": "device"}, 1),
        ("omnibus_engine_adapter_loaded", {"adapter": "c", "tier": "host"}, 1),
    ]
    assert got["omnibus_engine_adapter_pins"] == [
        ("omnibus_engine_adapter_pins", {"adapter": "a"}, 2),
        ("omnibus_engine_adapter_pins", {"adapter": "b"}, 0),  # resident, evictable
    ]
    assert got["omnibus_engine_adapter_loads"] == [
        ("omnibus_engine_adapter_loads_total", {"adapter": "a"}, 1),
        ("omnibus_engine_adapter_loads_total", {"adapter": "b"}, 2),
    ]
    assert got["omnibus_engine_adapter_evictions"] == [
        ("omnibus_engine_adapter_evictions_total", {"adapter": "a", "tier": "device"}, 1),
        ("omnibus_engine_adapter_evictions_total", {"adapter": "c", "tier": "host"}, 3),
    ]


def test_an_idle_engine_reports_empty_adapter_lists_and_one_without_adapters_no_lora_info():
    idle = EngineStats(0, 0, 64, 64, 0, 0, 0, 0)
    ((_, labels, _),) = scrape(idle)["omnibus_engine_lora_requests_info"]
    assert labels == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert scrape(idle)["omnibus_engine_kv_cache_usage_ratio"][0][2] == 0
    plain = scrape(idle, adapter_dir=None)  # as vLLM without --enable-lora
    assert "omnibus_engine_lora_requests_info" not in plain
    assert "omnibus_engine_adapter_loaded" not in plain
    assert "omnibus_engine_cache_config_info" in plain
