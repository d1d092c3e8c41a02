"""The command-line tools' flags (outside probe): help that states each default once and
never a secret, and values a request field cannot hold refused as usage errors."""

from __future__ import annotations

import pytest

from omnibus.bench.__main__ import build_parser as bench_parser
from omnibus.engine.serving.cli import build_parser as engine_parser
from omnibus.router.client import build_parser as client_parser


def test_client_help_never_shows_the_api_key(monkeypatch, capsys):
    monkeypatch.setenv("OMNIBUS_API_KEY", "sk-secret-123")
    with pytest.raises(SystemExit):
        client_parser().parse_args(["--help"])
    assert "sk-secret-123" not in capsys.readouterr().out


def test_help_states_each_default_once(capsys):
    with pytest.raises(SystemExit):
        engine_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-prefix-caching do not reuse the KV of shared prompt prefixes --waiting-order" in text
    assert "(default: None)" not in text and "(default: True)" not in text
    assert "(default: 256)" in text  # --max-num-seqs: argparse's, where the help states none


@pytest.mark.parametrize("argv", [
    ["--seed", "-1", "hi"], ["--max-tokens", "3000000000", "hi"], ["--priority", "2147483648", "hi"],
    ["--timeout", "inf", "hi"], ["--timeout", "nan", "hi"], ["--timeout", "0", "hi"],
])  # fmt: skip
def test_client_refuses_values_a_request_cannot_hold(argv, capsys):
    """They were tracebacks (protobuf's range check), or a deadline already passed."""
    with pytest.raises(SystemExit) as exit_:
        client_parser().parse_args(argv)
    assert exit_.value.code == 2 and f"argument {argv[0]}:" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--scale", "0"], ["--scale", "nan"], ["--output-cap", "0"],
                                  ["--slo-ttft-ms", "-5"]])
