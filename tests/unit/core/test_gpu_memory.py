"""GPU-path bookkeeping checked on the CPU (issue #17): KV-cache sizing counts each byte once
(defect 2), and the runner and the step thread make the engine's CUDA device current
(defect 4)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from omnibus.bench.shapes import LLAMA3_8B, write_config
from omnibus.engine.config import EngineConfig, ModelConfig
from omnibus.engine.lora.slots import DeviceSlots
from omnibus.engine.model.loader import empty_model
from omnibus.engine.worker import model_runner
from omnibus.engine.worker.memory import MemoryUse, kv_cache_budget, lora_stack_bytes
from omnibus.engine.worker.model_runner import ModelRunner, bind_device
from tests.checkpoints import make_checkpoint

GB = 1 << 30


def test_lora_stack_bytes_match_the_slots_and_8b() -> None:
    cfg = ModelConfig.from_dir(make_checkpoint(Path("/tmp") / "omnibus-test-mem-tiny"))
    slots = DeviceSlots(3, 8, cfg, torch.bfloat16, torch.device("cpu"))
    allocated = sum(t.numel() * t.element_size() for layer in slots.stacked for pair in layer.values()
                    for t in pair) + slots.scales.numel() * 4
    assert lora_stack_bytes(cfg, 3, 8, torch.bfloat16) == allocated
    big = ModelConfig.from_dir(write_config(Path("/tmp") / "omnibus-test-mem-8b", LLAMA3_8B))
    # 32 slots of rank 16 on every projection of 32 layers: the ~2.7 GB of the issue
    assert lora_stack_bytes(big, 32, 16, torch.bfloat16) == 32 * 81920 * 16 * 32 * 2 + 32 * 7 * 32 * 4


def test_budget_arithmetic() -> None:
    use = MemoryUse(total=140 * GB, used=20 * GB, step_peak=3 * GB, graph_pool=GB, lora_stacks=2 * GB)
    assert kv_cache_budget(use, 0.9) == int(140 * GB * 0.9) - 26 * GB
    assert kv_cache_budget(use, 0.1) == 0


class _FakeCuda:
    """torch.cuda's memory calls as seen by the runner: 20 GB allocated (weights), 10 GB
    more cached by PyTorch until empty_cache(), 5 GB used outside PyTorch."""

    total, allocated, cached, outside = 141 * GB, 20 * GB, 10 * GB, 5 * GB

    def __init__(self, peaks: list[int]) -> None:
        self.calls: list[str] = []
        self.peaks = peaks  # extra bytes at the peak of each warm-up, in order

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("synchronize", "reset_peak_memory_stats", "max_memory_allocated",
                     "memory_allocated", "empty_cache", "mem_get_info"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def synchronize(self, device=None) -> None:
        pass

    def reset_peak_memory_stats(self, device=None) -> None:
        self.calls.append("reset")

    def max_memory_allocated(self, device=None) -> int:
        return self.allocated + self.peaks.pop(0)

    def memory_allocated(self, device=None) -> int:
        return self.allocated

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.cached = 0

    def mem_get_info(self, device=None) -> tuple[int, int]:
        self.calls.append("mem_get_info")
        return self.total - self.allocated - self.cached - self.outside, self.total


def test_cuda_budget_counts_each_thing_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cache emptied before measuring; the warm-up peak, the decode-graph pool and the adapter
    stacks still to come are each subtracted once."""
    path = make_checkpoint(tmp_path / "m")
    config = EngineConfig(model=str(path), num_kv_blocks=16, decode_graphs=True, max_num_seqs=4,
                          max_num_batched_tokens=32, adapter_dir=str(tmp_path), max_loras=2,
                          max_lora_rank=8, gpu_memory_utilization=0.9)
    mc = ModelConfig.from_dir(path)
    runner = ModelRunner(config, mc)
    fake = _FakeCuda(peaks=[3 * GB, GB])
    fake.install(monkeypatch)
    lora = lora_stack_bytes(mc, 2, 8, torch.float32)
    assert runner._cuda_kv_budget() == int(141 * GB * 0.9) - 25 * GB - 3 * GB - GB - lora
    assert fake.calls == ["reset", "reset", "empty_cache", "mem_get_info"]


def test_bf16_model_is_never_materialized_in_float32() -> None:
    """The loader converts the meta model's dtype before allocating, so no float32 copy of
    any weight is ever made (at 8B that transient was 32 GB on the GPU)."""
    cfg = ModelConfig.from_dir(make_checkpoint(Path("/tmp") / "omnibus-test-mem-tiny"))
    with torch.device("meta"):
        shapes = {tuple(p.shape) for p in empty_model(cfg, torch.bfloat16, torch.device("meta"), 100).parameters()}
    seen: list[tuple[int, ...]] = []

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type != "meta":
                    seen.append(tuple(t.shape))
            return out

    with Allocations():
        model = empty_model(cfg, torch.bfloat16, torch.device("cpu"), 100)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert [s for s in seen if s in shapes] == []


def test_bind_device_sets_an_indexed_cuda_device_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    for device in ("cpu", "cuda", "cuda:1"):
        bind_device(torch.device(device))
    assert calls == [torch.device("cuda:1")]


def test_runner_and_step_thread_bind_the_engine_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omnibus.engine.engine import Engine
    from omnibus.engine.serving import async_engine, step_loop

    calls: list[tuple[str, torch.device]] = []

    def spy(device: torch.device) -> None:
        calls.append((threading.current_thread().name, device))

    monkeypatch.setattr(model_runner, "bind_device", spy)
    monkeypatch.setattr(step_loop, "bind_device", spy)
    engine = Engine(EngineConfig(model=str(make_checkpoint(tmp_path / "m")), num_kv_blocks=32))
    aengine = async_engine.AsyncEngine(engine)
    aengine.start()
    aengine.shutdown()
    cpu = torch.device("cpu")
    assert calls == [(threading.current_thread().name, cpu), ("engine-step-loop", cpu)]
