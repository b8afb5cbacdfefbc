"""The OpenAI-compatible wire format (docs/design.md §7): request bodies as pydantic models, the `kvflow`
metadata, the fixed-prompt boundary of chat requests, and response / error bodies.

Validation is strict, as OpenAI's API is: types and ranges as OpenAI documents them, unknown
top-level fields are errors, and parameters this server cannot honour (`logprobs`, ...) are rejected by
name rather than silently ignored. Tools (`tools`, `tool_choice`, `parallel_tool_calls`, assistant
`tool_calls`, `tool` messages) are OpenAI's protocol (docs/serving.md "Tool calls"). The only
extensions are `kvflow` (docs/design.md §7), `cache_control` on messages (Anthropic's, read as a
pause hint), `ignore_eos` (as in vLLM) and `custom_params` (SGLang's carrier, here only for
`kvflow`). Bad input raises `ApiError`, which the ingress turns into a 4xx with OpenAI's error body:
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import random
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvflow_ray.core.graph import KEY_PART_RE, is_name
from kvflow_ray.core.kv_budget import MAX_KV_BUDGET, MIN_BUDGET, parse_scorer
from kvflow_ray.core.reuse import MAX_DOCUMENTS, parse_reuse
from kvflow_ray.engines.base import MAX_STOP_STRINGS, META_FIELDS, GenerateResult, meta_problem
from kvflow_ray.engines.tool_calls import ToolCall

MAX_TOKENS_LIMIT = 32_768
MAX_MESSAGES = 4096
MAX_PROMPT_IDS = 131_072  # token ids in one prompt (the longest context a served model takes)
# OpenAI parameters this server knows but does not implement: named in a 400 instead of ignored
UNSUPPORTED = frozenset({
    "functions", "function_call", "logprobs", "top_logprobs",
    "logit_bias", "presence_penalty", "frequency_penalty", "response_format", "audio", "modalities",
    "prediction", "reasoning_effort", "service_tier", "store", "metadata", "web_search_options", "suffix",
    "echo", "best_of"})
# tools: OpenAI allows 128 per request; the other bounds keep one request's tool text within what a
# model's context can take anyway
MAX_TOOLS = 128
MAX_TOOLS_CHARS = 262_144  # all tools' JSON together
MAX_TOOL_DESCRIPTION = 8192
MAX_TOOL_CALLS = 128  # calls in one assistant message
MAX_ARGUMENTS_CHARS = 65_536  # one call's arguments (JSON text)
MAX_TOOL_CALL_ID = 128
TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names
TOOL_DEFAULT_MAX_TOKENS = 512  # a chat with callable tools that names no output limit (16 cannot hold a call)
MAX_PAUSE_S = 86_400.0
CACHE_TTL_S = {"5m": 300.0, "1h": 3600.0}  # Anthropic's cache_control ttls
SESSION_HEADERS = ("x-session-id", "x-dynamo-session-id")  # ours (and Serve's hash key), Dynamo's alias
SESSION_RULE = "must be 1-128 of A-Z a-z 0-9 _ . @ -"


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class FieldProblem(ValueError):
    """A problem a validator found with one field (`path`, relative to where the validator runs), so the
    400 names that field rather than the object holding it. `code` as in OpenAI's error bodies."""

    def __init__(self, path: Sequence[str | int], message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.path = [str(p) for p in path]
        self.message = message
        self.code = code


def _required(*path: str | int) -> FieldProblem:
    return FieldProblem(path, "is required", "missing_required_parameter")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def session_problem(value: object) -> str | None:
    """What is wrong with `value` as a session id: the client-id rule (`engines.base.meta_problem`, and
    the charset and length the router gives client ids), None when it is valid."""
    return meta_problem("client_id", value) or (None if is_name(value, KEY_PART_RE) else SESSION_RULE)


# the fields that make a request a workflow agent call (with `agent`, which a session turn may name too)
WORKFLOW_FIELDS = ("client_id", "workflow", "fixed_prefix_tokens", "workflow_spec", "reuse", "documents")


class KvflowMeta(_Strict):
    """The `kvflow` object of a request (docs/design.md §7). The types and length bounds are this door's;
    what client_id, agent and fixed_prefix_tokens may hold is `engines.base.meta_problem`'s rule,
    shared with every engine. `workflow` and `workflow_spec` are for the router alone. The workflow
    fields are optional as a group, and one that names any of them needs `client_id` and `agent`. A
    session turn carries the session fields instead (`session`, `final_turn`, `expected_pause_s`, and
    `agent`, the agent the session runs), never workflow fields (`WORKFLOW_FIELDS`)."""

    client_id: StrictStr | None = Field(None, max_length=128)
    agent: StrictStr | None = Field(None, max_length=128)
    workflow: StrictStr | None = Field(None, min_length=1, max_length=128)
    fixed_prefix_tokens: int | None = None
    workflow_spec: dict[str, Any] | None = None
    session: StrictStr | None = Field(None, max_length=128)
    final_turn: StrictBool | None = None
    expected_pause_s: StrictFloat | None = Field(None, gt=0, le=MAX_PAUSE_S)
    # how this call reuses earlier agents' outputs found in its prompt (`core.reuse.parse_reuse`)
    reuse: StrictStr | None = Field(None, max_length=64)
    # documents (retrieved chunks) the prompt holds verbatim, kept as segments under an approximate reuse
    documents: list[StrictStr] | None = Field(None, max_length=MAX_DOCUMENTS)
    # this call's private KV capped at this many tokens, its keys scored by `kv_scorer` (docs/design.md
    # §13; `core.kv_budget`): for any request, plain, workflow or session
    kv_budget: StrictInt | None = Field(None, ge=MIN_BUDGET, le=MAX_KV_BUDGET)
    kv_scorer: StrictStr | None = Field(None, max_length=64)

    @field_validator("reuse", "kv_scorer")
    @classmethod
    def _policy_rule(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:  # a registry's parser: its ValueError names what is wrong
            {"reuse": parse_reuse, "kv_scorer": parse_scorer}[str(info.field_name)](value)
        return value

    @field_validator(*META_FIELDS)
    @classmethod
    def _meta_rule(cls, value: object, info: ValidationInfo) -> object:
        problem = None if value is None else meta_problem(str(info.field_name), value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("session")
    @classmethod
    def _session_rule(cls, value: str | None) -> str | None:
        problem = None if value is None else session_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _workflow_fields(self) -> KvflowMeta:
        named = [f for f in WORKFLOW_FIELDS if getattr(self, f) is not None]
        if self.session is not None:  # a session turn: `agent` names the session's agent, nothing else applies
            if named:
                raise FieldProblem((named[0],), "belongs to a workflow call, and this request is a session turn "
                                   "('kvflow.session'): send one or the other", "invalid_value")
            return self
        if named:  # `agent` alone may name the agent of a session whose id is in a header (`ParsedRequest`)
            for required in ("client_id", "agent"):
                if getattr(self, required) is None:
                    raise _required(required)
        return self

    @property
    def workflow_call(self) -> bool:
        """Whether this metadata makes the request a workflow agent call (else it is served as plain)."""
        return self.client_id is not None


class CustomParams(_Strict):
    kvflow: KvflowMeta | None = None


def _arguments_object(value: str) -> str:
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError("must be a JSON object, as a string")
    return value


class FunctionDef(_Strict):
    name: StrictStr = Field(pattern=TOOL_NAME)
    description: StrictStr | None = Field(None, max_length=MAX_TOOL_DESCRIPTION)
    parameters: dict[str, Any] | None = None  # a JSON Schema object; rendered for the model as given
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: StrictStr = Field(pattern=TOOL_NAME)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Strict):
    name: StrictStr = Field(pattern=TOOL_NAME)
    arguments: StrictStr = Field(max_length=MAX_ARGUMENTS_CHARS)

    _object = field_validator("arguments")(_arguments_object)


class ToolCallParam(_Strict):
    id: StrictStr = Field(min_length=1, max_length=MAX_TOOL_CALL_ID)
    type: Literal["function"]
    function: FunctionCall


class CacheControl(_Strict):
    """Anthropic's prompt-caching mark: here a hint of how long the conversation may pause."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr | None = None  # none only for an assistant message with tool calls
    name: StrictStr | None = Field(None, max_length=64)
    tool_calls: Annotated[list[ToolCallParam], Field(min_length=1, max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: StrictStr | None = Field(None, min_length=1, max_length=MAX_TOOL_CALL_ID)
    cache_control: CacheControl | None = None

    @model_validator(mode="after")
    def _role_fields(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise _required("content")
        if self.tool_calls is not None and self.role != "assistant":
            raise FieldProblem(["tool_calls"], "is only allowed in assistant messages")
        if self.role == "tool" and self.tool_call_id is None:
            raise _required("tool_call_id")
        if self.tool_call_id is not None and self.role != "tool":
            raise FieldProblem(["tool_call_id"], "is only allowed in tool messages")
        return self


class StreamOptions(_Strict):
    include_usage: bool = False


StopParam = StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS)]


class _Completion(_Strict):
    model: StrictStr | None = Field(None, max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: Literal[1] = 1
    stop: StopParam | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = Field(None, max_length=256)
    ignore_eos: bool = False  # extension (as in vLLM): generate exactly max_tokens
    kvflow: KvflowMeta | None = None
    custom_params: CustomParams | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        for stop in [value] if isinstance(value, str) else value or []:
            if not stop:
                raise ValueError("stop strings must not be empty")
        return value

    @model_validator(mode="after")
    def _one_meta(self) -> _Completion:
        if self.kvflow is not None and self.custom_params is not None and self.custom_params.kvflow is not None:
            raise ValueError("give the kvflow metadata once: 'kvflow' or 'custom_params.kvflow'")
        return self


class ChatCompletionRequest(_Completion):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="after")
    def _tools(self) -> ChatCompletionRequest:
        if self.tools is None:
            for name in ("tool_choice", "parallel_tool_calls"):
                if getattr(self, name) is not None:
                    raise FieldProblem([name], "is only allowed when 'tools' are given")
        else:
            seen: set[str] = set()
            for i, tool in enumerate(self.tools):
                if tool.function.name in seen:
                    raise FieldProblem(["tools", i, "function", "name"], "names a function an earlier tool names")
                seen.add(tool.function.name)
            size = len(json.dumps([t.model_dump(exclude_none=True) for t in self.tools], ensure_ascii=False))
            if size > MAX_TOOLS_CHARS:
                raise FieldProblem(["tools"], f"must be at most {MAX_TOOLS_CHARS} characters of JSON in all")
            if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in seen:
                raise FieldProblem(["tool_choice", "function", "name"], "must name one of the given tools")
        calls: set[str] = set()
        for i, message in enumerate(self.messages):
            if message.tool_call_id is not None and message.tool_call_id not in calls:
                raise FieldProblem(["messages", i, "tool_call_id"],
                                   "must be the id of a tool call of an earlier assistant message")
            calls.update(call.id for call in message.tool_calls or ())
        return self


TokenIds = Annotated[list[StrictInt], Field(min_length=1, max_length=MAX_PROMPT_IDS)]


class CompletionRequest(_Completion):
    # text, or token ids (OpenAI's prompt array of integers), alone or as an array holding one
    prompt: (StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=1)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1, max_length=1)])

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[Any]) -> str | list[Any]:
        prompt = value if isinstance(value, str) else value[0]  # a text, a token id, or a list of ids
        if prompt == "" or prompt == []:  # token id 0 is a prompt
            raise ValueError("the prompt must not be empty")
        return value


@dataclass(frozen=True)
class SessionMeta:
    """A request's session metadata (docs/design.md §7, §11), validated: a request with a `session` is a
    turn of that agent session (the ingress routes it to the replica holding its history, and the
    engine ranks the history by the pause that follows). `session`: `kvflow.session`, else the
    `X-Session-ID` / `X-Dynamo-Session-ID` header; `agent`: `kvflow.agent`, the agent the session runs;
    `final_turn`: the session's last call; `expected_pause_s`: how long the client expects to pause
    before its next call; `cache_ttl_s`: the longest `cache_control` ttl on the messages, in seconds
    (a pause hint too)."""

    session: str | None = None
    session_source: str | None = None  # "kvflow.session" | the header's name
    agent: str | None = None  # `kvflow.agent`: the agent the session runs (its pauses are learned per agent)
    final_turn: bool | None = None
    expected_pause_s: float | None = None
    cache_ttl_s: float | None = None


@dataclass(frozen=True)
class ToolSpec:
    """A chat request's tools as the ingress uses them. `render`: the tools to render as callable (None
    under tool_choice "none"); `choice`: "auto" | "none" | "required" | "function" (named);
    `forced`: the names a forced call may take ("required": all, a named choice: one), else None;
    `max_calls`: 1 under `parallel_tool_calls: false`."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    forced: tuple[str, ...] | None
    max_calls: int | None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    @property
    def active(self) -> bool:
        """Tools are callable: rendered for the model, and its output parsed for calls."""
        return self.choice != "none"

    @property
    def render(self) -> list[dict[str, Any]] | None:
        return list(self.tools) if self.active else None


class ParsedRequest:
    """A validated request, in the shape the ingress uses."""

    def __init__(self, body: ChatCompletionRequest | CompletionRequest,
                 headers: Mapping[str, str] | None = None) -> None:
        self.chat = isinstance(body, ChatCompletionRequest)
        self.model = body.model
        # plain messages stay {"role", "content"} (rendered as before tools existed); tool turns keep
        # their calls and ids
        self.messages: list[dict[str, Any]] = (
            [_message(m) for m in body.messages] if isinstance(body, ChatCompletionRequest) else [])
        self.tools: ToolSpec | None = _tool_spec(body) if isinstance(body, ChatCompletionRequest) else None
        prompt = None if isinstance(body, ChatCompletionRequest) else _single(body.prompt)
        self.prompt: str | None = prompt if isinstance(prompt, str) else None
        # the prompt as token ids, when it came as such (the ingress checks them against the vocabulary)
        self.prompt_ids: list[int] | None = prompt if isinstance(prompt, list) else None
        chat_max = body.max_completion_tokens if isinstance(body, ChatCompletionRequest) else None
        default = TOOL_DEFAULT_MAX_TOKENS if self.tools is not None and self.tools.active else 16
        self.max_tokens: int = chat_max or body.max_tokens or default
        self.max_tokens_given = bool(chat_max or body.max_tokens)
        self.max_tokens_param = "max_completion_tokens" if chat_max else "max_tokens"
        self.temperature = float(body.temperature)
        self.top_p = float(body.top_p)
        self.stop: list[str] = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        self.seed = body.seed
        self.stream = body.stream
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.ignore_eos = body.ignore_eos
        kvflow = body.kvflow or (body.custom_params.kvflow if body.custom_params else None)
        # workflow metadata: the request is an agent call (routed by its workflow); session fields alone
        # leave it a plain request
        self.meta: KvflowMeta | None = kvflow if kvflow is not None and kvflow.workflow_call else None
        self.kv_budget = kvflow.kv_budget if kvflow is not None else None
        self.kv_scorer = kvflow.kv_scorer if kvflow is not None else None
        where = "custom_params.kvflow" if body.custom_params and not body.kvflow else "kvflow"
        self.session = _session_meta(kvflow, where, headers or {},
                                     body.messages if isinstance(body, ChatCompletionRequest) else [])
        if self.session.session is None and kvflow is not None:
            if kvflow.agent is not None and kvflow.client_id is None:  # neither a workflow call nor a session turn
                raise ApiError(400, f"'{where}.client_id' is required", f"{where}.client_id",
                               code="missing_required_parameter")
            for name in ("final_turn", "expected_pause_s"):
                if getattr(kvflow, name) is not None:
                    raise ApiError(400, f"'{where}.{name}' is a session field: name the session too "
                                        f"('{where}.session', or the 'X-Session-ID' header)", f"{where}.{name}")
        # a session header beside workflow metadata leaves the request a workflow call: the header (Ray
        # Serve's session key) then only keeps the client's calls on one ingress replica


def _message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls is not None:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _tool_spec(body: ChatCompletionRequest) -> ToolSpec | None:
    if body.tools is None:
        return None
    tools = tuple(t.model_dump(exclude_none=True) for t in body.tools)
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    if isinstance(choice, NamedToolChoice):
        name, forced = "function", (choice.function.name,)
    else:
        name = choice
        forced = tuple(t["function"]["name"] for t in tools) if choice == "required" else None
    return ToolSpec(tools, name, forced, 1 if body.parallel_tool_calls is False else None)


def _session_meta(kvflow: KvflowMeta | None, where: str, headers: Mapping[str, str],
                  messages: Sequence[ChatMessage]) -> SessionMeta:
    session, source = (kvflow.session, f"{where}.session") if kvflow is not None and kvflow.session else (None, None)
    if session is None:
        given = {h: headers[h] for h in SESSION_HEADERS if headers.get(h) is not None}
        if len(set(given.values())) > 1:
            raise ApiError(400, "the headers 'X-Session-ID' and 'X-Dynamo-Session-ID' name different sessions; "
                                "send one, or the same id in both", "X-Dynamo-Session-ID", code="invalid_value")
        for header, value in given.items():
            name = "X-Session-ID" if header == "x-session-id" else "X-Dynamo-Session-ID"
            problem = session_problem(value)
            if problem:
                raise ApiError(400, f"header '{name}' {problem}", name, code="invalid_value")
            if session is None:  # both: the same id (checked above), named by our own header
                session, source = value, name
    ttls = [CACHE_TTL_S[m.cache_control.ttl] for m in messages if m.cache_control is not None]
    return SessionMeta(session=session, session_source=source,
                       agent=kvflow.agent if kvflow is not None and kvflow.client_id is None else None,
                       final_turn=kvflow.final_turn if kvflow is not None else None,
                       expected_pause_s=kvflow.expected_pause_s if kvflow is not None else None,
                       cache_ttl_s=max(ttls) if ttls else None)


def _single(prompt: str | list[Any]) -> str | list[int]:
    """The one prompt of a completion body: text, or token ids, either alone or first of an array."""
    if isinstance(prompt, str):
        return prompt
    first = prompt[0]
    return first if isinstance(first, (str, list)) else prompt


def parse_request(body: Any, *, chat: bool, headers: Mapping[str, str] | None = None) -> ParsedRequest:
    """Validate a `/v1/chat/completions` (chat) or `/v1/completions` body; `headers` (lower-case names)
    may carry the session id (`SESSION_HEADERS`)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        return ParsedRequest(model.model_validate(body), headers)
    except ValidationError as exc:
        raise validation_error(exc) from None


def parse_meta(raw: Any) -> KvflowMeta | None:
    """The `kvflow` object alone (absent: a plain request)."""
    if raw is None:
        return None
    try:
        return KvflowMeta.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc, prefix="kvflow") from None


def validation_error(exc: ValidationError, prefix: str = "") -> ApiError:
    """The first problem of a pydantic error as a 400 naming the parameter, in OpenAI's words; the
    offending value is never echoed (only its JSON type, where that is the problem)."""
    error = exc.errors(include_url=False)[0]
    loc = [str(p) for p in error["loc"] if not _is_union_tag(p)]
    if prefix:
        loc.insert(0, prefix)
    problem = (error.get("ctx") or {}).get("error")
    if isinstance(problem, FieldProblem):  # a validator named the field itself
        param = _param(loc + problem.path)
        return ApiError(400, f"'{public_text(param, 120)}' {problem.message}", param, code=problem.code)
    param = _param(loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        name = loc[-1] if loc else "?"
        if len(loc) == 1 and name in UNSUPPORTED:
            return ApiError(400, f"'{name}' is not supported by this server", name, code="unsupported_parameter")
        return ApiError(400, f"unknown parameter '{public_text(param, 120)}'", param, code="unknown_parameter")
    if kind == "missing":
        return ApiError(400, f"'{public_text(param, 120)}' is required", param, code="missing_required_parameter")
    if param in UNION_MESSAGES:
        return ApiError(400, f"'{param}' {UNION_MESSAGES[param]}", param, code="invalid_value")
    return ApiError(400, f"'{public_text(param, 120)}' {_describe(param, error)}" if param
                    else _describe(param, error), param or None, code="invalid_value")


UNION_MESSAGES = {  # parameters of several shapes: one message for all of them
    "stop": f"must be a non-empty string or an array of at most {MAX_STOP_STRINGS} non-empty strings",
    "prompt": f"must be a non-empty string or an array of 1 to {MAX_PROMPT_IDS} token ids (or an array holding one)",
    "tool_choice": "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
}
# how a value must look, where OpenAI documents a range (checked by the models' Field bounds)
RANGES = {"max_tokens": f"must be between 1 and {MAX_TOKENS_LIMIT}",
          "max_completion_tokens": f"must be between 1 and {MAX_TOKENS_LIMIT}",
          "temperature": "must be between 0 and 2", "top_p": "must be greater than 0 and at most 1",
          "n": "must be 1 (only n=1 is supported)",
          **dict.fromkeys(("kvflow.expected_pause_s", "custom_params.kvflow.expected_pause_s"),
                          f"must be greater than 0 and at most {MAX_PAUSE_S:g} (seconds)")}
BOUNDS = {"greater_than_equal": ">=", "less_than_equal": "<=", "greater_than": ">", "less_than": "<"}
TYPES = {"int": "an integer", "float": "a number", "string": "a string", "bool": "a boolean", "dict": "an object",
         "model": "an object", "list": "an array"}


def _describe(param: str, error: Any) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    if param in RANGES and (kind in BOUNDS or kind == "literal_error"):
        return RANGES[param]
    if kind == "literal_error" and param.endswith(".role"):
        return "is not supported (system, user, assistant, tool)"
    if kind == "string_pattern_mismatch" and param.endswith(".name"):
        return "must be 1-64 of a-z A-Z 0-9 _ -"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected', '')}"
    base = kind.split("_")[0]
    if base in TYPES and kind.endswith(("_type", "_parsing", "_attributes_type")):
        got = error.get("input")
        return f"must be {TYPES[base]}" + (", got a boolean" if isinstance(got, bool) else "")
    if kind in ("too_short", "string_too_short"):
        return "must not be empty"
    if kind == "too_long":
        return f"must have at most {ctx.get('max_length')} items"
    if kind == "string_too_long":
        return f"must be at most {ctx.get('max_length')} characters"
    if kind in BOUNDS:
        return f"must be {BOUNDS[kind]} {next(iter(ctx.values()), '')}"
    return public_text(str(error["msg"]).removeprefix("Value error, "), 200)


def _is_union_tag(part: object) -> bool:
    # pydantic names the union member in a location (`stop.str`, `stop.list[str]`,
    # `tool_choice.NamedToolChoice`): not a parameter
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "NamedToolChoice") or "[" in part)


def _param(loc: list[str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out


def public_text(text: str, limit: int = 500) -> str:
    """Text safe to send a client: no control characters or terminal escape sequences, bounded."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]|[\x00-\x08\x0b-\x1f\x7f]", "", text)
    return text if len(text) <= limit else text[:limit] + "..."


