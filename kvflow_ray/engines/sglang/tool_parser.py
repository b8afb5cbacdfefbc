"""SGLang's own tool-call parsers behind kvflow's parser interface (`engines.tool_calls`).

`tool_call_parser: sglang:<name>` (`--tool-call-parser sglang:qwen25`) parses every engine's output
with SGLang's `FunctionCallParser` and the detector SGLang's `--tool-call-parser <name>` selects
(python/sglang/srt/function_call/function_call_parser.py, `ToolCallParserEnum`: hermes, qwen25,
llama3, mistral, deepseekv3, ...). With the SGLang engine this is the format handling SGLang's own
OpenAI layer applies; kvflow's `hermes` parser stays the default (no SGLang needed).

- A response (`parse`): SGLang's non-streaming parse (`parse_non_stream`), its content under kvflow's
  content rule (with calls: trailing whitespace dropped, nothing left is `null`).
- A stream: content is sent as SGLang's streaming detector releases it until a call starts (whitespace
  that may end the content held back); the rest of the content and the calls come when the output
  ends, from the non-streaming parse of the whole text, so a stream's calls are exactly the
  response's and never taken back.
- Calls go to the request's tools only (SGLang's detectors drop an unknown name); `max_calls` keeps
  the first ones.
- No constrained decoding: a forced `tool_choice` on the CPU engine needs a parser that spells a call
  (`hermes`); with this one it is refused with a 400 (`constrains` is False).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from kvflow_ray.engines.tool_calls import (
    CallEvent,
    ContentEvent,
    Event,
    ParsedOutput,
    ToolCall,
    ToolCallParser,
    new_call_id,
    release_content,
)

PREFIX = "sglang:"


def sglang_detectors() -> tuple[str, ...]:
    """The detector names SGLang's `--tool-call-parser` takes; raises ValueError without SGLang."""
    try:
        from sglang.srt.function_call.function_call_parser import FunctionCallParser
    except ImportError as exc:
        raise ValueError(f"tool-call parser '{PREFIX}<name>' needs SGLang installed (with xgrammar): {exc}") from None
    return tuple(FunctionCallParser.ToolCallParserEnum)


class SGLangToolParser(ToolCallParser):
    """One of SGLang's detectors, by the name its `--tool-call-parser` takes."""

    name: ClassVar[str] = PREFIX + "*"
    constrains: ClassVar[bool] = False

    def __init__(self, detector: str) -> None:
        known = sglang_detectors()
        if detector not in known:
            raise ValueError(f"unknown SGLang tool-call parser {detector[:64]!r} (known: {', '.join(known)})")
        self.detector = detector
        self.name = PREFIX + detector  # type: ignore[misc]  # an instance per detector

    def function_call_parser(self, names: Iterable[str] | None) -> Any:
        """SGLang's parser for a request whose tools are `names` (their schemas play no part in parsing)."""
        from sglang.srt.entrypoints.openai.protocol import Function, Tool
        from sglang.srt.function_call.function_call_parser import FunctionCallParser

        tools = [Tool(type="function", function=Function(name=name, parameters={})) for name in sorted(names or ())]
        return FunctionCallParser(tools, self.detector)

    def parse(self, text: str, names: Iterable[str] | None = None, max_calls: int | None = None) -> ParsedOutput:
        allowed = frozenset(names or ())  # SGLang's detectors find calls to the request's tools only
        content, items = self.function_call_parser(allowed).parse_non_stream(text)
        calls = tuple(ToolCall(new_call_id(), item.name, item.parameters)
                      for item in items if item.name in allowed)[:max_calls]
        if not calls:
            return ParsedOutput(text or None, ())
        return ParsedOutput(content.rstrip() or None, calls)

    def stream(self, names: Iterable[str] | None = None, max_calls: int | None = None) -> SGLangCallStream:
        return SGLangCallStream(self, frozenset(names) if names is not None else None, max_calls)

    def forced_call(self, tools: Sequence[tuple[str, Any]]) -> list[list[list[Any]]]:
        raise ValueError(f"the tool-call parser {self.name!r} does not constrain decoding")

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        raise ValueError(f"the tool-call parser {self.name!r} renders no calls (the model's template does)")


class SGLangCallStream:
    """The incremental parser of `SGLangToolParser.stream()` (the same `feed` / `finish` / `calls` as
    `tool_calls.ToolCallStream`)."""

    def __init__(self, parser: SGLangToolParser, names: frozenset[str] | None, max_calls: int | None) -> None:
        self.parser, self.names, self.max_calls = parser, names, max_calls
        self._sglang = parser.function_call_parser(names)
        self._text = ""
        self._streamed = ""  # content sent so far
        self._pending_ws = ""  # content whitespace held back: it may end the content before a call
        self._in_calls = False  # a call started: the rest waits for the end
        self.calls: list[ToolCall] = []
        self._finished = False

    def feed(self, text: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("the tool-call stream is finished")
        self._text += text
        if self._in_calls:
            return []
        normal, items = self._sglang.parse_stream_chunk(text)
        self._in_calls = bool(items)
        sent, self._pending_ws = release_content(self._pending_ws, normal)
        if not sent:
            return []
        self._streamed += sent
        return [ContentEvent(sent)]

    def finish(self) -> list[Event]:
        """The output ended: the rest of the content, then the calls, from the whole text."""
        if self._finished:
            return []
        self._finished = True
        parsed = self.parser.parse(self._text, self.names, self.max_calls)
        content = parsed.content or ""
        events: list[Event] = []
        if content.startswith(self._streamed) and len(content) > len(self._streamed):
            events.append(ContentEvent(content[len(self._streamed):]))
        for call in parsed.calls:
            events.append(CallEvent(len(self.calls), call))
            self.calls.append(call)
        return events

