"""make bench-quant's code path at a tiny size: a GGUF file of the tests' tiny model (Q4_1
projections) through every format, the report's rows and ratios."""

from __future__ import annotations

from omnibus.bench import quant
from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf


def test_the_smoke_run_reports_every_format(tmp_path):
    hf = make_checkpoint(tmp_path / "m", "llama", vocab_size=384)
    gguf = write_gguf(hf, tmp_path / "tiny.gguf", projection_type="Q4_1")
    out = tmp_path / "quant.md"
    quant.main(["--smoke", "--gguf", str(gguf), "--out", str(out)])
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| tiny |")]
    assert [r.split(" | ")[1] for r in rows] == list(quant.SMOLLM2_FORMATS)
    fp32 = rows[0].split(" | ")
    assert fp32[3] == "1.00" and fp32[-1] == "1.00 |"  # its own ratio and agreement
    assert "## Where a batch-1 decode step goes (tiny " in text
