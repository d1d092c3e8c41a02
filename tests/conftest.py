"""Shared test setup: the Triton interpreter on CPU, and deterministic torch."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

torch.set_num_threads(max(1, os.cpu_count() or 1))
