"""Quantized checkpoints served through router and engine processes, a LoRA adapter on top:
compressed-tensors FP8 (W8A8), compressed-tensors W4A16 (groups) and GPTQ (act-order),
made by tests/oracle/test_quantized.py's packers. Over gRPC (x-adapter-id selects the
adapter) each request's greedy tokens are those of an in-process engine on the same file
with the same kernels (`--quantization auto`), one request at a time so both run the same
shapes; the in-process engine is held to each format's tolerance against the dequantized
reference in tests/oracle/test_quantized.py."""

from __future__ import annotations

import grpc
import pytest
from omnibus.v1 import inference_pb2 as pb
from omnibus.v1 import inference_pb2_grpc

from tests.grpc_helpers import engine_process, router_process
from tests.oracle.test_lora import make_adapter, run
from tests.oracle.test_quantized import PROMPTS, built, engine  # noqa: F401 (built: a fixture)

FORMATS = ["ct-fp8", "ct-w4a16", "gptq-actorder"]
TOKENS = 6


def served(address: str, prompt: list[int], adapter: str) -> list[int]:
    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(address))
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=TOKENS, temperature=0.0, ignore_eos=True))
    ids: list[int] = []
    for reply in stub.Generate(request, metadata=[("x-adapter-id", adapter)], timeout=120):
        ids += reply.token_ids
    return ids


@pytest.mark.parametrize("name", FORMATS)
def test_a_quantized_checkpoint_with_an_adapter_serves_as_in_process(built, tmp_path, name):  # noqa: F811
    ck = built(name)
    adapters = tmp_path / "adapters"
    make_adapter(ck.dense, adapters / "a-r8", 8, 16, ["q_proj", "v_proj", "o_proj", "down_proj"], False, seed=5)
    eng = engine(ck.path, "auto", adapter_dir=str(adapters))
    expected = {(a, i): run(eng, [(a or None, p, TOKENS)])[0] for a in ("", "a-r8") for i, p in enumerate(PROMPTS)}
    logs = tmp_path / "logs"
    logs.mkdir()
    proc = engine_process(ck.path, logs, "engine", "--adapter-dir", str(adapters), "--num-kv-blocks", "64",
                          "--max-num-batched-tokens", "16", "--dtype", "float32")
    router = router_process(ck.path, [proc.address], logs, "router")
    try:
        proc.wait_serving()
        router.wait_serving()
        got = {(a, i): served(router.address, p, a) for a in ("", "a-r8") for i, p in enumerate(PROMPTS)}
    finally:
        router.stop()
        proc.stop()
    assert got == expected
    assert any(got[("", i)] != got[("a-r8", i)] for i in range(len(PROMPTS)))  # the adapter matters
