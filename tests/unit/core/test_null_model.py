"""The null model (`--load-format null`): the real engine and server with a near-free
forward. Tokens follow its fixed pattern and every KV block comes back."""

import json

import grpc
import pytest
import torch
from omnibus.v1 import engine_pb2_grpc

from omnibus.engine.config import EngineConfig, ModelConfig
from omnibus.engine.engine import Engine
from omnibus.engine.model.null import NullModel
from omnibus.engine.worker.sampling import SamplingParams
from tests.grpc_helpers import engine_process, engine_request, engine_stats

VOCAB = 384
CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """A model directory with config.json and nothing else: the null model reads no weights."""
    path = tmp_path_factory.mktemp("null-model")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return path


def expected(prompt_len: int, n: int) -> list[int]:
    null = NullModel(ModelConfig.from_dict(CONFIG), torch.device("cpu"))
    return null.next_tokens(torch.arange(prompt_len - 1, prompt_len - 1 + n)).tolist()


def test_pattern_avoids_eos_and_bos():
    null = NullModel(ModelConfig.from_dict(CONFIG), torch.device("cpu"))
    tokens = set(null.next_tokens(torch.arange(10_000)).tolist())
    assert 1 not in tokens and 2 not in tokens and len(tokens) == VOCAB - 2


def test_in_process_engine_generates_the_pattern_and_frees_every_block(config_only):
    engine = Engine(EngineConfig(model=str(config_only), load_format="null", num_kv_blocks=64,
                                 max_num_seqs=8))
    prompts = [[5, 6, 7], [9] * 20, [3, 4, 5, 6, 7, 8]]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    assert outputs == [expected(len(p), 40) for p in prompts]
    counts = engine.check_integrity()
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks == 63, counts


def test_served_engine_streams_the_pattern_and_frees_every_block(config_only, tmp_path):
    proc = engine_process(config_only, tmp_path, "null-engine", "--load-format", "null",
                          "--num-kv-blocks", "64", "--max-num-seqs", "4").wait_serving()
    try:
        with grpc.insecure_channel(proc.address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            calls = [stub.Generate(engine_request(f"r{i}", prompt=[5 + i] * (3 + i), max_tokens=30),
                                   timeout=60) for i in range(6)]  # 6 > 4 seats: some wait
            for i, call in enumerate(calls):
                tokens = [t for reply in call for t in reply.token_ids]
                assert tokens == expected(3 + i, 30)
        load = engine_stats(proc.address).load
        assert load.num_running == load.num_waiting == 0
        assert load.num_free_blocks == load.num_total_blocks == 63
    finally:
        proc.stop()
