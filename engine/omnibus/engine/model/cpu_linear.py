"""CPU linear layers as oneDNN matmuls over weights packed once at load.

torch's default CPU linear calls MKL's sgemm on the (out, in) weight every time. At the row
counts of decode steps that is far from the memory-bound rate: on the 2-core VM of
docs/benchmarks/offline.md a (2 to 8, 512) x (512, 2816) product took 1.8-2.8x as long as a
single row, where reading the weight once should cost about the same. oneDNN with the
weight reordered once into its blocked layout (what torch's inductor does for frozen CPU
models) ran 1 to 16 rows 2.8-6x faster, 64 rows 1.6x and 2048-row prefill chunks 1.3x; the
offline workload ran 1.2-1.5x faster with the same greedy tokens.

`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise` are the private ops behind
that inductor path (torch pinned to 2.13.0 here); `pack_linears` checks they exist and
leaves the model as it is when they do not.
"""

from __future__ import annotations

import torch
from torch import nn


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and all(
        hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise"))


class PackedLinear(nn.Module):
    """An nn.Linear's product with its weight in oneDNN's blocked layout. The packed weight
    is an opaque tensor held as a plain attribute: it is not in `state_dict()`, and
    `.to()` does not move or convert it (pack after the model is where and what it will
    stay)."""

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
    """Replaces every float32 CPU nn.Linear under `model` with a PackedLinear, freeing its
    weight, and returns how many it replaced (0 when oneDNN is not available). A linear
    whose weight another module also uses (a tied LM head reads the embedding table) keeps
    torch's linear: packing it would hold a second copy of the whole matrix."""
    if not onednn_available():
        return 0
    shared = {id(p) for m in model.modules() if not isinstance(m, nn.Linear)
              for p in m.parameters(recurse=False)}
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (isinstance(child, nn.Linear) and child.weight is not None  # None: a quantized layer's kernel
                    and child.weight.device.type == "cpu"
                    and child.weight.dtype == torch.float32 and id(child.weight) not in shared):
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced
