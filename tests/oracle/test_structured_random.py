"""Random JSON schemas (a Hypothesis strategy) hold sampled output to them: every output
of a batch of random schemas, sampled at temperature 1 from a random-weight model (which
tries whatever the grammar lets through), ends because its grammar ended, parses as
strict JSON and validates against its schema.

The strategy nests objects (required and optional properties, no others), arrays with
bounds, enums, bounded integers, booleans, null and patterned strings, so every output
is bounded. Strings use `pattern`, not `maxLength`: xgrammar 0.2.8 lets a string with
maxLength take raw control characters, which strict JSON refuses (docs/engine.md)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnibus.common.sampling import StructuredOutput
from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import Engine
from omnibus.engine.worker.sampling import SamplingParams
from tests.checkpoints import make_checkpoint

xgr = pytest.importorskip("xgrammar")

NAMES = st.text(alphabet="abcdefgh", min_size=1, max_size=5)
LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-99, 99), st.integers(0, 200)),
    st.integers(0, 6).map(lambda n: {"type": "string", "pattern": f"^[a-z0-9 ]{{0,{n}}}$"}),
    st.lists(st.one_of(NAMES, st.integers(-9, 9), st.booleans()), min_size=1, max_size=3,
             unique=True).map(lambda values: {"enum": values}),
)


def _object(properties: dict) -> st.SearchStrategy[dict]:
    return st.lists(st.sampled_from(sorted(properties)), unique=True).map(
        lambda required: {"type": "object", "properties": properties, "required": required,
                          "additionalProperties": False})


SCHEMAS = st.recursive(LEAVES, lambda inner: st.one_of(
    st.builds(lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo,
                                        "maxItems": lo + extra},
              inner, st.integers(0, 2), st.integers(0, 2)),
    st.dictionaries(NAMES, inner, min_size=1, max_size=3).flatmap(_object),
), max_leaves=6)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("random-schemas"), "llama")
    return Engine(EngineConfig(model=str(path), dtype="float32", structured_max_whitespace=1,
                               num_kv_blocks=256))


@settings(max_examples=10, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schemas=st.lists(SCHEMAS, min_size=8, max_size=8), seed=st.integers(0, 2**32))
def test_sampled_outputs_of_random_schemas_parse_and_validate(engine, schemas, seed):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(engine.config.model) + "/tokenizer.json")
    params = [SamplingParams(max_tokens=400, temperature=1.0, seed=seed + i,
                             structured_output=StructuredOutput("json_schema", json.dumps(s)))
              for i, s in enumerate(schemas)]
    tokens: dict[str, list[int]] = {}
    ends: dict[str, str | None] = {}
    for i, p in enumerate(params):
        engine.add_request(f"{seed}-{i}", [5 + i, 17, 33], p)
        tokens[f"{seed}-{i}"] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                ends[out.request_id] = out.finish_reason
    for schema, (rid, ids) in zip(schemas, tokens.items()):
        assert ends[rid] == "stop", (schema, ids)  # the grammar ended it, not the length
        value = json.loads(tokenizer.decode(ids))  # strict: no raw control characters
        jsonschema.validate(value, schema)
    assert engine.check_integrity().referenced == 0
