"""The heap of a long-running process, out of the garbage collector's way."""

from __future__ import annotations

import gc


def freeze_heap() -> None:
    """Moves every object alive now (modules, the model, the tokenizer, the KV bookkeeping)
    out of the cyclic garbage collector's reach, after one last collection. A full
    collection then walks only what was allocated since: on a loaded null-model engine
    (185k tracked objects) one took 92 ms, a pause of its step loop. Call once, when the
    process has started serving."""
    gc.collect()
    gc.freeze()
