"""LoraManager's interface on the CPU: the admission gate, pins, the adapter RPCs' policy."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

from omnibus.engine.lora import (
    AdapterError, AdapterLoadError, AdapterStateError, LoraConfig, LoraManager, UnknownAdapterError)
from omnibus.engine.lora.adapters import AdapterSpec, list_adapter_names, resolve_adapter_dir
from tests.unit.lora.conftest import MAX_RANK


@pytest.fixture
def manager(model):
    cfg, root = model
    m = LoraManager(LoraConfig(root, max_loras=1, max_cpu_loras=2, max_lora_rank=MAX_RANK),
                    cfg, torch.float32, torch.device("cpu"))
    yield m
    m.shutdown()


def settle(step, timeout=30.0):
    """Poll `step()` until it returns something other than None / a waiting gate."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        result = step()
        if result is not None and getattr(result, "state", None) != "wait":
            return result
        time.sleep(0.002)
    raise AssertionError("timed out")


def test_gate_waits_for_the_load_then_pins_the_slot(manager):
    assert manager.prefetch("qv-r2").startswith("qv-r2@")
    gate = settle(lambda: manager.gate("qv-r2"))
    assert (gate.state, gate.slot) == ("ready", 0)
    assert manager.inventory().running == 1
    # the only slot is pinned: another adapter waits, whatever its load state
    settle(lambda: manager.ready("k-r2") or None)
    assert manager.gate("k-r2").state == "wait"
    with pytest.raises(AdapterStateError, match="in use by 1 running sequence;"):
        manager.unload("qv-r2")
    manager.release("qv-r2")
    assert manager.gate("k-r2").slot == 0  # the unpinned slot is refilled
    inv = manager.inventory()
    assert (inv.resident, inv.cached, inv.running) == (("k-r2",), ("k-r2", "qv-r2"), 1)
    assert (manager.stats().loads, manager.stats().evictions) == (2, 1)


def test_loads_evictions_and_pins_are_counted_per_adapter_and_tier(manager):
    """One device slot, two host places: three adapters in turn. Each is read once; each
    refill evicts the slot's occupant; the third read drops the least recently used host
    copy that no slot holds (qv-r2)."""
    for name in ("qv-r2", "k-r2", "all-r8"):
        manager.prefetch(name)
        settle(lambda: manager.gate(name))
        assert manager.inventory().pins == ((name, 1),)
        if name != "all-r8":
            manager.release(name)
    stats, inventory = manager.stats(), manager.inventory()
    assert stats.adapter_loads == (("all-r8", 1), ("k-r2", 1), ("qv-r2", 1))
    assert stats.adapter_evictions == (("k-r2", "device", 1), ("qv-r2", "device", 1), ("qv-r2", "host", 1))
    assert (stats.loads, stats.evictions) == (3, 2)
    assert (inventory.resident, inventory.cached) == (("all-r8",), ("all-r8", "k-r2"))
    manager.release("all-r8")
    assert (manager.inventory().pins, manager.inventory().running) == ((), 0)


def test_inventory_salts_follow_the_adapter_files_read(manager, model):
    """The salt is the version in memory: a file replaced on disk changes it only once the
    adapter is read again (after an unload), so KV of one version never serves another."""
    _, root = model
    weights = root / "k-r2" / "adapter_model.safetensors"
    st = weights.stat()
    assert manager.inventory().salts == ()
    salt = manager.prefetch("k-r2")
    assert manager.inventory().salts == (("k-r2", salt),)
    try:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # the file was replaced
        assert manager.prefetch("k-r2") == salt  # loading or loaded: the version read
        settle(lambda: manager.ready("k-r2") or None)
        assert manager.prefetch("k-r2") == salt and manager.inventory().salts == (("k-r2", salt),)
        assert manager.unload("k-r2") is True
        assert manager.inventory().salts == ()
        new = manager.prefetch("k-r2")  # read again: the new version's salt
        assert new != salt and manager.inventory().salts == (("k-r2", new),)
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    settle(lambda: manager.ready("k-r2") or None)
    assert manager.unload("k-r2") is True
    assert manager.inventory().salts == ()



def test_a_ready_gate_carries_the_salt_of_the_weights_read(manager, model):
    """A request salted when it arrived may find its adapter read again by the time it is
    admitted (it left host memory and its files were rewritten in between): the gate tells
    the scheduler which version the slot holds. A load while a read runs keeps its salt."""
    _, root = model
    weights = root / "k-r2" / "adapter_model.safetensors"
    st = weights.stat()
    salt = manager.prefetch("k-r2")
    assert manager.load("k-r2") is False  # still loading
    try:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
        assert manager.load("k-r2") is False and manager.inventory().salts == (("k-r2", salt),)
        gate = settle(lambda: manager.gate("k-r2"))
        assert gate.salt == salt  # the version read, not the file now on disk
        manager.release("k-r2")
        for other in ("qv-r2", "mlp-r4"):  # two more fill the host tier (2): k-r2 leaves it
            manager.prefetch(other)
            settle(lambda: manager.ready(other) or None)
            assert manager.place(other) is True  # and the one device slot
        assert manager.inventory().cached == ("mlp-r4", "qv-r2")
        new = manager.prefetch("k-r2")  # read again: the rewritten files
        assert new != salt
        assert settle(lambda: manager.gate("k-r2")).salt == new
        manager.release("k-r2")
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_load_place_unload(manager):
    assert manager.load("mlp-r4") is False  # read from disk
    assert settle(lambda: manager.place("mlp-r4")) is True
    assert manager.load("mlp-r4") is True  # in host memory already
    assert manager.unload("mlp-r4") is True
    assert manager.inventory().cached == ()
    assert manager.unload("mlp-r4") is False  # on disk, not loaded
    with pytest.raises(UnknownAdapterError):
        manager.unload("never-there")
    with pytest.raises(AdapterError):
        manager.unload("../escape")
    assert "all-r8" in manager.available()


