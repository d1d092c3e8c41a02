"""bench/omnibus/bench/fairness.py's in-process noisy-neighbour study at a tiny size: it runs both
step budgets, counts B's requests and leaves nothing unaccounted (counts, never timings)."""

from __future__ import annotations

import json

from omnibus.bench import fairness
from tests.checkpoints import make_checkpoint


def test_the_in_process_noisy_neighbour_reports_every_budget(tmp_path, monkeypatch):
    path = make_checkpoint(tmp_path / "m", "llama")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    monkeypatch.setattr(fairness, "NOISY_STEP_TOKENS", (64, 32))
    out = fairness.noisy_in_process(path, vocab, seconds=1.5)
    assert list(out) == ["64 tok/step", "32 tok/step"]
    for row in out.values():
        assert row["b_done"] >= 1 and 1 <= row["b_steps_p50"] <= row["b_steps_max"]
        assert row["step_p50_ms"] <= row["step_max_ms"]
