"""The `omnibus` distribution: every package folder installs, the committed protobuf code
is what the .proto files generate, the base install is torch-free, and the pins resolve
with the CUDA torch the GPU image installs."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.requirements import Requirement

from tests.grpc_helpers import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def package_folders() -> dict[str, Path]:
    """Every importable package on disk, by the name it installs as."""
    found = {}
    for name, folder in SETUPTOOLS["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found[".".join([name, *rel.parts])] = init.parent
    return found


def test_every_package_folder_is_in_the_distribution():
    assert sorted(package_folders()) == sorted(SETUPTOOLS["packages"])


def test_committed_protobuf_code_is_fresh(tmp_path: Path):
    protos = sorted((ROOT / "protos" / "omnibus" / "v1").glob("*.proto"))
    from grpc_tools import protoc

    args = ["protoc", f"-I{ROOT / 'protos'}", f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
            *map(str, protos)]  # fmt: skip
    assert protoc.main(args) == 0
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert fresh, "protoc generated nothing"
    for rel in fresh:
        committed = ROOT / "protos" / rel
        assert committed.exists(), f"{rel} is not committed: run `make proto`"
        assert committed.read_text() == (tmp_path / rel).read_text(), f"{rel} is stale: run `make proto`"


def test_router_and_client_import_no_torch():
    code = (
        "import sys\n"
        "import omnibus.router.cli, omnibus.router.service.server, omnibus.router.client\n"
        "import omnibus.router.healthcheck, omnibus.common.adapters, omnibus.v1.engine_pb2_grpc\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'safetensors', 'triton'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


@pytest.mark.parametrize("script", sorted(PYPROJECT["project"]["scripts"]))
def test_console_scripts_start(script: str):
    exe = Path(sys.executable).parent / script
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


def test_no_top_level_kernels_package_for_transformers_to_mistake():
    # transformers probes for the Hugging Face `kernels` package by import name; the
    # installed view (not this repository's root, which pytest puts on sys.path) has none.
    code = (
        "import importlib.util\n"
        "assert importlib.util.find_spec('kernels') is None\n"
        "import omnibus.kernels\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "assert not is_kernels_available()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_engine_extra_admits_the_triton_cuda_torch_pins():
    # torch 2.13.0's CUDA wheels require triton==3.7.1: the extra must admit it, or
    # `pip install omnibus[engine]` next to CUDA torch cannot resolve.
    reqs = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["engine"]]
    by_name = {r.name: r for r in reqs}
    assert "3.7.1" in by_name["triton"].specifier
    assert by_name["torch"].specifier == SpecifierSet("==2.13.0")
    # the development lock (requirements.txt) satisfies every range of the distribution
    locked = dict(
        line.split("==") for line in (ROOT / "requirements.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )  # fmt: skip
    for extra in ("engine", "test", "bench"):
        for raw in PYPROJECT["project"]["optional-dependencies"][extra]:
            r = Requirement(raw)
            if r.name in locked:
                assert locked[r.name] in r.specifier, (r, locked[r.name])


def test_nothing_sets_pythonpath():
    # the project's own files (tracked, or new and not ignored): not the venvs and build
    # folders beside them, whose third-party packages may mention it
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    me = Path(__file__).resolve()
    offenders = [rel for rel in listed
                 if (path := ROOT / rel).is_file() and path != me
                 and path.suffix not in (".png", ".json", ".pyc", ".safetensors")
                 and "PYTHONPATH" in path.read_text(errors="replace")]
    assert len(listed) > 300 and not offenders, f"PYTHONPATH appears in {offenders}"


def test_the_engine_script_without_torch_says_what_to_install():
    """`pip install omnibus` (torch-free) installs omnibus-engine too: it must say what is
    missing, not end in a ModuleNotFoundError traceback."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # as if not installed: importing it raises ImportError\n"
        "from omnibus.engine.serving.cli import main\n"
        "sys.exit(main(['serve', '--model', '/nonexistent']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "omnibus-engine needs torch" in out.stderr and "pip install 'omnibus[engine]'" in out.stderr
