"""The load generator end to end against an in-process fake Inference server.

The fake streams `max_tokens` messages of one token each (or of two tokens for requests
whose priority is 7) with no model behind them, so what the client records can be
checked exactly. No assertion here depends on how fast anything runs.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from omnibus.v1 import engine_pb2, inference_pb2, inference_pb2_grpc

from omnibus.bench import serve, stats, workloads
from omnibus.bench.__main__ import build_parser, serve_main

VOCAB = 100
CONTEXT = 64


class FakeInference(inference_pb2_grpc.InferenceServicer):
    def __init__(self) -> None:
        self.requests: list[tuple[inference_pb2.GenerateRequest, dict[str, str]]] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self.hang = asyncio.Event()  # set: release requests that hang (max_tokens == 63)

    async def ListModels(self, request, context):
        return inference_pb2.ListModelsResponse(
            base_model=inference_pb2.ModelInfo(
                id="fake",
                max_context_length=CONTEXT,
                vocab_size=VOCAB,
                max_tokens_limit=CONTEXT - 1,
            )
        )

    async def Generate(self, request, context):
        metadata = {k: v for k, v in context.invocation_metadata()}
        self.requests.append((request, metadata))
        if metadata.get("x-adapter-id") == "missing":
            await context.abort(grpc.StatusCode.NOT_FOUND, "adapter 'missing' not found")
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            n = request.sampling.max_tokens
            if n == 63:
                await self.hang.wait()
            step = 2 if request.priority == 7 else 1
            sent = 0
            while sent < n:
                await asyncio.sleep(0.001)
                k = min(step, n - sent)
                sent += k
                last = sent == n
                yield inference_pb2.GenerateResponse(
                    request_id=request.request_id,
                    token_ids=list(range(k)),
                    finish_reason=inference_pb2.LENGTH if last else 0,
                    usage=inference_pb2.Usage(
                        prompt_tokens=len(request.token_ids.ids), completion_tokens=n
                    )
                    if last
                    else None,
                )
        finally:
            self.in_flight -= 1


@pytest.fixture
async def fake():
    server = grpc.aio.server()
    servicer = FakeInference()
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        servicer.hang.set()
        await server.stop(0)


def _requests(n: int, **mix) -> list[workloads.BenchRequest]:
    spec = workloads.AnyscaleSpec(input_len=8, mean_output=4, cap=10)
    return workloads.build_requests(spec, n, VOCAB, seed=3, **mix)


async def test_all_at_once_records_every_token(fake):
    servicer, target = fake
    reqs = _requests(12, adapters="a,base", priorities="0,7")
    run = await serve.run_workload(reqs, serve.RunConfig(target=target, progress=False))
    assert [r.code for r in run.results] == ["OK"] * 12
    for req, res in zip(reqs, run.results):
        assert res.output_tokens == req.max_tokens
        assert res.finish_reason == "LENGTH"
        assert len(res.token_times) == -(-req.max_tokens // (2 if req.priority == 7 else 1))
        assert res.ttft is not None and res.ttft >= 0 and res.e2e >= res.ttft
    sent = {m.request_id: (m, md) for m, md in servicer.requests}
    for i, req in enumerate(reqs):
        message, metadata = sent[f"bench-{i}"]
        assert list(message.token_ids.ids) == list(req.prompt_ids)
        assert message.sampling.max_tokens == req.max_tokens
        assert message.sampling.ignore_eos and message.sampling.temperature == 0.0
        assert message.priority == req.priority
        assert metadata.get("x-adapter-id", "") == req.adapter
    assert [r.adapter for r in reqs[:4]] == ["a", "", "a", ""]
    summary = stats.summarize(run.results, run.duration)
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["output_tokens"] == sum(r.max_tokens for r in reqs)


async def test_concurrency_bounds_requests_in_flight(fake):
    servicer, target = fake
    run = await serve.run_workload(
        _requests(10), serve.RunConfig(target=target, concurrency=3, progress=False)
    )
    assert all(r.ok for r in run.results)
    assert servicer.peak_in_flight <= 3
    assert len(servicer.requests) == 10


async def test_poisson_sends_in_schedule_order(fake):
    servicer, target = fake
    run = await serve.run_workload(
        _requests(6), serve.RunConfig(target=target, rate=500.0, seed=1, progress=False)
    )
    assert all(r.ok for r in run.results)
    assert [r.scheduled for r in run.results] == workloads.poisson_arrivals(6, 500.0, seed=1)
    assert sorted(m.request_id for m, _ in servicer.requests) == [f"bench-{i}" for i in range(6)]
    assert all(r.sent >= r.scheduled for r in run.results)


async def test_failures_are_counted_by_status_code(fake):
    _, target = fake
    reqs = _requests(4, adapters="base,missing")
    run = await serve.run_workload(reqs, serve.RunConfig(target=target, progress=False))
    summary = stats.summarize(run.results, run.duration)
    assert summary["failures_by_code"] == {"NOT_FOUND": 2}
    assert [r.code for r in run.results] == ["OK", "NOT_FOUND", "OK", "NOT_FOUND"]


async def test_a_run_the_time_limit_cut_lasts_to_the_limit(fake):
    """Outside probe: with requests still to send at --max-duration, the run's duration
    ended at its last completion (1.78 s of a 2 s limit), overstating throughput."""
    _, target = fake
    quick = workloads.BenchRequest(prompt_ids=(5, 6), max_tokens=2)
    config = serve.RunConfig(target=target, rate=0.01, max_duration_s=0.5, progress=False)
    run = await serve.run_workload([quick, quick], config)
    assert [r.code for r in run.results] == ["OK", serve.NOT_SENT]
    assert run.results[0].end < 0.5 <= run.duration


async def test_time_limit_cancels_running_and_skips_unsent(fake):
    _, target = fake
    hanging = workloads.BenchRequest(prompt_ids=(5, 6), max_tokens=63)
    quick = workloads.BenchRequest(prompt_ids=(5, 6), max_tokens=2)
    # At 0.01 req/s the second and third arrivals are scheduled long after the limit.
    config = serve.RunConfig(target=target, rate=0.01, max_duration_s=0.3, progress=False)
    run = await serve.run_workload([hanging, quick, quick], config)
    assert [r.code for r in run.results] == ["CANCELLED", serve.NOT_SENT, serve.NOT_SENT]
    assert stats.summarize(run.results, run.duration)["failures_by_code"] == {
        "CANCELLED": 1,
        serve.NOT_SENT: 2,
    }


async def test_check_fits_refuses_what_the_server_would(fake):
    _, target = fake
    model = (await serve.list_models(target)).base_model
    serve.check_fits(_requests(5), model)
    with pytest.raises(ValueError, match="exceeds the context"):
        serve.check_fits([workloads.BenchRequest(tuple([3] * 60), 10)], model)
    with pytest.raises(ValueError, match="vocab_size"):
        serve.check_fits([workloads.BenchRequest((VOCAB,), 1)], model)


async def test_cli_writes_json_markdown_and_plot(fake, tmp_path):
    _, target = fake
    args = build_parser().parse_args(
        [
            "serve",
            "--target",
            target,
            "--num-requests",
            "6",
            "--scale",
            "0.02",
            "--concurrency",
            "2",
            "--slo-ttft-ms",
            "60000",
            "--slo-tpot-ms",
            "60000",
            "--out-dir",
            str(tmp_path),
            "--name",
            "run",
            "--no-progress",
        ]
    )
    payload = await serve_main(args)
    assert payload["summary"]["completed"] == 6
    assert payload["summary"]["good_requests"] == 6
    saved = json.loads((tmp_path / "run.json").read_text())
    assert len(saved["results"]) == 6
    # --scale 0.02 of 512-token prompts: 10 tokens each.
    assert [r["prompt_tokens"] for r in saved["results"]] == [10] * 6
    assert "| output token throughput |" in (tmp_path / "run.md").read_text()
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"


def test_load_summary_time_weights_reports():
    def report(running, waiting, free):
        return engine_pb2.LoadReport(
            num_running=running,
            num_waiting=waiting,
            num_free_blocks=free,
            num_total_blocks=10,
            block_size=4,
        )

    # 0-1 s nothing running, work waiting (still so at 1 s: idle); 1-2 s the same report
    # before a step that admits two (busy: the next report shows them); 2-4 s two running
    # holding 6 blocks; 4-5 s one running.
    samples = [
        (0.0, report(0, 1, 10)),
        (1.0, report(0, 2, 10)),
        (2.0, report(2, 0, 4)),
        (4.0, report(1, 0, 7)),
    ]
    out = serve.load_summary(samples, duration=5.0)
    assert out["load_span_s"] == 5.0
    assert out["mean_running"] == pytest.approx((2 * 2 + 1 * 1) / 5)
    assert out["mean_waiting"] == pytest.approx((1 + 2) / 5)
    assert out["idle_with_work_fraction"] == pytest.approx(1 / 5)
    assert out["busy_fraction"] == pytest.approx(4 / 5)
    assert out["kv_used_token_seconds"] == pytest.approx(6 * 4 * 2 + 3 * 4 * 1)


def test_derived_ratios_need_both_counters():
    assert serve.derived_ratios({"num_steps": 3}) == {
        "compute_utilization": None,
        "kv_efficiency": None,
    }
    got = serve.derived_ratios(
        {"useful_tokens": 30, "slots_stepped": 40, "kv_tokens_stored": 10, "kv_tokens_reserved": 40}
    )
    assert got == {"compute_utilization": 0.75, "kv_efficiency": 0.25}


async def test_cli_exits_1_when_no_request_completed(fake, capsys):
    """Every request refused (an unknown adapter): the report lists the failures, and the
    exit status no longer says success to a script."""
    from omnibus.bench.__main__ import main

    _, target = fake
    argv = ["serve", "--target", target, "--num-requests", "3", "--scale", "0.02",
            "--adapters", "missing", "--no-progress"]
    assert await asyncio.to_thread(main, argv) == 1
    assert "error: none of the 3 requests completed ({'NOT_FOUND': 3})" in capsys.readouterr().err


async def test_cli_never_writes_the_api_key_into_the_saved_config(fake, tmp_path):
    """`--out-dir D` stored vars(args), the API key in plain text, in D/serve.json."""
    from omnibus.bench.__main__ import main

    servicer, target = fake
    argv = ["serve", "--target", target, "--num-requests", "2", "--scale", "0.02",
            "--api-key", "sk-secret-123", "--out-dir", str(tmp_path / "out"), "--no-progress"]
    assert await asyncio.to_thread(main, argv) == 0
    assert servicer.requests[0][1]["authorization"] == "Bearer sk-secret-123"  # still sent
    for file in (tmp_path / "out").iterdir():
        assert b"sk-secret-123" not in file.read_bytes(), file.name
    saved = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert saved["config"]["api_key"] == "<redacted>"
