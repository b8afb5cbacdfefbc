"""Tool calls (OpenAI's `tools` protocol, docs/serving.md "Tool calls"): how a model's text output holds
calls (parsers, chosen by name like SGLang's `--tool-call-parser`), how a forced call is spelled for
constrained decoding (`engines.constrained`), and the fallback chat rendering for templates that do
not render tools themselves.

Parsers work on text alone, so the ingress parses any engine's output the same way. One class per
format, registered by name in `TOOL_CALL_PARSERS`. A parser's `stream()` gives an incremental parser
whose events, over any split of the text into pieces, are exactly those of `parse` on the whole text
(`parse` is that stream fed once): a call is reported only when its block is complete and well-formed,
so a stream never announces a call it must take back. Content that might still turn out to be the
start of a call is held back until it is known not to be.

Content rule (both paths): the text outside the calls. When the output holds calls, trailing
whitespace of that text is dropped (it separates the text from a call) and whitespace-only content
is none (`null` on the wire); without calls the text is returned unchanged.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kvflow_ray.engines.constrained import schema_segments

DEFAULT_TOOL_CALL_PARSER = "hermes"

# The fallback's instruction, Hermes / Qwen2.5 style (their chat templates word it so): appended to the
# system message, with the tools' schemas one JSON object per line between the tags.
TOOLS_PREAMBLE = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_INSTRUCTION = ("</tools>\n\nFor each function call, return a json object with function name and arguments "
                     "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                     '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

_ids = random.Random()  # call ids name a call within a conversation; they grant nothing


def new_call_id() -> str:
    """`call_<24 hex>`, as OpenAI's call ids look."""
    return f"call_{_ids.getrandbits(96):024x}"


@dataclass(frozen=True)
class ToolCall:
    """One call: `arguments` is the JSON object's text exactly as the model wrote it (so that the
    conversation, rendered again with this call, spells the model's own output)."""

    id: str
    name: str
    arguments: str

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ContentEvent:
    text: str


@dataclass(frozen=True)
class CallEvent:
    index: int
    call: ToolCall


Event = ContentEvent | CallEvent


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None: no content (a call alone)
    calls: tuple[ToolCall, ...]


