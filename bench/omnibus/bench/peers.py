"""Transformers as the peer every throughput number is compared with, in the same process:
static batching with `generate` and its continuous-batching manager."""

from __future__ import annotations

import time

import torch


def hf_static_tok_s(model, prompts: list[list[int]], lengths: list[int], batch: int = 16) -> float:
    """Output tokens/s of `generate` over batches of `batch` requests; each batch runs to its
    longest request (left-padded prompts), and only requested tokens count as output."""
    model.generation_config.eos_token_id = None
    device = next(model.parameters()).device
    _sync(device)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk, want = prompts[i:i + batch], lengths[i:i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(want),
                                 pad_token_id=0)
        if out.shape[1] != width + max(want):
            raise RuntimeError("transformers stopped early; lengths would not be comparable")
    _sync(device)
    return sum(lengths) / (time.perf_counter() - t0)


def hf_continuous_tok_s(model, prompts: list[list[int]], lengths: list[int]) -> float:
    """Output tokens/s of transformers' continuous batching with per-request max_new_tokens."""
    import transformers

    model.generation_config.eos_token_id = None
    gen_cfg = transformers.GenerationConfig(do_sample=False, max_new_tokens=max(lengths), eos_token_id=None)
    manager = model.init_continuous_batching(generation_config=gen_cfg)
    manager.start()
    try:
        t0 = time.perf_counter()
        for p, m in zip(prompts, lengths):
            manager.add_request(p, max_new_tokens=m)
        done = produced = 0
        while done < len(prompts):
            result = manager.get_result(timeout=120)
            if result is None:
                raise RuntimeError("transformers continuous batching stalled")
            if result.is_finished():
                done += 1
                produced += len(result.generated_tokens)
        elapsed = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    return produced / elapsed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
