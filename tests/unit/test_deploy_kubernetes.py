"""deploy/kubernetes (kustomize base + cpu and gpu overlays) and deploy/grafana, checked
without a cluster: each overlay renders (with kustomize where a binary exists, otherwise
with tests/kustomize.py's stand-in), every built-in kind validates against the
Kubernetes 1.32 schemas of the `kubernetes-validate` wheel (strict: unknown fields
fail), the commands are ones the CLIs accept, and every metric the autoscaler and the
dashboard query is one the processes export.

Not validated: the CRD kinds ScaledObject (KEDA) and PodMonitor (Prometheus
Operator); the wheel has no schema for them, so they get the structural checks below.
Nothing is applied to a cluster, so scheduling, probes and autoscaling are not
exercised here."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import kubernetes_validate
import pytest
from omnibus.v1 import engine_pb2
from prometheus_client import generate_latest

from omnibus.common.metrics import exposition
from omnibus.engine.engine import EngineStats
from omnibus.engine.serving.cli import build_parser as engine_parser
from omnibus.engine.serving.cli import configs_from_args
from omnibus.engine.serving.metrics import EngineMetrics
from omnibus.router.admission.store import RedisLimits
from omnibus.router.cli import build_parser as router_parser
from omnibus.router.cli import config_from_args
from omnibus.router.config import EngineTarget
from omnibus.router.dispatch.engines import EngineClient
from omnibus.router.dispatch.fleet import Fleet
from omnibus.router.dispatch.queue import RequestQueue
from omnibus.router.service.metrics import RouterMetrics
from tests import kustomize
from tests.grpc_helpers import ROOT

KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = ["base", "overlays/cpu", "overlays/gpu"]
K8S_VERSION = "1.32.0"
CRD_KINDS = {"ScaledObject", "PodMonitor"}  # no schema in the wheel: checked structurally
RENDERER = "kustomize binary" if kustomize.kustomize_command() else "Python stand-in"


def render(overlay: str) -> list[dict]:
    directory = KUBERNETES / overlay
    if kustomize.kustomize_command():
        return kustomize.build_with_binary(directory)
    return kustomize.build(directory)


def one(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(docs: list[dict], name: str) -> dict:
    return one(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_builtin_kind_validates_and_only_the_crds_have_no_schema(overlay):
    docs = render(overlay)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["Deployment"] * 3 + ["Service"] * 3 + ["PersistentVolumeClaim"] * 2
                           + ["PodDisruptionBudget"] * 2 + ["HorizontalPodAutoscaler",
                                                            "ScaledObject", "PodMonitor"]), RENDERER
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.skipif(kustomize.kustomize_command() is None, reason="no kustomize binary to compare with")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_python_stand_in_renders_what_kustomize_renders(overlay):
    def key(d: dict) -> str:
        return f"{d['kind']}/{d['metadata']['name']}"

    binary = sorted(kustomize.build_with_binary(KUBERNETES / overlay), key=key)
    assert sorted(kustomize.build(KUBERNETES / overlay), key=key) == binary


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_commands_are_accepted_by_the_clis_and_routers_find_engines_by_dns(overlay):
    docs = render(overlay)
    router = config_from_args(router_parser().parse_args(container(docs, "omnibus-router")["args"]))
    engine, server = configs_from_args(engine_parser().parse_args(
        container(docs, "omnibus-engine")["args"]))
    (target,) = [EngineTarget.parse(t) for t in router.engines]
    headless = one(docs, "Service", target.host)
    assert target.dns and headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["ports"][0]["port"] == server.port == target.port
    assert headless["spec"]["selector"] == one(docs, "Deployment", "omnibus-engine")["spec"][
        "selector"]["matchLabels"]
    assert router.limits_store == "redis://omnibus-redis:6379/0"
    assert one(docs, "Service", "omnibus-redis")["spec"]["ports"][0]["port"] == 6379


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_grace_periods_match_the_drain(overlay):
    docs = render(overlay)
    for name, cli in (("omnibus-router", router_parser), ("omnibus-engine", engine_parser)):
        pod = one(docs, "Deployment", name)["spec"]["template"]["spec"]
        c = pod["containers"][0]
        args = cli().parse_args(c["args"])
        pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
        assert pod["terminationGracePeriodSeconds"] >= pre_stop + args.drain_seconds + 5, name
        assert c["readinessProbe"]["grpc"] == {"port": args.port}  # overall health
    router = container(docs, "omnibus-router")
    # Liveness must not depend on engines: the health service the router keeps SERVING.
    assert router["livenessProbe"]["grpc"] == {"port": 50051, "service": "liveness"}
    assert "tcpSocket" in container(docs, "omnibus-engine")["livenessProbe"]
    for name in ("omnibus-router", "omnibus-engine"):
        mounts = container(docs, name)["volumeMounts"]
        assert all(m["readOnly"] for m in mounts)


def test_gpu_engines_request_a_gpu_and_run_cuda_and_cpu_ones_do_not():
    gpu, cpu = render("overlays/gpu"), render("overlays/cpu")
    resources = container(gpu, "omnibus-engine")["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == "1"
    assert engine_parser().parse_args(container(gpu, "omnibus-engine")["args"]).device == "cuda"
    assert "nvidia.com/gpu" not in container(cpu, "omnibus-engine")["resources"]["requests"]
    assert engine_parser().parse_args(container(cpu, "omnibus-engine")["args"]).device == "cpu"
    assert container(gpu, "omnibus-engine")["image"] == "registry.example.com/omnibus-engine:0.1.0"
    assert container(cpu, "omnibus-router")["image"] == "omnibus-router:dev"


MAX_ENGINES = {"base": 4, "overlays/cpu": 4, "overlays/gpu": 16}  # what each overlay's ScaledObject allows


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_crds_scale_the_engine_deployment_and_scrape_the_metrics_ports(overlay):
    docs = render(overlay)
    scaled = one(docs, "ScaledObject", "omnibus-engine")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == "omnibus-engine"
    # never to zero (a cold start loads the model); the GPU overlay raises the ceiling
    assert scaled["spec"]["minReplicaCount"] == 1
    assert scaled["spec"]["maxReplicaCount"] == MAX_ENGINES[overlay]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and int(trigger["metadata"]["threshold"]) > 0
    assert metric_names(trigger["metadata"]["query"]) <= exported_names()
    max_num_seqs = engine_parser().parse_args(container(docs, "omnibus-engine")["args"]).max_num_seqs
    assert int(trigger["metadata"]["threshold"]) == max_num_seqs * 7 // 8
    monitor = one(docs, "PodMonitor", "omnibus")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    for name in ("omnibus-router", "omnibus-engine"):
        pod = one(docs, "Deployment", name)["spec"]["template"]
        assert selector.items() <= pod["metadata"]["labels"].items()
        assert endpoint["port"] in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}


# ---- metric names ------------------------------------------------------------------

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                "or", "unless", "offset"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (functions, label matchers, grouping
    clauses, ranges, numbers and Grafana variables removed)."""
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\$\w+", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        rest = expr[m.end():].lstrip()
        if m.group() not in PROMQL_WORDS and not rest.startswith("("):
            names.add(m.group())
    return names