class ToolCallStream:
    """The incremental parser a `ToolCallParser.stream()` returns (format-specific work in the parser's
    `_find_open` / `_find_close` / `_parse_block`)."""

    def __init__(self, parser: ToolCallParser, names: frozenset[str] | None, max_calls: int | None) -> None:
        self.parser, self.names, self.max_calls = parser, names, max_calls
        self._buffer = ""  # text not yet decided
        self._in_call = False  # the buffer is the body of an opened call block
        self._open = ""  # the opening tag of that block, as written
        self._pending_ws = ""  # content whitespace held back: it may end the content before a call
        self.calls: list[ToolCall] = []
        self._finished = False

    def feed(self, text: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("the tool-call stream is finished")
        self._buffer += text
        events: list[Event] = []
        while True:
            if self._in_call:
                close = self.parser._find_close(self._buffer)
                if close is None:
                    return events
                start, end = close
                self._block(self._buffer[:start], self._buffer[start:end], events)
                self._buffer = self._buffer[end:]
                self._in_call = False
                continue
            found = self.parser._find_open(self._buffer)
            if found is None:  # all but a possible opening tag's start is content
                keep = self.parser._held_back(self._buffer)
                self._content(self._buffer[:len(self._buffer) - keep], events)
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return events
            start, end = found
            self._content(self._buffer[:start], events)
            self._open = self._buffer[start:end]
            self._buffer = self._buffer[end:]
            self._in_call = True

    def finish(self) -> list[Event]:
        """The output ended: decide what is still held back."""
        events: list[Event] = []
        if not self._finished:
            self._finished = True
            if self._in_call:  # a block the output never closed: a call when its body is one whole call
                self._block(self._buffer, "", events)
            else:
                self._content(self._buffer, events)
            self._buffer = ""
            if not self.calls and self._pending_ws:  # no calls: the text is returned unchanged
                events.append(ContentEvent(self._pending_ws))
            self._pending_ws = ""
        return events

    def _block(self, body: str, close: str, events: list[Event]) -> None:
        call = self.parser._parse_block(body)
        if call is not None and (self.names is None or call[0] in self.names):
            if self.max_calls is None or len(self.calls) < self.max_calls:
                tool_call = ToolCall(new_call_id(), call[0], call[1])
                events.append(CallEvent(len(self.calls), tool_call))
                self.calls.append(tool_call)
            return  # a call past max_calls (parallel_tool_calls: false) is dropped
        self._content(self._open + body + close, events)  # not a call: the text stays content

    def _content(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        body, self._pending_ws = release_content(self._pending_ws, text)
        if body:
            events.append(ContentEvent(body))


def release_content(held: str, text: str) -> tuple[str, str]:
    """Content `text`, after the whitespace `held` back so far: (what a stream sends now, the trailing
    whitespace it holds back, since it may end the content before a call)."""
    text = held + text
    body = text.rstrip()
    return body, text[len(body):]


class ToolCallParser:
    """A tool-call format. Subclasses set `name` and implement the three format hooks, plus
    `forced_call` (the constrained-decoding grammar of one call) and `render_calls` (a call as the
    format writes it, for rendering a conversation's history)."""

    name: ClassVar[str]
    constrains: ClassVar[bool] = True  # `forced_call` spells its calls: a forced tool choice can be decoded

    def stream(self, names: Iterable[str] | None = None, max_calls: int | None = None) -> ToolCallStream:
        """An incremental parser; `names`: the request's tools (a call to another name stays text);
        `max_calls`: calls kept (later ones are dropped)."""
        return ToolCallStream(self, frozenset(names) if names is not None else None, max_calls)

    def parse(self, text: str, names: Iterable[str] | None = None, max_calls: int | None = None) -> ParsedOutput:
        stream = self.stream(names, max_calls)
        events = stream.feed(text) + stream.finish()
        content = "".join(e.text for e in events if isinstance(e, ContentEvent))
        return ParsedOutput(content or None, tuple(stream.calls))

    # format hooks
    def _find_open(self, text: str) -> tuple[int, int] | None:
        raise NotImplementedError

    def _held_back(self, text: str) -> int:
        raise NotImplementedError

    def _find_close(self, text: str) -> tuple[int, int] | None:
        raise NotImplementedError

    def _parse_block(self, body: str) -> tuple[str, str] | None:
        raise NotImplementedError

    def forced_call(self, tools: Sequence[tuple[str, Any]]) -> list[list[list[Any]]]:
        """The constrained-decoding grammar (`engines.constrained`) of one call to one of `tools`
        ((name, parameters schema) pairs): one alternative per tool, its arguments spelled by its schema."""
        raise NotImplementedError

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        raise NotImplementedError


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Hermes, Qwen2.5,
    and this server's fallback rendering). A block is a call when its body, whitespace aside, is one JSON
    object with a string `name` and an object `arguments`; anything else stays text."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _find_open(self, text: str) -> tuple[int, int] | None:
        at = text.find(self.OPEN)
        return None if at < 0 else (at, at + len(self.OPEN))

    def _held_back(self, text: str) -> int:
        for keep in range(min(len(self.OPEN) - 1, len(text)), 0, -1):
            if self.OPEN.startswith(text[-keep:]):
                return keep
        return 0

    def _find_close(self, text: str) -> tuple[int, int] | None:
        at = text.find(self.CLOSE)
        return None if at < 0 else (at, at + len(self.CLOSE))

    def _parse_block(self, body: str) -> tuple[str, str] | None:
        fields = object_fields(body)
        if fields is None or "name" not in fields or "arguments" not in fields:
            return None
        name, _ = fields["name"]
        arguments, raw = fields["arguments"]
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            return None
        return name, raw

    def forced_call(self, tools: Sequence[tuple[str, Any]]) -> list[list[list[Any]]]:
        # the layout `render_calls` writes, so a forced call re-renders to the text the model produced
        return [[["text", f'{self.OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '],
                 *schema_segments(parameters, "}\n" + self.CLOSE)] for name, parameters in tools]

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        return "\n".join(f'{self.OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}\n'
                         f"{self.CLOSE}" for name, arguments in calls)


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {}


def register_parser(parser: type[ToolCallParser]) -> type[ToolCallParser]:
    """Add a format under its `name` (replacing one of that name)."""
    TOOL_CALL_PARSERS[parser.name] = parser
    return parser


def get_parser(name: str) -> ToolCallParser:
    """The parser called `name`: a registered format, or `sglang:<detector>`, SGLang's own parser for the
    format its `--tool-call-parser <detector>` names (`engines.sglang.tool_parser`; needs SGLang)."""
    if name.startswith("sglang:"):
        from kvflow_ray.engines.sglang.tool_parser import SGLangToolParser

        return SGLangToolParser(name.removeprefix("sglang:"))
    try:
        return TOOL_CALL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name[:64]!r} (known: {', '.join(TOOL_CALL_PARSERS)}, or "
                         "sglang:<name> for SGLang's own parser of that name)") from None


register_parser(HermesParser)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_decoder = json.JSONDecoder(parse_constant=_no_constant)  # strict JSON: no NaN / Infinity


def object_fields(text: str) -> dict[str, tuple[Any, str]] | None:
    """A text that is one JSON object (whitespace around it aside), as {key: (value, the value's text)};
    None when it is not one. The value's text is its exact spelling in `text`."""
    s = text.strip()
    if not s.startswith("{"):
        return None
    out: dict[str, tuple[Any, str]] = {}
    at = _skip_ws(s, 1)
    try:
        if s[at:at + 1] == "}":
            return out if at + 1 == len(s) else None
        while True:
            if s[at:at + 1] != '"':
                return None
            key, at = _decoder.raw_decode(s, at)
            at = _skip_ws(s, at)
            if s[at:at + 1] != ":":
                return None
            at = _skip_ws(s, at + 1)
            value, end = _decoder.raw_decode(s, at)
            out[key] = (value, s[at:end])
            at = _skip_ws(s, end)
            if s[at:at + 1] == "}":
                return out if at + 1 == len(s) else None
            if s[at:at + 1] != ",":
                return None
            at = _skip_ws(s, at + 1)
    except ValueError:
        return None


def _skip_ws(s: str, at: int) -> int:
    while at < len(s) and s[at] in " \t\r\n":
        at += 1
    return at


# ---------------------------------------------------------------------------------------------- rendering
def tools_block(tools: Sequence[dict[str, Any]]) -> str:
    """The fallback's tools instruction (to append to the system message)."""
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return f"{TOOLS_PREAMBLE}{lines}\n{TOOLS_INSTRUCTION}"


def fallback_messages(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                      parser: ToolCallParser | None = None) -> list[dict[str, str]]:
    """A conversation with tools, in the three roles every template has (system, user, assistant), for
    templates that do not render tools themselves. Pure and deterministic: the same conversation always
    renders the same text, and a conversation that grew by turns renders with the old one as its prefix
    (what prefix caching across turns needs).

    - `tools` (None: not callable) go at the end of the system message (a new one first when there is
      none), with the instruction to answer with `<tool_call>` blocks (`tools_block`);
    - an assistant message's calls become its content's `<tool_call>` blocks (after its text and a
      newline), in the parser's own layout (`render_calls`), the arguments as the client sent them;
    - tool results become a user message, consecutive ones together, each in `<tool_response>` tags.
    """
    parser = parser or HermesParser()
    out: list[dict[str, str]] = []
    if tools:
        block = tools_block(tools)
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": f"{messages[0]['content']}\n\n{block}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    for message in messages:
        role = message["role"]
        if role == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("_tool"):  # consecutive results: one user turn
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + response}
            else:
                out.append({"role": "user", "content": response, "_tool": "1"})
            continue
        content = message.get("content") or ""
        calls = message.get("tool_calls") or []
        if calls:
            rendered = parser.render_calls([(c["function"]["name"], c["function"]["arguments"]) for c in calls])
            content = f"{content}\n{rendered}" if content else rendered
        out.append({"role": role, "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation as Hugging Face chat templates that render tools take it: tool calls' arguments
    as objects (the templates write them with `tojson`), everything else as OpenAI sends it."""
    out: list[dict[str, Any]] = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
                for call in message["tool_calls"]]
            message.setdefault("content", "")
        out.append(message)
    return out


__all__ = ["DEFAULT_TOOL_CALL_PARSER", "TOOL_CALL_PARSERS", "CallEvent", "ContentEvent", "HermesParser",
           "ParsedOutput", "ToolCall", "ToolCallParser", "ToolCallStream", "fallback_messages", "get_parser",
           "new_call_id", "object_fields", "register_parser", "release_content", "template_messages", "tools_block"]
