"""bench-spec's rows on a tiny checkpoint: one row pair measures, and the report is
written from the numbers (the full run is `make bench-spec`)."""

from __future__ import annotations

import json

from omnibus.bench import speculative
from tests.checkpoints import make_checkpoint


def test_a_row_pair_measures_the_same_greedy_output_and_the_report_says_cpu(tmp_path, monkeypatch):
    echo = make_checkpoint(tmp_path / "echo", echo=True)
    monkeypatch.setattr(speculative, "BATCHES", (1,))
    rows = {}
    for spec in (None, "ngram"):
        rows[spec or "off"] = speculative.measure(echo, "repetitive", 1, spec, 384)
    assert rows["off"]["outputs_digest"] == rows["ngram"]["outputs_digest"]
    assert rows["ngram"]["acceptance"] > 0.9 and rows["ngram"]["steps"] < rows["off"]["steps"] / 2
    result = {"k": 4, "machine": "test", "rows": {"echo ceiling, batch 1": {
        "off": rows["off"], "ngram": rows["ngram"], "speedup": 2.0, "same_output": True}}}
    out = tmp_path / "speculative.md"
    out.with_suffix(".json").write_text(json.dumps(result))
    speculative.main(["--out", str(out), "--report-only"])
    text = out.read_text()
    assert "CPU only: no GPU was lent" in text and "| echo ceiling, batch 1 |" in text
