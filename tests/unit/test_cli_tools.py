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
