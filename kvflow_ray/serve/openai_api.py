"""The OpenAI-compatible wire format (DESIGN.md §7): request parsing and validation, the `kvflow`
metadata, the fixed-prompt boundary of chat requests, and response / error bodies.

Pure functions over plain JSON values, so the ingress stays a thin HTTP layer and every rule here is
tested without a server. Bad input raises `ApiError`, which the ingress turns into a 4xx with
OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow_ray.engines.base import GenerateResult

MAX_TOKENS_LIMIT = 32_768
META_KEYS = {"client_id", "workflow", "agent", "fixed_prefix_tokens", "workflow_spec"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class KvflowMeta:
    client_id: str
    agent: str
    workflow: str | None = None
    fixed_prefix_tokens: int | None = None
    workflow_spec: dict[str, Any] | None = None


@dataclass
class ParsedRequest:
    chat: bool
    model: str | None
    messages: list[dict[str, str]] = field(default_factory=list)  # chat
    prompt: str | None = None  # completions
    max_tokens: int = 16
    temperature: float = 1.0
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False  # extension (as in vLLM): generate exactly max_tokens
    meta: KvflowMeta | None = None


def _get(body: dict[str, Any], key: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ApiError(400, f"'{key}' must be {_kind_name(kinds)}, got a boolean", key)
    if not isinstance(value, kinds):
        raise ApiError(400, f"'{key}' must be {_kind_name(kinds)}, got {type(value).__name__}", key)
    return value


def _kind_name(kinds: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "an array",
             dict: "an object"}
    seq = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in seq))


def parse_meta(raw: Any) -> KvflowMeta | None:
    """The `kvflow` object of a request body (absent: a plain request)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ApiError(400, "'kvflow' must be an object with client_id and agent", "kvflow")
    unknown = sorted(set(raw) - META_KEYS)
    if unknown:
        raise ApiError(400, f"'kvflow' has unknown keys {unknown} (known: {sorted(META_KEYS)})", "kvflow")
    for key in ("client_id", "agent"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise ApiError(400, f"'kvflow.{key}' is required and must be a non-empty string", f"kvflow.{key}")
    workflow = raw.get("workflow")
    if workflow is not None and (not isinstance(workflow, str) or not workflow):
        raise ApiError(400, "'kvflow.workflow' must be a non-empty string", "kvflow.workflow")
    fixed = raw.get("fixed_prefix_tokens")
    if fixed is not None and (isinstance(fixed, bool) or not isinstance(fixed, int) or fixed < 0):
        raise ApiError(400, "'kvflow.fixed_prefix_tokens' must be a non-negative integer", "kvflow.fixed_prefix_tokens")
    spec = raw.get("workflow_spec")
    if spec is not None and not isinstance(spec, dict):
        raise ApiError(400, "'kvflow.workflow_spec' must be a workflow spec object", "kvflow.workflow_spec")
    return KvflowMeta(raw["client_id"], raw["agent"], workflow, fixed, spec)


def parse_request(body: Any, *, chat: bool) -> ParsedRequest:
    """Validate a `/v1/chat/completions` (chat) or `/v1/completions` body."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    req = ParsedRequest(chat=chat, model=_get(body, "model", str))
    if chat:
        messages = _get(body, "messages", list)
        if not messages:
            raise ApiError(400, "'messages' is required and must be a non-empty array", "messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
            if message["role"] not in ("system", "user", "assistant"):
                raise ApiError(400, f"messages[{i}].role {message['role']!r} is not supported "
                                    "(system, user, assistant)", f"messages[{i}].role")
            if not isinstance(message.get("content"), str):
                raise ApiError(400, f"messages[{i}].content must be a string", f"messages[{i}].content")
            req.messages.append({"role": message["role"], "content": message["content"]})
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' is required and must be a non-empty string", "prompt")
        req.prompt = prompt
    n = _get(body, "n", int, 1)
    if n != 1:
        raise ApiError(400, "only n=1 is supported", "n")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    req.max_tokens = _get(body, key, int, 16)
    if not 1 <= req.max_tokens <= MAX_TOKENS_LIMIT:
        raise ApiError(400, f"'{key}' must be between 1 and {MAX_TOKENS_LIMIT}", key)
    req.temperature = float(_get(body, "temperature", (int, float), 1.0))
    if not 0 <= req.temperature <= 2:
        raise ApiError(400, "'temperature' must be between 0 and 2", "temperature")
    req.seed = _get(body, "seed", int)
    req.stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {})
    req.include_usage = bool(options.get("include_usage", False))
    req.ignore_eos = _get(body, "ignore_eos", bool, False)
    req.meta = parse_meta(body.get("kvflow"))
    return req


def fixed_boundary(render: Callable[[list[dict[str, str]]], str], encode: Callable[[str], list[int]],
                   messages: Sequence[dict[str, str]], agent_prompt: str | None, *, full: str | None = None,
                   full_ids: Sequence[int] | None = None) -> int | None:
    """Tokens of the rendered chat that belong to the agent's fixed prompt: when the first message's
    content begins with `agent_prompt`, the boundary is where that text ends after the chat
    template is applied (DESIGN.md §3). None when it does not apply, or when the tokenizer does
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


def response_body(result: GenerateResult, *, chat: bool, model: str, request_id: str | None = None) -> dict[str, Any]:
    request_id = request_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
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
