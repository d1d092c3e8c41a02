"""scripts/gpu_check.sh stays runnable (its --smoke dry run on the CPU goes through every
part) and omnibus.bench.gpu_report writes docs/benchmarks/gpu.md from what it returns,
never presenting a smoke run as GPU numbers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from omnibus.bench import gpu_report
from omnibus.bench.gpu import write_markdown

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
PARTS = ["env", "versions", "tests", "roofline", "quant", "offline", "lora"]
FILES = {"versions.json", "parts.jsonl", "tests.xml", "bench.json", "log.txt"}


def run_script(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--smoke", *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OUT=str(out), GPU_CHECK_PY=sys.executable, **env))


def parts(out: Path) -> dict[str, dict]:
    return {p["part"]: p for p in map(json.loads, (out / "parts.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu-check")
    done = run_script(out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_the_smoke_run_goes_through_every_part_and_says_it_is_one(smoke, tmp_path):
    assert {p.name for p in smoke.iterdir()} == FILES  # the device tool returns at most 8 files
    versions = json.loads((smoke / "versions.json").read_text())
    assert versions["smoke"] is True and versions["cuda"] is False and versions["device"] == "cpu"
    assert versions["omnibus_import"].startswith("ok") and versions["torch"] and versions["triton"]
    assert versions["parts"] == ["tests", "roofline", "quant", "offline", "lora"]

    recorded = parts(smoke)
    assert list(recorded) == PARTS
    assert all(p["status"] == "ok" and p["rc"] == 0 and p["smoke"] is True for p in recorded.values())
    assert "every GPU test reports skipped" in recorded["tests"]["note"]
    assert "smoke" in recorded["roofline"]["note"] and "no idle share" in recorded["roofline"]["note"]

    # The GPU tests were collected and each one skipped for want of CUDA, file by file.
    suites = ET.parse(smoke / "tests.xml").getroot().findall("testsuite")
    assert [s.get("file") for s in suites] == ["tests/gpu/test_kernels_gpu.py", "tests/gpu/test_engine_gpu.py"]
    cases = list(ET.parse(smoke / "tests.xml").getroot().iter("testcase"))
    assert len(cases) >= 10
    assert all("CUDA" in c.find("skipped").get("message") for c in cases)

    bench = json.loads((smoke / "bench.json").read_text())
    assert bench["smoke"] is True and bench["device"] == "cpu" and bench["shape"] == "tiny"
    assert [d["batch"] for d in bench["decode"]] == [1, 2, 4]
    assert all(d["overlap_ms"] > 0 and d["lockstep_ms"] > 0 and d["roofline_ms"] > 0 for d in bench["decode"])
    for key in ("offline_omnibus_tok_s", "hf_continuous_tok_s", "hf_static_tok_s"):
        assert bench[key] > 0, key
    assert bench["offline_requests"] == 2 and bench["hf_static_requests"] == 1
    assert bench["lora"]["8_adapters_tok_s"] > 0 and bench["lora"]["32_adapters_tok_s"] > 0
    # W4A16 (the Triton kernel interpreted) and FP8 (_scaled_mm) beside dense, tiny shapes
    assert [(w["out"], w["tokens"]) for w in bench["w4a16"]] == [(n, t) for n in (48, 100) for t in (1, 16, 64)]
    assert all(w["w4a16_us"] > 0 and w["dense_us"] > 0 and w["w4a16_weight_gb_s"] > 0 for w in bench["w4a16"])
    assert [(f["out"], f["tokens"]) for f in bench["fp8"]] == [(n, t) for n in (48, 100) for t in (16, 64)]
    assert all(f["fp8_us"] > 0 and f["fp8_quant_us"] > 0 and f["dense_us"] > 0 for f in bench["fp8"])
    assert "w4a16_error" not in bench and "fp8_error" not in bench
    assert set(bench["section_seconds"]) == {"roofline", "quant", "decode", "offline", "hf", "lora"}

    # `make bench-gpu`'s own markdown from the same results, every section present
    markdown = tmp_path / "bench-gpu.md"
    write_markdown(markdown, bench)
    text = markdown.read_text()
    for heading in ("copy bandwidth", "Decode step vs roofline", "Weight-format matmuls", "Offline throughput",
                    "Multi-LoRA"):
        assert heading in text, heading

    log = (smoke / "log.txt").read_text()
    assert "CPU SMOKE RUN" in log and "needs a CUDA device" in log
    assert "CPU SMOKE RUN, not GPU numbers" in log.split("== summary")[1]  # the closing table


def test_the_report_refuses_a_smoke_run_without_the_flag(smoke, tmp_path):
    out = tmp_path / "gpu.md"
    assert gpu_report.main(["--in", str(smoke), "--out", str(out)]) == 2
    assert not out.exists()
    assert subprocess.run([sys.executable, "-m", "omnibus.bench.gpu_report", "--in", str(smoke), "--out",
                           str(out)], capture_output=True).returncode == 2
    assert not out.exists()


def test_a_report_from_a_smoke_run_is_labelled_on_every_number(smoke, tmp_path):
    out = tmp_path / "gpu.md"
    assert gpu_report.main(["--in", str(smoke), "--out", str(out), "--allow-smoke"]) == 0
    text = out.read_text()
    assert text.startswith("# CPU SMOKE RUN, not GPU numbers")
    for heading in ("## GPU tests", "## Decode step vs roofline", "## Weight-format matmuls", "## Offline throughput",
                    "## Multi-LoRA"):
        assert heading in text
    assert_device_on_every_number(text, "cpu (CPU SMOKE RUN, not GPU numbers)")


def assert_device_on_every_number(text: str, device: str) -> None:
    """Every table row and headline after the machine and parts tables names the device."""
    lines = text.split("## GPU tests", 1)[1].splitlines()
    separators = {i for i, line in enumerate(lines) if line.startswith("|--")}
    rows = [line for i, line in enumerate(lines)  # a header (above a separator) may say "W4A16"
            if line.startswith("| ") and re.search(r"\d", line) and i + 1 not in separators]
    assert rows and all(device in line for line in rows)
    headline = text.split("## Headline", 1)[1].split("## Machine", 1)[0]
    items = [line for line in headline.splitlines() if line.startswith("- ")]
    assert items and all(device in line for line in items)


def test_a_part_cut_by_its_cap_is_recorded_and_the_rest_still_returns(tmp_path):
    """A part over its cap is killed and recorded as cut; what ran before it stays, and a
    test file its cap kills is an error in tests.xml, not a silent gap."""
    done = run_script(tmp_path, "--parts", "tests,roofline", GPU_CHECK_CAP_tests="1", GPU_CHECK_CAP_roofline="1",
                      GPU_CHECK_MIN_PART="0")
    assert done.returncode == 1  # not every part ok
    recorded = parts(tmp_path)
    assert list(recorded) == ["env", "versions", "tests", "roofline"]
    assert recorded["versions"]["status"] == "ok"
    assert recorded["tests"]["status"] == "timeout" and recorded["roofline"]["status"] == "timeout"
    assert recorded["roofline"]["rc"] in (124, 137)
    suites = ET.parse(tmp_path / "tests.xml").getroot().findall("testsuite")
    assert [s.get("name") for s in suites if s.get("name").endswith("(cut)")]
    if (tmp_path / "bench.json").exists():  # the copy-bandwidth section may end inside 1 s:
        assert "decode" not in json.loads((tmp_path / "bench.json").read_text())  # kept, the rest cut
    assert gpu_report.main(["--in", str(tmp_path), "--out", str(tmp_path / "r.md"), "--allow-smoke"]) == 0
    text = (tmp_path / "r.md").read_text()
    assert "No results: the roofline part was cut by its time cap" in text and "killed by its time cap" in text


# A GPU run's files as the script writes them (numbers invented, in tmp_path only).
H100 = "NVIDIA H100 80GB HBM3"


def fake_gpu_run(root: Path, device: str = H100, bench: dict | None = None, tests: bool = True) -> Path:
    root.mkdir(parents=True)
    (root / "versions.json").write_text(json.dumps({
        "smoke": False, "cuda": True, "device": device, "driver": "580.159.04", "cuda_runtime": "13.0",
        "torch": "2.11.0+cu130", "triton": "3.6.0", "transformers": "5.17.0", "memory_gib": 79.2,
        "capability": "9.0", "notes": [], "budget_s": 320, "date_utc": "2026-12-01 10:00:00", "commit": "abc1234"}))
    (root / "parts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in [
        {"part": "env", "status": "ok", "rc": 0, "seconds": 4, "cap": 90, "smoke": False, "note": ""},
        {"part": "tests", "status": "failed", "rc": 1, "seconds": 70, "cap": 150, "smoke": False, "note": ""}]))
    if tests:
        (root / "tests.xml").write_text(
            '<testsuites><testsuite name="pytest" file="tests/gpu/test_kernels_gpu.py">'
            '<testcase classname="k" name="test_store_kv[dtype0]" time="1.5"/>'
            '<testcase classname="k" name="test_rope_serving[1-dtype1]" time="0.5">'
            '<failure message="AssertionError: rel err 0.03">trace</failure></testcase>'
            '</testsuite></testsuites>')
    bench = bench if bench is not None else {
        "roofline_copy_bandwidth_gb_s": 3000.0, "decode_prompt_len": 512,
        "decode": [{"batch": 1, "overlap_ms": 8.0, "lockstep_ms": 9.0, "roofline_ms": 5.0, "of_roofline": 0.625,
                    "overlap_idle": 0.02, "lockstep_idle": 0.12}],
        "offline_requests": 200, "offline_omnibus_tok_s": 9000.0, "offline_gpu_idle_share": 0.05,
        "hf_continuous_tok_s": 3000.0, "hf_static_tok_s": 1500.0}
    (root / "bench.json").write_text(json.dumps({"device": device, "smoke": False, "cuda": True,
                                                 "shape": "llama-3-8b", "dtype": "bfloat16", **bench}))
    return root


def test_a_gpu_run_makes_the_report_with_its_device_on_every_number(tmp_path):
    run = fake_gpu_run(tmp_path / "run1")
    out = tmp_path / "gpu.md"
    assert gpu_report.main(["--in", str(run), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith(f"# GPU check on {H100}") and "SMOKE" not in text
    assert f"Batch-1 decode on {H100}: 8.00 ms per step, 62.5% of the measured copy bandwidth (3000 GB/s" in text
    assert "3.00× transformers continuous batching, 6.00× transformers static `generate`" in text
    assert "batch 1: 2.0% vs 12.0%" in text and "1 passed, 1 failed, 0 errors" in text
    assert "| test_kernels_gpu.py::test_rope_serving[1-dtype1] | " + H100 + " | failed | 0.5 | AssertionError" in text
    assert "No results: the lora part was not run" in text and "No results: the quant part was not run" in text
    assert_device_on_every_number(text, H100)


def test_a_rerun_adds_to_the_first_run_and_other_devices_never_mix(tmp_path):
    first = fake_gpu_run(tmp_path / "run1")
    rerun = fake_gpu_run(tmp_path / "run2", tests=False, bench={
        "lora_requests": 128, "lora_rank": 16,
        "lora": {"base_tok_s": 8000.0, "8_adapters_tok_s": 6000.0, "8_vs_base": 0.75,
                 "32_adapters_tok_s": 4000.0, "32_vs_base": 0.5},
        "quant_dtype": "bfloat16",
        "w4a16": [{"out": 4096, "in": 4096, "tokens": 1, "group": 128, "w4a16_us": 4.0, "dense_us": 12.0,
                   "w4a16_speedup": 3.0, "w4a16_weight_gb_s": 2200.0, "dense_weight_gb_s": 2800.0,
                   "w4a16_of_bandwidth": 0.55, "dense_of_bandwidth": 0.7}],
        "fp8": [{"out": 4096, "in": 4096, "tokens": 2048, "fp8_us": 60.0, "fp8_quant_us": 9.0, "dense_us": 110.0,
                 "fp8_speedup": 1.83, "fp8_tflops": 1145.0, "dense_tflops": 625.0}]})
    out = tmp_path / "gpu.md"
    assert gpu_report.main(["--in", str(first), "--in", str(rerun), "--out", str(out)]) == 0
    text = out.read_text()
    assert "62.5% of the measured copy bandwidth" in text and f"| 32 | {H100} | 4000 | 0.50 |" in text
    assert "1 passed, 1 failed, 0 errors" in text  # the first run's tests stay
    assert (f"W4A16 decode on {H100} (4096x4096, T=1): 4.0 us, 3.00× bfloat16 dense; weight bytes at 2200 GB/s "
            "= 55.0% of the measured copy bandwidth (bfloat16: 70.0%)") in text
    assert f"FP8 GEMM on {H100} (4096x4096, T=2048): 1.83× bfloat16 (1145 vs 625 TFLOP/s)" in text
    assert f"| 4096x4096 | 2048 | {H100} | 60.0 | 9.0 | 110.0 | 1.83× | 1145.0 | 625.0 |" in text
    assert_device_on_every_number(text, H100)

    other = fake_gpu_run(tmp_path / "h200", device="NVIDIA H200")
    assert gpu_report.main(["--in", str(first), "--in", str(other), "--out", str(tmp_path / "x.md")]) == 2
    mislabelled = fake_gpu_run(tmp_path / "mixed")
    bench = json.loads((mislabelled / "bench.json").read_text())
    (mislabelled / "bench.json").write_text(json.dumps(dict(bench, device="NVIDIA H200")))
    assert gpu_report.main(["--in", str(mislabelled), "--out", str(tmp_path / "y.md")]) == 2
    assert not (tmp_path / "x.md").exists() and not (tmp_path / "y.md").exists()
    assert gpu_report.main(["--in", str(tmp_path / "nothing-here"), "--summary"]) == 2
