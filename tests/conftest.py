"""Shared test setup: the Triton interpreter on CPU, and deterministic torch."""
import os

import torch

# Without a GPU, Triton kernels run in the interpreter (set before triton is imported; torch
# does not import it). On a CUDA host (`make test-gpu`) they must be compiled for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs several workers) each worker takes one thread, and so
# does every engine, router or script a test starts (OMP_NUM_THREADS, inherited; a test that
# sets its own keeps it): the workers and their processes share the cores, and torch's
# default of one OpenMP thread per core oversubscribes them. Its threads spin while they
# wait, so two 2-thread engines on 2 busy cores ran test_continuation's 6,000-token
# reference in 23.5 s against 3.6 s with one thread each.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
else:
    torch.set_num_threads(max(1, os.cpu_count() or 1))

from hypothesis import settings  # noqa: E402

# CI replays the same examples every run (a landing must not hinge on a lucky draw);
# local runs keep exploring new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


# `make test` runs files on parallel workers (pytest-xdist, --dist loadfile) in collection
# order; these take the longest (mostly waiting on processes: drains, stalls, partitions),
# so they start first instead of leaving one worker busy after the others have finished.
SLOW_FIRST = (
    "tests/e2e/test_continuation.py", "tests/e2e/test_continuation_stalled.py", "tests/e2e/test_partition.py", "tests/bench/test_gpu_check_smoke.py",
    "tests/e2e/test_e2e_failures.py", "tests/bench/test_soak.py", "tests/e2e/test_real_model.py",
    "tests/e2e/test_mix.py", "tests/e2e/test_tensor_parallel_serving.py", "tests/oracle/test_tensor_parallel.py", "tests/unit/core/test_rope_tables.py", "tests/e2e/test_openai_http.py",
    "tests/bench/test_bench_host.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    root = config.rootpath
    items.sort(key=lambda item: rank.get(item.path.relative_to(root).as_posix(), len(rank)))
