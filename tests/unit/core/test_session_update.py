"""The engine's Session writer merges the steps a router has not read yet into one entry
per request: token ids and logprobs append, counts and the finish reason are the latest."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from omnibus.engine.core.sequence import RequestOutput
from omnibus.engine.serving.server import _Live, _Session
from omnibus.v1 import inference_pb2


def out(rid: str, token: int, n: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id=rid, new_token_ids=[token], new_logprobs=[], finished=finished,
                         finish_reason="length" if finished else None, num_prompt_tokens=4,
                         num_cached_tokens=0, num_output_tokens=n)


def test_unsent_steps_merge_into_one_entry_per_request():
    ended = []
    service = SimpleNamespace(_live={}, _end=lambda live, outcome: ended.append((live.request_id, outcome)))
    loop = asyncio.new_event_loop()
    loop.close()  # deliver only sets an asyncio.Event: no loop runs here
    session = _Session(service, loop)
    a, b = _Live("a", "", 0.0, session, handle=7), _Live("b", "", 0.0, session, handle=9)
    service._live.update(a=a, b=b)
    session.deliver([out("a", 11, 1), out("b", 21, 1)])
    session.deliver([out("a", 12, 2)])
    session.deliver([out("a", 13, 3, finished=True), out("b", 22, 2)])
    update = session.take()
    got = [(o.handle, list(o.token_ids), o.num_output_tokens, o.finish_reason) for o in update.outputs]
    assert got == [(7, [11, 12, 13], 3, inference_pb2.LENGTH), (9, [21, 22], 2, 0)]
    assert ended == [("a", "length")]
    session.deliver([out("b", 23, 3)])  # after a take: a new entry
    assert [(o.handle, list(o.token_ids)) for o in session.take().outputs] == [(9, [23])]
