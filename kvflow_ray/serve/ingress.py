"""The ingress: an OpenAI-compatible HTTP API (DESIGN.md §7) in front of the engine replicas.

Per agent call it: authenticates the bearer key (key -> tenant), validates the body
(`openai_api.parse_request`), tokenizes the prompt, finds the fixed-prompt boundary, asks the
WorkflowRouter actor where the call goes, and calls the engine replicas through a Serve handle whose
request router honours that choice. When the replica dies mid-call, the router forgets it and the
call is retried once elsewhere. Every error is a 4xx/5xx with OpenAI's error body; no bad request
changes any state beyond what it was allowed to touch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from kvflow_ray.core.graph import SpecError, UnknownAgentError, WorkflowSpec, parse_spec
from kvflow_ray.engines.base import GenerateResult, prefix_hash
from kvflow_ray.engines.cpu.config import ModelConfig
from kvflow_ray.engines.cpu.tokenizer import load_tokenizer
from kvflow_ray.serve.config import AppConfig
from kvflow_ray.serve.openai_api import (
    ApiError,
    ParsedRequest,
    fixed_boundary,
    parse_request,
    response_body,
    stream_chunk,
    usage,
)
from kvflow_ray.serve.request_router import ROUTE_KWARG
from kvflow_ray.serve.router_actor import get_router
from kvflow_ray.serve.router_core import NoReplicaError, UnknownClientError, UnknownWorkflowError
from kvflow_ray.serve.store import check_name

logger = logging.getLogger("ray.serve")
api = FastAPI(title="kvflow-ray", description="OpenAI-compatible, workflow-aware LLM serving")
ROUTER_RETRY_S = 60.0  # how long calls wait for a restarting router
TEMPLATE_CACHE_S = 10.0  # templates registered through another ingress replica show up within this
DEAD = (ActorDiedError, ActorUnavailableError, RayActorError)


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _to_api_error(exc: BaseException) -> ApiError | None:
    """Request errors raised in the router (they arrive through Ray as instances of their cause)."""
    if isinstance(exc, NoReplicaError):
        return ApiError(503, str(exc), kind="service_unavailable", code="no_replica")
    if isinstance(exc, (UnknownClientError, UnknownWorkflowError)):
        return ApiError(404, str(exc), kind="not_found_error", code="not_found")
    if isinstance(exc, SpecError):
        return ApiError(400, str(exc), "workflow_spec")
    if isinstance(exc, UnknownAgentError):
        return ApiError(400, str(exc), "kvflow.agent")
    if isinstance(exc, ValueError):
        return ApiError(400, str(exc))
    return None


class Ingress:
    """The deployment class (wrapped by `serve.deployment` + `serve.ingress(api)` in `app.py`)."""

    def __init__(self, engine: Any, config: dict[str, Any]) -> None:
        self.config = AppConfig.from_dict(config)
        self.engine = engine
        self.router = get_router(self.config.redis, ttl_s=self.config.state_ttl_s,
                                 balance_threshold=self.config.balance_threshold,
                                 prefetch_horizon=self.config.horizon)
        # the engines' own tokenizer and context (the engine checks a prompt against its pool too)
        self.tokenizer = load_tokenizer(self.config.tokenizer_path())
        self.model_name = self.config.model_name()
        if self.config.engine == "sim":
            from kvflow_ray.engines.sim.serving import MAX_CONTEXT

            self.max_context = MAX_CONTEXT
        else:
            self.max_context = ModelConfig().max_context if self.config.model_path is None else 1 << 30
        self.routed = self.config.routing == "workflow"
        self._templates: dict[tuple[str, str], tuple[float, WorkflowSpec]] = {}  # -> (fetched at, spec)

    # ------------------------------------------------------------------ plumbing
    async def _call_router(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A router call that waits out a router restart (Ray restarts it; state is in the store)."""
        deadline = time.monotonic() + ROUTER_RETRY_S
        while True:
            try:
                return await getattr(self.router, method).remote(*args, **kwargs)
            except DEAD:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.25)

    def _tenant(self, request: Request) -> str:
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else None
        tenant = self.config.tenant_for(key)
        if tenant is None:
            raise ApiError(401, "invalid API key: send 'Authorization: Bearer <key>' with a configured key",
                           kind="authentication_error", code="invalid_api_key")
        return tenant

    async def _json(self, request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None

    async def _guard(self, fn: Callable[[], Awaitable[Response]]) -> Response:
        try:
            return await fn()
        except ApiError as exc:
            return _error(exc)
        except Exception as exc:
            api_error = _to_api_error(exc)
            if api_error is None:
                logger.exception("request failed")
                api_error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")
            return _error(api_error)

    async def _template(self, tenant: str, name: str) -> WorkflowSpec:
        """The template, cached briefly."""
        cached = self._templates.get((tenant, name))
        if cached is not None and time.monotonic() - cached[0] < TEMPLATE_CACHE_S:
            return cached[1]
        spec = parse_spec(await self._call_router("get_template", tenant, name))
        self._remember(tenant, spec)
        return spec

    def _remember(self, tenant: str, spec: WorkflowSpec) -> None:
        if len(self._templates) > 10_000:
            self._templates.clear()
        self._templates[(tenant, spec.name)] = (time.monotonic(), spec)

    # ------------------------------------------------------------------ completions
    async def completion(self, request: Request, *, chat: bool) -> Response:
        tenant = self._tenant(request)
        parsed = parse_request(await self._json(request), chat=chat)
        if parsed.model is not None and parsed.model not in (self.model_name, "default"):
            raise ApiError(404, f"model {parsed.model!r} does not exist; this server serves {self.model_name!r}",
                           "model", code="model_not_found")
        text = self.tokenizer.apply_chat_template(parsed.messages) if chat else parsed.prompt or ""
        tokens = self.tokenizer.encode(text)
        need = len(tokens) + parsed.max_tokens
        if need > self.max_context:
            raise ApiError(400, f"the prompt ({len(tokens)} tokens) plus max_tokens ({parsed.max_tokens}) is {need} "
                                f"tokens, more than the model's context of {self.max_context}",
                           "messages" if chat else "prompt", code="context_length_exceeded")
        engine_request: dict[str, Any] = {"tokens": tokens, "max_tokens": parsed.max_tokens,
                                          "temperature": parsed.temperature, "seed": parsed.seed,
                                          "ignore_eos": parsed.ignore_eos}
        call = await self._start_call(tenant, parsed, tokens, text, engine_request)
        if parsed.stream:
            return StreamingResponse(self._stream(call, parsed, engine_request, len(tokens)),
                                     media_type="text/event-stream")
        try:
            outcome = await self._run(call, engine_request)
        finally:
            await self._end_call(call)
        result = outcome["result"]
        body = response_body(GenerateResult(**result), chat=chat, model=self.model_name)
        headers = {"x-kvflow-replica": outcome["replica"], "x-kvflow-route": call.outcome if call else "plain"}
        return JSONResponse(body, headers=headers)

    async def _start_call(self, tenant: str, parsed: ParsedRequest, tokens: list[int], text: str,
                          engine_request: dict[str, Any]) -> _Call | None:
        meta = parsed.meta
        if meta is None:
            return None
        check_name("client_id", meta.client_id)
        workflow = meta.workflow
        if meta.workflow_spec is not None:
            spec = parse_spec(await self._call_router("put_template", tenant, meta.workflow_spec))
            if workflow is not None and workflow != spec.name:
                raise ApiError(400, f"'kvflow.workflow' ({workflow!r}) differs from the inline spec's name "
                                    f"({spec.name!r})", "kvflow.workflow")
            workflow = spec.name
            self._remember(tenant, spec)
        if workflow is None:
            workflow = await self._call_router("client_workflow", tenant, meta.client_id)
        spec = await self._template(tenant, workflow)
        if meta.agent not in spec.agents:
            raise UnknownAgentError(meta.agent, spec.name, spec.agents)
        boundary = meta.fixed_prefix_tokens
        if boundary is not None and boundary > len(tokens):
            raise ApiError(400, f"'kvflow.fixed_prefix_tokens' ({boundary}) is longer than the prompt "
                                f"({len(tokens)} tokens)", "kvflow.fixed_prefix_tokens")
        if boundary is None:
            boundary = self._boundary(parsed, tokens, text, spec.agents[meta.agent].prompt)
        fixed_hash = prefix_hash(tokens[:boundary]) if boundary else None
        route = await self._call_router("start_call", tenant, meta.client_id, meta.agent, workflow=workflow,
                                        prefix_hash=fixed_hash, prefix_tokens=boundary)
        engine_request.update(workflow=route["workflow_key"], agent=meta.agent, fixed_prefix_tokens=boundary)
        return _Call(tenant, meta.client_id, meta.agent, workflow, route["replica"], route["outcome"],
                     fixed_hash, boundary)

    def _boundary(self, parsed: ParsedRequest, tokens: list[int], text: str, prompt: str | None) -> int:
        """Where the agent's fixed prompt ends (DESIGN.md §3); 0 when the request does not start with it.
        `text` / `tokens`: the request as rendered and encoded already."""
        if not prompt:
            return 0
        if parsed.chat:
            n = fixed_boundary(self.tokenizer.apply_chat_template, self.tokenizer.encode, parsed.messages, prompt,
                               full=text, full_ids=tokens)
            return n or 0
        if text.startswith(prompt):
            head = self.tokenizer.encode(prompt)
            return len(head) if tokens[:len(head)] == head else 0
        return 0

    async def _run(self, call: _Call | None, engine_request: dict[str, Any]) -> dict[str, Any]:
        """One engine call; a replica that dies under it is dropped and the call retried once."""
        for attempt in (1, 2):
            try:
                outcome = await self.engine.generate.remote(engine_request, **self._route_kwargs(call))
            except DEAD:
                if attempt == 2:
                    raise
                await self._reroute(call)
                continue
            if call is not None:
                call.served_by = outcome["replica"]
            if "error" in outcome:
                raise ApiError(outcome["status"], outcome["error"], kind="invalid_request_error"
                               if outcome["status"] < 500 else "server_error")
            return outcome
        raise AssertionError("unreachable")

    def _route_kwargs(self, call: _Call | None) -> dict[str, str]:
        """The router's choice for `WorkflowRequestRouter` (under Serve's default router: nothing)."""
        return {ROUTE_KWARG: call.replica} if call is not None and self.routed else {}

    async def _reroute(self, call: _Call | None) -> None:
        if call is None:
            return
        logger.warning("replica %s died under a call of %s/%s; retrying elsewhere", call.replica, call.tenant,
                       call.client_id)
        await self._call_router("remove_replica", call.replica)
        # the agent is still running (no deviation); the dead replica's load went with it
        route = await self._call_router("start_call", call.tenant, call.client_id, call.agent,
                                        workflow=call.workflow, prefix_hash=call.prefix_hash,
                                        prefix_tokens=call.prefix_tokens)
        call.replica, call.outcome = route["replica"], route["outcome"]

    async def _end_call(self, call: _Call | None) -> None:
        if call is not None:
            await self._call_router("end_call", call.tenant, call.client_id, call.agent,
                                    call.served_by or call.replica)

    async def _stream(self, call: _Call | None, parsed: ParsedRequest, engine_request: dict[str, Any],
                      prompt_tokens: int) -> AsyncIterator[str]:
        request_id = f"{'chatcmpl' if parsed.chat else 'cmpl'}-{uuid.uuid4().hex}"
        first = True
        try:
            stream = self.engine.options(stream=True).stream
            async for item in stream.remote(engine_request, **self._route_kwargs(call)):
                if "error" in item:
                    body = ApiError(item["status"], item["error"]).body()
                    yield f"data: {json.dumps(body)}\n\n"
                    break
                if "text" in item:
                    chunk = stream_chunk(item["text"], chat=parsed.chat, model=self.model_name,
                                         request_id=request_id, first=first)
                    first = False
                    yield f"data: {json.dumps(chunk)}\n\n"
                    continue
                result = item["result"]
                if call is not None:
                    call.served_by = item["replica"]
                yield "data: " + json.dumps(stream_chunk("", chat=parsed.chat, model=self.model_name,
                                                         request_id=request_id,
                                                         finish_reason=result["finish_reason"], first=first)) + "\n\n"
                if parsed.include_usage:
                    final = stream_chunk("", chat=parsed.chat, model=self.model_name, request_id=request_id)
                    final["choices"] = []
                    final["usage"] = usage(prompt_tokens, len(result["tokens"]),
                                           result["gpu_hit_tokens"] + result["cpu_hit_tokens"])
                    yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"
        except Exception as exc:  # headers are sent: report in-band, as OpenAI does
            logger.exception("stream failed")
            yield f"data: {json.dumps(ApiError(500, str(exc), kind='server_error').body())}\n\n"
        finally:
            await self._end_call(call)

    # ------------------------------------------------------------------ workflows and clients
    async def register_workflow(self, request: Request) -> Response:
        tenant = self._tenant(request)
        spec = parse_spec(await self._call_router("put_template", tenant, await self._json(request)))
        self._remember(tenant, spec)
        return JSONResponse({"object": "workflow", **spec.to_dict()})

    async def get_workflow(self, request: Request, name: str) -> Response:
        tenant = self._tenant(request)
        check_name("workflow", name)
        spec = await self._template(tenant, name)
        return JSONResponse({"object": "workflow", **spec.to_dict()})

    async def finish_client(self, request: Request, client_id: str) -> Response:
        tenant = self._tenant(request)
        await self._call_router("finish_client", tenant, client_id)
        return JSONResponse({"object": "client", "id": client_id, "finished": True})

    async def health(self) -> Response:
        try:
            replicas = await asyncio.wait_for(self.router.replicas.remote(), 5)
        except Exception as exc:
            return JSONResponse({"status": "unavailable", "router": f"{type(exc).__name__}: {exc}"}, status_code=503)
        status = "ok" if replicas else "unavailable"
        return JSONResponse({"status": status, "replicas": sorted(replicas), "routing": self.config.routing},
                            status_code=200 if replicas else 503)

    async def metrics(self) -> Response:
        text = await self._call_router("metrics_text")
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def models(self) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "kvflow-ray"}]})


    # ------------------------------------------------------------------ HTTP routes
    @api.post("/v1/chat/completions")
    async def chat_completions_route(self, request: Request) -> Response:
        return await self._guard(lambda: self.completion(request, chat=True))

    @api.post("/v1/completions")
    async def completions_route(self, request: Request) -> Response:
        return await self._guard(lambda: self.completion(request, chat=False))

    @api.get("/v1/models")
    async def models_route(self) -> Response:
        return self.models()

    @api.post("/v1/workflows")
    async def register_route(self, request: Request) -> Response:
        return await self._guard(lambda: self.register_workflow(request))

    @api.get("/v1/workflows/{name}")
    async def workflow_route(self, request: Request, name: str) -> Response:
        return await self._guard(lambda: self.get_workflow(request, name))

    @api.post("/v1/clients/{client_id}/finish")
    async def finish_route(self, request: Request, client_id: str) -> Response:
        return await self._guard(lambda: self.finish_client(request, client_id))

    @api.get("/health")
    async def health_route(self) -> Response:
        return await self.health()

    @api.get("/metrics")
    async def metrics_route(self) -> Response:
        return await self._guard(self.metrics)


class _Call:
    """One routed agent call, from start_call to end_call."""

    def __init__(self, tenant: str, client_id: str, agent: str, workflow: str, replica: str, outcome: str,
                 prefix_hash: str | None, prefix_tokens: int) -> None:
        self.tenant, self.client_id, self.agent, self.workflow = tenant, client_id, agent, workflow
        self.replica, self.outcome = replica, outcome
        self.prefix_hash, self.prefix_tokens = prefix_hash, prefix_tokens
        self.served_by: str | None = None


# Bound here, at import, not in `build_app`: Serve pickles the FastAPI app by reference, so every
# process that imports this module (driver and replicas alike) must bind the routes to the class.
HttpIngress = serve.ingress(api)(Ingress)
