"""CPU linear layers as oneDNN matmuls over weights packed once at load.

torch's default CPU linear calls MKL's sgemm on the (out, in) weight every time. At the row
counts of decode steps that is far from the memory-bound rate: on the 2-core VM of
docs/benchmarks/offline.md a (8, 512) x (512, 2816) product took 2.7x as long as a single
row, where reading the weight once should cost the same. oneDNN with the weight reordered
once into its blocked layout (what torch's inductor does for frozen CPU models) ran 1 to 8
rows 3-5x faster, 64 rows 1.6x and 2048-row prefill chunks 1.3x; the offline workload went
from 552-599 to 774-816 output tokens/s with the same greedy tokens.

`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise` are the private ops behind
that inductor path (torch pinned to 2.13.0 here); `pack_linears` checks they exist and
leaves the model as it is when they do not.
"""

from __future__ import annotations

import torch
from torch import nn


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """An nn.Linear's product with its weight in oneDNN's blocked layout (an opaque
    tensor: read only through this module)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def pack_linears(model: nn.Module) -> int:
    """Replaces every float32 CPU nn.Linear under `model` with a PackedLinear (the original
    weight is freed unless another module shares it, as a tied LM head does) and returns
    how many it replaced: 0 when oneDNN is not available."""
    if not onednn_available():
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (isinstance(child, nn.Linear) and child.weight.device.type == "cpu"
                    and child.weight.dtype == torch.float32):
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced
