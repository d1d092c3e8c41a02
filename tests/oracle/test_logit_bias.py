"""logit_bias (OpenAI's): added to the logits of the named tokens before penalties'
choices and sampling. Greedy output equals transformers' generate with a logits processor
that adds the same biases, token for token, beside unbiased requests in the same batch;
the returned logprobs are of the biased distribution; ids outside the vocabulary are
refused at the engine."""

from __future__ import annotations

import pytest
import torch

from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import Engine
from omnibus.engine.worker.sampling import SamplingParams
from tests.checkpoints import load_hf, make_checkpoint

VOCAB = 384
PROMPTS = [[5], [7, 40, 9, 200, 31], list(range(20, 37))]
MAX_TOKENS = 8


class AddBias:
    """A transformers logits processor adding fixed biases (HF's own SequenceBias is per
    token sequence; this is OpenAI's per-token form)."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.ids = torch.tensor(list(bias))
        self.values = torch.tensor(list(bias.values()))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[:, self.ids] += self.values
        return scores


def hf_biased(model, prompt: list[int], bias: dict[int, float]) -> list[int]:
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                         logits_processor=[AddBias(bias)] if bias else None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("bias") / "m", "llama", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def engine(checkpoint):
    return Engine(EngineConfig(model=str(checkpoint), dtype="float32", num_kv_blocks=64))


def test_greedy_with_a_bias_is_transformers_with_the_same_bias_beside_unbiased_requests(checkpoint, engine):
    model = load_hf(checkpoint)
    plain = [hf_biased(model, p, {}) for p in PROMPTS]
    # biases big enough to change the argmax somewhere, not so big that one token wins always
    bias = {plain[0][0]: -100.0, plain[1][1]: -3.0, 77: 2.5, 201: 4.0}
    biased = [hf_biased(model, p, bias) for p in PROMPTS]
    assert biased != plain  # the bias changes the output
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logit_bias=b)
              for b in (bias, {}, bias, {}, bias, {})]
    got = engine.generate(PROMPTS + PROMPTS, params)
    assert got == [biased[0], plain[1], biased[2], plain[0], biased[1], plain[2]]


def test_logprobs_are_of_the_biased_distribution(engine):
    """+100 on one token: greedy takes it every step with a logprob of about 0; unbiased,
    the same token's logprob is far below."""
    token = 123
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1, logit_bias={token: 100.0})
    engine.add_request("biased", [5, 6, 7], params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == "biased"]
    tokens = [t for o in outs for t in o.new_token_ids]
    logprobs = [lp for o in outs for lp in o.new_logprobs]
    assert tokens == [token] * 4
    assert all(lp.token_id == token and lp.logprob > -1e-3 for lp in logprobs)


def test_a_bias_outside_the_vocabulary_is_refused(engine):
    params = SamplingParams(max_tokens=2, logit_bias={VOCAB: 1.0})
    with pytest.raises(ValueError, match=rf"logit_bias: token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"):
        engine.generate([[5]], params)
    assert not engine.has_unfinished()
