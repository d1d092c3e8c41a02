"""The engine's Session writer merges the steps a router has not read yet into one entry
per request: token ids and logprobs append, counts and the finish reason are the latest."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from omnibus.engine.core.sequence import RequestOutput
from omnibus.engine.serving.registry import Live
from omnibus.engine.serving.session import SessionStream
from omnibus.v1 import inference_pb2


def out(rid: str, token: int, n: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id=rid, new_token_ids=[token], new_logprobs=[], finished=finished,
                         finish_reason="length" if finished else None, num_prompt_tokens=4,
                         num_cached_tokens=0, num_output_tokens=n)



def fake_session(merges: bool = True):
    """A SessionStream over a stand-in registry: (session, its live requests by id, the
    (request id, outcome) of each end)."""
    ended: list = []
    live_requests: dict = {}
    service = SimpleNamespace(requests=SimpleNamespace(
        get=live_requests.get, end=lambda live, outcome: ended.append((live.request_id, outcome))))
    loop = asyncio.new_event_loop()
    loop.close()  # deliver only sets an asyncio.Event: no loop runs here
    return SessionStream(service, loop, merges=merges), live_requests, ended


def test_unsent_steps_merge_into_one_entry_per_request():
    session, live_requests, ended = fake_session()
    a, b = Live("a", "", 0.0, session, handle=7), Live("b", "", 0.0, session, handle=9)
    live_requests.update(a=a, b=b)
    session.deliver([out("a", 11, 1), out("b", 21, 1)])
    session.deliver([out("a", 12, 2)])
    session.deliver([out("a", 13, 3, finished=True), out("b", 22, 2)])
    update = session.take()
    got = [(o.handle, list(o.token_ids), o.num_output_tokens, o.finish_reason) for o in update.outputs]
    assert got == [(7, [11, 12, 13], 3, inference_pb2.LENGTH), (9, [21, 22], 2, 0)]
    assert ended == [("a", "length")]
    session.deliver([out("b", 23, 3)])  # after a take: a new entry
    assert [(o.handle, list(o.token_ids)) for o in session.take().outputs] == [(9, [23])]


def test_packed_sessions_send_started_requests_plain_tokens_as_pairs():
    session, live_requests, ended = fake_session()
    session.packed = True
    a, b = Live("a", "", 0.0, session, handle=7), Live("b", "", 0.0, session, handle=9)
    live_requests.update(a=a, b=b)
    session.deliver([out("a", 11, 1)])  # a's first token: an entry, with the counts
    update = session.take()
    assert [(o.handle, list(o.token_ids), o.num_prompt_tokens) for o in update.outputs] == [(7, [11], 4)]
    assert not update.tokens
    session.deliver([out("a", 12, 2), out("b", 21, 1)])
    session.deliver([out("a", 13, 3), out("b", 22, 2)])
    session.deliver([out("a", 14, 4, finished=True)])  # the finish: an entry after a's pairs
    update = session.take()
    assert list(zip(update.token_handles, update.tokens)) == [(7, 12), (7, 13)]
    assert [(o.handle, list(o.token_ids), o.finish_reason) for o in update.outputs] == [
        (9, [21, 22], 0), (7, [14], inference_pb2.LENGTH)]  # b started in this update: an entry
    assert ended == [("a", "length")]
    assert session.take() is None  # nothing pending: nothing to send
    session.deliver([out("b", 23, 3)])
    update = session.take()
    assert list(zip(update.token_handles, update.tokens)) == [(9, 23)] and not update.outputs
    session.packed = False  # a router that does not read pairs gets entries only
    session.deliver([out("b", 24, 4)])
    assert [(o.handle, list(o.token_ids)) for o in session.take().outputs] == [(9, [24])]


def test_a_generate_stream_sends_every_output_as_an_entry_of_its_own():
    """A Generate call's stream (`merges` off): one message per step, even when the caller
    reads slower than steps come."""
    session, live_requests, ended = fake_session(merges=False)
    a = Live("a", "", 0.0, session)
    live_requests.update(a=a)
    session.deliver([out("a", 11, 1)])
    session.deliver([out("a", 12, 2)])
    session.deliver([out("a", 13, 3, finished=True)])
    update = session.take()
    got = [(o.handle, list(o.token_ids), o.num_output_tokens, o.finish_reason) for o in update.outputs]
    assert got == [(0, [11], 1, 0), (0, [12], 2, 0), (0, [13], 3, inference_pb2.LENGTH)]
    assert ended == [("a", "length")]


def test_a_generate_call_s_grpc_deadline_folds_into_deadline_ms():
    """The earlier of the two counts, in whole milliseconds rounded up (0 would mean none),
    within deadline_ms's uint32; the call's request is left as it was, and a handle (a
    Session field) is dropped."""
    from omnibus.engine.serving.service import _with_call_deadline
    from omnibus.v1 import engine_pb2

    def folded(remaining: float | None, deadline_ms: int = 0) -> int:
        request = engine_pb2.EngineGenerateRequest(request_id="r", deadline_ms=deadline_ms, handle=7)
        msg = _with_call_deadline(request, remaining)
        assert (msg.request_id, msg.handle) == ("r", 0)
        assert (request.deadline_ms, request.handle) == (deadline_ms, 7)
        return msg.deadline_ms

    assert folded(None) == 0 and folded(None, 50) == 50  # no gRPC deadline
    assert folded(0.2) == 200 and folded(0.2001) == 201
    assert folded(0.2, 50) == 50 and folded(0.05, 200) == 50
    assert folded(0.0) == folded(-1.0) == 1  # passed already: it expires at once
    assert folded(1e10) == 2**32 - 1
