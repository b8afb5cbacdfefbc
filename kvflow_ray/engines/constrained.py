"""Constrained decoding: an output that must spell one string of a small grammar (a forced tool call,
docs/serving.md "Tool calls"), chosen token by token from the model's own logits.

The grammar is plain data, so that it crosses Ray as an engine request field
(`GenerateRequest.constraint`): a list of alternatives, each a list of segments:

- `["text", s]`: exactly `s`;
- `["choice", [a, b, ...]]`: exactly one of the alternatives, which must be prefix-free (none is a
  proper prefix of another), so the end of the choice is known at its last character;
- `["json", kind]`: one JSON value (RFC 8259) of `kind`: "object", "string", "number", "integer" or
  "value" (any), spelled compactly: at most one space between tokens, no newlines or tabs outside
  strings, nested at most `MAX_JSON_DEPTH` deep. These limits keep a small model from looping in
  whitespace or nesting; any JSON value is still expressible.

Each alternative must end with a text or choice segment (where a number ends is only known from the
character after it). `schema_segments` spells a JSON Schema's object (a tool's parameters) as segments.

`Grammar` is the character-level automaton (immutable states over the live alternatives, so a
candidate token is tried on a state without copying). `TokenConstraint` puts it on a decode loop.
Each step it takes the model's most likely token (or a sample, when the request samples) among those
whose text keeps the output a prefix of the grammar *and* leaves enough of the token budget to finish:
invariant, after every chosen token, tokens left >= characters of the shortest completion. Every
character that shortest completions use has a one-character token (checked when the constraint is
built), so the invariant can always be kept, and an output that reaches its last token is a complete
string of the grammar: a forced call is never cut by `max_tokens` when `max_tokens >=
Grammar.min_chars()`. The output ends as soon as one alternative is complete (no end-of-sequence
token is needed).

Cost per step: at most `CANDIDATES` candidate tokens are tried (each a few automaton steps per
character of its text, per live alternative); when none fits, the next character of the shortest
completion is forced.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

MAX_JSON_DEPTH = 16
CANDIDATES = 64  # tokens tried per step before the shortest completion's next character is forced
SEGMENT_KINDS = ("text", "choice", "json")
JSON_KINDS = ("object", "string", "number", "integer", "value")
MAX_ALTERNATIVES = 128  # one per tool a request may have
MAX_SEGMENTS = 512  # per alternative (a schema's properties)
MAX_CHOICES = 256  # alternatives of one choice segment
MAX_SEGMENT_CHARS = 4096

# JSON automaton state: (mode, stack, extra, ws). `stack` holds the open containers ("o" object, "a"
# array), innermost last; `ws`: the previous character was a space (no second one may follow).
# modes: root (extra = the kind of value to start), value, value_or_close (after "["), key_or_close
# (after "{"), key (after "," in an object), colon, after (a value ended), str (extra = (is_key,
# escape): escape 0 plain, 1 after a backslash, 2..5 inside a \u escape with 6 - escape hex digits
# still to come), num (extra = (the number's part so far, integer only)), lit (extra = the rest of
# true/false/null), done. A number at the root never reaches done by itself: it ends where the
# character after it cannot continue it (`json_can_end`).
JsonState = tuple[str, tuple[str, ...], Any, bool]
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_ESCAPES = '"\\/bfnrtu'
_NUMBER_ENDS = ("zero", "int", "frac", "exp")  # parts after which a number may end
_NUMBER_NEXT: dict[str, dict[str, str]] = {  # a number's part -> character -> the part it leads to
    "minus": {"0": "zero", **dict.fromkeys("123456789", "int")},
    "zero": {".": "dot", "e": "e", "E": "e"},
    "int": {**dict.fromkeys(_DIGITS, "int"), ".": "dot", "e": "e", "E": "e"},
    "dot": dict.fromkeys(_DIGITS, "frac"),
    "frac": {**dict.fromkeys(_DIGITS, "frac"), "e": "e", "E": "e"},
    "e": {**dict.fromkeys(_DIGITS, "exp"), "+": "esign", "-": "esign"},
    "esign": dict.fromkeys(_DIGITS, "exp"),
    "exp": dict.fromkeys(_DIGITS, "exp"),
}
_INTEGER_NEXT: dict[str, dict[str, str]] = {  # an integer: no fraction, no exponent
    "minus": _NUMBER_NEXT["minus"], "zero": {}, "int": dict.fromkeys(_DIGITS, "int")}
_ROOT_STARTS = {"object": "{", "string": '"', "number": "-" + _DIGITS, "integer": "-" + _DIGITS}
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}


def json_start(kind: str = "object") -> JsonState:
    return ("root", (), kind, False)


def _close(stack: tuple[str, ...]) -> str:
    return "".join("}" if c == "o" else "]" for c in reversed(stack))


def _after_value(stack: tuple[str, ...]) -> JsonState:
    return ("after", stack, None, False) if stack else ("done", (), None, False)


def _start_value(stack: tuple[str, ...], ch: str, integer: bool = False) -> JsonState | None:
    """The state after `ch` opens a value inside `stack` (None: `ch` opens none)."""
    if ch in "{[":
        if len(stack) >= MAX_JSON_DEPTH:
            return None
        return ("key_or_close", (*stack, "o"), None, False) if ch == "{" else \
            ("value_or_close", (*stack, "a"), None, False)
    if ch == '"':
        return ("str", stack, (False, 0), False)
    if ch == "-":
        return ("num", stack, ("minus", integer), False)
    if ch in _DIGITS:
        return ("num", stack, ("zero" if ch == "0" else "int", integer), False)
    literal = _LITERALS.get(ch)
    return ("lit", stack, literal, False) if literal else None


def json_step(state: JsonState, ch: str) -> JsonState | None:
    """The state after character `ch`, or None when `ch` cannot continue the compact JSON value."""
    mode, stack, extra, ws = state
    if mode == "str":
        is_key, escape = extra
        if escape == 1:
            if ch not in _ESCAPES:
                return None
            return ("str", stack, (is_key, 2 if ch == "u" else 0), False)
        if escape >= 2:
            if ch not in _HEX:
                return None
            return ("str", stack, (is_key, 0 if escape == 5 else escape + 1), False)
        if ch == '"':
            return ("colon", stack, None, False) if is_key else _after_value(stack)
        if ch == "\\":
            return ("str", stack, (is_key, 1), False)
        return None if ord(ch) < 0x20 else state
    if mode == "num":
        part, integer = extra
        nxt = (_INTEGER_NEXT if integer else _NUMBER_NEXT)[part].get(ch)
        if nxt is not None:
            return ("num", stack, (nxt, integer), False)
        if part not in _NUMBER_ENDS or not stack:  # at the root the number's end is the grammar's to see
            return None
        return json_step(_after_value(stack), ch)  # the number ended: `ch` follows it
    if mode == "lit":
        if ch != extra[0]:
            return None
        return ("lit", stack, extra[1:], False) if len(extra) > 1 else _after_value(stack)
    if mode == "done":
        return None
    if ch == " ":
        return None if ws or mode == "root" else (mode, stack, extra, True)
    if mode == "root":
        if extra != "value" and ch not in _ROOT_STARTS[extra]:
            return None
        return _start_value((), ch, integer=extra == "integer")
    if mode in ("value", "value_or_close"):
        if ch == "]" and mode == "value_or_close":
            return _after_value(stack[:-1])
        return _start_value(stack, ch)
    if mode in ("key_or_close", "key"):
        if ch == "}" and mode == "key_or_close":
            return _after_value(stack[:-1])
        return ("str", stack, (True, 0), False) if ch == '"' else None
    if mode == "colon":
        return ("value", stack, None, False) if ch == ":" else None
    # mode == "after": a value ended inside a container
    top = stack[-1]
    if ch == ",":
        return ("key" if top == "o" else "value", stack, None, False)
    if ch == ("}" if top == "o" else "]"):
        return _after_value(stack[:-1])
    return None


def json_can_end(state: JsonState) -> bool:
    """Whether the value is complete here: done, or a number at the root that may end."""
    mode, stack, extra, _ws = state
    return mode == "done" or (mode == "num" and not stack and extra[0] in _NUMBER_ENDS)


def json_completion(state: JsonState) -> str:
    """The shortest text that completes the value from `state`."""
    mode, stack, extra, _ws = state
    if mode == "root":
        return {"object": "{}", "string": '""'}.get(extra, "0")
    if mode == "done":
        return ""
    if mode == "str":
        is_key, escape = extra
        head = "n" if escape == 1 else "0" * (6 - escape) if escape >= 2 else ""
        return head + '"' + (":0" if is_key else "") + _close(stack)
    if mode == "num":
        return ("0" if extra[0] not in _NUMBER_ENDS else "") + _close(stack)
    if mode == "lit":
        return extra + _close(stack)
    tail = {"value": "0", "value_or_close": "", "key_or_close": "", "key": '"":0', "colon": ":0", "after": ""}[mode]
    return tail + _close(stack)


Segment = tuple[str, Any]
# a live alternative: (alternative index, segment index, the segment's own state); segment index ==
# the alternative's length: complete
Path = tuple[int, int, Any]
GrammarState = tuple[Path, ...]


class Grammar:
    """Alternatives of segment sequences (module doc) as a character automaton over the live
    alternatives. States are immutable; None is a dead end."""

    def __init__(self, alternatives: Sequence[Sequence[Sequence[Any]]]) -> None:
        if (not isinstance(alternatives, (list, tuple)) or not 0 < len(alternatives) <= MAX_ALTERNATIVES
                or not all(isinstance(a, (list, tuple)) for a in alternatives)):
            raise ValueError(f"a constraint is 1 to {MAX_ALTERNATIVES} alternatives, each a list of segments")
        self.alternatives: tuple[tuple[Segment, ...], ...] = tuple(
            tuple(_check_segment(s) for s in alt) for alt in alternatives)
        for alt in self.alternatives:
            if not 0 < len(alt) <= MAX_SEGMENTS:
                raise ValueError(f"an alternative has 1 to {MAX_SEGMENTS} segments, got {len(alt)}")
            if alt[-1][0] == "json":
                raise ValueError("an alternative must end with a text or choice segment")
        # the shortest spelling of each segment, for budgets and completions
        self._shortest = tuple(tuple(_shortest(s) for s in alt) for alt in self.alternatives)

    def start(self) -> GrammarState:
        return tuple((a, 0, self._initial(a, 0)) for a in range(len(self.alternatives)))

    def _initial(self, alt: int, index: int) -> Any:
        segments = self.alternatives[alt]
        if index >= len(segments):
            return None
        kind, value = segments[index]
        return 0 if kind == "text" else "" if kind == "choice" else json_start(value)

    def complete(self, state: GrammarState) -> bool:
        return any(index >= len(self.alternatives[alt]) for alt, index, _ in state)

    def _step_path(self, path: Path, ch: str) -> Path | None:
        alt, index, local = path
        segments = self.alternatives[alt]
        if index >= len(segments):
            return None
        kind, value = segments[index]
        if kind == "text":
            if value[local] != ch:
                return None
            if local + 1 < len(value):
                return (alt, index, local + 1)
            return (alt, index + 1, self._initial(alt, index + 1))
        if kind == "choice":
            grown = local + ch
            if not any(option.startswith(grown) for option in value):
                return None
            # prefix-free options: one spelled out in full is the choice made
            return (alt, index + 1, self._initial(alt, index + 1)) if grown in value else (alt, index, grown)
        after = json_step(local, ch)
        if after is None:
            if json_can_end(local):  # a number that ends here: `ch` belongs to the next segment
                return self._step_path((alt, index + 1, self._initial(alt, index + 1)), ch)
            return None
        return (alt, index + 1, self._initial(alt, index + 1)) if after[0] == "done" else (alt, index, after)

    def step(self, state: GrammarState, ch: str) -> GrammarState | None:
        live = tuple(p for p in (self._step_path(path, ch) for path in state) if p is not None)
        return live or None

    def feed(self, state: GrammarState, text: str) -> GrammarState | None:
        """The state after all of `text`, or None when it leaves the grammar."""
        for ch in text:
            nxt = self.step(state, ch)
            if nxt is None:
                return None
            state = nxt
        return state

    def _path_completion(self, path: Path) -> str:
        alt, index, local = path
        segments = self.alternatives[alt]
        if index >= len(segments):
            return ""
        kind, value = segments[index]
        if kind == "text":
            head = value[local:]
        elif kind == "choice":
            head = min((option for option in value if option.startswith(local)), key=len)[len(local):]
        else:
            head = json_completion(local)
        return head + "".join(self._shortest[alt][index + 1:])

    def completion(self, state: GrammarState) -> str:
        """The shortest text that completes the grammar from `state`."""
        return min((self._path_completion(path) for path in state), key=len)

    def remaining(self, state: GrammarState) -> int:
        """Characters of the shortest completion from `state`."""
        return len(self.completion(state))

    def min_chars(self) -> int:
        """Characters of the shortest string of the grammar: a budget of at least this many tokens always
        suffices (`TokenConstraint`)."""
        return min(sum(len(s) for s in shortest) for shortest in self._shortest)

    def completion_chars(self) -> set[str]:
        """Every character a shortest completion may use (each needs a one-character token): the
        segments' own text, and what `json_completion` writes (closers, quotes, `:0`, an escape's `n`,
        the rest of a literal)."""
        chars = set('{}]":0') | set("truefalsn")
        for alt in self.alternatives:
            for kind, value in alt:
                if kind == "text":
                    chars.update(value)
                elif kind == "choice":
                    chars.update(c for option in value for c in option)
        return chars


def _check_segment(segment: Sequence[Any]) -> Segment:
    if not isinstance(segment, (list, tuple)) or len(segment) != 2 or segment[0] not in SEGMENT_KINDS:
        raise ValueError(f"a constraint segment is [kind, value] with kind one of {SEGMENT_KINDS}")
    kind, value = segment
    if kind == "text":
        if not isinstance(value, str) or not 0 < len(value) <= MAX_SEGMENT_CHARS:
            raise ValueError(f"a text segment is a string of 1 to {MAX_SEGMENT_CHARS} characters")
        return kind, value
    if kind == "choice":
        if (not isinstance(value, (list, tuple)) or not 0 < len(value) <= MAX_CHOICES
                or not all(isinstance(a, str) and 0 < len(a) <= MAX_SEGMENT_CHARS for a in value)):
            raise ValueError(f"a choice segment is 1 to {MAX_CHOICES} non-empty strings")
        options = tuple(dict.fromkeys(value))
        if any(a != b and b.startswith(a) for a in options for b in options):
            raise ValueError("the options of a choice segment must be prefix-free")
        return kind, options
    if value not in JSON_KINDS:
        raise ValueError(f"a json segment's kind is one of {JSON_KINDS}")
    return kind, value


def _shortest(segment: Segment) -> str:
    kind, value = segment
    if kind == "text":
        return value
    if kind == "choice":
        return min(value, key=len)
    return json_completion(json_start(value))


# ---------------------------------------------------------------------------------------------- schemas
_SCALAR_KINDS = {"string": "string", "number": "number", "integer": "integer", "object": "object"}


def schema_segments(schema: Any, follow: str) -> list[list[Any]]:
    """Segments spelling a JSON object that a tool's `parameters` schema accepts, then `follow`.

    Properties in the schema's order: its required ones (all of them when it names none as required),
    each value by its schema: `enum` / `const` of JSON scalars and booleans as a choice, `string`,
    `number`, `integer`, `object` by kind, `null` as such, anything else as any JSON value. A schema
    without properties gives any JSON object. Compact layout, as `json.dumps` writes it
    (`{"a": 1, "b": "x"}`)."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict) or not props or schema.get("type", "object") != "object":
        return _merge([["json", "object"], ["text", follow]])
    required = schema.get("required")
    names = [n for n in required if n in props] if isinstance(required, list) and required else list(props)
    # a schema too large to spell segment by segment: any object (still valid JSON, not checked by it)
    if not names or len(names) > MAX_SEGMENTS // 3 or any(len(n) > MAX_SEGMENT_CHARS // 4 for n in names):
        return _merge([["json", "object"], ["text", follow]])
    segments: list[list[Any]] = []
    for i, name in enumerate(names):
        segments.append(["text", ("{" if i == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": "])
        segments.append(_value_segment(props[name]))
    segments.append(["text", "}" + follow])
    return _merge(segments)


def _value_segment(schema: Any) -> list[Any]:
    if not isinstance(schema, dict):
        return ["json", "value"]
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if (isinstance(values, list) and 0 < len(values) <= MAX_CHOICES
            and all(v is None or isinstance(v, (str, int, float, bool)) for v in values)):
        options = [json.dumps(v, ensure_ascii=False) for v in values]
        if all(len(o) <= MAX_SEGMENT_CHARS // 2 for o in options):  # room for the text folded in after
            return ["choice", options]
        return ["json", "value"]
    kind = schema.get("type")
    if kind == "boolean":
        return ["choice", ["true", "false"]]
    if kind == "null":
        return ["text", "null"]
    return ["json", _SCALAR_KINDS.get(kind, "value") if isinstance(kind, str) else "value"]


def _merge(segments: list[list[Any]]) -> list[list[Any]]:
    """Adjacent texts joined, and the text after a choice folded into its options (so options such as
    `1` and `10` stay prefix-free: `1, ` and `10, `)."""
    out: list[list[Any]] = []
    for kind, value in segments:
        if kind == "text" and out and out[-1][0] == "text":
            out[-1] = ["text", out[-1][1] + value]
        elif kind == "text" and out and out[-1][0] == "choice":
            out[-1] = ["choice", [option + value for option in out[-1][1]]]
        else:
            out.append([kind, value])
    return out


# ---------------------------------------------------------------------------------------------- decoding
class TokenTexts:
    """The text each token id adds to an output, for one tokenizer (built once, shared by requests):
    "" for tokens that add none (specials) or that spell part of a character (a byte of a multi-byte
    character), which constrained decoding never picks. `char_token[c]` is a token spelling exactly `c`."""

    def __init__(self, decode: Callable[[list[int]], str], vocab_size: int, encode: Callable[[str], list[int]]) -> None:
        # a token's text is what it adds after an anchor: decoders that drop a leading space at the start
        # of a text (SentencePiece's) keep it after one
        anchor_ids = encode("a")
        anchor = decode(anchor_ids)
        texts: list[str] = []
        for token in range(vocab_size):
            full = decode([*anchor_ids, token])
            text = full[len(anchor):] if full.startswith(anchor) else ""
            texts.append("" if "\ufffd" in text else text)
        self.texts = texts
        self.char_token: dict[str, int] = {}
        for token, text in enumerate(texts):
            if len(text) == 1:
                self.char_token.setdefault(text, token)


class TokenConstraint:
    """One request's grammar on its decode loop: `choose` picks each output token, `advance` records it."""

    def __init__(self, grammar: Grammar, texts: TokenTexts) -> None:
        missing = sorted(c for c in grammar.completion_chars() if c not in texts.char_token)
        if missing:
            raise ValueError(f"constrained decoding needs a one-character token for each of {missing!r}, "
                             "which this model's tokenizer lacks")
        self.grammar = grammar
        self.texts = texts
        self.state = grammar.start()

    @property
    def complete(self) -> bool:
        return self.grammar.complete(self.state)

    def fits(self, token: int, budget: int) -> bool:
        """Whether `token` keeps the output in the grammar with `budget` tokens left including it."""
        text = self.texts.texts[token] if 0 <= token < len(self.texts.texts) else ""
        if not text:
            return False
        after = self.grammar.feed(self.state, text)
        return after is not None and budget - 1 >= self.grammar.remaining(after)

    def choose(self, ranked: Sequence[int], budget: int) -> int:
        """The first token of `ranked` (the model's preference, best first) that fits, else the token of
        the shortest completion's next character (always fits: the invariant of the module doc)."""
        for token in ranked[:CANDIDATES]:
            if self.fits(token, budget):
                return token
        return self.forced()

    def forced(self) -> int:
        return self.texts.char_token[self.grammar.completion(self.state)[0]]

    def advance(self, token: int) -> bool:
        """Record an output token; True when the grammar is complete (the output is done)."""
        after = self.grammar.feed(self.state, self.texts.texts[token])
        if after is None:  # `choose` never picks such a token; a caller that did broke the contract
            raise ValueError(f"token {token} leaves the constrained grammar")
        self.state = after
        return self.complete


def check_constraint(alternatives: Any, max_tokens: int) -> Grammar:
    """The grammar of an engine request's `constraint`; ValueError when it is malformed or cannot be
    spelled within `max_tokens`."""
    grammar = Grammar(alternatives)
    if max_tokens < grammar.min_chars():
        raise ValueError(f"max_tokens ({max_tokens}) is too small for the constrained output: it needs up to "
                         f"{grammar.min_chars()} tokens")
    return grammar


__all__ = ["CANDIDATES", "Grammar", "TokenConstraint", "TokenTexts", "check_constraint", "json_can_end",
           "json_completion", "json_start", "json_step", "schema_segments"]
