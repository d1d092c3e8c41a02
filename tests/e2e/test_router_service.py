"""The router as a process, in front of fake engine processes (tests/fake_engine.py)
that echo each prompt's tokens back, so every expected text is known exactly.

Covers the public API's behaviour that needs no model: streaming and detokenization,
stop strings and stop tokens, each bad input's status code, adapters, API keys,
tenant caps and budgets, overload, queue deadlines, priorities, engine retries,
health, reflection, metrics and the client CLI.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from omnibus.v1 import inference_pb2 as pb
from omnibus.v1 import inference_pb2_grpc
from tokenizers import Tokenizer

from tests.grpc_helpers import (
    ROOT,
    ServerProcess,
    engine_stats,
    fake_engine_process,
    free_port,
    metric,
    router_process,
    scrape,
    tiny_checkpoint,
    wait_until,
)

PROMPT = "Once upon a time there was a little fox"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
VOCAB = 384
CONTEXT = 1024  # make_checkpoint's max_position_embeddings


@dataclass
class Cluster:
    tokenizer: Tokenizer
    plain: ServerProcess  # no keys, default limits, echo engine with room for 4
    keyed: ServerProcess  # tenants from a keys file, a 1 s queue limit, engine with room for 1
    busy: ServerProcess  # 6 queued requests at most, engine with room for 1
    busy_metrics: int
    busy_engine: ServerProcess
    retrying: ServerProcess  # first engine refuses everything, second serves
    refusing_engine: ServerProcess
    lonely: ServerProcess  # one engine, which a test kills and restarts
    lonely_engine: ServerProcess
    chunky: ServerProcess  # its engine sends 5 tokens of a sequence per output
    logs: Path


TENANTS = {
    "alice": {"keys": ["key-alice"], "max_concurrent": 1},
    "bob": {"keys": ["key-bob"], "tokens_per_minute": 100},
    "carol": {"keys": ["key-carol"]},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = tiny_checkpoint(tmp_path_factory)
    logs = tmp_path_factory.mktemp("logs")
    keys = logs / "keys.json"
    keys.write_text(json.dumps({"tenants": TENANTS}))
    engine_flags = {
        "plain": "--max-num-seqs 4",
        "keyed": "--max-num-seqs 1",
        "busy": "--max-num-seqs 1 --step-ms 10",
        "refusing": "--unavailable",
        "serving": "",
        "lonely": "",
        "chunky": "--tokens-per-step 5",
    }
    engines = {
        name: fake_engine_process(logs, f"fake-{name}", *flags.split())
        for name, flags in engine_flags.items()
    }
    busy_metrics = free_port()
    router_flags = {
        "plain": "--max-stop-strings 4 --max-stop-string-chars 20 --max-request-bytes 65536 "
        "--max-prompt-tokens 512",
        "keyed": f"--keys-file {keys} --max-queue-seconds 1",
        "busy": f"--max-queued-requests 6 --metrics-port {busy_metrics}",
        "lonely": "",
        "retrying": "",
        "chunky": "",
    }
    backends = {name: [engines[name].address] for name in ("plain", "keyed", "busy", "lonely", "chunky")}
    backends["retrying"] = [engines["refusing"].address, engines["serving"].address]
    routers = {
        name: router_process(model, backends[name], logs, f"router-{name}", *flags.split())
        for name, flags in router_flags.items()
    }
    procs = [*engines.values(), *routers.values()]
    try:
        for proc in procs:
            proc.wait_serving()
        yield Cluster(
            tokenizer=Tokenizer.from_file(str(model / "tokenizer.json")),
            plain=routers["plain"],
            keyed=routers["keyed"],
            busy=routers["busy"],
            busy_metrics=busy_metrics,
            busy_engine=engines["busy"],
            retrying=routers["retrying"],
            refusing_engine=engines["refusing"],
            lonely=routers["lonely"],
            lonely_engine=engines["lonely"],
            chunky=routers["chunky"],
            logs=logs,
        )
    finally:
        for proc in reversed(procs):
            proc.stop()


def stub(proc: ServerProcess) -> inference_pb2_grpc.InferenceStub:
    return inference_pb2_grpc.InferenceStub(grpc.insecure_channel(proc.address))


def generate(proc: ServerProcess, request: pb.GenerateRequest, metadata=(), timeout=None):
    return list(stub(proc).Generate(request, metadata=metadata, timeout=timeout))


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def echo(tokenizer: Tokenizer, text: str, n: int) -> list[int]:
    """What the fake engine generates: the prompt's ids, cycled, n of them."""
    ids = tokenizer.encode(text).ids
    return [ids[i % len(ids)] for i in range(n)]


