"""The batching study's counters are collected only when asked for (--study-counters):
serving engines run no per-step O(running) bookkeeping for them."""

import pytest

from omnibus.common.sampling import SamplingParams
from omnibus.engine.config import EngineConfig
from omnibus.engine.core.study import StudyCounters
from omnibus.engine.engine import Engine
from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("study") / "m"))


@pytest.mark.parametrize("study", [False, True])
def test_counters_only_with_the_study_flag(model, study):
    engine = Engine(EngineConfig(model=model, num_kv_blocks=32, block_size=4, study_counters=study))
    engine.warmup()  # the counters restart from zero after it
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.generate([[5, 6, 7], [8, 9]], params)
    stats = engine.stats()
    if not study:
        assert engine.scheduler.observer is None
        assert (stats.slots_stepped, stats.useful_tokens, stats.kv_tokens_stored) == (0, 0, 0)
        return
    assert isinstance(engine.scheduler.observer, StudyCounters)
    # 5 prompt tokens in one prefill step, then 2 decode steps of 2 sequences (the third
    # token of each is sampled by the second decode step and never computed).
    assert stats.useful_tokens == 5 + 2 + 2
    assert stats.slots_stepped == 2 * 3
    # KV stored after each step: 5, then 7, then 9 tokens; reserved in 4-token blocks.
    assert stats.kv_tokens_stored == 5 + 7 + 9
    assert stats.kv_tokens_reserved == (1 + 1) * 4 + (1 + 1) * 4 + (2 + 1) * 4
