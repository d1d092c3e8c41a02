"""A stream's engine outputs as the client's messages: token ids detokenized into text
deltas (incremental, special tokens skipped), stop strings applied, logprobs cut to the
tokens sent, and the last message's finish reason, usage and timing."""

from __future__ import annotations

import time
from collections.abc import Sequence

from omnibus.v1 import engine_pb2, inference_pb2
from tokenizers import Tokenizer

from omnibus.router.service.accounting import timing, usage
from omnibus.router.service.job import Job
from omnibus.router.text.detokenizer import IncrementalDetokenizer, byte_fallback_ids, special_ids
from omnibus.router.text.stop import StopStringMatcher

STOP, UNSPECIFIED = inference_pb2.STOP, inference_pb2.FINISH_REASON_UNSPECIFIED


class Shaper:
    """Turns one job's engine outputs into its GenerateResponses."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_ids = byte_fallback_ids(tokenizer)
        self._special_ids = special_ids(tokenizer)

    def detokenizer(self, prompt_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        """A new stream's detokenizer (special tokens skipped, continuing `prompt_ids`), as
        every stream's text is made."""
        return IncrementalDetokenizer(self.tokenizer, self._byte_ids, self._special_ids, context=prompt_ids)

    def start(self, job: Job) -> None:
        """The job's text state, kept across the engines that serve it."""
        job.detok = self.detokenizer(job.request.prompt_ids)
        job.stop = StopStringMatcher(job.request.stop)

    def response(self, job: Job, out: engine_pb2.EngineGenerateResponse) -> inference_pb2.GenerateResponse:
        """The client's message for engine output `out`; the job's counts follow it."""
        detok, stop = job.detok, job.stop
        assert detok is not None and stop is not None, "start(job) comes first"
        if out.token_ids and job.first_token is None:
            job.first_token = time.monotonic()
        ids: Sequence[int] = out.token_ids
        text = ""
        # A stop token (EOS, stop_token_ids) ends the output: its id is sent, its text is not
        # part of the text (vLLM's rule; a special token's is skipped anyway).
        shown = len(ids) - (out.finish_reason == STOP)
        if stop.active and len(ids) > 1:  # a stop string may complete before the last of them
            for n, token in enumerate(ids, 1):
                if n <= shown:
                    text += stop.feed(detok.push((token,)))
                if stop.stopped:
                    break
            ids = ids[:n]  # what comes after the token that completed it is neither sent nor billed
        else:
            text = stop.feed(detok.push(ids[:shown]))
        job.sent_ids.extend(ids)
        job.completion_tokens = job.offset + out.num_output_tokens - (len(out.token_ids) - len(ids))
        if not job.offset:  # a continuation's cache hits include the resent output
            job.cached_tokens = out.num_cached_tokens
        finish = STOP if stop.stopped else out.finish_reason
        if finish != UNSPECIFIED and not stop.stopped:
            text += stop.feed(detok.flush())  # the last bytes may still complete a stop string
            finish = STOP if stop.stopped else finish
            text += stop.flush()
        if finish != UNSPECIFIED:  # the last message: built with its usage and timing, not copied in
            response = inference_pb2.GenerateResponse(
                request_id=job.request.request_id, text=text, token_ids=ids,
                finish_reason=finish, usage=usage(job), timing=timing(job))
        else:
            response = inference_pb2.GenerateResponse(
                request_id=job.request.request_id, text=text, token_ids=ids)
        if out.logprobs:  # copying an empty repeated message field costs ~1 µs a message
            response.logprobs.extend(out.logprobs[:len(ids)])
        if out.prompt_logprobs:  # the first message of a request that asked
            response.prompt_logprobs.extend(out.prompt_logprobs)
        return response

    def final(self, job: Job, finish: int) -> inference_pb2.GenerateResponse:
        """A last message with no new token: `finish`, usage and timing."""
        assert job.detok is not None and job.stop is not None, "start(job) comes first"
        text = "" if job.stop.stopped else job.stop.feed(job.detok.flush()) + job.stop.flush()
        return inference_pb2.GenerateResponse(
            request_id=job.request.request_id, text=text,
            finish_reason=STOP if job.stop.stopped else finish, usage=usage(job), timing=timing(job))
