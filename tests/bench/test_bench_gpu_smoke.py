"""`make bench-gpu` stays runnable: the same script at a tiny shape on the CPU."""

import json

import pytest

from omnibus.bench.gpu import main


def test_gpu_benchmark_runs_end_to_end_at_a_tiny_shape(tmp_path):
    out = tmp_path / "gpu.md"
    # The transformers peers are skipped here (their CPU warm-up alone takes ~20 s);
    # bench/peers.py runs in `make bench-offline`.
    r = main(["--smoke", "--requests", "4", "--skip-hf", "--out", str(out)])
    assert [d["batch"] for d in r["decode"]] == [1, 2, 4]
    assert all(d["overlap_ms"] > 0 and d["lockstep_ms"] > 0 and d["roofline_ms"] > 0 for d in r["decode"])
    assert r["offline_omnibus_tok_s"] > 0 and "hf_static_tok_s" not in r
    assert set(r["lora"]) == {"base_tok_s", "8_adapters_tok_s", "8_vs_base", "32_adapters_tok_s", "32_vs_base"}
    assert "Decode step vs roofline" in out.read_text()
    assert json.loads(out.with_suffix(".json").read_text()) == r


def test_sections_run_separately_and_accumulate(tmp_path):
    """Each section can be its own command (a 10-minute limit per command on GPU hosts):
    results and markdown are written after each one and later runs add to them."""
    out = tmp_path / "gpu.md"
    first = main(["--smoke", "--requests", "2", "--sections", "roofline", "--out", str(out)])
    assert "roofline_copy_bandwidth_gb_s" in first and "decode" not in first
    assert "copy bandwidth" in out.read_text() and "Decode step" not in out.read_text()
    both = main(["--smoke", "--requests", "2", "--sections", "decode", "--out", str(out)])
    assert both["roofline_copy_bandwidth_gb_s"] == first["roofline_copy_bandwidth_gb_s"]
    assert [d["batch"] for d in both["decode"]] == [1, 2, 4]
    text = out.read_text()
    assert "copy bandwidth" in text and "Decode step vs roofline" in text and "Multi-LoRA" not in text
    with pytest.raises(SystemExit):
        main(["--smoke", "--sections", "decode,nope"])
