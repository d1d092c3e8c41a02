"""Loading the engine a server serves: the model, its warm-up and its --preload-adapters,
with every failure turned into an `EngineLoadError` that says what to fix. The server's
process loads it for `--step-loop thread`, the step-loop process for `--step-loop process`
(step_loop_runners.py)."""

from __future__ import annotations

import time
from pathlib import Path

from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import AdapterError, Engine

PRELOAD_TIMEOUT_S = 300.0


class EngineLoadError(Exception):
    """The engine could not be built: the message says what to fix."""


def load_engine(config: EngineConfig) -> Engine:
    """The engine of `config`, warmed up, with its --preload-adapters in host memory.
    Raises EngineLoadError."""
    if config.adapter_dir is not None and not Path(config.adapter_dir).is_dir():
        raise EngineLoadError(f"--adapter-dir {config.adapter_dir} is not a directory")
    if config.device.startswith("cuda"):
        _check_cuda(config.device)
    if config.load_format == "null" and config.device == "cpu":
        import torch

        # The null model's CPU tensors are a few hundred elements: more intra-op threads
        # only add the CPU they spin on (on a GPU these ops are the device's), which would
        # count against the host path the null model exists to measure.
        torch.set_num_threads(1)
    try:
        engine = Engine(config)
        engine.warmup()
    except AdapterError as exc:  # a --preload-adapters adapter this engine cannot serve
        raise EngineLoadError(f"--preload-adapters: {exc}") from exc
    except (OSError, ValueError) as exc:  # ModelLoadError
        raise EngineLoadError(f"cannot load {config.model}: {exc}") from exc
    except LookupError as exc:  # UnknownAdapterError: a --preload-adapters name
        raise EngineLoadError(f"--preload-adapters: {exc}") from exc
    except (MemoryError, RuntimeError) as exc:
        if not _out_of_memory(exc):
            raise
        raise EngineLoadError(
            f"cannot load {config.model}: out of {config.device} memory "
            f"({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}); the weights, "
            "the KV pool (--kv-cache-memory, --num-kv-blocks) and the rotary tables, one row per position "
            "up to --max-model-len (default: config.json's max_position_embeddings), must fit: lower "
            "those or use a larger device") from exc
    preload(engine)
    return engine


def _out_of_memory(exc: BaseException) -> bool:
    """torch's allocation failures: torch.OutOfMemoryError (CUDA), a RuntimeError from the
    CPU allocator, or Python's MemoryError."""
    import torch

    return (isinstance(exc, (MemoryError, torch.OutOfMemoryError))
            or "can't allocate memory" in str(exc) or "out of memory" in str(exc))


def _check_cuda(device: str) -> None:
    """EngineLoadError when `device` (cuda or cuda:N) is not a GPU this process can use."""
    import torch

    if not torch.cuda.is_available():
        why = ("this torch build has no CUDA" if torch.version.cuda is None
               else f"torch (CUDA {torch.version.cuda}) finds no GPU: check the driver and CUDA_VISIBLE_DEVICES")
        raise EngineLoadError(f"--device {device}: {why}; use --device cpu to run on the CPU")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise EngineLoadError(f"--device {device}: there are {torch.cuda.device_count()} GPUs "
                              f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")


def preload(engine: Engine, timeout: float = PRELOAD_TIMEOUT_S) -> None:
    """Waits until the --preload-adapters (whose loads Engine() started) are in host
    memory. Raises EngineLoadError naming an adapter that failed to load. Runs before the
    step loop starts, so polling the manager here is safe."""
    from omnibus.engine.lora import AdapterLoadError

    adapters = engine.adapters
    pending = list(engine.config.preload_adapters) if adapters is not None else []
    end = time.monotonic() + timeout
    while pending:
        for name in list(pending):
            try:
                if adapters.ready(name):
                    pending.remove(name)
            except AdapterLoadError as exc:
                raise EngineLoadError(f"cannot preload adapter {name!r}: {exc.reason}") from exc
        if pending and time.monotonic() > end:
            raise EngineLoadError(f"preloading {pending} took more than {timeout:.0f} s")
        time.sleep(0.005)
