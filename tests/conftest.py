"""Shared test setup: the Triton interpreter on CPU, and deterministic torch."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

torch.set_num_threads(max(1, os.cpu_count() or 1))

from hypothesis import settings  # noqa: E402

# CI replays the same examples every run (a landing must not hinge on a lucky draw);
# local runs keep exploring new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