def fixed_boundary(render: Callable[[list[dict[str, Any]]], str], encode: Callable[[str], list[int]],
                   messages: Sequence[dict[str, Any]], agent_prompt: str | None, *, full: str | None = None,
                   full_ids: Sequence[int] | None = None) -> int | None:
    """Tokens of the rendered chat that belong to the agent's fixed prompt: when the first message's
    content begins with `agent_prompt`, the boundary is where that text ends after the chat
    template is applied (docs/design.md §3). None when it does not apply, or when the tokenizer does
    not split the text at that point the same way on its own (then the boundary is not exact).
    `full` / `full_ids`: the whole chat rendered and encoded, when the caller has them already."""
    first_content = messages[0].get("content") if messages else None
    if not agent_prompt or not isinstance(first_content, str) or not first_content.startswith(agent_prompt):
        return None
    if full is None:
        full = render(list(messages))
    marker = f"\x00kvflow-boundary-{uuid.uuid4().hex}\x00"
    first = {**messages[0], "content": agent_prompt + marker}
    rendered = render([first, *messages[1:]])
    head = rendered[:rendered.index(marker)]
    if not full.startswith(head):
        return None
    head_ids = encode(head)
    if full_ids is None:
        full_ids = encode(full)
    return len(head_ids) if list(full_ids[:len(head_ids)]) == head_ids else None


