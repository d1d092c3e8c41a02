"""deploy/kubernetes (kustomize base + cpu, gpu, gpu-tp, pd and gateway overlays) and deploy/grafana,
checked without a cluster: each overlay renders (with kustomize where a binary exists,
otherwise with tests/kustomize.py's stand-in), every built-in kind validates against the
Kubernetes 1.32 schemas of the `kubernetes-validate` wheel (strict: unknown fields
fail), the commands are ones the CLIs accept, and every metric the autoscaler, the
dashboard and the gateway's endpoint picker read is one the processes export.

The wheel has no schema for custom kinds: InferencePool and HTTPRoute (and the endpoint
picker's config file) validate against the schemas in tests/schemas, written from the
documented API fields; ScaledObject (KEDA) and PodMonitor (Prometheus Operator) get the
structural checks below. Nothing is applied to a cluster, so scheduling, probes,
autoscaling and the gateway's routing are not exercised here."""

from __future__ import annotations

import asyncio
import copy
import json
import re
from types import SimpleNamespace

import jsonschema
import kubernetes_validate
import pytest
import yaml
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
OVERLAYS = ["base", "overlays/cpu", "overlays/gpu", "overlays/gpu-tp", "overlays/gateway", "overlays/pd"]
K8S_VERSION = "1.32.0"
SCHEMAS = ROOT / "tests" / "schemas"
# Custom kinds (no schema in the wheel): ours from tests/schemas, or structural checks.
CRD_SCHEMAS = {"InferencePool": "inferencepool.v1.json", "HTTPRoute": "httproute.v1.json"}
CRD_KINDS = {"ScaledObject", "PodMonitor", *CRD_SCHEMAS}
RENDERER = "kustomize binary" if kustomize.kustomize_command() else "Python stand-in"
BASE_KINDS = (["Deployment"] * 3 + ["Service"] * 3 + ["PersistentVolumeClaim"] * 2
              + ["PodDisruptionBudget"] * 2 + ["HorizontalPodAutoscaler", "ScaledObject", "PodMonitor"])
KINDS = {"base": BASE_KINDS, "overlays/cpu": BASE_KINDS, "overlays/gpu": BASE_KINDS, "overlays/gpu-tp": BASE_KINDS,
         "overlays/pd": BASE_KINDS + ["Deployment"],
         "overlays/gateway": BASE_KINDS + ["Deployment", "Service", "ServiceAccount", "Role", "RoleBinding",
                                           "ConfigMap", "InferencePool", "HTTPRoute"]}


def schema(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads((SCHEMAS / name).read_text()))


def render(overlay: str) -> list[dict]:
    directory = KUBERNETES / overlay
    if kustomize.kustomize_command():
        return kustomize.build_with_binary(directory)
    return kustomize.build(directory)


