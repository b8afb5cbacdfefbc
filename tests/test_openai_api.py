"""The OpenAI wire format: request validation with OpenAI-style errors, kvflow metadata, the chat
fixed-prompt boundary, and response bodies the official OpenAI SDK parses."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow_ray.engines.base import GenerateRequest, GenerateResult, request_tokens
from kvflow_ray.engines.sglang import protocol
from kvflow_ray.engines.tokenizer import ByteTokenizer
from kvflow_ray.serve.openai_api import ApiError, fixed_boundary, parse_request, response_body, stream_chunk

CHAT = {"model": "m", "messages": [{"role": "system", "content": "You are the Planner. Plan."},
                                   {"role": "user", "content": "task 1"}],
        "max_tokens": 8, "kvflow": {"client_id": "c1", "workflow": "peer", "agent": "planner"}}


def test_a_valid_chat_request() -> None:
    req = parse_request(CHAT, chat=True)
    assert req.chat and req.max_tokens == 8 and req.temperature == 1.0 and not req.stream
    assert req.meta is not None and (req.meta.client_id, req.meta.workflow, req.meta.agent) == ("c1", "peer", "planner")
    plain = parse_request({"prompt": ["hello"], "max_tokens": 2, "stream": True,
                           "stream_options": {"include_usage": True}}, chat=False)
    assert plain.prompt == "hello" and plain.meta is None and plain.stream and plain.include_usage
    ids = parse_request({"prompt": [0, 6, 7]}, chat=False)  # token id 0 is no empty prompt
    assert ids.prompt is None and ids.prompt_ids == [0, 6, 7]
    assert parse_request({"prompt": [[5, 6]]}, chat=False).prompt_ids == [5, 6]


BAD: dict[str, tuple[Any, bool, str, str | None]] = {
    "not an object": ([1, 2], True, "JSON object", None),
    "no messages": ({"model": "m"}, True, "'messages' is required", "messages"),
    "bad role": ({"messages": [{"role": "developer", "content": "x"}]}, True, "not supported", "messages[0].role"),
    "content not text": ({"messages": [{"role": "user", "content": 3}]}, True, "must be a string",
                         "messages[0].content"),
    "no prompt": ({"prompt": ""}, False, "'prompt' must be a non-empty string", "prompt"),
    "no token ids": ({"prompt": []}, False, "array of 1 to", "prompt"),
    "token ids mixed": ({"prompt": [1, "a"]}, False, "token ids", "prompt"),
    "token id bool": ({"prompt": [True]}, False, "token ids", "prompt"),
    "two prompts of ids": ({"prompt": [[1], [2]]}, False, "token ids", "prompt"),
    "max_tokens zero": ({**CHAT, "max_tokens": 0}, True, "between 1 and", "max_tokens"),
    "max_tokens text": ({**CHAT, "max_tokens": "8"}, True, "must be an integer", "max_tokens"),
    "max_tokens bool": ({**CHAT, "max_tokens": True}, True, "got a boolean", "max_tokens"),
    "temperature": ({**CHAT, "temperature": 3}, True, "between 0 and 2", "temperature"),
    "n": ({**CHAT, "n": 2}, True, "n=1", "n"),
    "kvflow not object": ({**CHAT, "kvflow": "c1"}, True, "must be an object", "kvflow"),
    "kvflow no agent": ({**CHAT, "kvflow": {"client_id": "c1"}}, True, "kvflow.agent", "kvflow.agent"),
    "kvflow unknown key": ({**CHAT, "kvflow": {"client_id": "c", "agent": "a", "tenant": "b"}}, True,
                           "unknown parameter 'kvflow.tenant'", "kvflow.tenant"),
    "kvflow fixed negative": ({**CHAT, "kvflow": {"client_id": "c", "agent": "a", "fixed_prefix_tokens": -1}}, True,
                              "non-negative", "kvflow.fixed_prefix_tokens"),
    "kvflow empty client": ({**CHAT, "kvflow": {"client_id": "", "agent": "a"}}, True,
                            "'kvflow.client_id' must be a non-empty string", "kvflow.client_id"),
    "custom_params fixed negative": ({**CHAT, "custom_params": {"kvflow": {"client_id": "c", "agent": "a",
                                                                           "fixed_prefix_tokens": -1}}}, True,
                                     "must be a non-negative integer", "custom_params.kvflow.fixed_prefix_tokens"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_requests_get_openai_errors(case: str) -> None:
    body, chat, message, param = BAD[case]
    with pytest.raises(ApiError) as info:
        parse_request(body, chat=chat)
    err = info.value
    assert err.status == 400 and message in err.message and err.param == param
    code = {"no messages": "missing_required_parameter", "kvflow no agent": "missing_required_parameter",
            "kvflow unknown key": "unknown_parameter", "not an object": None}.get(case, "invalid_value")
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error", "param": param,
                                    "code": code}}


@pytest.mark.parametrize(("field", "value"), [
    ("client_id", ""), ("agent", ""), ("fixed_prefix_tokens", -1), ("fixed_prefix_tokens", True)])
def test_every_door_applies_one_metadata_rule(field: str, value: object) -> None:
    # the OpenAI body, SGLang's custom_params and GenerateRequest all refuse the same values
    meta = {"client_id": "c", "agent": "a", field: value}
    with pytest.raises(ApiError, match=rf"'kvflow\.{field}' must be (a non-|an integer, got a boolean)"):
        parse_request({**CHAT, "kvflow": meta}, chat=True)
    with pytest.raises(ValueError, match=rf"custom_params\.kvflow\.{field} must be a non-"):
        protocol.parse_request_params({"kvflow": meta})
    request = GenerateRequest(tokens=[1, 2, 3], workflow=meta["client_id"], agent=meta["agent"],
                              fixed_prefix_tokens=meta.get("fixed_prefix_tokens"))
    with pytest.raises(ValueError, match="must be a non-"):
        request_tokens(request, model_name="m", encode=list, vocab_size=10, max_context=64, device_tokens=64)


def test_fixed_boundary_of_a_chat_request() -> None:
    tok = ByteTokenizer()
    messages = CHAT["messages"]
    n = fixed_boundary(tok.apply_chat_template, tok.encode, messages, "You are the Planner.")
    full = tok.encode(tok.apply_chat_template(messages))
    assert n is not None and tok.decode(full[:n]).endswith("You are the Planner.")
    assert tok.decode(full[:n]).startswith("<|system|>")
    # the first message does not begin with the agent's prompt: no boundary
    assert fixed_boundary(tok.apply_chat_template, tok.encode, messages, "You are the Reviewer.") is None
    assert fixed_boundary(tok.apply_chat_template, tok.encode, messages, None) is None


RESULT = GenerateResult(tokens=[104, 105], text="hi", prompt_tokens=40, gpu_hit_tokens=20, cpu_hit_tokens=5,
                        miss_tokens=15, stall_s=0.0, ttft_s=0.01, latency_s=0.02, finish_reason="length")


def test_responses_parse_with_the_openai_sdk() -> None:
    openai = pytest.importorskip("openai")
    chat = openai.types.chat.ChatCompletion.model_validate(response_body(RESULT, chat=True, model="m"))
    assert chat.choices[0].message.content == "hi" and chat.usage is not None
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens) == (40, 2, 42)
    assert chat.usage.prompt_tokens_details is not None and chat.usage.prompt_tokens_details.cached_tokens == 25
    text = openai.types.Completion.model_validate(response_body(RESULT, chat=False, model="m"))
    assert text.choices[0].text == "hi"
    chunk = openai.types.chat.ChatCompletionChunk.model_validate(
        stream_chunk("h", chat=True, model="m", request_id="x", first=True))
    assert chunk.choices[0].delta.content == "h" and chunk.choices[0].delta.role == "assistant"
    last = openai.types.Completion.model_validate(
        stream_chunk("", chat=False, model="m", request_id="x", finish_reason="stop"))
    assert last.choices[0].finish_reason == "stop"
