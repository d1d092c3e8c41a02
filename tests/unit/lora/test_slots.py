"""Device slot fills: exact contents, and only the targeted projections touched."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from omnibus.engine.lora.adapters import PROJECTIONS, AdapterSpec, load_adapter_weights
from omnibus.engine.lora.slots import DeviceSlots
from omnibus.engine.worker import transfer
from tests.unit.lora.conftest import MAX_RANK


def weights(model, name, device=torch.device("cpu")):
    cfg, root = model
    return load_adapter_weights(AdapterSpec.read(root, name, MAX_RANK), cfg, torch.float32, device)


class CountFills(TorchDispatchMode):
    """Counts the zero_ and copy_ ops run while active, and the copies' non_blocking flags."""

    def __init__(self) -> None:
        super().__init__()
        self.zeros = 0
        self.copies: list[bool] = []  # non_blocking of each copy_

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.zero_.default:
            self.zeros += 1
        elif func is torch.ops.aten.copy_.default:
            self.copies.append(bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False)))
        return func(*args, **kwargs)


def assert_holds(slots: DeviceSlots, slot: int, w) -> None:
    """The slot holds exactly `w`: its tensors up to its rank, zeros everywhere else."""
    for layer, stacked in enumerate(slots.stacked):
        for proj, (a, b) in stacked.items():
            want_a, want_b = torch.zeros_like(a[slot]), torch.zeros_like(b[slot])
            if (layer, proj) in w.tensors:
                wa, wb = w.tensors[(layer, proj)]
                want_a[:wa.shape[0]], want_b[:, :wa.shape[0]] = wa, wb
                assert slots.scales[layer, PROJECTIONS.index(proj), slot].item() == pytest.approx(w.spec.scale)
            assert torch.equal(a[slot], want_a), (layer, proj, "A")
            assert torch.equal(b[slot], want_b), (layer, proj, "B")
    assert torch.equal(slots.scales[:, :, slot], w.scales)


# previous occupant -> new adapter: (layer, projection)s zeroed per layer (A and B each)
REFILLS = [
    (None, "all-r8", 0),  # an empty slot: copies only
    ("all-r8", "qv-r2", 7),  # 5 projections dropped + q, v rank tails 2..8
    ("qv-r2", "mlp-r4", 2),  # q, v dropped; the old code zeroed all 7
    ("mlp-r4", "mlp-r8", 0),  # same projections, higher rank: everything overwritten
    ("mlp-r8", "mlp-r4", 3),  # same projections, lower rank: the rank tails only
    ("mlp-r4", "k-r2", 3),
]


@pytest.mark.parametrize("old,new,zeroed", REFILLS)
def test_a_refill_zeroes_only_what_the_old_occupant_left_behind(model, old, new, zeroed):
    cfg, _ = model
    slots = DeviceSlots(2, MAX_RANK, cfg, torch.float32, torch.device("cpu"))
    other = weights(model, "all-r8")
    slots.fill(1, other)  # a neighbour that must stay untouched
    if old is not None:
        slots.fill(0, weights(model, old))
    w = weights(model, new)
    with CountFills() as counts:
        slots.fill(0, w)
    assert counts.zeros == 2 * zeroed * cfg.num_layers
    assert len(counts.copies) == 2 * len(w.tensors) + 1  # A and B per targeted projection; scales
    assert all(counts.copies), "slot copies must be non-blocking"
    assert_holds(slots, 0, w)
    assert_holds(slots, 1, other)
    assert slots.names == [new, "all-r8"] and slots.evictions == (old is not None)


def test_a_cleared_slot_is_refilled_without_stale_weights(model):
    cfg, _ = model
    slots = DeviceSlots(1, MAX_RANK, cfg, torch.float32, torch.device("cpu"))
    slots.fill(0, weights(model, "all-r8"))
    slots.clear(0)  # an unload keeps the weights until the next fill
    assert slots.names == [None] and not slots.scales[:, :, 0].any()
    w = weights(model, "k-r2")
    with CountFills() as counts:
        slots.fill(0, w)
    assert counts.zeros == 2 * 7 * cfg.num_layers and slots.evictions == 0
    assert_holds(slots, 0, w)


def test_host_weights_are_pinned_only_for_cuda(model, monkeypatch):
    """The loader thread stages adapter tensors in pinned memory for a CUDA device (the
    decision is transfer.pinned's); on the CPU they stay plain tensors."""
    pinned_calls = []

    def fake_pin(self):
        pinned_calls.append(tuple(self.shape))
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    w = weights(model, "qv-r2")
    assert pinned_calls == []
    t = torch.ones(3)
    assert transfer.pinned(t, torch.device("cpu")) is t
    w = weights(model, "qv-r2", torch.device("cuda"))
    assert len(pinned_calls) == 2 * len(w.tensors) + 1  # A and B of each, and the scales
