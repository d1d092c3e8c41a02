"""docs/configuration.md is what scripts/gen_config_reference.py writes from the console
scripts' parsers: every script, every flag, its default and help, nothing machine-specific."""

from __future__ import annotations

import argparse
import importlib.util
import tomllib

from tests.grpc_helpers import ROOT

_SCRIPT = ROOT / "scripts" / "gen_config_reference.py"
_spec = importlib.util.spec_from_file_location("gen_config_reference", _SCRIPT)
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)


def test_the_committed_reference_is_fresh():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == gen.render(), (
        "docs/configuration.md is stale (a CLI flag, default or help changed): run `make docs` "
        "(.venv/bin/python scripts/gen_config_reference.py --out docs/configuration.md) "
        "and commit it"
    )


def test_every_console_script_is_documented():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert sorted(gen.COMMANDS) == sorted(scripts)
    for script, target in scripts.items():
        assert target == f"{gen.COMMANDS[script]}:main"


def test_every_flag_of_every_parser_has_a_row():
    text = gen.render()
    for command, _, parser in gen.parsers():
        section = text.split(f"\n## {command}\n", 1)[1].split("\n## ", 1)[0]
        for action in parser._actions:
            if gen._shown(action):
                name = (action.option_strings or [action.metavar or action.dest])[0]
                assert f"| `{name}" in section, f"{command} {name}"


def test_nothing_depends_on_the_machine():
    text = gen.render()
    assert str(ROOT) not in text
    # A path default, written relative to the repository:
    assert "| `docs/benchmarks/strategies.md` |" in text


def test_defaults_and_flags_as_written():
    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--model", required=True)
    p.add_argument("--n", type=int, default=3, help="at most %(default)s")
    p.add_argument("--off", dest="on", action="store_false", help="turn it off")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--mode", choices=["a", "b"], default="a", help="a|b")
    p.add_argument("--name", default="")
    rows = gen._command("x", "", p).splitlines()
    assert rows[2:] == [
        "| flag | default | help |",
        "|---|---|---|",
        "| `--model VALUE` | required |  |",
        "| `--n N` | `3` | at most 3 |",
        "| `--off` | off | turn it off |",
        "| `--graphs`, `--no-graphs` | unset |  |",
        "| `--mode {a,b}` | `a` | a\\|b |",
        '| `--name VALUE` | `""` |  |',
    ]


def test_check_fails_on_a_stale_file_naming_the_command(tmp_path, capsys):
    out = tmp_path / "configuration.md"
    out.write_text("old\n")
    assert gen.main(["--check", "--out", str(out)]) == 1
    assert "is stale: run `make docs`" in capsys.readouterr().err
    assert gen.main(["--out", str(out)]) == 0
    assert gen.main(["--check", "--out", str(out)]) == 0
