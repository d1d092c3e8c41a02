"""host_tensor builds the step's input tensors from lists exactly as torch.tensor does."""

from __future__ import annotations

import pytest
import torch

from omnibus.engine.worker.transfer import host_tensor, to_device


@pytest.mark.parametrize("data, dtype", [
    ([5, -1, 2**40, 0], torch.int64),
    ([3, -7, 2**31 - 1], torch.int32),
    ([[1, 2, 3], [4, 5, 6]], torch.int32),
    ([(1, 2), (3, 4), (5, 6)], torch.int64),
    ([[], []], torch.int32),
    ([], torch.int64),
    ([(1.5, 0.25), (2.0, 3.0)], torch.float32),  # not an integer type: torch.tensor's path
])
def test_host_tensor_equals_torch_tensor(data, dtype):
    want = torch.tensor(data, dtype=dtype)
    got = host_tensor(data, dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(to_device(data, dtype, torch.device("cpu")), want)


def test_the_tensor_is_writable_and_outlives_its_list():
    t = host_tensor(list(range(4)), torch.int64)
    t.index_copy_(0, torch.tensor([0]), torch.tensor([9]))
    assert t.tolist() == [9, 1, 2, 3]


def test_out_of_range_values_and_ragged_rows_are_refused():
    with pytest.raises(OverflowError):
        host_tensor([2**31], torch.int32)
    with pytest.raises(ValueError, match="unequal length"):
        host_tensor([[1, 2, 3], [4]], torch.int64)  # 4 values would view as 2 x 2
