"""The ingress: an OpenAI-compatible HTTP API (docs/design.md §7) in front of the engine replicas.

Per agent call it: authenticates the bearer key (key -> tenant), admits the call within the
tenant's limits, validates the body (`openai_api.parse_request`), tokenizes the prompt, finds the
fixed-prompt boundary, routes the call with this ingress's own router (`IngressRouter`: no actor call on
the path), and calls the engine replicas through a Serve handle whose request router honours that
choice. When the replica dies mid-call, the router forgets it and the call is retried once elsewhere.

Errors: every route answers OpenAI's error body, through one mapping (`error_response`) installed as
FastAPI exception handlers and a last-resort middleware; messages say what the caller did wrong and
never carry process ids, addresses, actor reprs or tracebacks. Each response carries `x-request-id`,
and the server log has the full detail under that id. Isolation: each tenant's requests carry its
cache namespace (`AppConfig.cache_salt`), so no tenant's KV, hit counts or routing reflect another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import hmac
import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayTaskError
from starlette.background import BackgroundTask
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException

from kvflow_ray.core.graph import SpecError, SpecLimitError, UnknownAgentError, WorkflowSpec, parse_spec
from kvflow_ray.core.reuse import EXACT
from kvflow_ray.core.sessions import SESSION_AGENT
from kvflow_ray.engines.base import GenerateResult, prefix_hash
from kvflow_ray.engines.constrained import Grammar
from kvflow_ray.engines.cpu.config import ModelConfig
from kvflow_ray.engines.tokenizer import load_tokenizer
from kvflow_ray.engines.tool_calls import CallEvent, ContentEvent, ToolCallStream, get_parser
from kvflow_ray.router.core import NoReplicaError, TenantLimitError, UnknownClientError, UnknownWorkflowError
from kvflow_ray.router.store import StoreUnavailableError, check_name
from kvflow_ray.serve.config import CONSTRAINED_ENGINES, AppConfig
from kvflow_ray.serve.ingress_router import DEAD, IngressRouter
from kvflow_ray.serve.openai_api import (
    ApiError,
    ParsedRequest,
    finish_reason,
    fixed_boundary,
    new_id,
    parse_request,
    public_text,
    response_body,
    stream_chunk,
    tool_call_deltas,
    usage,
)
from kvflow_ray.serve.replica_actors import replica_of
from kvflow_ray.serve.request_router import ROUTE_KWARG

logger = logging.getLogger("ray.serve")
api = FastAPI(title="kvflow-ray", description="OpenAI-compatible, workflow-aware LLM serving")
# the workflow every agent session is routed as: one agent that follows itself, turn after turn
SESSION_SPEC: dict[str, Any] = {"name": "kvflow.session", "entry": SESSION_AGENT,
                                "agents": {SESSION_AGENT: {"after": [SESSION_AGENT]}}}
REGISTERED_CACHE_S = 10.0  # a registration body seen again within this is answered without parsing
K = TypeVar("K")
V = TypeVar("V")


def _cause(exc: BaseException) -> BaseException:
    """The exception raised in the router actor, not Ray's wrapper: Ray re-raises an actor's error as a
    RayTaskError that is also an instance of its cause, but whose text carries the actor's pid, address,
    repr and traceback."""
    while isinstance(exc, RayTaskError) and getattr(exc, "cause", None) is not None:
        exc = exc.cause
    return exc


def _to_api_error(exc: BaseException) -> ApiError | None:
    """Request errors (raised here or in the router): what the caller did wrong, as a 4xx/503.
    None: not the caller's fault (a bug or an outage), answered as a 500 without detail."""
    exc = _cause(exc)
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, DEAD):  # an actor died under the request (an engine replica: after its one retry)
        return ApiError(503, "a replica serving this request stopped; retry", kind="service_unavailable",
                        code="replica_lost", headers={"Retry-After": "1"})
    if isinstance(exc, NoReplicaError):
        return ApiError(503, public_text(str(exc)), kind="service_unavailable", code="no_replica",
                        headers={"Retry-After": "1"})
    if isinstance(exc, StoreUnavailableError):
        return ApiError(503, public_text(str(exc)), kind="service_unavailable", code="store_unavailable",
                        headers={"Retry-After": "5"})
    if isinstance(exc, TenantLimitError):
        return ApiError(429, public_text(str(exc)), kind="rate_limit_error", code="tenant_limit_exceeded",
                        headers={"Retry-After": "1"})
    if isinstance(exc, (UnknownClientError, UnknownWorkflowError)):
        return ApiError(404, public_text(str(exc)), kind="not_found_error", code="not_found")
    if isinstance(exc, SpecLimitError):
        return ApiError(400, public_text(str(exc)), "workflow_spec", code="spec_limit_exceeded")
    if isinstance(exc, SpecError):
        return ApiError(400, public_text(str(exc)), "workflow_spec")
    if isinstance(exc, UnknownAgentError):
        return ApiError(400, public_text(str(exc)), "kvflow.agent")
    if isinstance(exc, ValueError):
        return ApiError(400, public_text(str(exc)))
    return None