# ---- streaming ------------------------------------------------------------------


def test_stream_text_is_the_decode_of_its_token_ids_with_usage(cluster):
    req = pb.GenerateRequest(
        text="café ☕ naïve", request_id="my-id-1", sampling=pb.SamplingParams(max_tokens=13)
    )
    responses = generate(cluster.plain, req)
    ids = [t for r in responses for t in r.token_ids]
    assert ids == echo(cluster.tokenizer, "café ☕ naïve", 13)
    assert "".join(r.text for r in responses) == cluster.tokenizer.decode(ids)
    assert all("\ufffd" not in r.text for r in responses)
    assert {r.request_id for r in responses} == {"my-id-1"}
    last = responses[-1]
    assert [r.finish_reason for r in responses[:-1]] == [pb.FINISH_REASON_UNSPECIFIED] * (
        len(responses) - 1
    )
    assert last.finish_reason == pb.LENGTH
    prompt_len = len(cluster.tokenizer.encode("café ☕ naïve").ids)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt_len, 13)
    assert (
        0
        <= last.timing.queue_seconds
        <= last.timing.time_to_first_token_seconds
        <= last.timing.total_seconds
    )
    assert not responses[0].HasField("usage")


def test_router_assigns_a_request_id_when_none_is_given(cluster):
    responses = generate(
        cluster.plain, pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2))
    )
    assert len({r.request_id for r in responses}) == 1 and len(responses[0].request_id) == 32


def test_token_id_prompt_with_a_stop_token(cluster):
    prompt = [10, 20, 30, 40, 50]
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(max_tokens=50, stop_token_ids=[40]),
    )
    responses = generate(cluster.plain, req)
    assert [t for r in responses for t in r.token_ids] == [10, 20, 30, 40]
    assert responses[-1].finish_reason == pb.STOP
    assert responses[-1].usage.completion_tokens == 4
    # The stop token's id is sent, its text is not part of the text (as in vLLM).
    text = "".join(r.text for r in responses)
    assert text == cluster.tokenizer.decode(prompt + [10, 20, 30])[len(cluster.tokenizer.decode(prompt)):]
    assert text != cluster.tokenizer.decode(prompt + [10, 20, 30, 40])[len(cluster.tokenizer.decode(prompt)):]


def test_stop_string_spanning_tokens_ends_the_stream(cluster):
    req = pb.GenerateRequest(
        text=PROMPT, sampling=pb.SamplingParams(max_tokens=200, stop=["xyz", "time th"])
    )
    responses = generate(cluster.plain, req)
    assert "".join(r.text for r in responses) == "Once upon a "
    assert responses[-1].finish_reason == pb.STOP
    tokens = [t for r in responses for t in r.token_ids]
    assert len(tokens) < 200
    assert responses[-1].usage.completion_tokens == len(tokens)


@pytest.mark.parametrize("logprobs", [0, 2])
def test_a_stop_string_inside_a_many_token_output_bills_up_to_its_token(cluster, logprobs):
    """When one engine output carries several tokens (a router reading late gets them
    merged), the stream ends at the token that completed the stop string: the tokens after
    it are neither sent nor billed, so usage does not depend on how outputs were merged."""
    sampling = pb.SamplingParams(max_tokens=200, stop=["time th"], logprobs=logprobs)
    one, five = (generate(router, pb.GenerateRequest(text=PROMPT, sampling=sampling))
                 for router in (cluster.plain, cluster.chunky))
    for responses in (one, five):
        assert "".join(r.text for r in responses) == "Once upon a "
        assert responses[-1].finish_reason == pb.STOP
    tokens = [t for r in five for t in r.token_ids]
    assert tokens == [t for r in one for t in r.token_ids]
    assert five[-1].usage.completion_tokens == len(tokens) == one[-1].usage.completion_tokens
    for responses in (one, five):  # the fake engine gives each token logprob -1
        assert [lp.token_id for r in responses for lp in r.logprobs] == (tokens if logprobs else [])


