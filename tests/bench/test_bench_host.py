"""`make bench-host`'s unloaded-TTFT part at a tiny size, against real engine and router
processes on the null model, and the report writer that rewrites only its own section.
Nothing here asserts on a timing: only that each path was measured and what was kept."""

import json
import math

from omnibus.bench.host import (
    TTFT_MARKER,
    build_model,
    floor_process,
    unloaded_ttft,
    write_markdown,
)
from omnibus.bench.processes import engine_and_router

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
