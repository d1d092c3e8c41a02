"""oneDNN-packed CPU linear layers (--cpu-matmul onednn): the same products as torch's
linear, every float32 layer of a loaded model replaced but a tied LM head (which shares the
embedding table), and the same greedy tokens as the aten path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import Engine
from omnibus.engine.model.cpu_linear import PackedLinear, onednn_available, pack_linears
from omnibus.engine.worker.sampling import SamplingParams
from torch import nn

from tests.checkpoints import make_checkpoint

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 64, 300])
def test_packed_linear_matches_linear(bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        want, got = F.linear(x, linear.weight, linear.bias), packed(x)
        assert got.shape == (rows, 160)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # Views with a row stride (the split of a fused projection) and 3-D inputs too.
        wide = torch.randn(rows, 192)[:, :96]
        torch.testing.assert_close(packed(wide), F.linear(wide, linear.weight, linear.bias),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed(x.view(1, rows, 96)), want.view(1, rows, 160),
                                   rtol=1e-5, atol=1e-5)


def test_pack_linears_replaces_float32_layers_only():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)),
                          nn.Linear(4, 4).to(torch.bfloat16))
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
    assert isinstance(model[2], nn.Linear)  # other dtypes keep torch's linear


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tied"), "qwen2", tie_word_embeddings=True)


def engine(path, cpu_matmul: str) -> Engine:
    return Engine(EngineConfig(model=str(path), num_kv_blocks=64, cpu_matmul=cpu_matmul))


def test_engine_packs_every_linear_but_a_tied_head_and_keeps_tokens(tied):
    packed, aten = engine(tied, "onednn"), engine(tied, "aten")
    model = packed.runner.model
    layers = [m for m in model.layers.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    assert len(layers) == 4 * model.cfg.num_layers  # qkv, o, gate_up, down
    assert all(isinstance(m, PackedLinear) for m in layers)
    # The tied head reads the embedding table itself: no second copy of the matrix.
    assert isinstance(model.lm_head, nn.Linear)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert all(not isinstance(m, PackedLinear) for m in aten.runner.model.modules())
    prompts = [[5, 9, 11, 40, 7], [3] * 20, list(range(30, 70))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert packed.generate(prompts, params) == aten.generate(prompts, params)


def test_cpu_matmul_is_checked(tied):
    with pytest.raises(ValueError, match="cpu_matmul must be onednn or aten"):
        EngineConfig(model=str(tied), cpu_matmul="mkl")
