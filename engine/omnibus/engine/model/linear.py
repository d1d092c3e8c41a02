"""The decoder's linear layer: it owns its weight, whatever format the checkpoint holds.

A layer may fuse several checkpoint projections along its output rows (`parts`: q, k, v
for `qkv_proj`; gate, up for `gate_up_proj`). Loading hands it one decoded weight per part
(`quant.weights`: dense, INT8, INT4 with groups, FP8); once every part is in, the layer
keeps the dense ones as an nn.Linear weight and gives the quantized ones a kernel
(`quant.kernels`). `finish` applies the engine's --quantization: `none` dequantizes every
weight to the model dtype (the exact reference), `int8`/`fp8`/`int4` quantize dense ones.
The model file builds these layers and calls them; it never branches on a format.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnibus.engine.model.quant.kernels import Kernel, make_kernel
from omnibus.engine.model.quant.weights import (
    QUANTIZERS,
    DenseWeight,
    Weight,
    WeightFormatError,
    concat_rows,
)


class Linear(nn.Linear):
    """nn.Linear whose weight may be quantized. Dense weights stay the `weight` parameter
    (so tied heads, LoRA, CUDA graphs and oneDNN packing see an nn.Linear); a quantized
    layer's `weight` is None and `kernel` multiplies."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 parts: tuple[int, ...] | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.parts = parts or (out_features,)
        if sum(self.parts) != out_features:
            raise ValueError(f"parts {self.parts} do not add up to {out_features} output rows")
        self.kernel: Kernel | None = None
        self._staged: dict[int, Weight] = {}  # quantized parts waiting for their siblings
        self._filled: set[int] = set()  # parts loaded (dense ones are copied in place)
        self.home: tuple[torch.dtype, torch.device] | None = None  # where a deferred weight goes

    def part_rows(self, part: int) -> slice:
        start = sum(self.parts[:part])
        return slice(start, start + self.parts[part])

    def defer(self) -> None:
        """Drop the dense weight before it is allocated (a quantized checkpoint: each part
        brings its own storage; a dense part allocates the weight when it comes)."""
        self.weight = None  # type: ignore[assignment]

    @property
    def complete(self) -> bool:
        return len(self._filled) + len(self._staged) == len(self.parts)

    def load(self, weight: Weight, part: int = 0) -> None:
        """One checkpoint projection's weight (rows `part_rows(part)`)."""
        want = (self.parts[part], self.in_features)
        if tuple(weight.shape) != want:
            raise WeightFormatError(f"checkpoint has {tuple(weight.shape)}, config.json implies {want}")
        if isinstance(weight, DenseWeight):
            self._dense_param()[self.part_rows(part)].copy_(weight.w)
            self._filled.add(part)
        else:
            self._staged[part] = weight

    def _dense_param(self) -> torch.Tensor:
        if self.weight is None:
            dtype, device = self.home or (torch.float32, torch.device("cpu"))
            self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, dtype=dtype,
                                                   device=device), requires_grad=False)
        return self.weight.data

    def finish(self, quantization: str, dtype: torch.dtype, device: torch.device) -> None:
        """After loading: settle the layer's weight kind and kernel (see the module doc)."""
        if not self._staged and quantization in ("auto", "none"):
            return  # dense as loaded
        if not self._staged:
            return self._quantize_dense(quantization)
        # `none`; int8/fp8/int4 asked of a quantized file (dequantize, then quantize as asked);
        # or a mixed layer (some parts dense, or of other kinds): one dense weight first
        weight = None if self._filled or quantization != "auto" else self._joined()
        if weight is None:
            for part, w in self._staged.items():
                self._dense_param()[self.part_rows(part)].copy_(w.dequantize(dtype))
            self._filled.update(self._staged)
            self._staged.clear()
            return self._quantize_dense(quantization)
        self._filled.update(self._staged)
        self._staged.clear()
        self._set_kernel(weight, device)

    def _joined(self) -> Weight | None:
        """The quantized parts as one weight; None when they cannot be held together (kinds,
        groups or column orders differ: a file may quantize q, k and v differently)."""
        try:
            return concat_rows([self._staged[p] for p in range(len(self.parts))])
        except WeightFormatError:
            return None

    def _quantize_dense(self, quantization: str) -> None:
        if quantization in ("auto", "none"):
            return
        w = self.weight.data
        self._set_kernel(QUANTIZERS[quantization](w), w.device)

    def use_int8(self, keep_weight: bool) -> None:
        """Multiply through INT8 per channel from now on; `keep_weight`: the dense weight
        is shared (a tied LM head is the embedding table) and stays."""
        w = self.weight.data
        if keep_weight:
            self.kernel = make_kernel(QUANTIZERS["int8"](w), w.device)
        else:
            self._set_kernel(QUANTIZERS["int8"](w), w.device)

    def _set_kernel(self, weight: Weight, device: torch.device) -> None:
        self.kernel = make_kernel(weight, device)
        self.weight = None  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            return F.linear(x, self.weight, self.bias)
        y = self.kernel(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        kind = "dense" if self.kernel is None else type(self.kernel).__name__
        return f"{super().extra_repr()}, {kind}"