def test_stop_string_never_seen_releases_held_text_at_the_end(cluster):
    # "fo" is held back as a possible start of "fox!" until the stream ends.
    req = pb.GenerateRequest(
        text="a little fo", sampling=pb.SamplingParams(max_tokens=3, stop=["fox!"])
    )
    ids = echo(cluster.tokenizer, "a little fo", 3)
    responses = generate(cluster.plain, req)
    assert "".join(r.text for r in responses) == cluster.tokenizer.decode(ids)
    assert responses[-1].finish_reason == pb.LENGTH


# ---- bad input ------------------------------------------------------------------

S = pb.SamplingParams
BAD_REQUESTS = [
    (pb.GenerateRequest(), "the prompt is missing: set either text or token_ids"),
    (
        pb.GenerateRequest(text=""),
        "the prompt text is empty",
    ),  # a oneof member is present even when empty
    (pb.GenerateRequest(token_ids=pb.TokenIds()), "prompt token_ids is empty: send at least one token"),
    (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, VOCAB])),
        f"prompt token_ids: token id {VOCAB} is outside the vocabulary [0, {VOCAB})",
    ),
    (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[-1])),
        "prompt token_ids: token id -1 is outside the vocabulary",
    ),
    (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * 600)),
        "the prompt has 600 tokens; the limit is 512",
    ),
    (
        pb.GenerateRequest(text="hi", sampling=S(max_tokens=-5)),
        "max_tokens must be in [1, 1023], got -5",
    ),
    (
        pb.GenerateRequest(text="hi", sampling=S(max_tokens=0)),
        "max_tokens must be in [1, 1023], got 0",
    ),
    (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * 10), sampling=S(max_tokens=1020)),
        f"the prompt (10 tokens) + max_tokens (1020) exceeds the model's context of {CONTEXT} "
        "tokens",
    ),
    (
        pb.GenerateRequest(text="hi", sampling=S(temperature=-0.5)),
        "temperature must be a finite number >= 0",
    ),
    (
        pb.GenerateRequest(text="hi", sampling=S(temperature=float("nan"))),
        "temperature must be a finite number",
    ),
    (
        pb.GenerateRequest(text="hi", sampling=S(top_p=0.0)),
        "top_p must be a finite number in (0, 1], got 0.0",
    ),
    (
        pb.GenerateRequest(text="hi", sampling=S(top_p=1.5)),
        "top_p must be a finite number in (0, 1], got 1.5",
    ),
    (
        pb.GenerateRequest(text="hi", sampling=S(top_k=-2)),
        "top_k must be >= 0 (0 or -1 disables it), got -2",
    ),
    (
        pb.GenerateRequest(text="hi", sampling=S(min_p=2)),
        "min_p must be a finite number in [0, 1], got 2.0",
    ),
    (
        pb.GenerateRequest(text="hi", sampling=S(repetition_penalty=0)),
        "repetition_penalty must be a finite number > 0",
    ),
    (
        pb.GenerateRequest(text="hi", sampling=S(presence_penalty=3)),
        "presence_penalty must be a finite number in [-2, 2]",
    ),
    (
        pb.GenerateRequest(text="hi", sampling=S(frequency_penalty=-2.5)),
        "frequency_penalty must be a finite number in [-2, 2]",
    ),
    (pb.GenerateRequest(text="hi", sampling=S(logprobs=21)), "logprobs must be in [0, 20], got 21"),
    (
        pb.GenerateRequest(text="hi", sampling=S(stop=["a", "b", "c", "d", "e"])),
        "5 stop strings given; at most 4 are allowed",
    ),
    (pb.GenerateRequest(text="hi", sampling=S(stop=[""])), "stop strings must not be empty"),
    (
        pb.GenerateRequest(text="hi", sampling=S(stop=["x" * 21])),
        "a stop string has 21 characters; the limit is 20",
    ),
    (
        pb.GenerateRequest(text="hi", sampling=S(stop_token_ids=[VOCAB + 1])),
        f"stop_token_ids: token id {VOCAB + 1} is outside the vocabulary [0, {VOCAB})",
    ),
    (pb.GenerateRequest(text="hi", priority=101), "priority must be in [-100, 100], got 101"),
    (
        pb.GenerateRequest(text="hi", request_id="has space"),
        "request_id must be at most 128 printable ASCII",
    ),
    (
        pb.GenerateRequest(text="hi", request_id="x" * 129),
        "request_id must be at most 128 printable ASCII",
    ),
    (pb.GenerateRequest(text="x" * 70_000), "the request is 70004 bytes; the limit is 65536 bytes"),
]


