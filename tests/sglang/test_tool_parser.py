"""`--tool-call-parser sglang:<name>`: SGLang's own tool-call parsers (python/sglang/srt/function_call,
`FunctionCallParser` with the detector its `--tool-call-parser` names) behind kvflow's parser interface
(kvflow_ray/engines/sglang/tool_parser.py), on the real SGLang 0.5.23 classes."""

from __future__ import annotations

import json

import pytest

from kvflow_ray.engines.tool_calls import CallEvent, ContentEvent, get_parser

NAMES = ("get_time", "get_weather")
PARIS = '{"city": "Paris"}'
# (detector, the model's output in that detector's format, content, calls)
OUTPUTS = [
    ("hermes", f'Sure.\n<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "Sure.", [("get_weather", PARIS), ("get_time", '{"city": "Oslo"}')]),
    ("qwen25", f'Let me see.\n<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>',
     "Let me see.", [("get_weather", PARIS)]),
    ("llama3", f'<|python_tag|>{{"name": "get_weather", "parameters": {PARIS}}}', None, [("get_weather", PARIS)]),
    ("mistral", f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {PARIS}}}]', None, [("get_weather", PARIS)]),
    ("hermes", "No tool is needed: it is sunny.\n", "No tool is needed: it is sunny.\n", []),
]


@pytest.mark.parametrize(("detector", "text", "content", "calls"), OUTPUTS)
def test_sglang_parsers_read_their_formats(detector: str, text: str, content: str | None,
                                           calls: list[tuple[str, str]]) -> None:
    parser = get_parser(f"sglang:{detector}")
    assert parser.name == f"sglang:{detector}" and not parser.constrains
    parsed = parser.parse(text, NAMES)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [(n, json.loads(a)) for n, a in calls]
    assert all(c.id.startswith("call_") for c in parsed.calls)


@pytest.mark.parametrize(("detector", "text", "content", "calls"), OUTPUTS)
def test_a_stream_gives_the_responses_calls_at_any_split(detector: str, text: str, content: str | None,
                                                        calls: list[tuple[str, str]]) -> None:
    """Split anywhere (and token by token): the calls are the response's, in order; the content streamed
    is the response's content."""
    parser = get_parser(f"sglang:{detector}")
    for pieces in ([text], list(text), [text[:len(text) // 2], text[len(text) // 2:]]):
        stream = parser.stream(NAMES)
        events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
        streamed = "".join(e.text for e in events if isinstance(e, ContentEvent))
        got = [(e.index, e.call.name, json.loads(e.call.arguments)) for e in events if isinstance(e, CallEvent)]
        assert got == [(i, n, json.loads(a)) for i, (n, a) in enumerate(calls)], (detector, len(pieces))
        assert streamed == (content or ""), (detector, len(pieces))
        assert stream.calls == [stream.calls[i] for i in range(len(calls))]


def test_calls_only_to_the_requests_tools_and_at_most_max_calls() -> None:
    parser = get_parser("sglang:hermes")
    text = OUTPUTS[0][1]
    assert [c.name for c in parser.parse(text, NAMES, max_calls=1).calls] == ["get_weather"]
    assert [c.name for c in parser.parse(text, ("get_time",)).calls] == ["get_time"]
    assert parser.parse(text, None).calls == ()  # no tools in the request: nothing is a call


def test_an_unknown_sglang_parser_names_the_known_ones_and_forced_calls_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown SGLang tool-call parser 'nope'.*qwen25"):
        get_parser("sglang:nope")
    with pytest.raises(ValueError, match="does not constrain decoding"):
        get_parser("sglang:qwen25").forced_call([("get_weather", None)])
