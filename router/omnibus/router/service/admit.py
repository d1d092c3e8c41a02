"""Admission into a job: the rules a request meets before it waits for an engine,
whatever the transport (the HTTP front asks these too, never deciding them itself).

The adapter: a well-formed name the tenant may use, that some engine has (NOT_FOUND
when none that has reported has it and every engine has reported; UNAVAILABLE while
one might). The request: validated and tokenized against the model's limits, at most
the context the engines serve. The engines: one taking requests can hold it (its
context and KV pool). The tenant: its limits and the queue caps admit it (all of one
client request's choices together, or none)."""

from __future__ import annotations

import time

import grpc
from omnibus.v1 import inference_pb2
from tokenizers import Tokenizer

from omnibus.common.adapters import is_adapter_name
from omnibus.router.admission.auth import Tenant
from omnibus.router.admission.limits import Cost, Permit
from omnibus.router.admission.store import admission_for
from omnibus.router.admission.validation import ModelLimits, Validator, ValidRequest, check_priority
from omnibus.router.config import RouterConfig
from omnibus.router.dispatch.adapters import ADAPTER_HEADER, check_adapter_name
from omnibus.router.dispatch.fleet import Fleet
from omnibus.router.dispatch.queue import RequestQueue
from omnibus.router.service.errors import RequestError, invalid
from omnibus.router.service.job import Caller, Job
from omnibus.router.service.metrics import RouterMetrics