def agent_prefix(render: Callable[[list[dict[str, str]]], str], encode: Callable[[str], list[int]],
                 agent_prompt: str) -> list[int]:
    """Token ids of an agent's fixed prompt as a chat request starts with it (the prompt as the
    system message, after the chat template): what an engine keeps and prefetches for the agent,
    and what `fixed_boundary` measures on a real request."""
    marker = f"\x00kvflow-boundary-{uuid.uuid4().hex}\x00"
    rendered = render([{"role": "system", "content": agent_prompt + marker}])
    return encode(rendered[:rendered.index(marker)])


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, reused_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage. `cached_tokens` counts exact prefix hits only; prompt tokens whose KV was placed
    from a reused segment (approximate) are `reused_tokens`, present when there are any."""
    details: dict[str, int] = {"cached_tokens": cached_tokens}
    if reused_tokens:
        details["reused_tokens"] = reused_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": details}


# Response and request ids name a response in logs and bodies; they grant nothing, so a fast
# generator of this process serves (uuid4 costs a system call per id). Secrets (the boundary markers
# above) keep using the operating system's.
_ids = random.Random()


def new_id(prefix: str, hex_digits: int = 32) -> str:
    """`prefix-<random hex>`, as OpenAI's ids look."""
    return f"{prefix}-{_ids.getrandbits(4 * hex_digits):0{hex_digits}x}"


