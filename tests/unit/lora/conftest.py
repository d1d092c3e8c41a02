"""A tiny base model and PEFT-named adapters of chosen ranks and projections."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from omnibus.engine.config import ModelConfig
from omnibus.engine.lora.adapters import PROJECTIONS, proj_dims
from tests.checkpoints import make_checkpoint

MAX_RANK = 8
ALL = list(PROJECTIONS)
ADAPTERS = {  # name -> (rank, targets)
    "all-r8": (8, ALL),
    "qv-r2": (2, ["q_proj", "v_proj"]),
    "mlp-r4": (4, ["o_proj", "down_proj", "up_proj"]),
    "mlp-r8": (8, ["o_proj", "down_proj", "up_proj"]),
    "k-r2": (2, ["k_proj"]),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[ModelConfig, object]:
    """The tiny model's config and a root holding the ADAPTERS (random PEFT-named tensors)."""
    root = tmp_path_factory.mktemp("slots")
    cfg = ModelConfig.from_dir(make_checkpoint(root / "base"))
    dims = proj_dims(cfg)
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        gen = torch.Generator().manual_seed(seed)
        d = root / "adapters" / name
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 2 * rank,
                                                           "target_modules": targets}))
        tensors = {}
        for layer in range(cfg.num_layers):
            for proj in targets:
                part = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, dims[proj][0], generator=gen) + 1
                tensors[f"{key}.lora_B.weight"] = torch.randn(dims[proj][1], rank, generator=gen) + 1
        save_file(tensors, str(d / "adapter_model.safetensors"))
    broken = root / "adapters" / "broken"  # its config promises rank 2, its tensors have rank 3
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"r": 2, "target_modules": ["q_proj"]}))
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{key}.lora_A.weight": torch.zeros(3, dims["q_proj"][0]),
               f"{key}.lora_B.weight": torch.zeros(dims["q_proj"][1], 3)}, str(broken / "adapter_model.safetensors"))
    return cfg, root / "adapters"