def _internal_error(reference: str) -> ApiError:
    """A 500 that says only where the server log has the detail."""
    return ApiError(500, f"internal server error ({reference}); the server log has the details",
                    kind="server_error", code="internal_error")


def _request_id(request: Request) -> str:
    return getattr(request.state, "request_id", None) or "unknown"


def error_response(request: Request, exc: BaseException) -> JSONResponse:
    """The one mapping from any exception to an OpenAI error body; the detail goes to the log."""
    api_error = _to_api_error(exc)
    request_id = _request_id(request)
    if api_error is None:
        logger.error("request %s (%s %s) failed", request_id, request.method, request.url.path,
                     exc_info=(type(exc), exc, exc.__traceback__))
        api_error = _internal_error(f"request id {request_id}")
    return JSONResponse(api_error.body(), status_code=api_error.status, headers=api_error.headers)


HTTP_MESSAGES = {404: ("no route {method} {path}; see the API reference (docs/serving.md)", "not_found_error"),
                 405: ("method {method} is not allowed on {path}", "invalid_request_error")}


class RequestContext:
    """Every request gets an id (in the response and in the log); anything not handled by the exception
    handlers becomes an OpenAI error body here, never Starlette's plain-text 500. A plain ASGI
    middleware: it adds a header and nothing else to the cost of a request."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_id("req", 24)
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message).append("x-request-id", request_id)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if started:  # a streamed body failed after its headers: nothing else can be sent
                raise
            await error_response(Request(scope), exc)(scope, receive, send_with_id)


api.add_middleware(RequestContext)


@api.exception_handler(ApiError)
async def _api_error_handler(request: Request, exc: ApiError) -> Response:
    return error_response(request, exc)


@api.exception_handler(HTTPException)
async def _http_error_handler(request: Request, exc: HTTPException) -> Response:
    message, kind = HTTP_MESSAGES.get(exc.status_code, ("{detail}", "invalid_request_error"))
    text = message.format(method=request.method, path=public_text(request.url.path, 200), detail=exc.detail)
    return error_response(request, ApiError(exc.status_code, public_text(text), kind=kind,
                                            code="not_found" if exc.status_code == 404 else None,
                                            headers=dict(exc.headers or {})))


@api.exception_handler(RequestValidationError)
async def _validation_handler(request: Request, exc: RequestValidationError) -> Response:
    errors = exc.errors()
    loc = ".".join(str(p) for p in errors[0].get("loc", ())) if errors else ""
    message = f"invalid {loc}: {errors[0].get('msg', '')}" if errors else "invalid request"
    return error_response(request, ApiError(400, public_text(message), loc or None))


def json_too_deep(value: Any, limit: int) -> bool:
    """Whether `value` nests containers deeper than `limit` (iterative: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _too_big(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes (limits.max_body_bytes)",
                    code="request_too_large")


def _too_deep(limit: int) -> ApiError:
    return ApiError(400, f"the request body nests deeper than {limit} levels (limits.max_json_depth)",
                    code="json_too_deep")


def _startup_failed(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:  # the first call tries again
        logger.warning("the ingress's router did not start with the replica", exc_info=task.exception())


class Ingress:
    """The deployment class (wrapped by `serve.deployment` + `serve.ingress(api)` in `app.py`)."""

    def __init__(self, engine: Any, config: dict[str, Any]) -> None:
        self.config = AppConfig.from_dict(config)
        self.engine = engine
        self.name: str = serve.get_replica_context().replica_id.unique_id  # this ingress replica
        self.router = IngressRouter(self.config.router_settings(), self.name)
        self.limits = self.config.limits
        self.spec_limits = self.limits.spec_limits()
        self._inflight: Counter[str] = Counter()  # per tenant: calls admitted here and not yet answered
        # the engines' own tokenizer and context (the engine checks a prompt against its pool too)
        tokenizer_path = self.config.tokenizer_path()
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.tool_parser = get_parser(self.config.tool_call_parser)  # every engine's output, same parser
        self._session_tenants: set[str] = set()  # tenants the built-in session workflow is registered for
        self.model_name = self.config.model_name()
        if self.config.engine == "sim":
            from kvflow_ray.engines.sim.serving import MAX_CONTEXT

            self.max_context = MAX_CONTEXT
        else:
            # the CPU engine's random model has no files (no tokenizer path); a real model's own limit is
            # the engine's to check
            random = self.config.engine == "cpu" and tokenizer_path is None
            self.max_context = ModelConfig.named(self.config.model).max_context if random else 1 << 30
        # (tenant, body hash) -> the spec it registered, while that is still the tenant's current template
        self._registered: FreshCache[tuple[str, bytes], WorkflowSpec] = FreshCache(REGISTERED_CACHE_S)
        self._watch_from_the_start()

    def _watch_from_the_start(self) -> None:
        """Start the router's sync and store keeper now, not at this replica's first call: a replica
        that Serve started in place of a lost one must already know whether the store is reachable
        (and for how long it has not been) when its first call comes. Serve runs the constructor on
        the replica's event loop; without one (a constructor called directly) the first call starts them."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        # a fresh context: the background tasks belong to no request
        task = loop.create_task(self.router.ready(), context=contextvars.Context())
        task.add_done_callback(_startup_failed)

    # ------------------------------------------------------------------ plumbing
    @staticmethod
    def _bearer(request: Request) -> str | None:
        """The token of an `Authorization: Bearer <token>` header, if any."""
        header = request.headers.get("authorization", "")
        return header[7:].strip() if header.lower().startswith("bearer ") else None

    def _tenant(self, request: Request) -> str:
        tenant = self.config.tenant_for(self._bearer(request))
        if tenant is None:
            raise ApiError(401, "invalid API key: send 'Authorization: Bearer <key>' with a configured key",
                           kind="authentication_error", code="invalid_api_key")
        return tenant

    async def _body(self, request: Request) -> bytes:
        """The raw body, within `limits.max_body_bytes` (read no further)."""
        limit = self.limits.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise _too_big(limit)
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise _too_big(limit)
        return bytes(raw)

    async def _json(self, request: Request, raw: bytes | None = None) -> Any:
        """The body as JSON, nested at most `limits.max_json_depth` deep."""
        if raw is None:
            raw = await self._body(request)
        limit = self.limits.max_json_depth
        try:
            body = json.loads(raw)
        except RecursionError:
            raise _too_deep(limit) from None
        except ValueError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {public_text(str(exc), 200)}") from None
        # a body with no more brackets than the limit cannot nest deeper (counted in C, strings included)
        if raw.count(b"[") + raw.count(b"{") > limit and json_too_deep(body, limit):
            raise _too_deep(limit)
        return body

    def _admit(self, tenant: str) -> Callable[[], None]:
        """One more call of `tenant` in flight, within `limits.max_inflight_requests` (a tenant's storm
        waits at its own door, 429, instead of in everyone's queue); returns its release, which acts once."""
        if self._inflight[tenant] >= self.limits.max_inflight_requests:
            raise ApiError(429, f"too many requests in flight for this tenant (at most "
                                f"{self.limits.max_inflight_requests}; limits.max_inflight_requests)",
                           kind="rate_limit_error", code="tenant_limit_exceeded", headers={"Retry-After": "1"})
        self._inflight[tenant] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._inflight[tenant] -= 1
                if not self._inflight[tenant]:
                    del self._inflight[tenant]
        return release

    async def _put_template(self, tenant: str, body: dict[str, Any]) -> WorkflowSpec:
        """Register a spec from the network. It is checked here first (pure: no file is read, limits
        apply), so a bad or oversized spec never reaches the router; the router checks it again,
        as the authority every ingress replica shares."""
        parse_spec(body, limits=self.spec_limits)
        return await self.router.put_template(tenant, body)

    # ------------------------------------------------------------------ completions
    async def completion(self, request: Request, *, chat: bool) -> Response:
        tenant = self._tenant(request)
        release = self._admit(tenant)
        streaming = False
        try:
            response = await self._completion(request, tenant, chat=chat, release=release)
            streaming = isinstance(response, StreamingResponse)
            return response
        finally:
            if not streaming:
                release()

    async def _completion(self, request: Request, tenant: str, *, chat: bool, release: Callable[[], None]
                          ) -> Response:
        """A streamed response keeps the tenant's admission until its last chunk (`_stream` releases it)."""
        parsed = parse_request(await self._json(request), chat=chat, headers=request.headers)
        if parsed.model is not None and parsed.model not in (self.model_name, "default"):
            raise ApiError(404, f"model {parsed.model!r} does not exist; this server serves {self.model_name!r}",
                           "model", code="model_not_found")
        if parsed.prompt_ids is not None:  # token ids, as OpenAI's completions take them
            vocab = self.tokenizer.vocab_size
            if not all(0 <= t < vocab for t in parsed.prompt_ids):
                raise ApiError(400, f"'prompt' token ids must be within the model's vocabulary (0 to {vocab - 1})",
                               "prompt", code="invalid_value")
            text, tokens = "", parsed.prompt_ids
        else:
            text = self._render(parsed)(parsed.messages) if chat else parsed.prompt or ""
            tokens = self.tokenizer.encode(text)
        need = len(tokens) + parsed.max_tokens
        if need > self.max_context:
            raise ApiError(400, f"the prompt ({len(tokens)} tokens) plus {parsed.max_tokens_param} "
                                f"({parsed.max_tokens}) is {need} tokens, more than the model's context of "
                                f"{self.max_context}", "messages" if chat else "prompt", code="context_length_exceeded")
        salt = self.config.cache_salt(tenant)
        engine_request: dict[str, Any] = {"tokens": tokens, "max_tokens": parsed.max_tokens,
                                          "temperature": parsed.temperature, "top_p": parsed.top_p,
                                          "stop": parsed.stop, "seed": parsed.seed, "ignore_eos": parsed.ignore_eos,
                                          "cache_salt": salt}
        constraint = self._forced_call(parsed)
        if constraint is not None:
            engine_request["constraint"] = constraint
        if parsed.kv_budget is not None:
            engine_request["kv_budget"] = parsed.kv_budget
        if parsed.kv_scorer is not None:
            engine_request["kv_scorer"] = parsed.kv_scorer
        call = await self._start_call(tenant, parsed, tokens, text, engine_request)
        default_budget = self.config.tenant_kv_budget.get(tenant)
        # the tenant's default budget: for calls that set none and reuse nothing (the two do not combine)
        if (default_budget is not None and "kv_budget" not in engine_request
                and engine_request.get("reuse", EXACT) == EXACT):
            engine_request["kv_budget"] = default_budget
        if parsed.stream:
            # the generator ends the call when it stops; the background task when the client hung up
            # before the generator ever started (both act once)
            return StreamingResponse(self._stream(call, parsed, engine_request, len(tokens), release),
                                     media_type="text/event-stream", headers=self._route_headers(call, None),
                                     background=BackgroundTask(self._close, call, release))
        try:
            outcome = await self._run(call, engine_request)
        finally:
            self._end_call(call)
        result = GenerateResult(**outcome["result"])
        tools = parsed.tools
        if tools is not None and tools.active:  # the output's calls, by the configured parser
            output = self.tool_parser.parse(result.text, tools.names, tools.max_calls)
            body = response_body(result, chat=chat, model=self.model_name, content=output.content,
                                 tool_calls=output.calls)
        else:
            body = response_body(result, chat=chat, model=self.model_name)
        return JSONResponse(body, headers=self._route_headers(call, outcome["replica"]))

    def _render(self, parsed: ParsedRequest) -> Callable[[list[dict[str, Any]]], str]:
        """How this request's chat renders (with its callable tools, if any): one function for the prompt
        and for finding the fixed-prompt boundary, so both see the same text."""
        tools = parsed.tools.render if parsed.tools is not None else None
        return lambda messages: self.tokenizer.apply_chat_template(messages, tools=tools)

    def _forced_call(self, parsed: ParsedRequest) -> list[list[Any]] | None:
        """The constrained-decoding grammar of a forced tool call (`tool_choice` "required" or a named
        function), or None. Forced choice is honoured by constrained decoding or refused: never ignored."""
        tools = parsed.tools
        if tools is None or tools.forced is None:
            return None
        if self.config.engine not in CONSTRAINED_ENGINES:
            raise ApiError(400, f"this engine ({self.config.engine}) does not support forced tool choice "
                                "('tool_choice' \"required\" or a named function); use \"auto\" or \"none\"",
                           "tool_choice", code="unsupported_parameter")
        if not self.tool_parser.constrains:
            raise ApiError(400, f"the tool-call parser ({self.tool_parser.name}) cannot constrain a forced tool "
                                "choice ('tool_choice' \"required\" or a named function); use \"auto\" or \"none\"",
                           "tool_choice", code="unsupported_parameter")
        schemas = {t["function"]["name"]: t["function"].get("parameters") for t in tools.tools}
        grammar = self.tool_parser.forced_call([(name, schemas[name]) for name in tools.forced])
        need = Grammar(grammar).min_chars()
        if parsed.max_tokens < need:
            param = parsed.max_tokens_param if parsed.max_tokens_given else "tool_choice"
            raise ApiError(400, f"a forced tool call needs up to {need} output tokens, and "
                                f"{parsed.max_tokens_param} is {parsed.max_tokens}", param, code="invalid_value")
        return grammar

    def _route_headers(self, call: _Call | None, replica: str | None) -> dict[str, str]:
        """Where the call went and why: only when the config enables them (debugging), since they
        describe the fleet's cache to the caller."""
        if not self.config.route_headers:
            return {}
        headers = {"x-kvflow-route": call.outcome if call else "plain", "x-kvflow-ingress": self.name}
        replica = replica or (call.replica if call else None)
        if replica:
            headers["x-kvflow-replica"] = replica
        return headers

    async def _start_call(self, tenant: str, parsed: ParsedRequest, tokens: list[int], text: str,
                          engine_request: dict[str, Any]) -> _Call | None:
        meta = parsed.meta
        if meta is None:
            if parsed.session.session is not None:
                return await self._start_session(tenant, parsed, tokens, engine_request)
            return None
        check_name("client_id", meta.client_id)
        workflow = meta.workflow
        if meta.workflow_spec is not None:
            name = meta.workflow_spec.get("name")
            if workflow is not None and workflow != name:  # checked before anything is registered
                raise ApiError(400, f"'kvflow.workflow' ({workflow!r}) differs from the inline spec's name "
                                    f"({public_text(repr(name), 130)})", "kvflow.workflow")
            spec = await self._put_template(tenant, meta.workflow_spec)
            workflow = spec.name
        router = self.router
        await router.ready()
        await router.recall(tenant, meta.client_id)
        if workflow is None:
            workflow = router.client_workflow(tenant, meta.client_id)
        spec = await router.template(tenant, workflow)
        # an agent the current template lacks may belong to the version a live client started with:
        # the router, which knows each client's version, decides (and names an unknown agent)
        agent = spec.agents.get(meta.agent)
        boundary = meta.fixed_prefix_tokens
        if boundary is not None and boundary > len(tokens):
            raise ApiError(400, f"'kvflow.fixed_prefix_tokens' ({boundary}) is longer than the prompt "
                                f"({len(tokens)} tokens)", "kvflow.fixed_prefix_tokens")
        if boundary is None:
            boundary = self._boundary(parsed, tokens, text, agent.prompt if agent is not None else None)
        salt = engine_request["cache_salt"]
        fixed_hash = prefix_hash(tokens[:boundary], salt) if boundary else None
        route = router.start_call(tenant, meta.client_id, meta.agent, workflow=workflow, prefix_hash=fixed_hash,
                                  prefix_tokens=boundary, cache_salt=salt, tokens=tokens, max_new=parsed.max_tokens)
        engine_request.update(workflow=route.workflow_key, agent=meta.agent, call=route.call,
                              fixed_prefix_tokens=boundary)
        # reuse beyond the prefix: the call's choice, else its workflow's, else its tenant's default
        reuse = meta.reuse or (spec.reuse if spec is not None else None) or self.config.tenant_reuse.get(tenant)
        if reuse is not None:
            engine_request["reuse"] = reuse
        if meta.documents:
            engine_request["documents"] = self._documents(meta.documents, text)
        return _Call(tenant, meta.client_id, meta.agent, workflow, route.replica, route.outcome,
                     fixed_hash, boundary, salt, tokens, parsed.max_tokens)

    def _documents(self, documents: list[str], text: str) -> list[list[int]]:
        """`kvflow.documents` as token ids; each must appear verbatim in the prompt's text."""
        for i, document in enumerate(documents):
            if not document or document not in text:
                raise ApiError(400, f"'kvflow.documents[{i}]' does not appear verbatim in the prompt",
                               f"kvflow.documents[{i}]", code="invalid_value")
        return [self.tokenizer.encode(document) for document in documents]

    async def _start_session(self, tenant: str, parsed: ParsedRequest, tokens: list[int],
                             engine_request: dict[str, Any]) -> _Call:
        """A turn of an agent session (docs/design.md §11): routed as the one agent of the built-in
        `SESSION_SPEC` workflow, its session id the client id, so it stays on the replica holding its
        history; the engine ranks the history by the pause that follows."""
        meta = parsed.session
        assert meta.session is not None
        if tenant not in self._session_tenants:
            await self._put_template(tenant, SESSION_SPEC)
            self._session_tenants.add(tenant)
        router = self.router
        await router.ready()
        await router.recall(tenant, meta.session)
        salt = engine_request["cache_salt"]
        route = router.start_call(tenant, meta.session, SESSION_AGENT, workflow=SESSION_SPEC["name"], cache_salt=salt,
                                  tokens=tokens, max_new=parsed.max_tokens)
        tools = parsed.tools
        hint = meta.expected_pause_s if meta.expected_pause_s is not None else meta.cache_ttl_s
        engine_request.update(workflow=route.workflow_key, agent=SESSION_AGENT, call=route.call, session={
            "tenant": tenant, "agent": meta.agent or SESSION_AGENT, "hint_s": hint, "final": bool(meta.final_turn),
            "tool_parser": self.tool_parser.name if tools is not None and tools.active else None,
            "tools": list(tools.names) if tools is not None and tools.active else None})
        call = _Call(tenant, meta.session, SESSION_AGENT, SESSION_SPEC["name"], route.replica, route.outcome,
                     None, 0, salt, tokens, parsed.max_tokens)
        call.final = bool(meta.final_turn)
        return call

    def _boundary(self, parsed: ParsedRequest, tokens: list[int], text: str, prompt: str | None) -> int:
        """Where the agent's fixed prompt ends (docs/design.md §3); 0 when the request does not start with it.
        `text` / `tokens`: the request as rendered and encoded already."""
        if not prompt:
            return 0
        if parsed.chat:
            n = fixed_boundary(self._render(parsed), self.tokenizer.encode, parsed.messages, prompt,
                               full=text, full_ids=tokens)
            return n or 0
        if text.startswith(prompt):
            head = self.tokenizer.encode(prompt)
            return len(head) if tokens[:len(head)] == head else 0
        return 0

    async def _run(self, call: _Call | None, engine_request: dict[str, Any]) -> dict[str, Any]:
        """One engine call, retried as `_engine_items` retries."""
        (outcome,) = [item async for item in self._engine_items(call, engine_request, stream=False)]
        if "error" in outcome:
            raise _engine_error(outcome)
        return outcome

    def _route_kwargs(self, call: _Call | None) -> dict[str, str]:
        """The router's choice, for the request router in place: `WorkflowRequestRouter` honours it,
        Serve's own router ignores it (and so does the replica, which only records it)."""
        return {ROUTE_KWARG: call.replica} if call is not None else {}

    async def _reroute(self, call: _Call | None, error: BaseException) -> None:
        """The call's engine replica died under it: that replica (named by the error; not the chosen
        one when Serve found that full and the call spilled) is dropped, and the call routed again."""
        if call is None:
            return
        dead = replica_of(error)
        logger.warning("replica %s died under a call of %s/%s (routed to %s); retrying", dead or "(unknown)",
                       call.tenant, call.client_id, call.replica)
        if dead is not None:  # else Serve's own death hook drops it (`WorkflowRequestRouter`)
            await self.router.remove_replica(dead)
        # the agent is still running (no deviation); the call's count moves off the replica it was routed to
        route = self.router.start_call(call.tenant, call.client_id, call.agent, workflow=call.workflow,
                                       prefix_hash=call.prefix_hash, prefix_tokens=call.prefix_tokens,
                                       cache_salt=call.salt, retry_from=call.replica, tokens=call.tokens,
                                       max_new=call.max_new)
        call.replica, call.outcome = route.replica, route.outcome

    async def _engine_items(self, call: _Call | None, engine_request: dict[str, Any], stream: bool = True
                            ) -> AsyncIterator[dict[str, Any]]:
        """The engine's items for the call: its stream, or (`stream` False) its one outcome. A replica that
        dies under it before the first item, when nothing has reached the client yet, is dropped and the
        call retried once."""
        for attempt in (1, 2):
            received = False
            try:
                if not stream:
                    yield await self.engine.generate.remote(engine_request, **self._route_kwargs(call))
                    return
                items = self.engine.options(stream=True).stream.remote(engine_request, **self._route_kwargs(call))
                async for item in items:
                    received = True
                    yield item
                return
            except DEAD as error:
                if received or attempt == 2:
                    raise
                await self._reroute(call, error)

    async def _close(self, call: _Call | None, release: Callable[[], None]) -> None:
        release()
        self._end_call(call)

    def _end_call(self, call: _Call | None) -> None:
        """The call is over: the router's books (on the replica it counted the call on, even where
        Serve's default router sent it elsewhere) and its hints follow at once, in this process."""
        if call is None or call.ended:
            return
        call.ended = True
        self.router.end_call(call.tenant, call.client_id, call.agent, call.replica)
        if call.final:  # the session's last turn: the router forgets it (its engine released the KV)
            self.router.finish_client(call.tenant, call.client_id)

    async def _stream(self, call: _Call | None, parsed: ParsedRequest, engine_request: dict[str, Any],
                      prompt_tokens: int, release: Callable[[], None]) -> AsyncIterator[str]:
        request_id = new_id("chatcmpl" if parsed.chat else "cmpl")
        first = True
        tools = parsed.tools
        # with callable tools the text goes through the parser: content that may open a call is held
        # back, and a call is sent once its block is complete (docs/serving.md, Tool calls)
        calls: ToolCallStream | None = (self.tool_parser.stream(tools.names, tools.max_calls)
                                        if tools is not None and tools.active else None)

        def chunks(text: str, final: bool = False) -> list[dict[str, Any]]:
            nonlocal first
            if calls is None:
                events: list[Any] = [ContentEvent(text)] if text else []
            else:
                events = calls.feed(text) if text else []
                if final:
                    events += calls.finish()
            out: list[dict[str, Any]] = []
            for event in events:
                if isinstance(event, CallEvent):
                    for delta in tool_call_deltas(event.index, event.call):
                        out.append(stream_chunk("", chat=True, model=self.model_name, request_id=request_id,
                                                first=first, tool_call=delta))
                        first = False
                else:
                    out.append(stream_chunk(event.text, chat=parsed.chat, model=self.model_name,
                                            request_id=request_id, first=first))
                    first = False
            return out

        try:
            async with contextlib.aclosing(self._engine_items(call, engine_request)) as items:
                async for item in items:
                    if "error" in item:
                        yield f"data: {json.dumps(_engine_error(item).body())}\n\n"
                        break
                    if "text" in item:
                        for chunk in chunks(item["text"]):
                            yield f"data: {json.dumps(chunk)}\n\n"
                        continue
                    result = item["result"]
                    for chunk in chunks("", final=True):
                        yield f"data: {json.dumps(chunk)}\n\n"
                    reason = finish_reason(result["finish_reason"], bool(calls is not None and calls.calls))
                    yield "data: " + json.dumps(stream_chunk("", chat=parsed.chat, model=self.model_name,
                                                             request_id=request_id,
                                                             finish_reason=reason, first=first)) + "\n\n"
                    if parsed.include_usage:
                        final = stream_chunk("", chat=parsed.chat, model=self.model_name, request_id=request_id)
                        final["choices"] = []
                        final["usage"] = usage(prompt_tokens, len(result["tokens"]),
                                               result["gpu_hit_tokens"] + result["cpu_hit_tokens"],
                                               result.get("reused_tokens", 0))
                        yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"
        except Exception as exc:  # headers are sent: report in-band, as OpenAI does
            error = _to_api_error(exc)
            if error is None:
                logger.exception("stream %s failed", request_id)
                error = _internal_error(f"stream {request_id}")
            yield f"data: {json.dumps(error.body())}\n\n"
        finally:
            await self._close(call, release)

    # ------------------------------------------------------------------ workflows and clients
    async def register_workflow(self, request: Request) -> Response:
        tenant = self._tenant(request)
        raw = await self._body(request)
        # the same body again (clients re-register on start-up): answered here, no parse, no router call
        digest = (tenant, hashlib.blake2b(raw, digest_size=16).digest())
        seen = self._registered.get(digest)
        if seen is not None and self.router.held(tenant, seen.name) is seen:
            return JSONResponse({"object": "workflow", **seen.to_dict()})
        body = await self._json(request, raw)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a workflow spec object", "workflow_spec")
        spec = await self._put_template(tenant, body)
        self._registered.put(digest, spec)
        return JSONResponse({"object": "workflow", **spec.to_dict()})

    async def get_workflow(self, request: Request, name: str) -> Response:
        tenant = self._tenant(request)
        check_name("workflow", name)
        spec = await self.router.template(tenant, name)
        return JSONResponse({"object": "workflow", **spec.to_dict()})

    async def finish_client(self, request: Request, client_id: str) -> Response:
        tenant = self._tenant(request)
        check_name("client_id", client_id)
        await self.router.ready()
        await self.router.recall(tenant, client_id)
        self.router.finish_client(tenant, client_id)
        return JSONResponse({"object": "client", "id": client_id, "finished": True})

    async def health(self) -> Response:
        try:
            replicas = await asyncio.wait_for(self.router.fleet(), 5)
        except Exception:
            logger.warning("health: the router did not answer", exc_info=True)
            replicas = None
        if replicas is None:
            return JSONResponse({"status": "unavailable", "router": "not answering"}, status_code=503)
        status = "ok" if replicas else "unavailable"
        return JSONResponse({"status": status, "replicas": sorted(replicas), "routing": self.config.routing},
                            status_code=200 if replicas else 503)

    async def metrics(self, request: Request) -> Response:
        """Prometheus metrics: they name every tenant and replica, so with a metrics token configured
        only a scraper that sends it may read them."""
        token = self.config.metrics_token_value()
        if token is not None and not hmac.compare_digest((self._bearer(request) or "").encode(), token.encode()):
            raise ApiError(401, "/metrics needs the metrics token: send 'Authorization: Bearer <token>'",
                           kind="authentication_error", code="invalid_metrics_token",
                           headers={"WWW-Authenticate": "Bearer"})
        text = await self.router.metrics_text()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def models(self) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "kvflow-ray"}]})


    # ------------------------------------------------------------------ HTTP routes
    # errors propagate to the app's exception handlers (module top): one mapping for every route
    @api.post("/v1/chat/completions")
    async def chat_completions_route(self, request: Request) -> Response:
        return await self.completion(request, chat=True)

    @api.post("/v1/completions")
    async def completions_route(self, request: Request) -> Response:
        return await self.completion(request, chat=False)

    @api.get("/v1/models")
    async def models_route(self, request: Request) -> Response:
        self._tenant(request)  # as OpenAI's: only for callers with a key
        return self.models()

    @api.post("/v1/workflows")
    async def register_route(self, request: Request) -> Response:
        return await self.register_workflow(request)

    @api.get("/v1/workflows/{name}")
    async def workflow_route(self, request: Request, name: str) -> Response:
        return await self.get_workflow(request, name)

    @api.post("/v1/clients/{client_id}/finish")
    async def finish_route(self, request: Request, client_id: str) -> Response:
        return await self.finish_client(request, client_id)

    @api.get("/health")
    async def health_route(self) -> Response:
        return await self.health()

    @api.get("/metrics")
    async def metrics_route(self, request: Request) -> Response:
        return await self.metrics(request)


