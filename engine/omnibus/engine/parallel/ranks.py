"""The ranks of a tensor-parallel engine: processes the engine starts and owns.

Rank 0 is the engine's own model runner (the scheduler, the block allocator and the step
loop stay there, unchanged). It starts ranks 1..N-1 (`Ranks.start`), each a process that
loads its shard of the checkpoint onto its device and then does what rank 0 tells it,
call for call: rank 0's model is a `ShardedModel`, which first sends each forward's
inputs (the step's plan, once: token ids, positions, block tables, slot mapping) over
the group's CPU channel (gloo's broadcast) and then runs its own shard; every rank then
meets in the same all-reduces (NCCL on CUDA, gloo on the CPU). The rest of the system
sees one engine.

A rank that dies breaks the group: rank 0's next collective raises and the engine's step
loop ends as crashed (routers continue its streams elsewhere); one that hangs stalls the
step, which the watchdog ends. A rank dies with the process that started it
(PR_SET_PDEATHSIG) and leaves when rank 0 goes (its channel closes), so none is left
running.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from dataclasses import fields, replace
from typing import Any

import structlog
import torch

from omnibus.engine.config import EngineConfig, ModelConfig
from omnibus.engine.model.llama import ForwardBatch
from omnibus.engine.parallel.group import TensorParallel

log = structlog.get_logger(__name__)

# A collective that waits longer than this raises (a rank gone without closing its socket);
# the watchdog's bound ends a stalled step sooner.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)
JOIN_TIMEOUT_S = 120.0  # the ranks' processes must join the group within this


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """cuda:k+rank for an engine on cuda:k (the host's devices one per rank), or the CPU."""
    device = config.torch_device
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def check_devices(config: EngineConfig) -> None:
    """ValueError when the host has fewer devices than the ranks need."""
    size = config.tensor_parallel_size
    device = config.torch_device
    if size == 1 or device.type != "cuda":
        return
    first, have = device.index or 0, torch.cuda.device_count()
    if first + size > have:
        raise ValueError(f"--tensor-parallel-size {size} on {config.device} needs devices cuda:{first}.."
                         f"cuda:{first + size - 1}, but this host has {have} CUDA device(s)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANK_COMMAND = [sys.executable, "-m", "omnibus.engine.parallel.ranks"]  # a rank's process


def _join(config: EngineConfig, procs: list[subprocess.Popen], port: int) -> TensorParallel:
    """Rank 0 serves the group's store and waits until every rank has checked in, watching
    them meanwhile: one that exits first (it could not start) fails the start at once,
    naming its exit code, instead of leaving rank 0 waiting out the group's timeout."""
    import torch.distributed as dist

    size = config.tensor_parallel_size
    store = dist.TCPStore("127.0.0.1", port, size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                          wait_for_workers=False)
    keys = [f"rank-{r}-ready" for r in range(1, size)]
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not store.check(keys):
        exited = [(p.pid, p.returncode) for p in procs if p.poll() is not None]
        if exited:
            raise RuntimeError(f"tensor-parallel rank process(es) exited before joining the group "
                               f"(pid, exit code): {exited}; their output is above in this log")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks did not join the group within {JOIN_TIMEOUT_S:.0f} s")
        time.sleep(0.05)
    return init_group(config, 0, store)


def init_group(config: EngineConfig, rank: int, store: object) -> TensorParallel:
    """Join the engine's group through `store`: NCCL between CUDA devices (with a gloo group
    beside it for the CPU channel), gloo on the CPU."""
    import torch.distributed as dist

    cuda = config.torch_device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank,  # type: ignore[arg-type]
                            world_size=config.tensor_parallel_size, timeout=COLLECTIVE_TIMEOUT)
    cpu_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if cuda else dist.group.WORLD
    return TensorParallel(rank, config.tensor_parallel_size, dist.group.WORLD, cpu_group)


class Ranks:
    """Rank 0's handle on ranks 1..N-1: their processes and the channel to them."""

    def __init__(self, procs: list[subprocess.Popen], tp: TensorParallel) -> None:
        self.procs, self.tp = procs, tp
        self.closed = False

    @classmethod
    def start(cls, config: EngineConfig, model_config: ModelConfig) -> "Ranks":
        """Start ranks 1..N-1 (`python -m omnibus.engine.parallel.ranks`, handed their
        arguments on stdin: plain processes, so a daemonic step-loop process may start
        them) and join the group with them."""
        check_devices(config)
        port = _free_port()
        procs = []
        try:
            for rank in range(1, config.tensor_parallel_size):
                proc = subprocess.Popen(RANK_COMMAND, stdin=subprocess.PIPE)
                procs.append(proc)
                assert proc.stdin is not None
                proc.stdin.write(pickle.dumps((config, model_config, rank, port, os.getpid())))
                proc.stdin.close()
            tp = _join(config, procs, port)
        except BaseException:
            for proc in procs:
                proc.kill()
                proc.wait(timeout=5)
            raise
        log.info("tensor_parallel_group", size=tp.size, ranks=[p.pid for p in procs],
                 backend="nccl" if config.torch_device.type == "cuda" else "gloo")
        return cls(procs, tp)

    def dead(self) -> list[int]:
        """The pids of ranks that have exited."""
        return [p.pid for p in self.procs if p.poll() is not None]

    def send(self, message: tuple) -> None:
        """One message to every other rank (they act on it in order)."""
        import torch.distributed as dist

        dead = self.dead()
        if dead:
            raise RuntimeError(f"tensor-parallel rank process(es) {dead} died")
        try:
            dist.broadcast_object_list([message], src=0, group=self.tp.cpu_group)
        except RuntimeError as exc:  # gloo's words for a peer gone: name it
            dead = self.dead()
            raise RuntimeError(f"tensor-parallel rank process(es) {dead or 'of this engine'} "
                               f"{'died' if dead else 'broke the group'}: {exc}") from exc

    def close(self) -> None:
        """Stop the ranks (asked, then killed) and leave the group."""
        if self.closed:
            return
        self.closed = True
        try:
            if not self.dead():
                self.send(("stop",))
        except Exception:  # a broken group: the kill below ends them
            pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """End the ranks now (a start that failed) and leave the group."""
        self.closed = True
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=5)
        try:
            import torch.distributed as dist

            dist.destroy_process_group()
        except Exception:
            pass


