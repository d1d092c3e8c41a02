"""`make bench-host`'s unloaded-TTFT and GPU-paced parts at a tiny size, against real
engine and router processes on the null model, and the report writer that rewrites only
the part a run measured.
Nothing here asserts on a timing: only that each path was measured and what was kept."""

import json
import math
import os

from omnibus.bench.host import (
    NOTES_MARKER,
    OUTPUT_LEN,
    PACED_MARKER,
    REQUESTS_MARKER,
    TTFT_MARKER,
    build_model,
    floor_process,
    measure_paced,
    measure_requests,
    unloaded_ttft,
    write_markdown,
)
from omnibus.bench.processes import engine_and_router, step_loop_pid
from omnibus.bench.report import machine

PATHS = ("in_process", "engine_grpc", "router_grpc", "floor_bidi", "floor_unary_stream")


def test_unloaded_ttft_times_every_request_on_each_path(tmp_path):
    model = build_model(tmp_path / "model", vocab_size=300)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    flags = ("--load-format", "null", "--max-num-seqs", "8")
    with engine_and_router(model, tmp_path, flags) as (engine, router), floor_process(tmp_path) as floor:
        out = unloaded_ttft(model, flags, engine.address, router.address, floor.address, vocab,
                            n=3, warmup=1)
    assert (out["requests"], out["warmup"]) == (3, 1)
    for path in PATHS:
        assert out[path]["n"] == 3
        assert math.isfinite(out[path]["p50_ms"]) and out[path]["p99_ms"] >= out[path]["p50_ms"]
    assert set(out["diffs"]) >= {"engine_hop_above_floor", "router_hop_above_floor"}


def _ttft(label: str) -> dict:
    row = {"n": 1, "p50_ms": 1.0, "p99_ms": 2.0}
    return {"label": label, "ttft": {"requests": 1, "warmup": 0, "prompt_len": 16,
                                     "max_tokens": 4, "gap_ms": 30.0} | {p: row for p in PATHS}}


def test_a_ttft_run_rewrites_only_its_section(tmp_path):
    doc = tmp_path / "host.md"
    doc.write_text("# the stream tables\n\n| 64 | 19,792 |\n")
    write_markdown(doc, _ttft("run-one"), None)
    write_markdown(doc, _ttft("run-two"), None)
    text = doc.read_text()
    assert text.startswith("# the stream tables\n\n| 64 | 19,792 |\n\n" + TTFT_MARKER)
    assert text.count(TTFT_MARKER) == 1 and "run-one" not in text
    assert "## Unloaded TTFT: run-two" in text and "| router added (c − b) | +0.000 | +0.000 |" in text
    assert "| router hop above its floor (c − b − e) | -1.000 | -2.000 |" in text


def test_a_streams_run_keeps_the_last_ttft_section(tmp_path):
    doc = tmp_path / "host.md"
    write_markdown(doc, _ttft("kept"), None)
    run = {"streams": 2, "ok": 2, "tokens_per_s": 10.0, "ttft_p50_ms": 1.0, "ttft_p99_ms": 1.0,
           "itl_p99_ms": 1.0, "cpu_us_per_token": {"router": 1.0, "engine": 1.0, "client": 1.0}}
    write_markdown(doc, {"label": "streams", "runs": [run]}, None)
    text = doc.read_text()
    assert text.startswith("# Host path") and "## Now: streams" in text
    assert text.index("## Now: streams") < text.index(TTFT_MARKER)
    assert "## Unloaded TTFT: kept" in text


