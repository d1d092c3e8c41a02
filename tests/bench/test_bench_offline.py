"""`make bench-offline` pieces that run without the transformers peers: the host-work
measurement and the markdown writer, which keeps the hand-written analysis."""

from omnibus.bench.offline import KEEP_MARKER, host_work_per_step, write_markdown
from tests.checkpoints import make_checkpoint


def test_host_work_is_measured_per_batch_size_and_leaves_nothing_running(tmp_path):
    path = make_checkpoint(tmp_path / "m", "llama")
    out = host_work_per_step(path, batch_sizes=(2, 5), prompt_len=8, steps=3)
    assert list(out) == [2, 5]
    for times in out.values():
        assert set(times) == {"schedule", "prepare", "update", "model"}
        assert all(v > 0 for v in times.values())


def test_rewrite_keeps_the_text_below_the_marker(tmp_path):
    doc = tmp_path / "offline.md"
    doc.write_text("# old numbers\n" + KEEP_MARKER + "\n\n## Why\nhand-written analysis\n")
    r = {"omnibus_tok_s": 500.0, "hf_static_tok_s": 250.0, "hf_continuous_tok_s": 125.0, "vs_hf_static": 2.0,
         "vs_hf_continuous": 4.0, "matmul_gflops": 180.0, "matmul_params": 18.7e6, "output_tokens": 100,
         "scheduler_ms_per_step_256": 0.7, "share_of_matmul_peak": 0.1, "share_of_matmul_peak_all_tokens": 0.3,
         "host_ms_per_decode_step": {64: {"schedule": 0.1, "prepare": 0.2, "update": 0.2, "model": 40.0}},
         "env": {"cores": 2, "torch": "x", "threads": 2}}
    write_markdown(doc, r, 64)
    text = doc.read_text()
    assert "old numbers" not in text and "| 64 | 0.10 | 0.20 | 0.20 | 0.50 | 40.0 |" in text
    assert text.endswith(KEEP_MARKER + "\n\n## Why\nhand-written analysis\n")