class ShardedModel:
    """Rank 0's model under tensor parallelism: each call goes to every rank, then runs on
    rank 0's own shard (`local`). `caches` tells the ranks which of their KV caches a
    forward uses: the pool (`pool`), none (embeddings) or scratch ones of n blocks (the
    memory warm-ups)."""

    def __init__(self, local: torch.nn.Module, ranks: Ranks) -> None:
        self.local, self.ranks = local, ranks
        self.pool: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # rank 0's KV pool

    def __getattr__(self, name: str) -> Any:  # modules(), cfg, lm_head, ...: the local shard's
        return getattr(self.local, name)

    def __call__(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None) -> torch.Tensor:
        if kv_caches is None:
            caches: object = None
        elif kv_caches is self.pool:
            caches = "pool"
        else:
            caches = kv_caches[0][0].shape[0]
        self.ranks.send(("forward", host_batch(batch), caches))
        return self.local(batch, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        hidden = hidden.contiguous()
        self.ranks.send(("logits", tuple(hidden.shape), hidden.dtype))
        dist.broadcast(hidden, src=0, group=self.ranks.tp.group)
        return self.local.compute_logits(hidden)

    def allocate_pool(self, num_blocks: int) -> None:
        self.ranks.send(("pool", num_blocks))


_BATCH_TENSORS = [f.name for f in fields(ForwardBatch)
                  if f.name not in ("max_query_len", "lora", "attn_plan", "prompt_logprobs", "kv_marks")]


def host_batch(batch: ForwardBatch) -> ForwardBatch:
    """The forward's inputs as the other ranks need them: host tensors, without what only
    rank 0 uses (the attention plan is made by each rank's forward; prompt-logprob rows are
    scored through compute_logits)."""
    lora = None if batch.lora is None else batch.lora.runs  # each rank rebuilds it over its own slots
    return replace(on_device(batch, torch.device("cpu")), lora=lora, attn_plan=None, prompt_logprobs=None,
                   kv_marks=None)  # (a sharded pool's early holds advance at the step's end)


def on_device(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    """`batch` with its step tensors on `device` (no copy where they are already)."""
    return replace(batch, **{name: getattr(batch, name).to(device) for name in _BATCH_TENSORS})


def rank_main(config: EngineConfig, model_config: ModelConfig, rank: int, port: int, parent_pid: int) -> None:
    """A rank's process: join the group, load this rank's shard, then serve rank 0's calls."""
    _die_with(parent_pid)
    from omnibus.engine.worker.model_runner import ShardRuntime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False,
                          timeout=COLLECTIVE_TIMEOUT)
    store.set(f"rank-{rank}-ready", "1")
    tp = init_group(config, rank, store)
    runtime = ShardRuntime(config, model_config, tp, rank_device(config, rank))
    try:
        serve_rank(runtime, tp)
    except Exception as exc:  # the group broke (rank 0 gone): leave quietly
        log.info("tensor_parallel_rank_leaves", rank=rank, reason=repr(exc))
    finally:
        os._exit(0)


def serve_rank(runtime: Any, tp: TensorParallel) -> None:
    import torch.distributed as dist

    from omnibus.engine.kv_transfer.shards import serve_kv
    from omnibus.engine.lora.batch import LoraBatch
    from omnibus.engine.worker.kv_pool import copy_kv

    device = runtime.device
    box: list[Any] = [None]
    with torch.inference_mode():
        while True:
            dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
            message = box[0]
            kind = message[0]
            if kind == "forward":
                batch, caches = message[1], message[2]
                lora = None if batch.lora is None else LoraBatch(runtime.slots, batch.lora)
                runtime.model(replace(on_device(batch, device), lora=lora), runtime.caches(caches))
            elif kind == "logits":
                hidden = torch.empty(message[1], dtype=message[2], device=device)
                dist.broadcast(hidden, src=0, group=tp.group)
                runtime.model.compute_logits(hidden)
            elif kind == "graph":  # a padded decode step on the rank's static buffers
                runtime.graphs.run(on_device(message[1], device))
            elif kind == "pool":
                runtime.allocate_pool(message[1])
            elif kind == "graphs":
                runtime.build_graphs(*message[1:])
            elif kind == "host_pool":
                runtime.allocate_host_pool(message[1])
            elif kind == "kv_copies":
                copy_kv(runtime.pool, runtime.host, message[1])
            elif kind == "lora_fill":
                runtime.slots.fill(message[1], message[2])
            elif kind == "lora_clear":
                runtime.slots.clear(message[1])
            elif kind.startswith("kv_"):  # KV that moves: this rank's shard of it
                serve_kv(runtime, tp.rank, message,
                         lambda obj: dist.gather_object(obj, None, dst=0, group=tp.cpu_group))
            elif kind == "stop":
                return


def _die_with(parent_pid: int) -> None:
    """SIGKILL this rank when the process that started it dies, however it dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(1)


if __name__ == "__main__":  # a rank's process (Ranks.start): its arguments come on stdin
    rank_main(*pickle.loads(sys.stdin.buffer.read()))
