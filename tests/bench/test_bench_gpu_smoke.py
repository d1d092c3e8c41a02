"""`make bench-gpu` stays runnable: the same script at a tiny shape on the CPU."""

from omnibus.bench.gpu import main


def test_gpu_benchmark_runs_end_to_end_at_a_tiny_shape(tmp_path):
    out = tmp_path / "gpu.md"
    # The transformers peers are skipped here (their CPU warm-up alone takes ~20 s);
    # bench/peers.py runs in `make bench-offline`.
    r = main(["--smoke", "--requests", "4", "--skip-hf", "--out", str(out)])
    assert [d["batch"] for d in r["decode"]] == [1, 2, 4]
    assert all(d["overlap_ms"] > 0 and d["lockstep_ms"] > 0 and d["roofline_ms"] > 0 for d in r["decode"])
    assert r["omnibus_tok_s"] > 0 and "hf_static_tok_s" not in r
    assert set(r["lora"]) == {"base_tok_s", "8_adapters_tok_s", "8_vs_base", "32_adapters_tok_s", "32_vs_base"}
    assert "Decode step vs roofline" in out.read_text()
