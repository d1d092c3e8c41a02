"""The strategies study's pieces that need no servers: its settings, the router's
tokenizer for the benchmark checkpoint, and the report written from results."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
from omnibus.bench import strategies, strategies_report
from omnibus.bench.__main__ import main as bench_main
from omnibus.bench.stats import RequestResult, summarize
from omnibus.bench.strategies import Point, StudyConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
COMMITTED, COMMITTED_RESULTS = DOCS / "strategies.md", DOCS / "strategies" / "results.json"


def test_scaled_settings():
    cfg = StudyConfig(out=Path("x.md"))
    assert cfg.caps == [4, 16, 64, 192]
    assert (cfg.input_len, cfg.mean_output) == (64, 16.0)
    # a full batch of the longest requests: 16 x ceil((64 + 192) / 16) blocks, + the null block
    assert cfg.kv_blocks == 16 * 16 + 1
    assert cfg.plots_dir == Path("x")


def test_settings_that_would_hang_static_are_refused():
    with pytest.raises(ValueError, match="multiple of batch_size"):
        StudyConfig(out=Path("x.md"), batch_size=16, rate_requests=20)
    with pytest.raises(ValueError, match="policies"):
        StudyConfig(out=Path("x.md"), policies=("greedy",))


def test_engine_flags_pass_batching_flags_only_where_they_apply():
    cfg = StudyConfig(out=Path("x.md"), window_ms=20)
    dyn = strategies.engine_flags(cfg, "dynamic")
    assert dyn[dyn.index("--batching") + 1] == "dynamic"
    assert dyn[dyn.index("--batch-window-ms") + 1] == "20"
    assert dyn[dyn.index("--max-batch-size") + 1] == "16"
    cont = strategies.engine_flags(cfg, "continuous")
    assert "--max-batch-size" not in cont and "--batch-window-ms" not in cont
    assert cont[cont.index("--num-kv-blocks") + 1] == str(cfg.kv_blocks)


def test_results_record_the_commands_as_the_report_shows_them():
    commands = strategies.shown_commands(StudyConfig(out=Path("x.md")))
    assert commands["engine"].startswith(
        "python -m omnibus.engine serve --port PORT --model MODEL --dtype float32 "
        "--batching POLICY --max-num-seqs 16 "
    )
    assert commands["router"] == (
        "python -m omnibus.router serve --port PORT --model MODEL --engine 127.0.0.1:PORT "
        "--max-inflight-per-engine 32 --max-queue-seconds 600.0 --log-level warning "
        "--drain-seconds 1"
    )


def test_tokenizer_covers_the_vocabulary(tmp_path):
    from tokenizers import Tokenizer

    strategies.write_tokenizer(tmp_path / "tokenizer.json", 50)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 50
    assert tok.decode([3, 49]) == "t3 t49"
    assert tok.decode([1, 5, 2]) == "t5"  # specials skipped


def _summary(tokens_per_request: int, ttft: float, n: int = 4) -> dict:
    results = [
        RequestResult(
            i,
            8,
            tokens_per_request,
            sent=0.0,
            token_times=[ttft + 0.01 * k for k in range(tokens_per_request)],
            token_counts=[1] * tokens_per_request,
            end=ttft + 0.01 * tokens_per_request,
        )
        for i in range(n)
    ]
    return summarize(results, duration=1.0)


def _engine(slots: int, useful: int) -> dict:
    return {
        "counters": {
            "num_steps": 10,
            "slots_stepped": slots,
            "useful_tokens": useful,
            "kv_tokens_stored": 50,
            "kv_tokens_reserved": 100,
        },
        "compute_utilization": useful / slots,
        "kv_efficiency": 0.5,
        "busy_fraction": 0.9,
        "idle_with_work_fraction": 0.1,
        "mean_running": 3.0,
    }


def test_report_from_results(tmp_path):
    cfg = StudyConfig(out=tmp_path / "strategies.md")
    points = []
    for i, policy in enumerate(strategies.POLICIES):
        caps = cfg.caps if policy in ("continuous", "static") else [max(cfg.caps)]
        for cap in caps:
            points.append(
                Point(
                    policy,
                    "burst",
                    cap,
                    None,
                    _summary(4 if policy == "continuous" else 2, 0.1),
                    _engine(40, 100),
                    1.0,
                )
            )
        for rate in (1.0, 2.0):
            points.append(
                Point(
                    policy,
                    "rate",
                    64,
                    rate,
                    _summary(3, 0.05 * (i + 1) * rate),
                    _engine(40, 100),
                    1.0,
                )
            )
    data = {
        "config": strategies._config_dict(cfg),
        "rates": [1.0, 2.0],
        "latency_cap": 64,
        "points": [asdict(p) for p in points],
        "commands": strategies.shown_commands(cfg),
        "started": 0.0,
        "elapsed_s": 60.0,
        "machine": {"cpu": "x86_64", "cores": 2, "torch": "2", "load_average_at_end": None},
    }
    strategies_report.write_report(data, cfg.out)
    doc = (tmp_path / "strategies.md").read_text()
    # continuous produced twice the tokens of static at every cap in the same time
    assert "| 192 (1536) |" in doc and "2.00×" in doc
    assert "measured 2.00× at cap 192** (does not hold)" in doc
    assert "Continuous has lower TTFT than dynamic at every rate: holds" in doc
    # utilization: 16 output tokens of continuous over 40 slots stepped
    assert "| compute utilization: token-producing slot-steps ÷ batch slots stepped¹ | 40% |" in doc
    for name in (
        "ratio_by_cap.png",
        "throughput_by_cap.png",
        "latency_vs_rate.png",
        "latency_vs_throughput.png",
    ):
        assert (tmp_path / "strategies" / name).read_bytes()[:4] == b"\x89PNG"


def test_the_committed_results_render_the_committed_report():
    """docs/benchmarks/strategies.md is exactly what its results.json renders to."""
    data = json.loads(COMMITTED_RESULTS.read_text())
    assert strategies_report.render(data) == COMMITTED.read_text()


def test_report_only_runs_nothing_and_writes_the_report_and_plots(tmp_path):
    out = tmp_path / "strategies.md"
    assert (
        bench_main(["strategies", "--report-only", str(COMMITTED_RESULTS), "--out", str(out)]) == 0
    )
    assert out.read_text() == COMMITTED.read_text()
    assert sorted(f.name for f in (tmp_path / "strategies").iterdir()) == sorted(
        strategies_report.PLOTS.values()
    )
