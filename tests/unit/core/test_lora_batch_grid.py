"""A step's LoRA batch hands the kernels its longest segment, known on the host, so the
Triton grid is sized by it instead of by every token of the step (issue #17, defect 3)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omnibus.engine.lora import batch as lora_batch


def test_longest_segment_reaches_both_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int | None]] = []
    monkeypatch.setattr(lora_batch, "lora_shrink",
                        lambda x, a, starts, slots, max_seg_len=None: calls.append(("shrink", max_seg_len))
                        or torch.zeros(x.shape[0], a.shape[1]))
    monkeypatch.setattr(lora_batch, "lora_expand",
                        lambda *args, max_seg_len=None: calls.append(("expand", args[6] if len(args) > 6
                                                                      else max_seg_len)))
    slots = SimpleNamespace(device=torch.device("cpu"), targets=[frozenset({"o_proj"})] * 2,
                            columns={"o": [("o_proj", 0, 4)]}, proj_scales=[{"o_proj": torch.ones(2)}],
                            stacked=[{"o_proj": (torch.zeros(2, 2, 4), torch.zeros(2, 4, 2))}])
    # runs of one sequence each; sequences 3 and 4 share slot 1, so one 20-token segment
    batch = lora_batch.LoraBatch(slots, [(0, 3), (-1, 5), (1, 18), (1, 2)])
    batch.apply(torch.zeros(28, 4), torch.zeros(28, 4), 0, "o")
    assert calls == [("shrink", 20), ("expand", 20)]