def test_a_failed_read_is_the_gates_error_until_a_new_request_retries(manager):
    gate = settle(lambda: manager.gate("broken"))
    assert gate.state == "error"
    assert gate.error.startswith("adapter 'broken' failed to load: adapter 'broken' does not fit")
    with pytest.raises(AdapterLoadError, match="failed to load") as info:
        manager.ready("broken")
    assert info.value.reason.startswith("adapter 'broken' does not fit this base model")
    manager.prefetch("broken")  # a new request reads it again, and fails again
    assert settle(lambda: manager.gate("broken")).error == gate.error


def test_a_waiting_adapter_unloaded_and_deleted_fails_its_request_not_the_engine(manager, model):
    """Unload of an adapter a queued request waits for (in host memory, no slot free), its
    directory deleted first: the request's gate errs; the step loop raised before."""
    _, root = model
    shutil.copytree(root / "k-r2", root / "gone")
    try:
        manager.prefetch("qv-r2")
        assert settle(lambda: manager.gate("qv-r2")).slot == 0  # the only slot, pinned
        manager.prefetch("gone")
        settle(lambda: manager.ready("gone") or None)
        assert manager.gate("gone").state == "wait"
    finally:
        shutil.rmtree(root / "gone")
    assert manager.unload("gone") is True  # deleted, but loaded: it can be unloaded
    gate = manager.gate("gone")
    assert gate.state == "error" and "'gone' not found under the adapter root" in gate.error
    manager.release("qv-r2")


def test_a_read_that_ended_is_taken_in_though_no_request_asks(manager):
    """A read whose request went away (cancelled while it loaded) is in the inventory, and
    unloading it is not refused as "still loading" forever."""
    manager.prefetch("mlp-r4")
    settle(lambda: manager.stats().load_seconds or None)  # the disk read ended
    assert manager.unload("mlp-r4") is True
    manager.prefetch("mlp-r8")
    settle(lambda: manager.stats().load_seconds[1:] or None)
    assert "mlp-r8" in manager.inventory().cached
    assert manager.unload("mlp-r8") is True


def test_more_adapters_waiting_than_the_host_tier_holds_are_each_read_once(manager, model):
    """Five requests for five adapters, one slot, a host tier of two: each adapter is read
    from disk once; adapters read for waiting requests are not evicted by later reads
    before their request gets the slot (every adapter was read again and again)."""
    names = ["all-r8", "qv-r2", "mlp-r4", "mlp-r8", "k-r2"]
    for name in names:
        manager.prefetch(name)
    waiting, running, end = list(names), {}, time.monotonic() + 60
    while (waiting or running) and time.monotonic() < end:  # one step of the scheduler
        for name, steps in list(running.items()):  # a request runs 20 steps, then finishes
            running[name] = steps - 1
            if not running[name]:
                manager.release(name)
                del running[name]
        for name in list(waiting):  # its pass over the waiting queue
            if manager.gate(name).state == "ready":
                waiting.remove(name)
                running[name] = 20
        time.sleep(0.002)
    assert not waiting and not running
    assert manager.stats().loads == len(names)
    assert len(manager.inventory().cached) <= manager.config.max_cpu_loras


def test_a_symlink_loop_under_the_adapter_root_is_no_adapter(tmp_path, model):
    """Python 3.11's Path.resolve raises RuntimeError on a loop: the listing skips it and
    a request for it is NOT_FOUND (the engine failed to start, or its catalog task died)."""
    _, root = model
    (tmp_path / "loopy").symlink_to("loopy")
    shutil.copytree(root / "k-r2", tmp_path / "k-r2")
    assert list_adapter_names(tmp_path) == ["k-r2"]
    with pytest.raises(UnknownAdapterError, match="'loopy' not found"):
        resolve_adapter_dir(tmp_path, "loopy")
    (tmp_path / "k-r2" / "adapter_model.safetensors").rename(tmp_path / "k-r2" / "real.safetensors")
    (tmp_path / "k-r2" / "adapter_model.safetensors").symlink_to("adapter_model.safetensors")
    with pytest.raises(AdapterError, match="has no adapter_model.safetensors"):  # a loop is no file
        AdapterSpec.read(tmp_path, "k-r2", MAX_RANK)