def finish_reason(engine_reason: str, calls: bool) -> str:
    """OpenAI's finish reason: "tool_calls" when the model ended its turn with calls; an output cut by
    the token limit stays "length" (the calls listed are the complete ones)."""
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason


def response_body(result: GenerateResult, *, chat: bool, model: str, request_id: str | None = None,
                  content: str | None = None, tool_calls: Sequence[ToolCall] | None = None) -> dict[str, Any]:
    """`content` / `tool_calls`: the output as a tool-call parser split it (chat with tools); without
    them the message is the output text."""
    request_id = request_id or new_id("chatcmpl" if chat else "cmpl")
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        if tool_calls is not None:
            message["content"] = content
            if tool_calls:
                message["tool_calls"] = [call.to_openai() for call in tool_calls]
        choice: dict[str, Any] = {"index": 0, "message": message,
                                  "finish_reason": finish_reason(result.finish_reason, bool(tool_calls))}
    else:
        choice = {"index": 0, "text": result.text, "finish_reason": result.finish_reason, "logprobs": None}
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": usage(result.prompt_tokens, len(result.tokens), result.gpu_hit_tokens + result.cpu_hit_tokens,
                           result.reused_tokens)}


def stream_chunk(text: str, *, chat: bool, model: str, request_id: str, finish_reason: str | None = None,
                 first: bool = False, tool_call: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk. `tool_call` (chat): a tool-call delta as OpenAI streams them instead of text
    (`tool_call_deltas`)."""
    if chat:
        delta: dict[str, Any] = {"content": text} if tool_call is None else {"tool_calls": [tool_call]}
        if first:
            delta["role"] = "assistant"
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}


def tool_call_deltas(index: int, call: ToolCall) -> list[dict[str, Any]]:
    """A call as OpenAI streams it: first its index, id, type and name with empty arguments, then the
    arguments (one piece: a call is streamed once its block is complete, docs/serving.md)."""
    return [{"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}},
            {"index": index, "function": {"arguments": call.arguments}}]
