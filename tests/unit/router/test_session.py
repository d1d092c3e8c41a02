"""The router's side of an engine session: a request's outputs it has not read yet are
merged into one, and an error comes after the tokens that preceded it."""

import grpc
import pytest
from omnibus.v1 import engine_pb2

from omnibus.router.dispatch.session import _Slot, rpc_error

Out = engine_pb2.EngineGenerateResponse


async def test_outputs_not_taken_yet_merge_into_one():
    slot = _Slot("r")
    slot.push(Out(handle=3, token_ids=[5], num_prompt_tokens=4, num_output_tokens=1))
    slot.push(Out(handle=3, token_ids=[6, 7], num_prompt_tokens=4, num_output_tokens=3))
    slot.push(Out(handle=3, token_ids=[8], num_prompt_tokens=4, num_output_tokens=4, finish_reason=2))
    merged = await slot.next()
    assert list(merged.token_ids) == [5, 6, 7, 8]
    assert (merged.num_output_tokens, merged.num_prompt_tokens, merged.finish_reason) == (4, 4, 2)
    slot.push(Out(handle=3, token_ids=[9], num_output_tokens=5))
    assert list((await slot.next()).token_ids) == [9]  # taken: a new output starts


async def test_an_error_follows_the_tokens_before_it():
    slot = _Slot("r")
    slot.push(Out(handle=1, token_ids=[5], num_output_tokens=1))
    slot.fail(rpc_error(grpc.StatusCode.UNAVAILABLE, "engine gone"))
    slot.fail(rpc_error(grpc.StatusCode.INTERNAL, "later errors are ignored"))
    assert list((await slot.next()).token_ids) == [5]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await slot.next()
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAVAILABLE, "engine gone")


async def test_a_stream_interval_holds_tokens_after_the_first_until_it_has_enough():
    import asyncio

    slot = _Slot("r", interval=3)

    async def taken_now() -> list[int] | None:
        """The output next() returns at once, or None when it waits."""
        task = asyncio.ensure_future(slot.next())
        await asyncio.sleep(0)
        if task.done():
            return list(task.result().token_ids)
        task.cancel()
        return None

    slot.push(Out(token_ids=[5], num_output_tokens=1))
    assert await taken_now() == [5]  # the first token goes at once (TTFT)
    slot.push(Out(token_ids=[6], num_output_tokens=2))
    slot.push(Out(token_ids=[7], num_output_tokens=3))
    assert await taken_now() is None  # two of three
    slot.push(Out(token_ids=[8], num_output_tokens=4))
    assert await taken_now() == [6, 7, 8]
    slot.push(Out(token_ids=[9], num_output_tokens=5, finish_reason=2))
    assert await taken_now() == [9]  # the finish goes at once
    held = _Slot("h", interval=4)
    held.push(Out(token_ids=[1]))
    await held.next()
    held.push(Out(token_ids=[2]))
    held.fail(rpc_error(grpc.StatusCode.UNAVAILABLE, "engine gone"))
    assert list((await held.next()).token_ids) == [2]  # an error releases what is held first
    with pytest.raises(grpc.aio.AioRpcError):
        await held.next()


async def test_packed_tokens_carry_the_counts_of_the_entry_before_them():
    slot = _Slot("r", interval=2)
    slot.push(Out(handle=3, token_ids=[5], num_prompt_tokens=9, num_cached_tokens=8, num_output_tokens=1))
    first = await slot.next()
    assert (list(first.token_ids), first.num_output_tokens) == ([5], 1)
    slot.push_token(6)
    assert slot.held == 1 and not slot._ready()  # one of two: held
    slot.push_token(7)
    out = await slot.next()
    assert list(out.token_ids) == [6, 7]
    assert (out.num_prompt_tokens, out.num_cached_tokens, out.num_output_tokens) == (9, 8, 3)
    slot.push_token(8)  # the update's packed tokens come before its entry: both merge, in order
    slot.push(Out(handle=3, token_ids=[9], num_prompt_tokens=9, num_cached_tokens=8,
                  num_output_tokens=5, finish_reason=2))
    last = await slot.next()
    assert (list(last.token_ids), last.num_output_tokens, last.finish_reason) == ([8, 9], 5, 2)


async def test_a_packed_first_token_is_handed_over_at_once():
    slot = _Slot("r", interval=8)  # an entry always brings the first token; a packed one would too
    slot.push_token(4)
    assert list((await slot.next()).token_ids) == [4]