def test_paced_runs_measure_each_engine_and_interval_and_the_streaming_floor():
    out = measure_paced(repeats=1, step_ms=2.0, intervals=(1, 3), streams=4, engine_seats=8)
    assert out["step_ms"] == 2.0 and out["overlap"] == [False, True]
    assert [(r["overlap"], r["stream_interval"]) for r in out["runs"]] == [
        (False, 1), (False, 3), (True, 1), (True, 3)]
    for run in out["runs"]:
        assert run["ok"] == 4 and run["tokens"] == 4 * OUTPUT_LEN and not run["errors"]
        # sent at once, the four streams share nearly every step of their own engine (steps
        # counted on another engine, or twice, would break this)
        assert run["tokens_per_step"] > 3
        assert run["ms_per_step"] >= 2.0  # the simulated device runs one step at a time
        assert set(run["cpu_us_per_token"]) >= {"router", "engine", "client"}
        assert run["step_loop_us_per_token"] > 0  # its named thread was found and ran
    lockstep_1, lockstep_3 = out["runs"][:2]
    assert lockstep_1["tokens_per_message"] < lockstep_3["tokens_per_message"]
    assert [f["step_ms"] for f in out["floor"]] == [2.0, 0.0]  # one per step, then flat out
    for floor in out["floor"]:
        assert floor["messages"] == 4 * OUTPUT_LEN and floor["cpu_us_per_message"] > 0
    paced, busy = out["floor"]
    assert paced["messages_per_s"] < busy["messages_per_s"]  # 4 streams at 500 steps/s at most


def _paced(label: str) -> dict:
    run = {"overlap": True, "stream_interval": 1, "ok": 2, "tokens_per_s": 10.0,
           "ms_per_step": 10.5, "ttft_p50_ms": 1.0, "itl_p50_ms": 1.0, "itl_p99_ms": 2.0,
           "tokens_per_step": 2.0, "tokens_per_message": 1.0,
           "cpu_us_per_token": {"router": 50.0, "engine": 20.0, "client": 40.0},
           "step_loop_us_per_token": 15.0}
    floors = [{"streams": 2, "step_ms": ms, "messages": 400, "messages_per_s": 1e4,
               "cpu_us_per_message": us} for ms, us in ((10.24, 40.0), (0.0, 25.0))]
    return {"label": label, "paced": {"step_ms": 10.24, "streams": 2, "intervals": [1],
                                      "overlap": [True], "runs": [run], "floor": floors}}


def test_a_paced_run_rewrites_only_its_part_between_the_others(tmp_path):
    doc = tmp_path / "host.md"
    doc.write_text("# the stream tables\n")
    write_markdown(doc, _ttft("ttft-kept"), None)
    write_markdown(doc, _paced("paced-one"), None)
    write_markdown(doc, _paced("paced-two"), None)
    text = doc.read_text()
    assert text.startswith("# the stream tables\n\n" + PACED_MARKER)
    assert text.count(PACED_MARKER) == 1 and "paced-one" not in text
    assert text.index("## At a GPU's pace: paced-two") < text.index("## Unloaded TTFT: ttft-kept")
    assert ("| overlapped | 1 | 10 | 10.5 | 1 | 1.0 | 2.0 | 2 | 1.00 | 50.0 | 20.0 | 15.0 | 40.0 | "
            "20,000 | 50,000 | 0 of 2 |") in text
    assert "spent 40.0 CPU µs per message when it sent one per stream every 10.24 ms" in text
    assert "and 25.0 when it sent them as fast as it could" in text


def test_notes_after_their_marker_survive_every_rewrite(tmp_path):
    doc = tmp_path / "host.md"
    write_markdown(doc, _paced("paced-one") | _ttft("ttft-one"), None)
    doc.write_text(doc.read_text() + "\n" + NOTES_MARKER + "\n\nWhat the numbers mean.\n")
    write_markdown(doc, _ttft("ttft-two"), None)
    write_markdown(doc, _paced("paced-two"), None)
    text = doc.read_text()
    assert text.index("paced-two") < text.index("ttft-two") < text.index(NOTES_MARKER)
    assert text.endswith(NOTES_MARKER + "\n\nWhat the numbers mean.\n")
    assert "paced-one" not in text and "ttft-one" not in text
    assert "and 25.0 when it sent them as fast as it could" in text


