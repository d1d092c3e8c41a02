"""A chat request's tools and tool_choice, checked (a 400 naming the first bad field),
and the output format that a tool_choice forcing a call holds the output to. The calls
a model makes go back to the client as shapes.ToolChatShape shapes them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from omnibus.v1 import inference_pb2 as pb

from omnibus.router.http.structured import only_keys, schema_text
from omnibus.router.service.errors import invalid

# OpenAI's rule for a function's name.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function without parameters


@dataclass(frozen=True)
class Tools:
    """A chat request's tools, as sent (the template gets them so), and what its
    tool_choice asks: "none" (plain text), "auto" (the model may call: the parser finds
    calls in the text), "required" (one call or more) or "function" (a call of
    `function`). The last two hold the output to a JSON schema (`forced`)."""

    tools: list[dict[str, Any]]
    choice: Literal["none", "auto", "required", "function"]
    function: str = ""
    parallel: bool = True  # parallel_tool_calls: false allows one call at most

    def parameters(self, name: str) -> tuple[int, dict[str, Any]]:
        """The index of function `name` and its parameters' schema."""
        for i, tool in enumerate(self.tools):
            if tool["function"]["name"] == name:
                return i, tool["function"].get("parameters") or _EMPTY_PARAMETERS
        raise KeyError(name)

    def forced(self) -> tuple[pb.StructuredOutput, str] | None:
        """The format tool_choice holds the output to, and the field that gave its schema:
        for a named function its parameters (the output is the arguments); for required,
        as vLLM's, a JSON array of at least one {"name", "parameters"} object, each one
        of the tools (one at most without parallel calls)."""
        if self.choice == "function":
            i, schema = self.parameters(self.function)
            fmt = pb.StructuredOutput(json_schema=schema_text(schema, ""))
            return fmt, f"tools.{i}.function.parameters"
        if self.choice != "required":
            return None
        calls: dict[str, Any] = {"type": "array", "minItems": 1}
        if not self.parallel:
            calls["maxItems"] = 1
        calls["items"] = {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                            "parameters": t["function"].get("parameters") or _EMPTY_PARAMETERS},
             "required": ["name", "parameters"]} for t in self.tools]}
        defs = _shared_defs(self.tools)
        if defs:  # a parameters' "$ref": "#/$defs/..." resolves from the root
            calls["$defs"] = defs
        return pb.StructuredOutput(json_schema=json.dumps(calls, ensure_ascii=False)), "tools"


def chat_tools(tools: list[dict[str, Any]] | None, choice: object, parallel: bool) -> Tools | None:
    """`tools` and `tool_choice` checked (RequestError naming the first bad field)."""
    names = [_tool_name(tool, i) for i, tool in enumerate(tools or [])]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid(f"tools.{i}.function.name: {name!r} is also tools.{names.index(name)}'s "
                          "name; each function needs its own", f"tools.{i}.function.name")
    if choice is None:
        choice = "auto" if names else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid(f"tool_choice must be none, auto, required or {{\"type\": \"function\", "
                          f"\"function\": {{\"name\": ...}}}}, got {choice!r}", "tool_choice")
        function = ""
    else:
        function = _named_choice(choice)
        choice = "function"
    if not names:
        if choice == "none":
            return None
        shown = choice if choice != "function" else repr(function)
        raise invalid(f"tool_choice {shown} needs tools: send the functions in tools", "tool_choice")
    if function and function not in names:
        raise invalid(f"tool_choice names function {function!r}, which tools does not define "
                      f"(it has {', '.join(names)})", "tool_choice.function.name")
    return Tools(list(tools or []), choice, function, parallel)


def _tool_name(tool: dict[str, Any], i: int) -> str:
    """Tool i's function name, once its shape is checked: {"type": "function", "function":
    {"name", "description", "parameters", "strict"}}."""
    where = f"tools.{i}"
    only_keys(tool, {"type", "function"}, where)
    if tool.get("type") != "function":
        raise invalid(f"{where}.type must be \"function\", got {tool.get('type')!r}",
                      f"{where}.type")
    spec = tool.get("function")
    where += ".function"
    if not isinstance(spec, dict):
        raise invalid(f"{where} must be an object with name (and description, parameters)", where)
    only_keys(spec, {"name", "description", "parameters", "strict"}, where)
    name = spec.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
        raise invalid(f"{where}.name must be 1 to 64 letters, digits, _ or -, got {name!r}",
                      f"{where}.name")
    for key, kind in (("description", str), ("strict", bool), ("parameters", dict)):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            what = "a JSON Schema object" if key == "parameters" else f"a {kind.__name__}"
            raise invalid(f"{where}.{key} must be {what}, got {type(spec[key]).__name__}",
                          f"{where}.{key}")
    return name


def _named_choice(choice: object) -> str:
    if not isinstance(choice, dict):
        raise invalid(f"tool_choice must be a string or an object, got {type(choice).__name__}",
                      "tool_choice")
    only_keys(choice, {"type", "function"}, "tool_choice")
    if choice.get("type") != "function":
        raise invalid(f"tool_choice.type must be \"function\", got {choice.get('type')!r}",
                      "tool_choice.type")
    spec = choice.get("function")
    if not isinstance(spec, dict):
        raise invalid("tool_choice.function must be an object with name", "tool_choice.function")
    only_keys(spec, {"name"}, "tool_choice.function")
    if not isinstance(spec.get("name"), str):
        raise invalid("tool_choice.function.name must be a string", "tool_choice.function.name")
    return spec["name"]


def _shared_defs(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The $defs of every tool's parameters in one (required's schema is one document);
    two tools defining one name differently is a 400 naming the second."""
    defs: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        own = (tool["function"].get("parameters") or {}).get("$defs") or {}
        if not isinstance(own, dict):
            raise invalid(f"tools.{i}.function.parameters.$defs must be an object",
                          f"tools.{i}.function.parameters.$defs")
        for key, value in own.items():
            if defs.setdefault(key, value) != value:
                raise invalid(f"tools.{i}.function.parameters.$defs.{key} differs from another "
                              "tool's definition of that name; with tool_choice required the "
                              "schemas share one $defs: rename one",
                              f"tools.{i}.function.parameters")
    return defs
