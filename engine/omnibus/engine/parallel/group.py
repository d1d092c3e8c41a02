"""The tensor-parallel group a model shard computes in: its rank, the world size and the
two collectives the sharded layers need (a sum over ranks, the vocabulary gathered).

A single-device model gets `SINGLE` (rank 0 of 1): every collective is the identity, so
the model file reads the same at any world size. Ranks reduce over torch.distributed:
NCCL between CUDA devices, gloo on the CPU (parallel/ranks.py starts the group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed ProcessGroup of the ranks; None when size is 1
    cpu_group: object | None = None  # the same ranks over gloo: the CPU channel (the group itself on a CPU)

    def part(self, n: int) -> int:
        """This rank's share of `n` (heads, channels) split evenly over the ranks."""
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (a row-parallel layer's partial products)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """Each rank's (rows, total / size rounded up) column block, side by side and cut
        to `total` columns (the vocabulary-parallel LM head's logits), on every rank."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :total]


SINGLE = TensorParallel()


def vocab_range(vocab: int, tp: TensorParallel) -> tuple[int, int]:
    """The token ids [start, stop) whose embedding rows (and LM-head rows) `tp.rank` holds:
    ceil(vocab / size) each, the last rank's cut short; every rank's block is padded to
    the same height so the gathered logits line up."""
    per = -(-vocab // tp.size)
    start = min(tp.rank * per, vocab)
    return start, min(start + per, vocab)


def padded_vocab_part(vocab: int, tp: TensorParallel) -> int:
    return -(-vocab // tp.size)