class Admitter:
    """Checks and admits requests; the model's limits as the engines serve them."""

    def __init__(
        self,
        config: RouterConfig,
        limits: ModelLimits,
        tokenizer: Tokenizer,
        fleet: Fleet,
        queue: RequestQueue,
        metrics: RouterMetrics,
    ) -> None:
        self._config = config
        self._model_limits = limits  # from config.json and the flags
        self._served_context = 0  # the longest context an engine reported serving (0: none yet)
        self._validator = Validator(config, limits, tokenizer)
        self._tenants = admission_for(config, metrics.registry)
        self._fleet = fleet
        self._queue = queue
        self._metrics = metrics

    # ---- the model -------------------------------------------------------------

    @property
    def limits(self) -> ModelLimits:
        """The model's limits, at most the longest context an engine reports serving (an
        engine's --max-model-len, or a cap the router cannot see in config.json), so that
        what is advertised and admitted is what an engine takes."""
        return self._refresh()

    def _refresh(self) -> ModelLimits:
        """`limits`, handed to the validator too when an engine's report changed them."""
        served = self._fleet.served_context()
        if served != self._served_context:
            self._served_context = served
            self._validator.limits = self._model_limits.within(served) if served else self._model_limits
        return self._validator.limits

    async def close(self) -> None:
        """The shared limits store's connection and renewals end (the router stops)."""
        await self._tenants.close()

    def default_max_tokens(self, prompt_tokens: int) -> int:
        """max_tokens when the client sets none (the OpenAI API's chat default): up to the
        context of an engine that takes the request, at least 1."""
        most = self._fleet.fill_tokens()
        limits = self.limits
        most = limits.context if most is None else min(most, limits.context)
        return max(1, min(limits.max_tokens, most - prompt_tokens))

    def check_priority(self, priority: int, name: str = "priority") -> None:
        """A priority within --max-abs-priority (INVALID_ARGUMENT naming `name`)."""
        check_priority(priority, self._config.max_abs_priority, name)

    # ---- adapters --------------------------------------------------------------

    def check_adapter_use(self, tenant: Tenant, adapter: str) -> None:
        """A well-formed name (INVALID_ARGUMENT) the tenant may use (PERMISSION_DENIED)."""
        check_adapter_name(adapter)
        if not tenant.may_use(adapter):
            raise RequestError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"tenant {tenant.name!r} may not use adapter {adapter!r}; ListModels lists the "
                "adapters it may use",
                "adapter_denied",
            )

    def adapter_missing(self, adapter: str) -> bool:
        """No engine has `adapter`, for sure: none that reported lists it and every engine
        has reported (one that has not may have it: a restart)."""
        return not self._fleet.serves_adapter(adapter) and not self._fleet.unheard()

    def model_adapter(self, model: str, header: str | None, tenant: Tenant) -> str | None:
        """The adapter a request names with `model` (the base model's id or an adapter's
        name, the vLLM / LoRAX convention) and the x-adapter-id `header` (as on gRPC); ""
        for the base model; None when `model` names neither (an unknown model). Either
        goes through the tenant's list (refusals name param `model`)."""
        base = self.limits.model_id
        if model == base:
            return header or ""
        if header and header != model:
            raise invalid(
                f"model {model!r} and {ADAPTER_HEADER} {header!r} name different adapters; "
                f"set one of them (model {base!r} with the header)",
                "model",
            )
        if not is_adapter_name(model):
            return None
        if header is None:
            try:  # one outside the tenant's list is PERMISSION_DENIED, as on gRPC
                self.check_adapter_use(tenant, model)
            except RequestError as err:
                err.param = "model"
                raise
            if self.adapter_missing(model):
                return None  # (else admission's UNAVAILABLE: retry)
        return model

    def check_embedding_adapter(self, adapter: str, fix: str = "leave x-adapter-id empty",
                                param: str | None = None) -> None:
        """Embeddings come from the base model only (INVALID_ARGUMENT saying `fix`)."""
        if adapter:
            raise invalid(
                f"embeddings come from the base model {self.limits.model_id!r}, not adapter "
                f"{adapter!r}: {fix}",
                param,
            )

    def _check_adapter_served(self, adapter: str) -> None:
        if not self._fleet.serves_adapter(adapter):
            silent = self._fleet.unheard()
            if silent:  # it may be on an engine the router has not heard from (a restart)
                raise RequestError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"adapter {adapter!r} is not on any engine that has reported, and {silent} "
                    "engine(s) have not reported since this router started (starting or down); "
                    "retry later",
                    "adapter_unavailable",
                )
            raise RequestError(
                grpc.StatusCode.NOT_FOUND,
                f"adapter {adapter!r} not found on any engine; ListModels lists the adapters you "
                "may use",
                "unknown_adapter",
            )
        if not self._fleet.taking(adapter):
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"no engine with adapter {adapter!r} is taking requests now (down, restarting or "
                "draining); retry later",
                "adapter_unavailable",
            )

    # ---- generation --------------------------------------------------------------

    async def admit(
        self,
        requests: list[inference_pb2.GenerateRequest],
        request_ids: list[str],
        caller: Caller,
        per_prompt: int = 0,
    ) -> list[Job]:
        """The requests (the choices of one client request: groups of `per_prompt` of one
        prompt each, 0: all of one) validated and admitted together, all or none."""
        arrival = time.monotonic()
        tenant, adapter = caller.tenant, caller.adapter
        if adapter:
            self.check_adapter_use(tenant, adapter)
        self._refresh()
        valid = await self._validated(requests, request_ids, per_prompt or len(requests))
        if not self._fleet.serving():
            raise no_engine()
        if adapter:
            self._check_adapter_served(adapter)
        # The choices share max_tokens; batched prompts differ, and each choice is charged
        # as the longest (refunded what it does not use when it ends).
        first = max(valid, key=lambda v: v.cost)
        if not self._fleet.taking(adapter, first.cost):  # engines' KV pools may differ
            raise self._unfit(adapter, len(first.prompt_ids), first.cost)
        cost = Cost(len(first.prompt_ids), first.sampling.max_tokens, len(valid))
        permits = await self._tenants.admit(tenant, cost, len(self._queue), self._queue.tokens)
        if adapter:
            self._metrics.adapter_requests.labels(adapter).inc(len(valid))
        return [Job(v, caller, permit, arrival) for v, permit in zip(valid, permits)]

    async def _validated(
        self, requests: list[inference_pb2.GenerateRequest], request_ids: list[str], group: int
    ) -> list[ValidRequest]:
        """Each request validated, in groups of `group` choices of one prompt, tokenized
        once. With several groups (HTTP's batched prompts) a refusal of prompt k says so
        (param prompt.k)."""
        valid: list[ValidRequest] = []
        for i, (request, request_id) in enumerate(zip(requests, request_ids)):
            if i % group:  # another choice of the same prompt
                request.token_ids.ids[:] = valid[i - i % group].prompt_ids
            try:
                valid.append(await self._validator.validate(request, request_id))
            except RequestError as err:
                if group < len(requests) and (i or err.param == "prompt"):  # the prompt's fault
                    err.message = f"prompt {i // group}: {err.message}"
                    if err.param == "prompt":
                        err.param = f"prompt.{i // group}"
                raise
        return valid

    def _unfit(self, adapter: str, prompt_tokens: int, tokens: int) -> RequestError:
        """The refusal of a request (prompt + max_tokens = `tokens`) that no engine taking
        requests (with its adapter) can hold (engines' contexts and KV pools may differ):
        UNAVAILABLE while one that can is down or draining (a restart), or while some
        engine has not reported; else INVALID_ARGUMENT naming the most an engine takes."""
        most = self._fleet.most_request_tokens(adapter)
        if tokens <= most or self._fleet.unheard():
            return RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"no engine that can hold this request (prompt + max_tokens = {tokens} tokens) is "
                "taking requests now (down, restarting, draining or not yet reported); retry later",
                "no_engine",
            )
        if prompt_tokens + 1 > most:  # max_tokens 1 does not fit either
            return invalid(
                f"the prompt has {prompt_tokens} tokens, but the most one request may span on an "
                f"engine is {most} tokens (prompt + max_tokens; its context and KV cache); shorten "
                "the prompt",
                param="prompt",
            )
        return invalid(
            f"prompt + max_tokens = {tokens} tokens, but the most one request may span on an "
            f"engine is {most} tokens (its context and KV cache); lower max_tokens to at most "
            f"{most - prompt_tokens} or shorten the prompt",
            param="max_tokens",
        )

    # ---- embeddings ----------------------------------------------------------------

    async def embed_inputs(self, request: inference_pb2.EmbedRequest) -> list[list[int]]:
        """An Embed request's inputs, validated and tokenized."""
        self._refresh()
        return await self._validator.embed_inputs(request)

    async def admit_embedding(self, tenant: Tenant, tokens: int) -> Permit:
        """The tenant's limits for an embedding of `tokens` input tokens (no queue: the
        engine's embed queue has its own cap)."""
        (permit,) = await self._tenants.admit(tenant, Cost(tokens), 0, 0)
        return permit


def no_engine() -> RequestError:
    return RequestError(
        grpc.StatusCode.UNAVAILABLE, "no engine worker is available; retry later", "no_engine"
    )
