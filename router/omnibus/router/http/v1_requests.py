"""OpenAI bodies (bodies.py) in, omnibus.v1 requests out: the prompts, the sampling
parameters and structured output, one GenerateRequest per choice (fan_out, with each
choice's seed), and the EmbedRequest. Only the shape changes here: ranges and limits
are the Validator's to check."""

from __future__ import annotations

from omnibus.v1 import inference_pb2 as pb

from omnibus.common.sampling import MAX_SEED
from omnibus.router.admission.validation import MAX_REQUEST_ID_CHARS
from omnibus.router.http import structured
from omnibus.router.http.bodies import ChatBody, EmbeddingBody, GenerationBody
from omnibus.router.service.errors import invalid

MIN_SEED = -(2**63)  # OpenAI's seed is an int64: a negative one is taken modulo 2**64


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)


def _token_ids(ids: list[int], field: str) -> pb.TokenIds:
    """Token ids for a protobuf field, or INVALID_ARGUMENT naming the first that no
    vocabulary holds (the Validator checks the rest against the model's)."""
    bad = next((t for t in ids if not -(2**31) <= t < 2**31), None)
    if bad is not None:
        raise invalid(f"{field}: token id {bad} is outside the vocabulary", field)
    return pb.TokenIds(ids=ids)


def completion_prompts(prompt: object, max_prompts: int) -> list[pb.GenerateRequest]:
    """A GenerateRequest for each of the body's prompts: a string, a list of strings,
    token ids, or a list of token-id lists (OpenAI's four forms), at most `max_prompts`."""
    if isinstance(prompt, str) or (_is_ids(prompt) and prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise invalid("prompt must be a non-empty string or a non-empty list of token ids, or a "
                      "list of those", "prompt")
    if len(prompt) > max_prompts:
        raise invalid(f"prompt holds {len(prompt)} prompts; at most {max_prompts} per request",
                      "prompt")
    prompts = []
    for i, item in enumerate(prompt):
        field = "prompt" if len(prompt) == 1 else f"prompt.{i}"
        if isinstance(item, str):
            prompts.append(pb.GenerateRequest(text=item))
        elif _is_ids(item) and item:
            prompts.append(pb.GenerateRequest(token_ids=_token_ids(item, field)))
        else:
            raise invalid(f"{field} must be a non-empty string or a non-empty list of token ids",
                          field)
    return prompts


def stop_strings(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise invalid("stop must be a string or a list of strings", "stop")


def structured_output(body: GenerationBody) -> tuple[pb.StructuredOutput, str] | None:
    """The format the body holds the output to, and the field that set it: OpenAI's
    `response_format` (`json_object`, or `json_schema` with `name`, `schema`, `strict`,
    `description`; `text` is none), vLLM's `structured_outputs` (`json`: a schema object
    or its text; `json_object`: true; `regex`, `choice`, `grammar`) or its older
    `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, or a chat
    `tool_choice` that forces a call (Tools.forced: the field is the schema's). At most
    one of them. The schema itself is checked by the Validator (as JSON) and compiled by
    the engine, as are the regex and the grammar."""
    tools = body.tool_spec() if isinstance(body, ChatBody) else None
    forced = tools.forced() if tools is not None else None
    sources = [(name, value) for name, value in (
        ("tool_choice", forced),
        ("response_format", body.response_format), ("structured_outputs", body.structured_outputs),
        ("guided_json", body.guided_json), ("guided_regex", body.guided_regex),
        ("guided_choice", body.guided_choice), ("guided_grammar", body.guided_grammar),
    ) if value is not None]
    if len(sources) > 1:
        raise invalid(f"{sources[0][0]} and {sources[1][0]} both set the output's format; set one",
                      sources[1][0])
    if not sources:
        return None
    name, value = sources[0]
    if name == "tool_choice":
        return forced
    if name == "response_format":
        fmt = structured.response_format(value)
    elif name == "structured_outputs":
        fmt = structured.structured_outputs(value)
    elif name == "guided_json":
        fmt = pb.StructuredOutput(json_schema=structured.schema_text(value, name))
    else:
        fmt = structured.guided(name.removeprefix("guided_"), value, name)
    return None if fmt is None else (fmt, name)


def logit_bias(value: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as strings) as token ids; the ranges are the
    Validator's (omnibus.common.sampling)."""
    out: dict[int, float] = {}
    for key, bias in (value or {}).items():
        if not key.isascii() or not key.isdigit() or len(key) > 10 or int(key) > 2**31 - 1:
            raise invalid(f"logit_bias keys must be token ids (integers >= 0 as strings), got {key!r}",
                          "logit_bias")
        if int(key) in out:
            raise invalid(f"logit_bias names token {int(key)} twice", "logit_bias")
        out[int(key)] = bias
    return out


# The public sampling scalars an HTTP body carries under the same name (vLLM's and
# OpenAI's names are Omnibus's), copied as they are; derived from the two schemas, so a
# new such field needs no line here. max_tokens and logprobs are the endpoint's to read,
# seed is made per choice (fan_out), speculative is a word in the body.
_SAME_NAMED = tuple(
    f.name for f in pb.SamplingParams.DESCRIPTOR.fields
    if f.name in GenerationBody.model_fields and not f.is_repeated and f.message_type is None
    and f.name not in ("max_tokens", "logprobs", "seed", "speculative"))


def sampling(
    body: GenerationBody, max_tokens: int | None, logprobs: int | None
) -> pb.SamplingParams:
    """The body's sampling parameters as omnibus.v1's; unset stays unset (the
    Validator's defaults). `logprobs` 0 asks for the chosen token only: the engine is
    asked for one alternative, which the response leaves out."""
    params = pb.SamplingParams(
        stop=stop_strings(body.stop),
        stop_token_ids=body.stop_token_ids,
        logprobs=0 if logprobs is None else max(logprobs, 1),  # in range: bodies.check_logprobs
        speculative=pb.SPECULATIVE_OFF if body.speculative == "off" else pb.SPECULATIVE_AUTO,
        logit_bias=logit_bias(body.logit_bias),
    )
    if max_tokens is not None:
        params.max_tokens = max_tokens
    for name in _SAME_NAMED:
        value = getattr(body, name)
        if value is not None:  # unset: the Validator's default
            setattr(params, name, value)
    fmt = structured_output(body)
    if fmt is not None:
        params.structured_output.CopyFrom(fmt[0])
    return params


def fan_out(
    body: GenerationBody, prompts: list[pb.GenerateRequest], max_n: int, request_id: str,
    priority: int,
) -> list[pb.GenerateRequest]:
    """One GenerateRequest per choice, prompt-major: choice j of prompt p is index
    p * n + j, as OpenAI indexes them. Choice j of a seeded request gets choice_seed(seed,
    j), so the choices differ and each is reproducible on its own."""
    if not 1 <= body.n <= max_n:
        raise invalid(f"n must be in [1, {max_n}], got {body.n}", "n")
    seed = body.seed
    if seed is not None:
        if not MIN_SEED <= seed <= MAX_SEED:
            raise invalid(f"seed must be in [{MIN_SEED}, {MAX_SEED}], got {seed}", "seed")
        seed %= 2**64
    count = len(prompts) * body.n
    longest = MAX_REQUEST_ID_CHARS - len(f"-{count - 1}")
    if count > 1 and len(request_id) > longest:  # choice i's id is the request's + "-i"
        raise invalid(f"with {count} choices the request id (x-request-id) must be at most "
                      f"{longest} characters, as each choice's id appends -i; it has "
                      f"{len(request_id)}")
    requests = []
    for prompt in prompts:
        for j in range(body.n):
            one = pb.GenerateRequest()
            one.CopyFrom(prompt)
            one.priority = priority
            one.request_id = request_id if count == 1 else f"{request_id}-{len(requests)}"
            if seed is not None:
                one.sampling.seed = choice_seed(seed, j)
            requests.append(one)
    return requests


def choice_seed(seed: int, j: int) -> int:
    """The seed of choice j of a request seeded `seed`: the seed itself for choice 0 (as
    with n=1, or over gRPC), else a mix of (seed, j). Not seed + j: that is the first
    choice of the request seeded seed + j, which would share its tokens. For each j it is
    one-to-one in the seed, so two requests' choices j never share a seed."""
    if j == 0:
        return seed
    return _mix64(seed ^ _mix64(j))


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers, nearby inputs unrelated."""
    x = (x + 0x9E3779B97F4A7C15) & MAX_SEED
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MAX_SEED
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MAX_SEED
    return x ^ (x >> 31)


def embed_request(body: EmbeddingBody, request_id: str, priority: int) -> pb.EmbedRequest:
    if body.dimensions is not None:
        raise invalid("dimensions is not supported: embeddings have the model's hidden size",
                      "dimensions")
    items = body.input
    if items == []:
        raise invalid("input is empty: send a string, token ids, or a list of those", "input")
    if isinstance(items, str) or _is_ids(items):
        items = [items]
    if not isinstance(items, list) or not items:
        raise invalid("input must be a string, a list of strings, token ids or lists of token ids",
                      "input")
    inputs = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            inputs.append(pb.EmbedInput(text=item))
        elif _is_ids(item):
            inputs.append(pb.EmbedInput(token_ids=_token_ids(item, f"input.{i}")))
        else:
            raise invalid(f"input {i} must be a string or a list of token ids", f"input.{i}")
    return pb.EmbedRequest(
        inputs=inputs,
        pooling=pb.LAST if body.pooling == "last" else pb.MEAN,
        normalize=body.normalize,
        priority=priority,
        request_id=request_id,
    )
