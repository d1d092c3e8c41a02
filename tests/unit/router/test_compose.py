"""compose.yaml and the Dockerfile agree with the CLIs: every command, healthcheck and
engine address is one the programs accept. (Docker itself is not run here.)"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omnibus.engine.serving.cli import build_parser as engine_parser
from omnibus.engine.serving.cli import configs_from_args
from omnibus.router.cli import build_parser as router_parser
from omnibus.router.cli import config_from_args
from omnibus.router.config import EngineTarget
from omnibus.router.healthcheck import build_parser as healthcheck_parser
from tests.grpc_helpers import ROOT

COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = (ROOT / "pyproject.toml").read_text()
ENGINES = [name for name, s in SERVICES.items() if s["build"]["target"] == "engine"]


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    try:
        return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{parser.prog} refuses {argv}")


def service_args(name: str) -> argparse.Namespace:
    service = SERVICES[name]
    parser = engine_parser() if service["build"]["target"] == "engine" else router_parser()
    return parse(parser, service["command"])


def test_there_is_a_router_a_gpu_engine_a_tensor_parallel_one_a_cpu_engine_and_a_prefill_decode_pair():
    assert sorted(SERVICES) == ["engine", "engine-cpu", "engine-decode", "engine-prefill", "engine-tp", "router"]
    assert SERVICES["engine"]["profiles"] == ["gpu"] and SERVICES["engine-cpu"]["profiles"] == ["cpu"]
    assert SERVICES["engine-tp"]["profiles"] == ["gpu-tp"]
    assert SERVICES["engine-prefill"]["profiles"] == SERVICES["engine-decode"]["profiles"] == ["pd"]


def test_the_pd_profile_runs_a_prefill_and_a_decode_engine_that_move_kv_and_serve_the_same_model():
    """The router finds both as engine:50061 and sends each its part by the role in its
    load report (a prefill and a decode engine of one model, both moving KV, same flags
    but the role: adapters and layout must agree for the decode side to read the KV)."""
    prefill, decode = (configs_from_args(service_args(name))[0] for name in ("engine-prefill", "engine-decode"))
    assert (prefill.role, decode.role) == ("prefill", "decode")
    for config in (prefill, decode):
        assert (config.kv_transfer, config.kv_transfer_host) == ("mooncake", "auto")
    assert SERVICES["engine-prefill"]["command"][:-1] == SERVICES["engine-decode"]["command"][:-1]
    assert SERVICES["engine-prefill"]["build"] == SERVICES["engine-cpu"]["build"]


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_each_command_is_accepted_by_its_cli_and_makes_a_valid_config(name):
    args = service_args(name)
    if name in ENGINES:
        engine, server = configs_from_args(args)
        assert (engine.model, server.host) == ("/models/smollm2.gguf", "0.0.0.0")
    else:
        config = config_from_args(args)
        assert (config.model, config.host) == ("/models/smollm2.gguf", "0.0.0.0")


def test_stopped_cpu_engines_move_their_streams_kv_to_the_others_and_gpu_ones_do_not_yet():
    """engine-cpu replicas offer and read KV (--kv-transfer) at their container's own IP,
    so a stopped one's streams go on elsewhere with their KV; the GPU variants leave it
    off (the staging path has not run on a GPU)."""
    config, _ = configs_from_args(service_args("engine-cpu"))
    assert (config.kv_transfer, config.kv_transfer_host) == ("mooncake", "auto")
    assert configs_from_args(service_args("engine"))[0].kv_transfer == "none"
    assert configs_from_args(service_args("engine-tp"))[0].kv_transfer == "none"
    assert "libibverbs1" in DOCKERFILE  # Mooncake's transfer engine links it


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_healthcheck_asks_the_grpc_health_protocol_on_the_service_port(name):
    test = SERVICES[name]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "omnibus-healthcheck"]
    target = parse(healthcheck_parser(), test[2:]).target
    assert target == f"localhost:{service_args(name).port}"


def test_router_publishes_its_grpc_metrics_and_http_ports():
    args = service_args("router")
    assert args.http_port, "the router's OpenAI-compatible HTTP API is off"
    published = {int(p.split(":")[1]) for p in SERVICES["router"]["ports"]}
    assert published == {args.port, args.http_port, args.metrics_port}


def test_make_run_serves_the_http_api_on_a_port_the_cli_accepts():
    makefile = (ROOT / "Makefile").read_text()
    (port,) = re.findall(r"^HTTP_PORT \?= (\d+)$", makefile, re.M)
    (line,) = [l for l in makefile.splitlines() if "omnibus-router serve" in l]
    assert "--http-port $(HTTP_PORT)" in line
    assert parse(router_parser(), ["serve", "--engine", "e:1", "--model", "m",
                                   "--http-port", port]).http_port == int(port)


def test_router_reaches_whichever_engine_variant_runs():
    (address,) = service_args("router").engines
    target = EngineTarget.parse(address)
    for name in ENGINES:
        aliases = SERVICES[name].get("networks", {}).get("default", {}).get("aliases", [])
        assert target.host == name or target.host in aliases, f"{name} is not reachable as {target.host}"
        assert target.port == service_args(name).port
    assert set(SERVICES["router"]["depends_on"]) == set(ENGINES)


def test_scaled_engines_are_all_found_by_dns_and_none_pins_a_name_or_host_port():
    # `--scale engine=N` gives N containers behind one DNS name: the router must resolve
    # the name (each address its own engine), and no engine may claim a fixed container
    # name or host port, which would make scaling fail.
    (address,) = service_args("router").engines
    target = EngineTarget.parse(address)
    assert target.dns and target.dns_server is None  # Docker's embedded DNS
    for name in ENGINES:
        assert "container_name" not in SERVICES[name] and "ports" not in SERVICES[name]


def test_gpu_engine_reserves_a_gpu_and_the_cpu_variant_does_not():
    (device,) = SERVICES["engine"]["deploy"]["resources"]["reservations"]["devices"]
    assert (device["driver"], device["capabilities"]) == ("nvidia", ["gpu"])
    assert service_args("engine").device == "cuda"
    assert "deploy" not in SERVICES["engine-cpu"] and service_args("engine-cpu").device == "cpu"


def test_the_tensor_parallel_engine_reserves_a_gpu_per_rank_and_shared_memory():
    (device,) = SERVICES["engine-tp"]["deploy"]["resources"]["reservations"]["devices"]
    args = service_args("engine-tp")
    assert device["count"] == args.tensor_parallel_size == 2 and args.device == "cuda"
    assert SERVICES["engine-tp"]["shm_size"] == "16gb"


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_model_and_adapter_directories_are_read_only_volumes(name):
    volumes = SERVICES[name]["volumes"]
    assert "./models:/models:ro" in volumes
    if name in ENGINES:
        assert "./adapters:/adapters:ro" in volumes


def test_dockerfile_stages_compose_builds_run_the_right_module():
    # Each stage runs from its FROM line to the next one.
    stages = dict(re.findall(r"^FROM \S+ AS (\w+)\n(.*?)(?=^FROM |\Z)", DOCKERFILE, re.M | re.S))
    for name, service in SERVICES.items():
        target = service["build"]["target"]
        assert f'ENTRYPOINT ["omnibus-{target}"]' in stages[target], name
        assert f"omnibus-{target} = " in PYPROJECT, f"no console script omnibus-{target}"


def test_router_image_has_no_torch_and_the_engine_image_runs_as_a_user():
    stages = dict(re.findall(r"^FROM \S+ AS (\w+)\n(.*?)(?=^FROM |\Z)", DOCKERFILE, re.M | re.S))
    assert "torch==" not in stages["router"] and "[engine]" not in stages["router"]
    # numeric, non-root users (resolvable whatever the host's passwd says)
    for name in ("router", "engine"):
        (uid,) = re.findall(r"^USER (\d+)$", stages[name], re.M)
        assert int(uid) != 0, name
    assert "pip install --index-url \"$TORCH_INDEX_URL\" torch==2.13.0" in stages["engine"]
    # the runtime images are built from the wheel, not from a copied source tree
    assert "COPY . ." not in DOCKERFILE


def test_compose_file_follows_the_compose_specification():
    """compose.yaml against the Compose specification's JSON schema (vendored by
    check-jsonschema; `depends_on: required` needs Compose >= 2.20)."""
    exe = Path(sys.executable).parent / "check-jsonschema"
    out = subprocess.run([str(exe), "--builtin-schema", "vendor.compose-spec", str(ROOT / "compose.yaml")],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_passes_hadolint():
    exe = Path(sys.executable).parent / "hadolint"
    out = subprocess.run([str(exe), "--no-color", str(ROOT / "Dockerfile")],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
