"""A tensor-parallel rank's part of each weight kind (model/quant/weights.py take_rows and
take_columns, parallel/shard.py's plan) dequantizes to the same part of the dense weight,
bit for bit; what cannot split is refused naming the columns and the groups."""

from __future__ import annotations

import pytest
import torch

from omnibus.engine.config import ModelConfig
from omnibus.engine.model.quant.weights import (
    DenseWeight, WeightFormatError, quantize_fp8, quantize_int4, quantize_int8, take_columns, take_rows)
from omnibus.engine.parallel.group import TensorParallel
from omnibus.engine.parallel.shard import ShardPlan

W = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))


def affine(w):
    q = quantize_int4(w, group=32)
    q.kind, q.zero = "affine", q.zero * 0 - 8 * q.scale  # GGUF's convention, the same values
    return q


@pytest.mark.parametrize("make", [DenseWeight, quantize_int8, quantize_fp8, lambda w: quantize_int4(w, 32), affine],
                         ids=["dense", "int8", "fp8", "int4", "int4-affine"])
@pytest.mark.parametrize("cols", [(0, 64), (64, 128), (32, 96), (96, 128)])
def test_a_shard_dequantizes_to_the_dense_shard(make, cols):
    weight = make(W)
    full = weight.dequantize()
    rows = torch.arange(16, 40)
    assert torch.equal(take_rows(weight, rows).dequantize(), full[rows])
    assert torch.equal(take_columns(weight, *cols).dequantize(), full[:, cols[0]:cols[1]])


def test_a_slice_inside_one_group_keeps_its_scale_and_others_are_refused():
    weight = quantize_int4(W, 128)  # one group per row
    part = take_columns(weight, 64, 128)
    assert part.group == 64 and torch.equal(part.dequantize(), weight.dequantize()[:, 64:])
    with pytest.raises(WeightFormatError, match=r"columns \[16, 80\) do not fall on the INT4 groups of 32"):
        take_columns(quantize_int4(W, 32), 16, 80)
    perm = quantize_int4(W, 32)
    perm.perm = torch.randperm(128)
    with pytest.raises(WeightFormatError, match="act-order"):
        take_columns(perm, 0, 64)


def test_the_plan_splits_heads_channels_and_the_vocabulary():
    cfg = ModelConfig.from_dict(dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=1, vocab_size=101, max_position_embeddings=64, rms_norm_eps=1e-5,
        model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=True))
    for rank in range(2):
        plan = ShardPlan(cfg, TensorParallel(rank, 2))
        q = torch.arange(64 * 64, dtype=torch.float32).view(64, 64)
        assert torch.equal(plan.shard("layers.0.self_attn.qkv_proj.weight", 0, q), q[32 * rank:32 * (rank + 1)])
        k = torch.randn(16, 64)
        assert torch.equal(plan.shard("layers.0.self_attn.qkv_proj.weight", 1, k), k)  # one KV head: replicated
        o = torch.randn(64, 64)
        assert torch.equal(plan.shard("layers.0.self_attn.o_proj.weight", None, o), o[:, 32 * rank:32 * (rank + 1)])
        bias = torch.randn(64)
        assert torch.equal(plan.shard("layers.0.self_attn.o_proj.bias", None, bias),
                           bias if rank == 0 else torch.zeros(64))
        table = torch.randn(101, 64)
        got = plan.shard("embed_tokens.weight", None, table)
        assert got.shape == (51, 64)
        assert torch.equal(got[:51 - rank], table[51 * rank:51 * rank + 51 - rank])
        assert rank == 0 or torch.equal(got[50:], torch.zeros(1, 64))  # the last block padded
