"""`make bench-gpu` stays runnable: the same script at a tiny shape on the CPU. Every
section end to end (hf included, through the command line) runs in
tests/bench/test_gpu_check_smoke.py, which drives it as scripts/gpu_check.sh does."""

import json

import pytest

from omnibus.bench.gpu import main


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


def test_smoke_and_full_results_never_mix(tmp_path):
    """A results file from a GPU run is never added to by a smoke run (or the reverse)."""
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "smoke": False}))
    with pytest.raises(SystemExit, match="never mix"):
        main(["--smoke", "--sections", "roofline", "--json", str(path)])
    assert json.loads(path.read_text()) == {"device": "NVIDIA H100 80GB HBM3", "smoke": False}


def test_a_failed_matmul_table_is_recorded_and_the_other_still_measured(tmp_path, monkeypatch):
    """The quant section on a one-shot loan: W4A16 failing leaves its error in the results,
    FP8 is still measured, and the command fails (so gpu_check records the part as failed)."""
    from omnibus.bench import matmul

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(matmul, "w4a16_rows", broken)
    path = tmp_path / "bench.json"
    with pytest.raises(SystemExit, match="quant section failed: w4a16: RuntimeError: no kernel today"):
        main(["--smoke", "--sections", "quant", "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["w4a16_error"] == "RuntimeError: no kernel today" and "w4a16" not in result
    assert [(f["out"], f["tokens"]) for f in result["fp8"]] == [(48, 16), (48, 64), (100, 16), (100, 64)]
