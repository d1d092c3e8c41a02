"""KV-cache sizing on a GPU: what is left of ``gpu_memory_utilization`` × device memory once
everything else the engine will hold is counted, each thing once.

The runner measures (after ``torch.cuda.empty_cache()``, so that memory PyTorch cached but
no tensor uses, such as the loader's transients and the warm-ups' freed activations, is not
counted as in use) and this module does the arithmetic, which the tests check on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnibus.engine.config import ModelConfig
from omnibus.engine.lora.adapters import PROJECTIONS, proj_dims


@dataclass(frozen=True)
class MemoryUse:
    """Bytes, measured or computed before the KV cache is allocated."""

    total: int  # device memory
    used: int  # in use with PyTorch's cache emptied: CUDA context, other processes, weights, LoRA slots
    step_peak: int  # the largest step's activations and sampler temporaries, above what stays allocated
    graph_pool: int  # decode CUDA graphs' private pool (captured after sizing); 0 without graphs
    lora_stacks: int  # adapter slot stacks still to be allocated after sizing; 0 once they exist


def kv_cache_budget(use: MemoryUse, utilization: float) -> int:
    """Bytes left for the KV cache (never negative)."""
    budget = int(use.total * utilization) - use.used - use.step_peak - use.graph_pool - use.lora_stacks
    return max(budget, 0)


def lora_stack_bytes(model_config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype) -> int:
    """Device bytes of the stacked adapter slots: per layer and projection, A (slots, r, in) and
    B (slots, out, r) in the model dtype, and a float32 scale per slot, layer and projection."""
    elem = torch.empty((), dtype=dtype).element_size()
    dims = proj_dims(model_config)
    per_layer = sum(dims[p][0] + dims[p][1] for p in PROJECTIONS) * max_rank * max_loras * elem
    return model_config.num_layers * (per_layer + 4 * len(PROJECTIONS) * max_loras)