def test_bench_refuses_lengths_and_bounds_that_mean_nothing(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_parser().parse_args(["serve", "--target", "h:1", *argv])
    assert exit_.value.code == 2 and f"argument {argv[0]}:" in capsys.readouterr().err


@pytest.mark.parametrize(("tool", "argv", "message"), [
    ("engine", ["--block-size", "3"], "--block-size must be a power of two from 1 to 128, got 3"),
    ("engine", ["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    ("engine", ["--watchdog-step-seconds", "nan"], "--watchdog-step-seconds must be >= 0, got nan"),
    ("engine", ["--embed-max-queue-delay-ms", "inf"], "--embed-max-queue-delay-ms must be finite and >= 0, got inf"),
    ("router", ["--stream-interval", "0"], "--stream-interval must be > 0, got 0"),
    ("router", ["--port", "70000"], "--port must be in [0, 65535], got 70000"),
    # regression probe: fields named in the message, and flags with a prefix
    ("engine", ["--batching", "static", "--max-batch-size", "300"],
     "--max-batch-size must be in [1, --max-num-seqs (256)], got 300"),
    ("engine", ["--embed-preferred-batch-sizes", "64"],
     "--embed-preferred-batch-sizes must lie in [1, --embed-max-batch-size], got (64,)"),
    ("router", ["--tenant-max-concurrent", "-1"], "--tenant-max-concurrent must be >= 0 (0: no cap), got -1"),
    ("router", ["--engine-retry-max-seconds", "0.01"],
     "--engine-retry-max-seconds must be >= --engine-retry-initial-seconds, got 0.01"),
])
def test_a_bad_flag_value_is_named_as_the_flag(tool, argv, message, capsys):
    """Outside probe: start-up errors named config fields (block_size), not the flags."""
    if tool == "engine":
        from omnibus.engine.serving.cli import main

        code = main(["serve", "--model", "m", *argv])
    else:
        from omnibus.router.cli import main

        code = main(["serve", "--model", "m", "--engine", "127.0.0.1:1", *argv])
    assert code == 2 and capsys.readouterr().err == f"error: {message}\n"


# ---- outside probe, second round ---------------------------------------------------------


@pytest.mark.parametrize("value", ["1e10", "7e9", "1e300"])
def test_timeouts_past_what_grpc_carries_are_refused_naming_the_bound(value, capsys):
    """grpc turns now + timeout into int64 ns: from ~7e9 s on it overflows and the call
    failed DEADLINE_EXCEEDED at once."""
    with pytest.raises(SystemExit) as exit_:
        client_parser().parse_args(["--timeout", value, "hi"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --timeout: must be at most 1e+08 seconds" in err
    assert client_parser().parse_args(["--timeout", "1e8", "hi"]).timeout == 1e8


@pytest.mark.parametrize("argv", [
    ["--timeout", "inf"], ["--timeout", "1e10"], ["--max-duration", "inf"], ["--max-duration", "0"],
    ["--output-mean", "inf"], ["--output-mean", "nan"], ["--output-mean", "0"],
    ["--num-requests", "0"], ["--concurrency", "0"], ["--input-len", "0"],
    ["--name", "../../x"], ["--name", ".."], ["--name", ""],  # would write outside --out-dir
])  # fmt: skip
def test_bench_serve_refuses_values_named_as_their_flags(argv, capsys):
    """They were accepted (inf: every request DEADLINE_EXCEEDED at once; --output-mean inf:
    ZeroDivisionError) or refused naming config fields (n, mean_output, timeout_s)."""
    with pytest.raises(SystemExit) as exit_:
        bench_parser().parse_args(["serve", "--target", "h:1", *argv])
    assert exit_.value.code == 2 and f"argument {argv[0]}:" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--batch-size", "0"], ["--rate-requests", "0"],
                                  ["--burst-requests", "-1"], ["--scale", "inf"]])
def test_bench_strategies_refuses_values_named_as_their_flags(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_parser().parse_args(["strategies", *argv])
    assert exit_.value.code == 2 and f"argument {argv[0]}:" in capsys.readouterr().err


def test_bench_strategies_config_errors_name_the_flags(tmp_path, capsys):
    from omnibus.bench.__main__ import main

    out = tmp_path / "r.md"
    assert main(["strategies", "--out", str(out), "--batch-size", "16", "--rate-requests", "20"]) == 2
    assert capsys.readouterr().err == (
        "error: --rate-requests must be a multiple of --batch-size (a static batch without a "
        "timeout runs only when full)\n"
    )
    assert main(["strategies", "--out", str(out), "--scale", "2"]) == 2
    assert capsys.readouterr().err == "error: --scale must be in (0, 1], got 2.0\n"
    assert not (tmp_path / "r").exists()  # nothing created for a run that never started


@pytest.mark.parametrize("content", [None, "not json", '{"points": []}', "[1, 2]"])
def test_bench_report_only_needs_a_results_file(content, tmp_path, capsys):
    """Were FileNotFoundError / KeyError 'config' tracebacks."""
    from omnibus.bench.__main__ import main

    results = tmp_path / "results.json"
    if content is not None:
        results.write_text(content)
    code = main(["strategies", "--out", str(tmp_path / "r.md"), "--report-only", str(results)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: --report-only {results}: ")
    assert err.count("\n") == 1


def test_bench_out_dir_is_checked_before_the_run(tmp_path, capsys):
    """It was only used after the whole run: a traceback, the results lost."""
    from omnibus.bench.__main__ import main

    file = tmp_path / "file"
    file.write_text("")
    for out_dir in (file, file / "sub"):
        # the target is never contacted: the out dir is refused first
        code = main(["serve", "--target", "127.0.0.1:1", "--out-dir", str(out_dir)])
        assert code == 2 and capsys.readouterr().err.startswith(f"error: --out-dir {out_dir}: ")
    assert main(["serve", "--target", "127.0.0.1:1", "--out-dir", "/proc/nope"]) == 2
    assert capsys.readouterr().err.startswith("error: --out-dir /proc/nope: ")


def test_bench_interrupted_exits_130_with_one_line(monkeypatch, capsys):
    import omnibus.bench.__main__ as bench

    async def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "serve_main", interrupted)
    try:
        code = bench.main(["serve", "--target", "127.0.0.1:1"])
    except KeyboardInterrupt:  # not let through: it would stop the test session
        pytest.fail("KeyboardInterrupt escaped main (a traceback)")
    assert code == 130
    assert capsys.readouterr().err == "error: interrupted; no report written\n"


def test_bench_redacts_secrets_from_saved_configs():
    from omnibus.bench.__main__ import redact_secrets

    config = {"api_key": "sk-1", "auth_token": "t", "client_secret": "s", "password": "p",
              "max_num_batched_tokens": 2048, "key": None, "target": "h:1"}
    assert redact_secrets(config) == {
        "api_key": "<redacted>", "auth_token": "<redacted>", "client_secret": "<redacted>",
        "password": "<redacted>", "max_num_batched_tokens": 2048, "key": None, "target": "h:1",
    }  # fmt: skip


@pytest.mark.parametrize(("argv", "flag"), [
    (["\udcff\udcfe"], "prompt"),
    (["--stop", "\udcff", "hi"], "--stop"),
    (["--key", "clé", "hi"], "--key"),
    (["--adapter", "modèle", "hi"], "--adapter"),
    (["--key", "a\nb", "hi"], "--key"),
])  # fmt: skip
def test_client_refuses_text_a_request_cannot_carry(argv, flag, capsys):
    """Non-UTF-8 argv (surrogate-escaped) was a UnicodeEncodeError traceback; a non-ASCII
    --key or --adapter was gRPC's log lines and "INTERNAL: Invalid metadata"."""
    from omnibus.router.client import main

    with pytest.raises(SystemExit) as exit_:
        main(["--target", "127.0.0.1:1", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"error: argument {flag}: " in err


def test_client_refuses_a_non_ascii_key_from_the_environment(monkeypatch, capsys):
    from omnibus.router.client import main

    monkeypatch.setenv("OMNIBUS_API_KEY", "clé")
    with pytest.raises(SystemExit) as exit_:
        main(["--target", "127.0.0.1:1", "hi"])
    assert exit_.value.code == 2 and "argument $OMNIBUS_API_KEY: " in capsys.readouterr().err


@pytest.fixture
def fake_router():
    """An Inference server whose Generate streams "café" and ends with finish_reason
    `fake_router.finish`."""
    from concurrent import futures

    import grpc
    from omnibus.v1 import inference_pb2, inference_pb2_grpc

    class Fake(inference_pb2_grpc.InferenceServicer):
        finish = inference_pb2.LENGTH

        def Generate(self, request, context):
            yield inference_pb2.GenerateResponse(text="caf")
            yield inference_pb2.GenerateResponse(text="é", finish_reason=self.finish)

    servicer = Fake()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def test_client_exits_1_when_the_completion_was_aborted(fake_router, capsys):
    """A stream the router cut short (ABORTED, e.g. draining) exited 0, as if complete."""
    from omnibus.v1 import inference_pb2

    from omnibus.router.client import main

    servicer, target = fake_router
    assert main(["--target", target, "hi"]) == 0
    servicer.finish = inference_pb2.ABORTED
    assert main(["--target", target, "hi"]) == 1
    captured = capsys.readouterr()
    assert captured.out.endswith("café\n")
    assert captured.err.endswith("error: the completion was aborted before it finished (ABORTED)\n")


def test_client_writes_what_stdout_cannot_encode_as_replacements(fake_router, monkeypatch):
    """PYTHONIOENCODING=ascii: was a UnicodeEncodeError traceback writing stdout."""
    import io
    import sys

    from omnibus.router.client import main

    _, target = fake_router
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["--target", target, "hi"]) == 0
    stdout.flush()
    assert stdout.buffer.getvalue() == b"caf?\n"


def test_nothing_reaches_stderr_after_the_engines_last_log_line():
    """Regression probe: triton's nanobind printed a leak report without a final newline
    at interpreter shutdown, so the engine's last JSON line (engine_stopped) was glued to
    it and could not be parsed."""
    import json
    import subprocess
    import sys

    script = """
import atexit, os, structlog
from omnibus.common.logs import configure_logging, quiet_shutdown
atexit.register(lambda: os.write(2, b"nanobind: leaked 3 instances!"))  # runs after the silence
configure_logging("info")
quiet_shutdown()
structlog.get_logger().info("engine_stopped")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert [json.loads(line)["event"] for line in out.stderr.splitlines()] == ["engine_stopped"]
