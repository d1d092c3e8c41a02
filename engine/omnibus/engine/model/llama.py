"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2) over a paged KV cache.

Reads top to bottom: RMSNorm, rotary embedding, attention, MLP, decoder layer, model.
Every forward takes one `ForwardBatch` with the step's metadata; there is no
global state. Tokens of all sequences are packed along one dimension T.

Under tensor parallelism (`tp`, parallel/) each rank builds this same model at its share
of the sizes: its query and KV heads, its MLP channels and its block of the vocabulary
(parallel/shard.py says which rows and columns); `o_proj` and `down_proj` then hold
partial sums that are all-reduced, the embedding lookup is masked and summed, and the
logits are gathered. At one rank every collective is the identity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from omnibus.engine.config import ModelConfig, RopeScaling
from omnibus.engine.model.linear import Linear
from omnibus.engine.parallel.group import SINGLE, TensorParallel, padded_vocab_part, vocab_range
from omnibus.engine.parallel.shard import local_kv_heads
from omnibus.kernels import (
    AttentionPlan,
    add_rms_norm,
    paged_attention,
    plan_attention,
    rms_norm,
    rope,
    silu_and_mul,
    store_kv,
)


@dataclass
class ForwardBatch:
    """Per-step metadata shared by every layer. Sequences that decode come first."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    slot_mapping: torch.Tensor  # (T,) int64: KV slot each new token is written to
    block_tables: torch.Tensor  # (B, max_blocks) int32
    query_start_loc: torch.Tensor  # (B+1,) int32: cumulative new-token counts
    seq_lens: torch.Tensor  # (B,) int32: KV length of each sequence after this step
    max_query_len: int
    logits_indices: torch.Tensor  # (S,) int64: tokens whose next-token logits are needed
    lora: object | None = None  # adapter segments (multi-LoRA), None when no adapter is used
    attn_plan: AttentionPlan | None = None  # the CPU attention's per-step work (kernels.plan_attention)
    # rows whose logits score prompt tokens (worker.sampling.PromptRows); None: none
    prompt_logprobs: object | None = None
    # early-held prefills' progress words (worker/kv_pool.py KvMarks), told as each layer's KV is written
    kv_marks: object | None = None


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm (float32 statistics, cast back before the weight), so
    outputs agree token for token. Given the residual stream, it first adds `x` into it
    in place (one fused kernel on the GPU) and returns (normalized, residual)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) for default, linear, llama3 and freq_factors rope scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.kind == "freq_factors":  # llama.cpp's rope_freqs: theta_i / factor_i
        return inv_freq / torch.tensor(scaling.factors, dtype=torch.float32)
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """float32 cos/sin tables (max_len, D) for every position; each layer rotates its q
    and k by the step's positions with `kernels.rope`."""

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        # Computed on the CPU even inside a meta-device context (loader.empty_model builds
        # the model there and moves these to the device): these ops on meta would import
        # torch's Python decompositions, 1.7 s of an engine's start.
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
            freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)  # (max_len, D)
        # On one thread: a process's first vectorized cos on the CPU can return the share
        # of its other OpenMP threads at low accuracy (torch 2.13, 2 threads: in ~7% of
        # fresh processes, cos rows of the second half off by up to 1.5e-4, which flipped
        # greedy tokens), and these tables serve the process's whole life.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            cos, sin = emb.cos(), emb.sin()
        finally:
            torch.set_num_threads(threads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q: (T, H, D), k: (T, KVH, D) -> rotated (q, k); rotated in place on the GPU."""
        return rope(q, k, self.cos, self.sin, positions)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int],
                           scale: float) -> torch.Tensor:
    """Causal attention within each packed sequence [starts[i], starts[i+1]), without a cache.
    q: (T, H, D), k/v: (T, KVH, D) -> (T, H, D)."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for lo, hi in zip(starts, starts[1:]):
        qi = q[lo:hi].transpose(0, 1)  # (H, n, D)
        ki = k[lo:hi].transpose(0, 1).repeat_interleave(group, 0)
        vi = v[lo:hi].transpose(0, 1).repeat_interleave(group, 0)
        out[lo:hi] = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale).transpose(0, 1)
    return out


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_idx, self.tp = layer_idx, tp
        self.num_heads, self.num_kv_heads, self.head_dim = tp.part(cfg.num_heads), local_kv_heads(cfg, tp), cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        # q, k and v projections fused into one matmul; loading fills the row slices.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias,
                               parts=(self.q_size, self.kv_size, self.kv_size))
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.head_dim**-0.5
        # An FP8 KV cache holds k / k_scale and v / v_scale (the checkpoint's self_attn.k_scale
        # and v_scale, loader.load_weights); the model runner sets them back to 1.0 for any
        # other cache, which holds k and v as they are.
        self.k_scale = self.v_scale = 1.0

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        lora=None,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # (T, q + 2kv)
        if lora is not None:
            lora.apply(qkv, x, self.layer_idx, "qkv")
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rotary(q, k, batch.positions)
        if kv_cache is None:  # embeddings: whole sequences, nothing to keep
            o = dense_causal_attention(q, k, v, batch.query_start_loc.tolist(), self.scale)
        else:
            k_cache, v_cache = kv_cache
            store_kv(k, v, k_cache, v_cache, batch.slot_mapping, batch.attn_plan, self.k_scale, self.v_scale)
            o = paged_attention(
                q, k_cache, v_cache, batch.block_tables, batch.query_start_loc,
                batch.seq_lens, self.scale, batch.max_query_len, plan=batch.attn_plan,
                k_scale=self.k_scale, v_scale=self.v_scale,
            )  # (T, H, D)
        o = o.reshape(-1, self.q_size)
        out = self.o_proj(o)
        if lora is not None:
            lora.apply(out, o, self.layer_idx, "o")
        return self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_idx, self.tp = layer_idx, tp
        inter = tp.part(cfg.intermediate_size)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias, parts=(inter, inter))
        self.down_proj = Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2I)
        if lora is not None:
            lora.apply(gate_up, x, self.layer_idx, "gate_up")
        h = silu_and_mul(gate_up)  # silu(gate) * up, (T, I)
        out = self.down_proj(h)
        if lora is not None:
            lora.apply(out, h, self.layer_idx, "down")
        return self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, layer_idx, tp)

    def forward(self, x, residual, batch, rotary, kv_cache, lora=None):
        """x: the previous layer's MLP output, added into the residual stream here (the
        first layer gets residual None and x the embeddings). Returns (mlp_out, residual)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, batch, rotary, kv_cache, lora)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, lora), residual


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus LM head. `forward` returns final hidden states (T, hidden)."""

    def __init__(self, cfg: ModelConfig, max_len: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        vocab = padded_vocab_part(cfg.vocab_size, tp)  # this rank's rows of the vocabulary
        self.vocab_start, vocab_stop = vocab_range(cfg.vocab_size, tp)
        self.vocab_rows = vocab_stop - self.vocab_start
        # Given its (uninitialized) weight, the table skips nn.Embedding's normal_ init: on the
        # meta device that init imports torch's Python decompositions, 1.7 s of an engine's
        # start. Every weight is loaded (or random_model fills it) after.
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size, _weight=torch.empty(vocab, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, vocab, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg, max_len)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None
    ) -> torch.Tensor:
        """Final hidden states (T, hidden). kv_caches None: cache-free (embeddings)."""
        x = self.embed(batch.input_ids)  # (T, hidden)
        if kv_caches:  # worked out once here, not by each layer
            plan = plan_attention(kv_caches[0][0], batch.block_tables, batch.query_start_loc,
                                  batch.seq_lens, batch.slot_mapping)
            if plan is not None:
                batch = replace(batch, attn_plan=plan)
        residual, marks = None, batch.kv_marks
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches or [None] * len(self.layers))):
            x, residual = layer(x, residual, batch, self.rope, kv_cache, batch.lora)
            if marks is not None:
                marks.layer_done(i)  # type: ignore[attr-defined]
        return self.norm(x, residual)[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of `ids`; over several ranks each looks up the ids its block of
        the vocabulary holds (zeros for the rest) and the blocks are summed."""
        if self.tp.size == 1:
            return self.embed_tokens(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        x = self.embed_tokens(local.masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0.0))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, vocab) float32; each rank's block of the vocabulary gathered."""
        return self.tp.gather_columns(self.lm_head(hidden).float(), self.cfg.vocab_size)
