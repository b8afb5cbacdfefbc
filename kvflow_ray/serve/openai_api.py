"""The OpenAI-compatible wire format (docs/design.md §7): request bodies as pydantic models, the `kvflow`
metadata, the fixed-prompt boundary of chat requests, and response / error bodies.

Validation is strict, as OpenAI's API is: types and ranges as OpenAI documents them, unknown
top-level fields are errors, and parameters this server cannot honour (`tools`, `logprobs`, ...) are
rejected by name rather than silently ignored. The only extensions are `kvflow` (docs/design.md §7),
`ignore_eos` (as in vLLM) and `custom_params` (SGLang's carrier, here only for `kvflow`). Bad input
raises `ApiError`, which the ingress turns into a 4xx with OpenAI's error body:
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import random
import re
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvflow_ray.engines.base import MAX_STOP_STRINGS, META_FIELDS, GenerateResult, meta_problem

MAX_TOKENS_LIMIT = 32_768
MAX_MESSAGES = 4096
MAX_PROMPT_IDS = 131_072  # token ids in one prompt (the longest context a served model takes)
# OpenAI parameters this server knows but does not implement: named in a 400 instead of ignored
UNSUPPORTED = frozenset({
    "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "logprobs", "top_logprobs",
    "logit_bias", "presence_penalty", "frequency_penalty", "response_format", "audio", "modalities",
    "prediction", "reasoning_effort", "service_tier", "store", "metadata", "web_search_options", "suffix",
    "echo", "best_of"})


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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class KvflowMeta(_Strict):
    """The `kvflow` object of a request (docs/design.md §7). The types and length bounds are this door's;
    what client_id, agent and fixed_prefix_tokens may hold is `engines.base.meta_problem`'s rule,
    shared with every engine. `workflow` and `workflow_spec` are for the router alone."""

    client_id: StrictStr = Field(max_length=128)
    agent: StrictStr = Field(max_length=128)
    workflow: StrictStr | None = Field(None, min_length=1, max_length=128)
    fixed_prefix_tokens: int | None = None
    workflow_spec: dict[str, Any] | None = None

    @field_validator(*META_FIELDS)
    @classmethod
    def _meta_rule(cls, value: object, info: ValidationInfo) -> object:
        problem = meta_problem(str(info.field_name), value)
        if problem:
            raise ValueError(problem)
        return value


class CustomParams(_Strict):
    kvflow: KvflowMeta | None = None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: StrictStr
    name: StrictStr | None = Field(None, max_length=64)


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


class ParsedRequest:
    """A validated request, in the shape the ingress uses."""

    def __init__(self, body: ChatCompletionRequest | CompletionRequest) -> None:
        self.chat = isinstance(body, ChatCompletionRequest)
        self.model = body.model
        self.messages: list[dict[str, str]] = (
            [{"role": m.role, "content": m.content} for m in body.messages]
            if isinstance(body, ChatCompletionRequest) else [])
        prompt = None if isinstance(body, ChatCompletionRequest) else _single(body.prompt)
        self.prompt: str | None = prompt if isinstance(prompt, str) else None
        # the prompt as token ids, when it came as such (the ingress checks them against the vocabulary)
        self.prompt_ids: list[int] | None = prompt if isinstance(prompt, list) else None
        chat_max = body.max_completion_tokens if isinstance(body, ChatCompletionRequest) else None
        self.max_tokens: int = chat_max or body.max_tokens or 16
        self.max_tokens_param = "max_completion_tokens" if chat_max else "max_tokens"
        self.temperature = float(body.temperature)
        self.top_p = float(body.top_p)
        self.stop: list[str] = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        self.seed = body.seed
        self.stream = body.stream
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.ignore_eos = body.ignore_eos
        self.meta: KvflowMeta | None = body.kvflow or (body.custom_params.kvflow if body.custom_params else None)


def _single(prompt: str | list[Any]) -> str | list[int]:
    """The one prompt of a completion body: text, or token ids, either alone or first of an array."""
    if isinstance(prompt, str):
        return prompt
    first = prompt[0]
    return first if isinstance(first, (str, list)) else prompt


def parse_request(body: Any, *, chat: bool) -> ParsedRequest:
    """Validate a `/v1/chat/completions` (chat) or `/v1/completions` body."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        return ParsedRequest(model.model_validate(body))
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
}
# how a value must look, where OpenAI documents a range (checked by the models' Field bounds)
RANGES = {"max_tokens": f"must be between 1 and {MAX_TOKENS_LIMIT}",
          "max_completion_tokens": f"must be between 1 and {MAX_TOKENS_LIMIT}",
          "temperature": "must be between 0 and 2", "top_p": "must be greater than 0 and at most 1",
          "n": "must be 1 (only n=1 is supported)"}
BOUNDS = {"greater_than_equal": ">=", "less_than_equal": "<=", "greater_than": ">", "less_than": "<"}
TYPES = {"int": "an integer", "float": "a number", "string": "a string", "bool": "a boolean", "dict": "an object",
         "model": "an object", "list": "an array"}


def _describe(param: str, error: Any) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    if param in RANGES and (kind in BOUNDS or kind == "literal_error"):
        return RANGES[param]
    if kind == "literal_error" and param.endswith(".role"):
        return "is not supported (system, user, assistant)"
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
    # pydantic names the union member in a location (`stop.str`, `stop.list[str]`): not a parameter
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def _param(loc: list[str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out


def public_text(text: str, limit: int = 500) -> str:
    """Text safe to send a client: no control characters or terminal escape sequences, bounded."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]|[\x00-\x08\x0b-\x1f\x7f]", "", text)
    return text if len(text) <= limit else text[:limit] + "..."


def fixed_boundary(render: Callable[[list[dict[str, str]]], str], encode: Callable[[str], list[int]],
                   messages: Sequence[dict[str, str]], agent_prompt: str | None, *, full: str | None = None,
                   full_ids: Sequence[int] | None = None) -> int | None:
    """Tokens of the rendered chat that belong to the agent's fixed prompt: when the first message's
    content begins with `agent_prompt`, the boundary is where that text ends after the chat
    template is applied (docs/design.md §3). None when it does not apply, or when the tokenizer does
    not split the text at that point the same way on its own (then the boundary is not exact).
    `full` / `full_ids`: the whole chat rendered and encoded, when the caller has them already."""
    if not agent_prompt or not messages or not messages[0]["content"].startswith(agent_prompt):
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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


# Response and request ids name a response in logs and bodies; they grant nothing, so a fast
# generator of this process serves (uuid4 costs a system call per id). Secrets (the boundary markers
# above) keep using the operating system's.
_ids = random.Random()


def new_id(prefix: str, hex_digits: int = 32) -> str:
    """`prefix-<random hex>`, as OpenAI's ids look."""
    return f"{prefix}-{_ids.getrandbits(4 * hex_digits):0{hex_digits}x}"


def response_body(result: GenerateResult, *, chat: bool, model: str, request_id: str | None = None) -> dict[str, Any]:
    request_id = request_id or new_id("chatcmpl" if chat else "cmpl")
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": result.text},
                                  "finish_reason": result.finish_reason}
    else:
        choice = {"index": 0, "text": result.text, "finish_reason": result.finish_reason, "logprobs": None}
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": usage(result.prompt_tokens, len(result.tokens), result.gpu_hit_tokens + result.cpu_hit_tokens)}


def stream_chunk(text: str, *, chat: bool, model: str, request_id: str, finish_reason: str | None = None,
                 first: bool = False) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}
