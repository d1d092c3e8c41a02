"""A short soak (bench/omnibus/bench/soak.py): router + 2 null-model engines under the mixed workload
(streams, client cancels, deadlines, Embed, overload bursts) for ~10 s (two overload bursts, five samples); no growth past
the tolerances, every KV block free at the end, every call an expected status.
`make soak DURATION=600` runs the long one."""

from __future__ import annotations

from omnibus.bench import soak


def test_a_short_soak_leaks_nothing(tmp_path):
    run = soak.run(10.0, tmp_path)
    assert run.failures == [], soak.report(run)
    assert run.final is not None and run.final.free_blocks == run.total_blocks
    for kind in ("full_stream:OK", "cancelled_stream:CANCELLED",
                 "deadline_stream:DEADLINE_EXCEEDED", "embed:OK", "burst:RESOURCE_EXHAUSTED"):
        assert run.outcomes[kind] > 0, f"the workload never produced {kind}: {run.outcomes}"