def exported_names() -> set[str]:
    """What the router's and engine's /metrics show, from the same classes the processes
    use: a router with one engine and the shared limits store, an engine's collectors."""

    async def router_text() -> bytes:
        engine = EngineClient("e:1", config, lambda: None)
        engine.take_report(engine_pb2.LoadReport(num_free_blocks=1, num_total_blocks=1))
        metrics = RouterMetrics(RequestQueue(10.0), Fleet([engine]), "demo")
        RedisLimits(config, metrics.registry)
        await engine.close()
        return generate_latest(exposition(metrics.registry, "demo"))

    config = config_from_args(router_parser().parse_args(
        ["serve", "--engine", "e:1", "--model", "m", "--limits-store", "redis://r:6379/0"]))
    stats = EngineStats(0, 0, 1, 1, 0, 0, 0, 0)
    aengine = SimpleNamespace(stats=lambda: stats, config=SimpleNamespace(adapter_dir=None))
    engine_text = generate_latest(exposition(EngineMetrics(aengine).registry, "demo"))
    names = set()
    for text in (asyncio.run(router_text()), engine_text):
        for line in text.decode().splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split()
                names |= {f"{name}{s}" for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
            elif line and not line.startswith("#"):
                names.add(re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group())
    return names


def test_metric_name_extraction_from_promql():
    expr = ('histogram_quantile(0.95, sum by (le) (rate(omnibus_router_e2e_latency_seconds_bucket'
            '{model_name=~"$model_name"}[5m]))) / clamp_min(sum(rate(x_total[1m])), 1)')
    assert metric_names(expr) == {"omnibus_router_e2e_latency_seconds_bucket", "x_total"}


def test_dashboard_queries_only_metrics_the_processes_export():
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "omnibus.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    read = set().union(*(metric_names(e) for e in exprs))
    exported = exported_names()
    assert read <= exported, sorted(read - exported)
    # The autoscaling signals and the per-model series are on the dashboard.
    for name in ("omnibus_router_queue_length", "omnibus_engine_kv_cache_usage_ratio",
                 "omnibus_engine_prefix_cache_hits_total", "process_cpu_seconds_total"):
        assert name in read


def test_queue_length_is_exported_at_zero_with_the_model_name_when_the_queue_is_empty():
    metrics = RouterMetrics(RequestQueue(10.0), Fleet(), "demo")
    text = generate_latest(exposition(metrics.registry, "demo")).decode()
    assert 'omnibus_router_queue_length{model_name="demo",priority="0"} 0.0' in text
    assert "process_cpu_seconds_total" in text
