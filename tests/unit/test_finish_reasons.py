"""One table says how a request ends (omnibus.common.finish_reasons): every wire
FinishReason has one row, each column maps one to one, and every reason the engine's
scheduler writes is in it."""

from __future__ import annotations

import re
from pathlib import Path

from omnibus.v1 import inference_pb2 as pb

from omnibus.common import finish_reasons

ROOT = Path(__file__).resolve().parents[2]


def test_every_finish_reason_has_one_row_and_each_column_is_one_to_one():
    protos = [v for v in pb.FinishReason.values() if v != pb.FINISH_REASON_UNSPECIFIED]
    assert sorted(f.proto for f in finish_reasons.FINISHES) == sorted(protos)
    for column in ("engine", "proto", "outcome", "openai", "responses"):
        values = [getattr(f, column) for f in finish_reasons.FINISHES]
        assert len(set(values)) == len(values), column
    assert finish_reasons.DEADLINE not in finish_reasons.PROTO  # a status, not a FinishReason
    # the router's outcome label is the FinishReason's own name, as its metrics always said
    assert {pb.FinishReason.Name(p): o for p, o in finish_reasons.OUTCOME.items()} == {
        "STOP": "stop", "LENGTH": "length", "ABORTED": "aborted"}


def test_the_scheduler_writes_only_reasons_of_the_table():
    # the scheduler's modules: Lifecycle.end / finish are called with each reason, and
    # Bookkeeping._ends says why a token ends a sequence
    core = ROOT / "engine/omnibus/engine/core"
    source = "".join(p.read_text() for p in sorted(core.glob("*.py")))
    written = set(re.findall(r'\.(?:end|finish)\(seq, "(\w+)"', source))
    ends = source.split("def _ends(", 1)[1].split("\n    def ", 1)[0]  # why a token ends a sequence
    written |= set(re.findall(r'return "(\w+)"', ends))
    assert written == set(finish_reasons.ENGINE_REASONS), written