def test_the_report_names_the_machine_it_ran_on(tmp_path):
    """Numbers move with the VM: a report says which CPU measured them (its own, or this one's)."""
    doc = tmp_path / "host.md"
    run = {"streams": 2, "ok": 2, "tokens_per_s": 10.0, "ttft_p50_ms": 1.0, "ttft_p99_ms": 1.0,
           "itl_p99_ms": 1.0, "cpu_us_per_token": {"router": 1.0, "engine": 1.0, "client": 1.0}}
    write_markdown(doc, {"label": "a", "runs": [run], "machine": "Some CPU, 3 cores"}, None)
    assert "Machine: Some CPU, 3 cores, shared" in doc.read_text()
    here = machine()
    assert here.endswith(f", {os.cpu_count()} cores") and len(here) > len(f", {os.cpu_count()} cores")


def test_per_request_cost_at_a_tiny_scale_and_its_section(tmp_path):
    """One-token requests through a real router and engine, a closed loop of a few clients,
    beside a few streams on the same processes; the section goes in before the notes, and
    a later run of it rewrites only it."""
    model = build_model(tmp_path / "model", vocab_size=300)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    flags = ("--load-format", "null", "--max-num-seqs", "8")
    with (engine_and_router(model, tmp_path, flags) as (engine, router),
          floor_process(tmp_path) as floor):
        pids = {"router": router.proc.pid, "engine": engine.proc.pid, "client": os.getpid()}
        if (core := step_loop_pid(engine.proc.pid)) is not None:
            pids["engine_core"] = core
        out = measure_requests(router.address, engine.address, pids, vocab, repeats=2, n=12,
                               clients=3, floor=floor)
    assert (out["requests"], out["clients"], out["max_tokens"]) == (12, 3, 1)
    assert len(out["runs"]) == len(out["stream_runs"]) == len(out["floor"]) == 2
    for f in out["floor"]:
        # measured per thread to the nanosecond: 12 calls cost more than nothing
        assert (f["calls"], f["clients"]) == (12, 3) and f["calls_per_s"] > 0
        assert f["cpu_us_per_call"] > 0
    for run in out["runs"]:
        assert run["ok"] == 12 and run["tokens"] == 12 and not run["errors"]
        assert run["concurrency"] == 3 and run["requests_per_s"] > 0
        assert set(run["cpu_ms_per_request"]) >= {"router", "engine", "client"}
    for run in out["stream_runs"]:
        assert run["ok"] == 3 and run["tokens"] == 3 * OUTPUT_LEN
    doc = tmp_path / "host.md"
    doc.write_text("# the stream tables\n")
    write_markdown(doc, _ttft("ttft-kept"), None)
    doc.write_text(doc.read_text() + "\n" + NOTES_MARKER + "\n\nNotes.\n")
    write_markdown(doc, {"label": "req-one", "requests": out}, None)
    write_markdown(doc, {"label": "req-two", "requests": out}, None)
    text = doc.read_text()
    assert text.count(REQUESTS_MARKER) == 1 and "req-one" not in text
    assert (text.index("## Unloaded TTFT: ttft-kept") < text.index("## Per-request cost: req-two")
            < text.index(NOTES_MARKER))
    assert text.endswith(NOTES_MARKER + "\n\nNotes.\n")
    rows = [line for line in text.splitlines() if line.startswith(("| 1-token", "| 3 streams"))]
    assert len(rows) == 2 and all(row.endswith(" |") and row.count(" | ") == 12 for row in rows)
    assert rows[0].endswith("| 0 of 24 |") and rows[1].endswith("| 0 of 6 |")
    assert "One request of 1 token costs the router" in text
    assert "answering 12 unary-stream calls with one small message each, 3 in flight" in text
    write_markdown(doc, _ttft("ttft-two"), None)  # the TTFT part stops at this one's marker
    assert "## Per-request cost: req-two" in doc.read_text()
