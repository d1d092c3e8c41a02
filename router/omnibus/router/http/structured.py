"""Structured output: the body fields that hold a generation to a format (OpenAI's
response_format, vLLM's structured_outputs and guided_*) read into omnibus.v1's
StructuredOutput. Which field a request used, and that it used one at most, is
v1_requests.structured_output's; checking the schema (as JSON) is the Validator's, and
compiling a schema, regex or grammar the engine's."""

from __future__ import annotations

import json
from typing import Any

from omnibus.v1 import inference_pb2 as pb

from omnibus.router.service.errors import invalid


def response_format(value: dict[str, Any]) -> pb.StructuredOutput | None:
    kind = value.get("type")
    if kind == "text":
        only_keys(value, {"type"}, "response_format")
        return None
    if kind == "json_object":
        only_keys(value, {"type"}, "response_format")
        return pb.StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise invalid(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                      "response_format.type")
    only_keys(value, {"type", "json_schema"}, "response_format")
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise invalid(f"{where} must be an object with name and schema", where)
    only_keys(spec, {"name", "schema", "strict", "description"}, where)
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise invalid(f"{where}.name must be a non-empty string", f"{where}.name")
    for key, kind_ in (("strict", bool), ("description", str)):
        if spec.get(key) is not None and not isinstance(spec[key], kind_):
            raise invalid(f"{where}.{key} must be a {kind_.__name__}", f"{where}.{key}")
    if "schema" not in spec:
        raise invalid(f"{where}.schema is required: the JSON Schema the output must follow",
                      f"{where}.schema")
    # strict or not, the schema is enforced (properties it does not name are not generated)
    return pb.StructuredOutput(json_schema=schema_text(spec["schema"], f"{where}.schema"))


_GUIDED_KINDS = ("regex", "choice", "grammar")


def structured_outputs(value: dict[str, Any]) -> pb.StructuredOutput | None:
    """vLLM's structured_outputs: one of `json`, `json_object`, `regex`, `choice`,
    `grammar`; structural tags are not served."""
    kinds = ("json", "json_object", *_GUIDED_KINDS)
    for key in value:
        if key not in kinds:
            raise invalid(f"structured_outputs.{key} is not supported; use one of "
                          f"{', '.join(kinds)}", f"structured_outputs.{key}")
    json_object = value.get("json_object")
    if json_object is not None and not isinstance(json_object, bool):
        raise invalid("structured_outputs.json_object must be a boolean",
                      "structured_outputs.json_object")
    given = [k for k in kinds if value.get(k) is not None and value.get(k) is not False]
    if len(given) > 1:
        raise invalid(f"structured_outputs sets both {given[0]} and {given[1]}; set one",
                      "structured_outputs")
    if not given:
        return None
    kind = given[0]
    if kind == "json":
        schema = schema_text(value["json"], "structured_outputs.json")
        return pb.StructuredOutput(json_schema=schema)
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    return guided(kind, value[kind], f"structured_outputs.{kind}")


def guided(kind: str, value: object, where: str) -> pb.StructuredOutput:
    """A regex (the whole output matches it), a choice (the output is one of the strings)
    or a grammar (EBNF in GBNF's dialect from rule `root`, or Lark from rule `start`).
    Compiling them is the engine's."""
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise invalid(f"{where} must be a non-empty list of strings", where)
        for i, option in enumerate(value):
            if not isinstance(option, str) or not option:
                raise invalid(f"{where}.{i} must be a non-empty string", f"{where}.{i}")
        return pb.StructuredOutput(choice=pb.Choices(options=value))
    if not isinstance(value, str) or not value:
        what = ("a regular expression" if kind == "regex"
                else "a grammar (EBNF with rule root, or Lark with rule start)")
        raise invalid(f"{where} must be {what}, as a non-empty string", where)
    return pb.StructuredOutput(**{kind: value})


def schema_text(schema: object, where: str) -> str:
    """A JSON Schema given as an object (sent on as JSON text, its key order kept: the
    order properties are generated in) or as JSON text (vLLM's string form)."""
    if isinstance(schema, str):
        return schema  # the Validator checks that it is JSON
    if isinstance(schema, dict) or schema is True:
        return json.dumps(schema, ensure_ascii=False)
    raise invalid(f"{where} must be a JSON Schema object, got {type(schema).__name__}", where)


def only_keys(value: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = next((k for k in value if k not in allowed), None)
    if extra is not None:
        raise invalid(f"unknown field '{where}.{extra}'", f"{where}.{extra}")
