"""bench-tp's code path at a tiny shape: both rows measure, rank 0's collectives are the
ones a step needs, each rank holds half the weights (the full run is `make bench-tp`)."""

from __future__ import annotations

from omnibus.bench import tp


def test_each_rank_holds_half_the_weights_and_a_step_makes_its_collectives():
    rows = tp.run(tp.TINY, [2], tokens=3)
    one, two = rows
    assert (one.tp, two.tp) == (1, 2) and one.tok_s > 0 and two.tok_s > 0
    assert one.comm_ms == 0 and one.calls_per_step == 0
    # a step: its inputs broadcast, 2 all-reduces per layer and the embedding's, then the
    # logits' rows broadcast, their request and the gather
    layers = tp.TINY["num_hidden_layers"]
    assert two.calls_per_step == 2 * layers + 1 + 1 + 3 and two.comm_ms > 0
    assert 0.45 < two.weight_mib / one.weight_mib < 0.6
    text = tp.markdown(rows, tp.TINY, 3)
    assert "| 2 | 2 |" in text and "not a speedup" in text