def _engine_error(outcome: dict[str, Any]) -> ApiError:
    """An engine's refusal (400: the request can never run there) or failure (500: no detail)."""
    if outcome["status"] < 500:
        return ApiError(outcome["status"], public_text(str(outcome["error"])))
    logger.error("engine replica %s failed a request: %s", outcome.get("replica"), outcome["error"])
    return ApiError(500, "the engine failed to serve the request; the server log has the details",
                    kind="server_error", code="engine_error")


class FreshCache(Generic[K, V]):
    """Values kept for `ttl_s` after they were put, then forgotten: expired entries leave from the front
    on every put (O(what expired)), so the cache holds only what was put within the last `ttl_s`."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._items: OrderedDict[K, tuple[float, V]] = OrderedDict()

    def get(self, key: K) -> V | None:
        item = self._items.get(key)
        return item[1] if item is not None and time.monotonic() - item[0] < self.ttl_s else None

    def put(self, key: K, value: V) -> None:
        now = time.monotonic()
        self._items[key] = (now, value)
        self._items.move_to_end(key)
        while self._items and now - next(iter(self._items.values()))[0] >= self.ttl_s:
            self._items.popitem(last=False)


class _Call:
    """One routed agent call, from start_call to end_call."""

    def __init__(self, tenant: str, client_id: str, agent: str, workflow: str, replica: str, outcome: str,
                 prefix_hash: str | None, prefix_tokens: int, salt: str, tokens: list[int], max_new: int) -> None:
        self.tenant, self.client_id, self.agent, self.workflow = tenant, client_id, agent, workflow
        self.replica, self.outcome = replica, outcome
        self.prefix_hash, self.prefix_tokens, self.salt = prefix_hash, prefix_tokens, salt
        self.tokens, self.max_new = tokens, max_new  # what the routing policy prices (a retry sends them again)
        self.ended = False  # end_call sent (once per call)
        self.final = False  # a session's last turn: the router forgets the session once it ends


# Bound here, at import, not in `build_app`: Serve pickles the FastAPI app by reference, so every
# process that imports this module (driver and replicas alike) must bind the routes to the class.
HttpIngress = serve.ingress(api)(Ingress)