@pytest.mark.parametrize("request_, message", BAD_REQUESTS, ids=[m[:40] for _, m in BAD_REQUESTS])
def test_bad_input_is_invalid_argument_with_a_clear_message(cluster, request_, message):
    err = rpc_error(lambda: generate(cluster.plain, request_))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(message)


def test_unknown_adapter_is_not_found(cluster):
    err = rpc_error(
        lambda: generate(cluster.plain, pb.GenerateRequest(text="hi"), [("x-adapter-id", "pirate")])
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert err.details().startswith("adapter 'pirate' not found")
    # An empty x-adapter-id is the base model.
    base = pb.GenerateRequest(text="hi", sampling=S(max_tokens=2))
    assert generate(cluster.plain, base, [("x-adapter-id", "")])[-1].finish_reason == pb.LENGTH


def test_list_models_gives_the_base_model_and_its_limits(cluster):
    reply = stub(cluster.plain).ListModels(pb.ListModelsRequest())
    assert reply.base_model == pb.ModelInfo(
        id="tiny-llama", max_context_length=CONTEXT, vocab_size=VOCAB, max_tokens_limit=CONTEXT - 1
    )
    assert list(reply.adapters) == []


def test_health_and_reflection(cluster):
    with grpc.insecure_channel(cluster.plain.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "omnibus.v1.Inference"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"omnibus.v1.Inference", "grpc.health.v1.Health"} <= services


# ---- keys and tenants -----------------------------------------------------------


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


@pytest.mark.parametrize(
    "metadata, message",
    [
        ([], "missing 'authorization: Bearer <key>' header"),
        (bearer("key-mallory"), "invalid API key"),
    ],
)
def test_missing_or_wrong_key_is_unauthenticated(cluster, metadata, message):
    for call in (
        lambda: generate(cluster.keyed, pb.GenerateRequest(text="hi"), metadata),
        lambda: stub(cluster.keyed).ListModels(pb.ListModelsRequest(), metadata=metadata),
    ):
        err = rpc_error(call)
        assert (err.code(), err.details()) == (grpc.StatusCode.UNAUTHENTICATED, message)


def test_tenant_concurrency_cap(cluster):
    alice = bearer("key-alice")
    long = pb.GenerateRequest(text=PROMPT, sampling=S(max_tokens=1000))
    first = stub(cluster.keyed).Generate(long, metadata=alice)
    next(first)
    err = rpc_error(lambda: generate(cluster.keyed, pb.GenerateRequest(text="hi"), alice))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details() == (
        "tenant 'alice' has reached its limit of 1 concurrent requests; "
        "retry when one of them has finished"
    )
    first.cancel()  # frees alice's slot once the router sees the cancel

    def admitted() -> bool:
        try:
            generate(cluster.keyed, pb.GenerateRequest(text="hi", sampling=S(max_tokens=2)), alice)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            return False
        return True

    wait_until(admitted, 30, "alice to be admitted again")


def test_tenant_token_budget(cluster):
    bob = bearer("key-bob")  # 100 tokens per minute
    prompt_len = len(cluster.tokenizer.encode(PROMPT).ids)
    done = generate(cluster.keyed, pb.GenerateRequest(text=PROMPT, sampling=S(max_tokens=60)), bob)
    assert done[-1].usage.completion_tokens == 60
    err = rpc_error(
        lambda: generate(
            cluster.keyed, pb.GenerateRequest(text=PROMPT, sampling=S(max_tokens=60)), bob
        )
    )
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details().startswith(
        "tenant 'bob' is over its budget of 100 tokens per minute "
        f"(this request needs {prompt_len + 60}, "
    )
    err = rpc_error(
        lambda: generate(
            cluster.keyed, pb.GenerateRequest(text=PROMPT, sampling=S(max_tokens=200)), bob
        )
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT  # waiting cannot help
    assert err.details() == (
        f"this request needs {prompt_len + 200} tokens (a prompt of {prompt_len} + max_tokens "
        "200) but tenant 'bob' has a budget of 100 tokens per minute, so it can never be "
        f"admitted; lower max_tokens to at most {100 - prompt_len}"
    )


def test_router_queue_limit_ends_a_request_that_never_got_an_engine(cluster):
    carol = bearer("key-carol")  # no limits of her own; the router waits 1 s at most
    blocker = stub(cluster.keyed).Generate(
        pb.GenerateRequest(text=PROMPT, sampling=S(max_tokens=1000)), metadata=carol
    )
    next(blocker)
    err = rpc_error(lambda: generate(cluster.keyed, pb.GenerateRequest(text="hi"), carol))
    blocker.cancel()
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (
        "for an engine and was never scheduled: the router's queue limit is 1.0 s" in err.details()
    )


# ---- queueing: overload, deadlines, priority ---------------------------------------


def queued(cluster: Cluster) -> float:
    text = scrape(cluster.busy_metrics)
    return sum(metric(text, "omnibus_router_queue_length", priority=str(p)) for p in range(-5, 6))


def occupy(cluster: Cluster):
    """A long request holding the busy engine's only slot; cancel it to free the slot."""
    call = stub(cluster.busy).Generate(pb.GenerateRequest(text=PROMPT, sampling=S(max_tokens=1000)))
    next(call)
    return call


def test_overload_is_resource_exhausted(cluster):
    blocker = occupy(cluster)
    waiting = [stub(cluster.busy).Generate(pb.GenerateRequest(text="hi")) for _ in range(6)]
    wait_until(lambda: queued(cluster) == 6, 30, "6 queued requests")
    err = rpc_error(lambda: generate(cluster.busy, pb.GenerateRequest(text="hi")))
    for call in [blocker, *waiting]:
        call.cancel()
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details() == "server overloaded, retry later (6 requests are queued, the limit is 6)"
    wait_until(lambda: queued(cluster) == 0, 30, "the queue to empty")
    assert (
        metric(
            scrape(cluster.busy_metrics),
            "omnibus_router_rejected_requests_total",
            reason="overloaded",
        )
        >= 1
    )


def test_client_deadline_passing_in_the_queue_never_reaches_the_engine(cluster):
    blocker = occupy(cluster)
    before = engine_stats(cluster.busy_engine.address).num_requests
    err = rpc_error(lambda: generate(cluster.busy, pb.GenerateRequest(text="hi"), timeout=0.5))
    blocker.cancel()
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(
        lambda: engine_stats(cluster.busy_engine.address).num_active_streams == 0,
        30,
        "an idle engine",
    )
    assert engine_stats(cluster.busy_engine.address).num_requests == before
    assert queued(cluster) == 0


def test_high_priority_requests_get_their_first_token_before_earlier_low_priority_ones(cluster):
    blocker = occupy(cluster)
    order: list[str] = []
    lock = threading.Lock()

    finish: dict[str, int] = {}

    def first_token(name: str, call) -> None:
        next(call)
        with lock:
            order.append(name)
        finish[name] = list(call)[-1].finish_reason

    threads = []
    arrivals = [
        ("low-1", 0),
        ("low-2", 0),
        ("low-3", 0),
        ("high-1", 5),
        ("high-2", 5),
        ("high-3", 5),
    ]
    for name, priority in arrivals:
        # The engine runs one request at a time for 20 steps of 10 ms, so first tokens
        # arrive at least 200 ms apart, in the order the router hands requests out.
        request = pb.GenerateRequest(text=name, priority=priority, sampling=S(max_tokens=20))
        call = stub(cluster.busy).Generate(request)
        threads.append(threading.Thread(target=first_token, args=(name, call)))
        threads[-1].start()
        wait_until(lambda: queued(cluster) == len(threads), 30, f"{name} to be queued")
    blocker.cancel()
    for thread in threads:
        thread.join(60)
    assert order == ["high-1", "high-2", "high-3", "low-1", "low-2", "low-3"]
    assert set(finish.values()) == {pb.LENGTH}


# ---- engines --------------------------------------------------------------------


def test_request_refused_by_an_engine_before_any_token_is_retried_on_another(cluster):
    for i in range(4):
        responses = generate(
            cluster.retrying, pb.GenerateRequest(text=f"try {i}", sampling=S(max_tokens=4))
        )
        assert responses[-1].finish_reason == pb.LENGTH
    assert engine_stats(cluster.refusing_engine.address).num_requests >= 1


def test_dead_engine_is_marked_unhealthy_and_reconnected_when_back(cluster):
    router, engine = cluster.lonely, cluster.lonely_engine
    # A stream the dead engine was serving fails at once (no engine is left to continue
    # it, as a new request is refused), saying how far it got; not after the queue limit.
    stream = stub(router).Generate(pb.GenerateRequest(text="hi", sampling=S(max_tokens=1000)), timeout=30)
    first = next(stream)
    engine.signal(signal.SIGKILL)
    engine.wait_exit()
    with pytest.raises(grpc.RpcError) as lost:
        for _ in stream:
            pass
    assert lost.value.code() == grpc.StatusCode.UNAVAILABLE, lost.value.details()
    assert "is unavailable" in lost.value.details()
    assert " tokens and no other engine could continue" in lost.value.details()
    assert len(first.token_ids) == 1
    wait_until(lambda: router.health() == NOT_SERVING, 30, "the router to see its engine gone")
    err = rpc_error(lambda: generate(router, pb.GenerateRequest(text="hi")))
    assert (err.code(), err.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        "no engine worker is available; retry later",
    )
    port = int(engine.address.rsplit(":", 1)[1])
    revived = fake_engine_process(cluster.logs, "fake-lonely-again", port=port).wait_serving()
    try:
        wait_until(lambda: router.health() == SERVING, 30, "the router to reconnect")
        done = generate(router, pb.GenerateRequest(text="hi", sampling=S(max_tokens=2)))
        assert done[-1].finish_reason == pb.LENGTH
    finally:
        revived.stop()


# ---- the client CLI ---------------------------------------------------------------


def run_cli(script: str, *args: str) -> subprocess.CompletedProcess:
    """Runs an installed console script (beside this interpreter, as pip puts it)."""
    env = {"PATH": "/usr/bin:/bin"}
    exe = Path(sys.executable).parent / script
    return subprocess.run(
        [str(exe), *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env
    )


def test_healthcheck_cli_exit_code_follows_the_health_protocol(cluster):
    serving = run_cli("omnibus-healthcheck", cluster.plain.address)
    assert (serving.returncode, serving.stdout) == (0, f"{cluster.plain.address}: SERVING\n")
    nobody = run_cli("omnibus-healthcheck", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert nobody.returncode == 1
    typo = run_cli("omnibus-healthcheck", cluster.plain.address, "--service", "nope")
    assert typo.returncode == 1  # it said "NOT_FOUND: " and nothing else
    assert "no health status for service 'nope' (routers: ''" in typo.stderr


def test_client_cli_streams_the_completion_to_stdout(cluster):
    flags = f"--target {cluster.plain.address} --max-tokens 5 --temperature 0".split()
    out = run_cli("omnibus-client", PROMPT, *flags)
    assert out.returncode == 0, out.stderr
    assert out.stdout == cluster.tokenizer.decode(echo(cluster.tokenizer, PROMPT, 5)) + "\n"
    assert "[LENGTH] prompt" in out.stderr and "completion 5 tokens" in out.stderr