def one(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(docs: list[dict], name: str, index: int = 0) -> dict:
    return one(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][index]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_builtin_kind_validates_and_only_the_crds_have_no_schema(overlay):
    docs = render(overlay)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(KINDS[overlay]), RENDERER
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            if doc["kind"] in CRD_SCHEMAS:
                schema(CRD_SCHEMAS[doc["kind"]]).validate(doc)
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
    # the Service's pods are the engine Deployment's (and, in pd, the prefill one's too)
    assert headless["spec"]["selector"].items() <= one(docs, "Deployment", "omnibus-engine")["spec"][
        "selector"]["matchLabels"].items()
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
        mounts = container(docs, name)["volumeMounts"]  # models and adapters: read-only; /dev/shm is memory
        assert all(m.get("readOnly") for m in mounts if m["mountPath"] != "/dev/shm")


def test_gpu_engines_request_a_gpu_and_run_cuda_and_cpu_ones_do_not():
    gpu, cpu = render("overlays/gpu"), render("overlays/cpu")
    resources = container(gpu, "omnibus-engine")["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == "1"
    assert engine_parser().parse_args(container(gpu, "omnibus-engine")["args"]).device == "cuda"
    assert "nvidia.com/gpu" not in container(cpu, "omnibus-engine")["resources"]["requests"]
    assert engine_parser().parse_args(container(cpu, "omnibus-engine")["args"]).device == "cpu"
    assert container(gpu, "omnibus-engine")["image"] == "registry.example.com/omnibus-engine:0.1.0"
    assert container(cpu, "omnibus-router")["image"] == "omnibus-router:dev"


def test_a_rolling_update_of_cpu_engines_migrates_their_streams_and_gpu_engines_leave_it_off():
    """The base (CPU) engines start with --kv-transfer at their pod's IP, and a rolling
    update starts a new pod before it stops an old one (somewhere for the stopped one's
    streams to move, KV and all). The GPU overlays do not enable it: its staging path has
    not run on a GPU."""
    cpu = render("overlays/cpu")
    engine = container(cpu, "omnibus-engine")
    config, _ = configs_from_args(engine_parser().parse_args(engine["args"]))
    assert (config.kv_transfer, config.kv_transfer_host) == ("mooncake", "$(POD_IP)")
    (pod_ip,) = [e for e in engine["env"] if e["name"] == "POD_IP"]  # Kubernetes expands $(POD_IP) in args
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    rolling = one(cpu, "Deployment", "omnibus-engine")["spec"]["strategy"]
    assert rolling["type"] == "RollingUpdate" and rolling["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    for overlay in ("overlays/gpu", "overlays/gpu-tp"):
        args = engine_parser().parse_args(container(render(overlay), "omnibus-engine")["args"])
        assert args.kv_transfer == "none", overlay


def test_a_tensor_parallel_engine_holds_as_many_gpus_as_ranks_and_shared_memory():
    docs = render("overlays/gpu-tp")
    engine = container(docs, "omnibus-engine")
    args = engine_parser().parse_args(engine["args"])
    assert args.tensor_parallel_size == 2 and args.device == "cuda"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == engine["resources"]["requests"]["nvidia.com/gpu"] == "2"
    pod = one(docs, "Deployment", "omnibus-engine")["spec"]["template"]["spec"]
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
    assert {v["name"] for v in pod["volumes"]} >= {"dshm", "models", "adapters"}


def test_the_pd_overlay_runs_prefill_and_decode_engines_that_routers_find_by_one_name():
    """Two engine Deployments of one model and the same flags but the role, both moving
    KV at their pod's IP; the headless Service (the routers' DNS name) selects both,
    each Deployment's selector only its own pods; KEDA scales the decode engines."""
    docs = render("overlays/pd")
    deployments = {name: one(docs, "Deployment", name) for name in ("omnibus-engine", "omnibus-engine-prefill")}
    args = {name: container(docs, name)["args"] for name in deployments}
    configs = {name: configs_from_args(engine_parser().parse_args(a))[0] for name, a in args.items()}
    assert (configs["omnibus-engine"].role, configs["omnibus-engine-prefill"].role) == ("decode", "prefill")
    assert all((c.kv_transfer, c.kv_transfer_host) == ("mooncake", "$(POD_IP)") for c in configs.values())
    service = one(docs, "Service", "omnibus-engine-headless")["spec"]["selector"]
    for name, deployment in deployments.items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service.items() <= labels.items(), name
        for other, d in deployments.items():  # a Deployment's selector matches its own pods only
            selected = d["spec"]["selector"]["matchLabels"].items() <= labels.items()
            assert selected == (other == name), (other, name)
    assert one(docs, "ScaledObject", "omnibus-engine")["spec"]["scaleTargetRef"]["name"] == "omnibus-engine"

    def but_the_role(deployment: dict) -> dict:  # (engine-prefill.yaml is the base's pod, written out again)
        template = copy.deepcopy(deployment["spec"]["template"])
        del template["metadata"]["labels"]["omnibus.dev/role"]
        template["spec"]["containers"][0]["args"] = template["spec"]["containers"][0]["args"][:-1]
        return {"strategy": deployment["spec"]["strategy"], "template": template}

    assert but_the_role(deployments["omnibus-engine"]) == but_the_role(deployments["omnibus-engine-prefill"])
    assert container(docs, "omnibus-engine-prefill")["image"] == "omnibus-engine:cpu"


MAX_ENGINES = {"base": 4, "overlays/cpu": 4, "overlays/gpu": 16, "overlays/gpu-tp": 16, "overlays/gateway": 4,
               "overlays/pd": 4}  # what each overlay's ScaledObject allows


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
    scraped = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    selector = monitor["spec"]["selector"]["matchLabels"]
    for name in ("omnibus-router", "omnibus-engine"):
        pod = one(docs, "Deployment", name)["spec"]["template"]
        assert selector.items() <= pod["metadata"]["labels"].items()
        for c in pod["spec"]["containers"]:  # every process's --metrics-port is scraped
            cli = engine_parser if c["name"] == "engine" else router_parser
            metrics_port = cli().parse_args(c["args"]).metrics_port
            (port,) = [p["name"] for p in c["ports"] if p["containerPort"] == metrics_port]
            assert port in scraped, (name, c["name"])


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
    engine_config = SimpleNamespace(adapter_dir="/adapters", max_loras=2, block_size=16)
    aengine = SimpleNamespace(stats=lambda: stats, config=engine_config)
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


# ---- the gateway overlay (Gateway API Inference Extension) -------------------------

GATEWAY = "overlays/gateway"
# EPP v1.4+ refuses these at startup ("configure metrics via engineConfigs"): the names
# are set in its config file instead.
REFUSED_EPP_FLAGS = ("--total-queued-requests-metric", "--total-running-requests-metric",
                     "--kv-cache-usage-percentage-metric", "--lora-info-metric", "--cache-info-metric")


def flag(args: list[str], name: str) -> str:
    """The value of `--name V` or `--name=V` in an argument list (a Go flag set's forms)."""
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {args}")


def test_engine_pods_are_pool_members_serving_openai_http_through_a_router_sidecar():
    docs = render(GATEWAY)
    pod = one(docs, "Deployment", "omnibus-engine")["spec"]["template"]
    engine_c, sidecar = pod["spec"]["containers"]
    assert (engine_c["name"], sidecar["name"]) == ("engine", "router")
    engine_args = engine_parser().parse_args(engine_c["args"])
    _, server = configs_from_args(engine_args)
    router = config_from_args(router_parser().parse_args(sidecar["args"]))
    # The sidecar serves its own engine only, over the pod's loopback.
    assert router.engines == (f"localhost:{server.port}",)
    assert router.limits_store == "redis://omnibus-redis:6379/0"  # shared with the router tier
    assert router.max_inflight_per_engine == 4 * engine_args.max_num_seqs  # the queue stays in the engine
    ports = [p for c in pod["spec"]["containers"] for p in c["ports"]]
    assert len({p["name"] for p in ports}) == len({p["containerPort"] for p in ports}) == len(ports)
    pool = one(docs, "InferencePool", "omnibus")
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pool["spec"]["targetPorts"] == [{"number": router.http_port}]
    assert router.http_port in {p["containerPort"] for p in sidecar["ports"]}
    # Ready (a member) only once the sidecar's engine reports; it drains with the engine.
    assert sidecar["readinessProbe"]["grpc"] == {"port": router.port}
    assert sidecar["livenessProbe"]["grpc"] == {"port": router.port, "service": "liveness"}
    pre_stop = int(sidecar["lifecycle"]["preStop"]["exec"]["command"][1])
    assert router.drain_seconds == engine_args.drain_seconds
    assert pod["spec"]["terminationGracePeriodSeconds"] >= pre_stop + router.drain_seconds + 5
    assert all(m["readOnly"] for m in sidecar["volumeMounts"])
    # The router tier still reaches every engine directly (gRPC clients, the autoscaler).
    tier = config_from_args(router_parser().parse_args(container(docs, "omnibus-router")["args"]))
    assert tier.engines == ("dns:///omnibus-engine-headless:50061",)


def test_the_route_sends_to_the_pool_and_the_pool_to_the_endpoint_picker():
    docs = render(GATEWAY)
    pool = one(docs, "InferencePool", "omnibus")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    (rule,) = one(docs, "HTTPRoute", "omnibus")["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": pool["metadata"]["name"]}]
    ref = pool["spec"]["endpointPickerRef"]
    service = one(docs, "Service", ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    epp = one(docs, "Deployment", "omnibus-epp")["spec"]["template"]
    assert service["spec"]["selector"].items() <= epp["metadata"]["labels"].items()
    (c,) = epp["spec"]["containers"]
    (target,) = [p for p in c["ports"] if p["name"] == port["targetPort"]]
    assert target["containerPort"] == int(flag(c["args"], "--grpc-port"))
    health = int(flag(c["args"], "--grpc-health-port"))
    assert c["readinessProbe"]["grpc"]["port"] == c["livenessProbe"]["grpc"]["port"] == health
    assert flag(c["args"], "--pool-name") == pool["metadata"]["name"]
    assert flag(c["args"], "--pool-group") == "inference.networking.k8s.io"
    assert c["image"].startswith("registry.k8s.io/gateway-api-inference-extension/epp:v")
    # It may read the pool's pods and the pool.
    binding = one(docs, "RoleBinding", "omnibus-epp")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": epp["spec"]["serviceAccountName"]}]
    rules = {(g, r): set(rule["verbs"]) for rule in one(docs, "Role", binding["roleRef"]["name"])["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}
    for needed in (("", "pods"), ("inference.networking.k8s.io", "inferencepools")):
        assert {"get", "list", "watch"} <= rules[needed]


def test_the_endpoint_picker_reads_the_metrics_the_engines_export():
    docs = render(GATEWAY)
    epp = one(docs, "Deployment", "omnibus-epp")["spec"]["template"]["spec"]
    (c,) = epp["containers"]
    assert not [a for a in c["args"] if a.split("=")[0] in REFUSED_EPP_FLAGS]
    # The config file is the ConfigMap's key, mounted where --config-file says.
    path = flag(c["args"], "--config-file")
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in epp["volumes"] if v["name"] == mount["name"]]
    config_map = one(docs, "ConfigMap", volume["configMap"]["name"])
    config = yaml.safe_load(config_map["data"][path.removeprefix(mount["mountPath"] + "/")])
    schema("endpointpickerconfig.v1alpha1.json").validate(config)
    # It scrapes each engine's --metrics-port (the pool's port serves the sidecar's metrics).
    pod = one(docs, "Deployment", "omnibus-engine")["spec"]["template"]
    engine_args = engine_parser().parse_args(pod["spec"]["containers"][0]["args"])
    assert int(flag(c["args"], "--model-server-metrics-port")) == engine_args.metrics_port
    assert engine_args.adapter_dir  # the LoRA info gauge is exported only with adapters
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    params = extractor["parameters"]
    (omnibus,) = [e for e in params["engineConfigs"] if e["name"] == "omnibus"]
    assert pod["metadata"]["labels"][params["engineLabelKey"]] == omnibus["name"] == params["defaultEngine"]
    specs = {k: v for k, v in omnibus.items() if k.endswith("Spec")}
    assert specs == {
        "queuedRequestsSpec": "omnibus_engine_waiting_sequences",
        "runningRequestsSpec": "omnibus_engine_running_sequences",
        "kvUsageSpec": "omnibus_engine_kv_cache_usage_ratio",
        "loraSpec": "omnibus_engine_lora_requests_info",
        "cacheInfoSpec": "omnibus_engine_cache_config_info",
    }
    assert set(specs.values()) <= exported_names()
    # Every plugin a profile or the data layer names is defined.
    defined = {p.get("name", p["type"]) for p in config["plugins"]}
    refs = {p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]}
    refs |= {s["pluginRef"] for s in config["dataLayer"]["sources"]}
    refs |= {e["pluginRef"] for s in config["dataLayer"]["sources"] for e in s["extractors"]}
    assert refs <= defined, refs - defined


def test_the_custom_kind_schemas_refuse_what_the_apis_refuse():
    pool = one(render(GATEWAY), "InferencePool", "omnibus")
    pool_schema, route_schema = schema("inferencepool.v1.json"), schema("httproute.v1.json")
    bad = [
        {**pool, "spec": {**pool["spec"], "targetPort": [{"number": 8000}]}},  # unknown field
        {**pool, "spec": {**pool["spec"], "targetPorts": []}},  # at least one
        {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": 70000}]}},
        {**pool, "spec": {**pool["spec"], "endpointPickerRef": {"name": "omnibus-epp"}}},  # a Service needs a port
        {**pool, "spec": {**pool["spec"], "appProtocol": "grpc"}},
        {**pool, "apiVersion": "inference.networking.x-k8s.io/v1alpha2"},  # the pre-v1 group
    ]
    for doc in bad:
        assert not pool_schema.is_valid(doc), doc
    route = {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "r"},
             "spec": {"rules": [{"backendRefs": [{"name": "svc"}]}]}}  # a Service without a port
    assert not route_schema.is_valid(route)
    route["spec"]["rules"][0]["backendRefs"][0]["port"] = 80
    route_schema.validate(route)
    route["spec"]["rules"][0]["timeouts"] = {"request": "five minutes"}
    assert not route_schema.is_valid(route)
