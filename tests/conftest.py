"""Shared test setup: the Triton interpreter on CPU, and deterministic torch."""
import os

import torch

# Without a GPU, Triton kernels run in the interpreter (set before triton is imported; torch
# does not import it). On a CUDA host (`make test-gpu`) they must be compiled for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, os.cpu_count() or 1))

from hypothesis import settings  # noqa: E402

# CI replays the same examples every run (a landing must not hinge on a lucky draw);
# local runs keep exploring new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
